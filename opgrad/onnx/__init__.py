"""ONNX interop: ``load`` an ONNX file as an ``opgrad.nn.Model``, ``save`` a model as ONNX.

::

    from opgrad import onnx as og_onnx
    model = og_onnx.load("resnet.onnx")      # an nn.Model with the file's weights
    logits = model.predict(images)           # NCHW float32
    og_onnx.save(model, "tuned.onnx")        # opset 17, runs in onnxruntime

Both need the ``onnx`` package (``pip install 'opgrad[interop]'``); it is imported on first use.
See docs/interop.md for the supported nodes and the errors.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opgrad.nn.model import Model
    from opgrad.onnx.table import OnnxError

__all__ = ["ImportedOnnx", "OnnxError", "load", "read", "save"]


@dataclass
class ImportedOnnx:
    """An imported model and what the import changed (``notes``: a final softmax left out)."""

    model: Model
    notes: list[str] = field(default_factory=list)


def load(path: str | os.PathLike[str], *, keep_softmax: bool = False) -> Model:
    """The ONNX model at ``path`` as an ``opgrad.nn.Model`` with its weights; a final classifier
    ``Softmax`` is left out unless ``keep_softmax``; see :func:`opgrad.onnx.importer.read`."""
    return read(path, keep_softmax=keep_softmax).model


def read(path: str | os.PathLike[str], *, keep_softmax: bool = False) -> ImportedOnnx:
    """:func:`load`'s model with the notes on what the import changed."""
    from opgrad.onnx.importer import read as read_model

    model, notes = read_model(path, keep_softmax=keep_softmax)
    return ImportedOnnx(model, notes)


def save(model: Model, path: str | os.PathLike[str], *, opset: int | None = None) -> None:
    """Write ``model`` with its current weights to ``path`` as ONNX; see :func:`opgrad.onnx.exporter.save`."""
    from opgrad.onnx.exporter import save as save_model

    save_model(model, path, opset=opset)


def __getattr__(name: str) -> Any:
    # Imported on use: `opgrad export-onnx` is configured on every `opgrad` start, which should not
    # load opgrad.nn for it.
    if name == "OnnxError":
        from opgrad.onnx.table import OnnxError

        return OnnxError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
