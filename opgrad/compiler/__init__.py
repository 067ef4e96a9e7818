"""Native code engine: LLVM IR generators, the host JIT with its object cache, and a JIT thread pool.

Public surface for the layers above (phase 2 lowerings call only these):
``KernelBuilder``/``View``/``Scalar`` to compose a graph into one entry point, ``GemmSpec`` and
``Conv2dGeometry`` for the heavy primitives, and ``gemm``/``conv2d_kernels`` for direct calls.
"""

from .builder import CompiledGraph, KernelBuilder, Scalar, View
from .conv import Conv2dGeometry
from .gemm import GemmSpec, IndexMap, Operand
from .graph import CompiledFunction, GraphPlan, compile, plan_graph
from .jit import NativeModule, ObjectCache, host_target
from .kernels import CompiledKernel, Conv2dKernels, conv2d_geometry, conv2d_kernels, gemm, gemm_kernel
from .steploop import LoopStopped, StepLoop
from .target import Target, current_target, resolve_target, use_target

__all__ = [
    "CompiledFunction",
    "CompiledGraph",
    "CompiledKernel",
    "Conv2dGeometry",
    "Conv2dKernels",
    "GemmSpec",
    "GraphPlan",
    "IndexMap",
    "KernelBuilder",
    "LoopStopped",
    "NativeModule",
    "ObjectCache",
    "Operand",
    "Scalar",
    "StepLoop",
    "Target",
    "View",
    "compile",
    "conv2d_geometry",
    "conv2d_kernels",
    "current_target",
    "gemm",
    "gemm_kernel",
    "host_target",
    "plan_graph",
    "resolve_target",
    "use_target",
]
