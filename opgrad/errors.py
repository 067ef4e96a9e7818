"""Exceptions raised by opgrad.

Every error a user can trigger names the operator (or function argument) involved, what it got
and what was expected. The classes subclass the builtin exception a Python user would expect to
catch (``ValueError`` for bad values and shapes, ``TypeError`` for wrong kinds), so existing
``except ValueError`` code keeps working.
"""

from __future__ import annotations


class OpgradError(Exception):
    """Base class of every error opgrad raises on purpose."""


class ShapeError(OpgradError, ValueError):
    """Raised by a shape rule or attribute validator; the operator adds the call's context."""


class OpCallError(OpgradError, ValueError):
    """A call of a registered operator is invalid (bad shapes, dtypes or attributes)."""


class ArgumentError(OpgradError, ValueError):
    """An array passed to ``evaluate`` or a compiled function does not match its parameter."""


class GradientError(OpgradError):
    """Differentiation failed: an operator on the path has no gradient, or a rule misbehaved."""


class RegistryError(OpgradError, LookupError):
    """An operator name is unknown or declared twice."""


class CompileError(OpgradError, RuntimeError):
    """Native compilation failed; the message names the function, the kernel and the host CPU."""


class CompileWarning(UserWarning):
    """Compilation succeeded only by working around a problem (e.g. an LLVM crash) that was found."""
