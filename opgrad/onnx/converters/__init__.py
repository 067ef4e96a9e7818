"""ONNX node converters, one module per family; importing this package fills the converter table."""

from opgrad.onnx.converters import (
    activations,
    conv,
    dense,
    elementwise,
    logical,
    normalization,
    pooling,
    resize,
    shape,
)

__all__ = ["activations", "conv", "dense", "elementwise", "logical", "normalization", "pooling", "resize", "shape"]
