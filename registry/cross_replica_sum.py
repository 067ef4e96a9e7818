"""cross_replica_sum: data summed over every replica of the step (JAX's ``psum``, XLA's CrossReplicaSum).

Data-parallel training runs the same step on N replicas (MPI ranks), each on its shard of the
batch. ``cross_replica_sum(x)`` returns, on every replica, ``sum_r x_r``: what SyncBatchNorm needs
to normalize with the statistics of the global batch. The communicator is not part of the graph:
the caller installs it for the step (:func:`opgrad.replicas.replica_group`); without one there is
one replica and the op is the identity, which is how ``opgrad check`` sees it.

Gradient: the objective of data-parallel training is the sum of every replica's loss,
``L = sum_r' L_r'``, and every ``L_r'`` sees ``x_r`` through the sum, so

    d_x_r = sum_r' dL_r'/dy = cross_replica_sum(grad)

which is the same op on the output gradient; with one replica it is ``grad``.

Compiled code reaches the communicator through a C function pointer (a ctypes callback,
:mod:`opgrad.replicas`), called from the step's top level rather than from a worker thread. An
exported C library has no communicator, so ``opgrad export`` refuses graphs that contain it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from opgrad import ops
from opgrad.ir import Call, Expr
from opgrad.op import Input, Operator
from opgrad.replicas import sum_over_replicas

from ._common import same_as_first

if TYPE_CHECKING:  # types only: the compiler and the checker sit above the registry
    from opgrad.compiler.builder import KernelBuilder
    from opgrad.compiler.views import View


cross_replica_sum = Operator(
    "cross_replica_sum",
    inputs=[Input("data")],
    doc="data summed elementwise over every replica of a data-parallel step (MPI ranks; JAX's psum), the "
        "same result on every replica; the identity in a single process.",
    linear_in=("data",),
)
cross_replica_sum.shape_rule(same_as_first)


@cross_replica_sum.reference
def _cross_replica_sum_forward(data: np.ndarray) -> np.ndarray:
    return sum_over_replicas(data)


@cross_replica_sum.gradient
def _cross_replica_sum_gradient(call: Call, grad: Expr) -> list[Expr | None]:
    """d_data = cross_replica_sum(grad): every replica's loss reads data_r through the sum"""
    return [cross_replica_sum(grad)]


@cross_replica_sum.mutant("treats the sum over replicas as a constant (no gradient flows back)")
def _cross_replica_sum_stopped(call: Call, grad: Expr) -> list[Expr | None]:
    return [ops.zeros_like(grad)]


@cross_replica_sum.lowering
def _cross_replica_sum_lowering(kb: KernelBuilder, call: Call, out: View, data: View) -> None:
    """out = data summed over the replicas (the host's reducer, called on out in place)"""
    kb.cross_replica_sum(out, data)
