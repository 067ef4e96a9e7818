"""``opgrad bench``: ms per training step of the seed CNN, compiled vs reference vs PyTorch and JAX.

Why this shape: the main job is a training loop, so the number that matters is one whole step
(forward + backward + SGD update) at the batch size ``opgrad train`` uses, not single-kernel
GFLOP/s. Every engine runs the same model from the same initial weights on the same batch; the
third step's loss (after two updates) is compared with opgrad's reference backend, so a peer row can't be faster by
computing something else. Times are medians (these machines vary 10-15 % run to run) of at
least 20 steps after warm-up, and ratios are taken within one run.

PyTorch and JAX are imported lazily and only if installed; they are never opgrad dependencies.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from opgrad.argtypes import positive_int

#: A benchmark subject: (params, images, labels, lr) -> a function running one step, returning its loss.
CHECK_STEP = 3

Runner = Callable[[dict[str, np.ndarray], np.ndarray, np.ndarray, float], Callable[[], float]]


@dataclass
class Row:
    name: str
    ms: float | None = None
    check_loss: float | None = None
    note: str = ""
    setup_s: float | None = None


def configure(parser: argparse.ArgumentParser) -> None:
    """Add ``opgrad bench``'s options to ``parser``."""
    parser.add_argument("--steps", type=positive_int, default=20, help="timed steps per engine (median; default 20)")
    parser.add_argument("--warmup", type=positive_int, default=3, help="untimed steps first (default 3)")
    parser.add_argument("--batch-size", type=positive_int, default=32, help="batch size (default 32, as opgrad train)")
    parser.add_argument("--skip", action="append", default=[], choices=("llvm", "reference", "torch", "jax"),
                        help="leave an engine out (repeatable)")


def _opgrad_runner(backend: str) -> Runner:
    def make(params: dict[str, np.ndarray], images: np.ndarray, labels: np.ndarray,
             lr: float) -> Callable[[], float]:
        from opgrad import nn

        model = nn.seed_cnn()
        step = nn.TrainStep(model, nn.SGD(), batch_size=len(labels), backend=backend)
        current = {"params": dict(params)}

        def run() -> float:
            result = step(images, labels, current["params"], {}, lr)
            current["params"] = result.params
            return result.loss

        return run

    return make


def _torch_runner(params: dict[str, np.ndarray], images: np.ndarray, labels: np.ndarray,
                  lr: float) -> Callable[[], float]:
    import torch
    import torch.nn.functional as F

    p = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    x, y = torch.from_numpy(images), torch.from_numpy(labels)

    def run() -> float:
        h = F.relu(F.conv2d(x, p["conv1.weight"], p["conv1.bias"]))
        h = F.relu(F.conv2d(h, p["conv2.weight"], p["conv2.bias"]))
        h = F.avg_pool2d(h, 2)
        h = F.relu(F.conv2d(h, p["conv3.weight"], p["conv3.bias"])).flatten(1)
        loss = F.cross_entropy(F.linear(h, p["dense1.weight"], p["dense1.bias"]), y)
        grads = torch.autograd.grad(loss, list(p.values()))
        with torch.no_grad():
            for value, grad in zip(p.values(), grads):
                value -= lr * grad
        return float(loss.detach())

    return run


def _jax_runner(params: dict[str, np.ndarray], images: np.ndarray, labels: np.ndarray,
                lr: float) -> Callable[[], float]:
    import jax
    import jax.numpy as jnp

    def conv(h: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
        out = jax.lax.conv_general_dilated(h, w, (1, 1), "VALID", dimension_numbers=("NCHW", "OIHW", "NCHW"))
        return jax.nn.relu(out + b[None, :, None, None])

    def loss_fn(p: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
        h = conv(x, p["conv1.weight"], p["conv1.bias"])
        h = conv(h, p["conv2.weight"], p["conv2.bias"])
        n, c, hh, ww = h.shape
        h = h.reshape(n, c, hh // 2, 2, ww // 2, 2).mean(axis=(3, 5))
        h = conv(h, p["conv3.weight"], p["conv3.bias"]).reshape(n, -1)
        logits = h @ p["dense1.weight"].T + p["dense1.bias"]
        logp = jax.nn.log_softmax(logits, axis=1)
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))

    @jax.jit
    def step(p: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        loss, grads = jax.value_and_grad(loss_fn)(p, x, y)
        return loss, {k: p[k] - lr * grads[k] for k in p}

    current = {"p": {k: jnp.asarray(v) for k, v in params.items()}}
    x, y = jnp.asarray(images), jnp.asarray(labels)

    def run() -> float:
        loss, current["p"] = step(current["p"], x, y)
        return float(loss)  # float() waits for the result, so the time is the real step time

    return run


def _version(module: str) -> str:
    try:
        mod = __import__(module)
    except Exception:
        return ""
    return str(getattr(mod, "__version__", ""))


def _measure(name: str, runner: Runner, params: dict[str, np.ndarray], images: np.ndarray, labels: np.ndarray,
             lr: float, steps: int, warmup: int, *, peer: bool) -> Row:
    start = time.perf_counter()
    try:
        run = runner(params, images, labels, lr)
        first = run()
    except ImportError as exc:
        if peer and exc.name in ("torch", "jax"):
            return Row(name, note="not installed")
        return Row(name, note=f"unavailable ({type(exc).__name__}: {exc})")
    except AttributeError as exc:  # e.g. opgrad.compile missing while the compiler is being written
        return Row(name, note=f"unavailable ({type(exc).__name__}: {exc})")
    setup = time.perf_counter() - start
    # Warm-up doubles as the correctness check: the third step's loss has been through two
    # backward passes and updates, so it compares gradients and SGD too, not just the forward.
    losses = [first] + [run() for _ in range(max(CHECK_STEP, warmup) - 1)]
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return Row(name, ms=statistics.median(times) * 1000, check_loss=losses[CHECK_STEP - 1], setup_s=setup)


def run(args: argparse.Namespace) -> int:
    """Time each engine and print the table; returns 0."""
    from opgrad import nn
    from opgrad.nn.step import llvm_unavailable_reason

    model = nn.seed_cnn()
    params = model.init_params(seed=0)
    rng = np.random.default_rng(0)
    images = rng.random((args.batch_size, 1, 28, 28), dtype=np.float32)
    labels = rng.integers(0, 10, args.batch_size).astype(np.int64)
    lr = 0.01
    torch_name = f"PyTorch {_version('torch')}".strip()
    jax_name = f"JAX {_version('jax')}".strip()
    subjects: list[tuple[str, str, Runner]] = [
        ("llvm", "opgrad llvm (compiled)", _opgrad_runner("llvm")),
        ("reference", "opgrad reference (numpy)", _opgrad_runner("reference")),
        ("torch", torch_name, _torch_runner),
        ("jax", f"{jax_name} (jit)", _jax_runner),
    ]
    print(f"opgrad bench: seed CNN training step (forward + backward + SGD), batch {args.batch_size}, float32; "
          f"median of {args.steps} steps after {args.warmup} warm-up")
    rows: dict[str, Row] = {}
    for key, name, runner in subjects:
        if key in args.skip:
            rows[key] = Row(name, note="skipped")
            continue
        if key == "llvm" and (reason := llvm_unavailable_reason()) is not None:
            rows[key] = Row(name, note=f"unavailable: {reason}")
            continue
        rows[key] = _measure(name, runner, params, images, labels, lr, args.steps, args.warmup,
                             peer=key in ("torch", "jax"))
    base_key = "llvm" if rows["llvm"].ms is not None else "reference"
    base = rows[base_key].ms
    ref_loss = rows["reference"].check_loss
    print(f"{'engine':<28} {'ms/step':>9} {'vs ' + rows[base_key].name.split(' (')[0]:>22} {'setup':>8}  loss check")
    for row in rows.values():
        if row.ms is None:
            print(f"{row.name:<28} {row.note}")
            continue
        ratio = f"{row.ms / base:.2f}x" if base else "-"
        check = "-"
        if ref_loss is not None and row.check_loss is not None:
            rel = abs(row.check_loss - ref_loss) / abs(ref_loss)
            check = f"ok (rel. diff {rel:.1e})" if rel < 1e-4 else f"MISMATCH {row.check_loss:.6f} vs {ref_loss:.6f}"
        setup = f"{row.setup_s:.2f}s" if row.setup_s is not None else "-"
        print(f"{row.name:<28} {row.ms:>9.1f} {ratio:>22} {setup:>8}  {check}")
    print("ratio = ms/step divided by the first row that ran; setup = build/compile + first step; "
          "loss check = loss of step 3 (after two SGD updates) against opgrad's reference backend")
    return 0
