"""opgrad: operators with registered gradients, checked numerically, compiled with llvmlite.

    >>> import opgrad
    >>> from opgrad import ops
    >>> x = opgrad.var("x", (2, 3), "float64")
    >>> w = opgrad.var("w", (4, 3), "float64")
    >>> loss = ops.sum(ops.relu(ops.dense(x, w)))
    >>> fn = opgrad.function([x, w], loss)
    >>> value_and_grads = opgrad.grad(fn)     # (loss, d_x, d_w)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from opgrad import ops
from opgrad.autodiff import grad, gradients, hvp, jvp
from opgrad.dtypes import TensorType
from opgrad.errors import (
    ArgumentError,
    CompileError,
    CompileWarning,
    ConfigError,
    DimensionTypeError,
    GradientError,
    NonFiniteLossError,
    OpCallError,
    OpgradError,
    OpInputTypeError,
    OutputFileError,
    RegistryError,
    ShapeError,
    UserError,
)
from opgrad.ir import Call, Const, Expr, Function, Var, const, var
from opgrad.reference import evaluate

if TYPE_CHECKING:
    from collections.abc import Sequence

    # The lazily imported functions (``__getattr__`` below), as type checkers and editors see them
    # (the subpackages are typed where imported: ``from opgrad.checks import check_op``).
    from opgrad.compiler import compile as compile
    from opgrad.deploy.export import export as export

__version__ = "0.1.0"


def function(params: Sequence[Var], output: Expr | Sequence[Expr]) -> Function:
    """A function of ``params`` returning ``output`` (one expression or a tuple of them)."""
    return Function(params, output)


def __getattr__(name: str) -> Any:
    # Imported lazily: `registry` walks the operator files; `compile` pulls in llvmlite.
    if name == "registry":
        import importlib

        return importlib.import_module("opgrad.registry")
    if name == "compile":
        from opgrad.compiler import compile as compile_fn

        return compile_fn
    if name == "export":
        from opgrad.deploy import export as export_fn

        return export_fn
    if name == "checks":
        import importlib

        return importlib.import_module("opgrad.checks")
    raise AttributeError(f"module 'opgrad' has no attribute {name!r}")


__all__ = [
    "ArgumentError",
    "Call",
    "CompileError",
    "CompileWarning",
    "ConfigError",
    "Const",
    "DimensionTypeError",
    "Expr",
    "Function",
    "GradientError",
    "NonFiniteLossError",
    "OpCallError",
    "OpInputTypeError",
    "OpgradError",
    "OutputFileError",
    "RegistryError",
    "ShapeError",
    "TensorType",
    "UserError",
    "Var",
    "const",
    "evaluate",
    "function",
    "grad",
    "gradients",
    "hvp",
    "jvp",
    "ops",
    "var",
]
