"""The thread pool off its fast path: where futex is unavailable (not Linux, or an unknown CPU) it runs
kernels single-threaded, and between jobs its workers sleep."""

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


def test_an_idle_pool_sleeps_instead_of_spinning() -> None:
    # Workers spin briefly after a job and then sleep; a sleep that times out with no new job
    # must go back to sleep: spinning again after every timeout costs an idle pool a fifth of a core.
    script = textwrap.dedent("""
        import os, time
        os.environ["OPGRAD_NUM_THREADS"] = "2"
        import numpy as np
        import opgrad
        from opgrad.compiler.threads import futex_supported, pool

        x = opgrad.var("x", (400, 400))
        compiled = opgrad.compile(opgrad.function([x], x @ x))
        compiled(np.ones((400, 400), np.float32))  # a job wakes the workers
        assert pool().nthreads == 2 or not futex_supported()
        time.sleep(0.2)  # past the spinning after the job
        cpu = time.process_time()
        time.sleep(1.0)
        print(f"{time.process_time() - cpu:.4f}")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    idle_cpu_seconds = float(result.stdout.strip())
    assert idle_cpu_seconds < 0.08, f"an idle pool used {idle_cpu_seconds:.3f} s of CPU in 1 s"
