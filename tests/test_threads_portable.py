"""Where futex is unavailable (not Linux, or an unknown CPU), the pool runs kernels single-threaded."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_without_futex_kernels_run_on_the_calling_thread() -> None:
    script = textwrap.dedent("""
        import numpy as np
        import opgrad
        import opgrad.compiler.threads as threads
        from opgrad import ops

        threads.futex_supported = lambda: False  # what a macOS or RISC-V host reports
        x = opgrad.var("x", (300, 300))
        fn = opgrad.function([x], ops.tanh(x) @ x)
        a = np.random.default_rng(0).standard_normal((300, 300)).astype(np.float32)
        got = opgrad.compile(fn)(a)
        assert threads.pool().nthreads == 1
        assert np.allclose(got, opgrad.evaluate(fn, a), rtol=1e-4, atol=1e-3)
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
