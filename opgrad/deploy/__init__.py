"""Deployment: export a model's training step, eval step and checkpoint I/O as a C library.

``opgrad.export(...)`` (:func:`opgrad.deploy.export.export`) and ``opgrad export`` write a header,
a C runtime and the compiled graphs for the host, an x86-64 baseline, ARM Linux or Android; see
docs/deployment.md.
"""

from opgrad.deploy.export import ExportError, ExportResult, default_c_compiler, export

__all__ = ["ExportError", "ExportResult", "default_c_compiler", "export"]
