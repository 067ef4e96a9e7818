"""Import Keras models: ``opgrad.keras.load("model.keras")`` -> an ``opgrad.nn.Model`` with Keras' weights.

Reads Keras 3 ``.keras`` files and legacy ``.h5`` files (Keras 2, tf.keras, or Keras 3's
``model.save("x.h5")``) of Sequential and functional models without importing Keras: the
architecture is JSON, the weights are HDF5 read with h5py (``pip install 'opgrad[interop]'``).

The imported model is an ordinary opgrad model: it predicts, trains (``nn.Trainer``, compiled
kernels), checks its gradients, and saves as an opgrad checkpoint. Like every opgrad model it
takes NCHW images: pass ``x.transpose(0, 3, 1, 2)`` for Keras' NHWC batch, or load with
``layout="NHWC"`` to have the model take (and give back) NHWC images itself. A final softmax is
left out, so the model outputs logits (see :func:`read`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from opgrad.keras.activations import ACTIVATIONS
from opgrad.keras.converters import CONVERTERS
from opgrad.keras.files import KerasImportError, read_model_file
from opgrad.keras.graph import Builder, build_model
from opgrad.keras.operations import OPERATIONS
from opgrad.nn.model import Model

__all__ = ["ACTIVATIONS", "SUPPORTED_LAYERS", "ImportedModel", "KerasImportError", "load", "read"]

#: The Keras layer classes the importer converts (besides InputLayer).
SUPPORTED_LAYERS = tuple(sorted(CONVERTERS))
LAYOUTS = ("NCHW", "NHWC")


@dataclass
class ImportedModel:
    """An imported model and what the import had to say about it.

    ``notes`` lists what differs from the Keras model and why (a final softmax left out, a
    regularizer or a constraint that only Keras' training used); ``format`` is ``".keras"`` or
    ``".h5"``; ``keras_version`` is the version that wrote the file, where it says.
    """

    model: Model
    notes: list[str] = field(default_factory=list)
    format: str = ""
    keras_version: str = ""


def read(path: str | os.PathLike[str], *, layout: str = "NCHW", keep_softmax: bool = False) -> ImportedModel:
    """Import the Keras model in ``path`` (``.keras`` or ``.h5``), with notes on the conversion.

    ``layout`` is the image layout of the imported model's inputs and image outputs: ``"NCHW"``
    (opgrad's, the default) or ``"NHWC"`` (Keras', through a transpose inside the model).
    ``keep_softmax=False`` leaves out a softmax that ends a classifier (an output with one axis
    per example): opgrad trains classifiers with softmax cross-entropy on logits, so
    ``predict`` returns logits, whose softmax is what Keras predicts and whose argmax is the
    same class. ``keep_softmax=True`` keeps it, for a model whose outputs must be probabilities.

    Every problem is a :class:`KerasImportError` naming the file, the layer, its class, the
    config field or variable, and what is supported.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"opgrad.keras.load: layout must be one of {LAYOUTS}, got {layout!r}")
    name = os.fspath(path)
    spec, store, facts = read_model_file(name)
    version = str(facts["keras_version"])
    builder = Builder(name, store, keras2=version.startswith("2.") or (not version and facts["format"] == ".h5"))
    try:
        model = build_model(spec, builder, CONVERTERS, OPERATIONS, layout=layout, keep_softmax=bool(keep_softmax))
    except OSError as exc:  # h5py's error for damaged data inside an HDF5 file that opened
        raise KerasImportError(f"{name}: the weights cannot be read ({exc})") from None
    finally:
        store.file.close()
    return ImportedModel(model, builder.notes, facts["format"], facts["keras_version"])


def load(path: str | os.PathLike[str], *, layout: str = "NCHW", keep_softmax: bool = False) -> Model:
    """The Keras model in ``path`` as an ``opgrad.nn.Model`` with its weights (see :func:`read`)."""
    return read(path, layout=layout, keep_softmax=keep_softmax).model
