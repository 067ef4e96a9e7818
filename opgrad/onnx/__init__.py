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
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opgrad.nn.model import Model
    from opgrad.onnx.table import OnnxError

__all__ = ["OnnxError", "load", "save"]


def load(path: str | os.PathLike[str]) -> Model:
    """The ONNX model at ``path`` as an ``opgrad.nn.Model`` with its weights; see :func:`opgrad.onnx.importer.load`."""
    from opgrad.onnx.importer import load as load_model

    return load_model(path)


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
