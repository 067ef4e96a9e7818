"""``opgrad bench``: ms per training step of a model, compiled vs reference vs PyTorch and JAX.

Why this shape: the main job is a training loop, so the number that matters is one whole step
(forward + backward + SGD update) at the batch size ``opgrad train`` uses, not single-kernel
GFLOP/s. Every engine runs the same model from the same initial weights on the same batch; the
third step's loss (after two updates) is compared with opgrad's reference backend, so a peer row can't be faster by
computing something else. Times are medians (these machines vary 10-15 % run to run) of at
least 20 steps after warm-up, and ratios are taken within one run, the engines taking turns in
short rounds so that the machine's drift during the run reaches all of them alike.

``--model`` picks a built-in model (the seed CNN by default, or ``keras-mnist`` / ``resnet`` / ``mlp``, or the
sequence models ``lstm`` / ``transformer``, which read a digit's rows as 28 steps), and
``--checkpoint`` the model a file written by ``model.save`` or ``opgrad train --save`` holds (a
classifier: one image input, one output of class scores), stepped on uniform random images of
its input shape. PyTorch runs the same
graph through :func:`torch_forward`, a layer-by-layer translation of the opgrad model to
``torch.nn.functional`` (BatchNorm included, with its running statistics; dropout with the
masks opgrad's step gets); a layer it does not translate leaves PyTorch's row out, saying which.
JAX has a hand-written twin of the seed CNN with SGD only. ``--optimizer`` steps opgrad with
:func:`opgrad.nn.make_optimizer`'s update and PyTorch with the ``torch.optim`` optimizer that
matches it step for step (:func:`torch_optimizer`).

Every table shows each engine's GFLOP/s (the FLOPs of the step's GEMM and conv kernels, counted
from opgrad's plan, over its time) and the percent of this machine's fp32 FMA peak on the threads
used, measured first by a generated FMA loop (:mod:`opgrad.compiler.peak`). ``--threads`` sets
opgrad's pool and PyTorch's intra-op threads alike (default: the CPUs this process may use).
``--peak``, ``--kernels``, ``--scaling``, ``--compile-times``, ``--memory`` and ``--simulate-threads``
add the sections of :mod:`opgrad.benchreport`.

PyTorch and JAX are imported lazily and only if installed; they are never opgrad dependencies.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from opgrad.argtypes import int_range, non_negative_int, positive_int
from opgrad.env import MAX_THREADS, available_cpus
from opgrad.errors import ConfigError

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
    best_ms: float | None = None
    cpu_ms: float | None = None  # CPU time of the whole process per step: steadier on a shared machine


#: The models ``--model`` names.
BUILT_IN_MODELS = ("seed-cnn", "keras-mnist", "resnet", "mlp", "lstm", "transformer")
#: ``--optimizer``'s choices: ``opgrad train``'s (:func:`opgrad.nn.make_optimizer`).
OPTIMIZER_NAMES = ("sgd", "momentum", "nesterov", "adam", "adamw", "rmsprop")


def checkpoint_argument(text: str) -> str:
    """``--checkpoint``'s type: an existing file, as an absolute path (so that no file is taken
    for a built-in model's name by :func:`bench_model`, here or in a child process)."""
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, expected a checkpoint file (.npz)")
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"no such file: {text!r}")
    return os.path.abspath(text)


def bench_model(spec: str) -> Any:
    """The :class:`~opgrad.nn.Model` that ``spec`` names: a built-in one, or the architecture in
    the checkpoint at that path (``model.save``, ``opgrad train --save``). Its step must be a
    classifier's: one floating-point input and one output of class scores, as :func:`bench_batch`
    feeds it."""
    from opgrad import nn

    if spec in BUILT_IN_MODELS:
        return nn.build_model(spec)
    model = nn.load_model(spec)
    inputs, outputs = model.input_vars(1), model.outputs
    if len(inputs) != 1 or not np.issubdtype(np.dtype(inputs[0].dtype), np.floating):
        found = ", ".join(f"{t.dtype}{list(t.shape[1:])}" for t in inputs)
        raise ConfigError(f"--checkpoint {spec}: opgrad bench times a model with one floating-point input, "
                          f"this one takes {found}")
    if len(outputs) != 1 or len(outputs[0].shape) != 1 or outputs[0].shape[0] < 2:
        found = ", ".join(str(list(t.shape)) for t in outputs)
        raise ConfigError(f"--checkpoint {spec}: opgrad bench times a classifier (one output of class scores "
                          f"per example), this model's outputs have shapes {found}")
    return model


def bench_batch(model: Any, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """The batch every engine steps on: uniform [0, 1) inputs of the model's input shape and
    labels drawn from its classes, from seed 0."""
    rng = np.random.default_rng(0)
    (inp,), classes = model.input_vars(batch), model.outputs[0].shape[0]
    images = rng.random(inp.shape, dtype=np.float32).astype(inp.dtype, copy=False)
    return images, rng.integers(0, classes, batch).astype(np.int64)


def bench_masks(model: Any, batch: int) -> dict[str, np.ndarray]:
    """The dropout masks every engine's step applies (none without dropout), from seed 1."""
    return dict(model.sample_noise(np.random.default_rng(1), batch))


def configure(parser: argparse.ArgumentParser) -> None:
    """Add ``opgrad bench``'s options to ``parser``."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", choices=BUILT_IN_MODELS, default="seed-cnn",
                        help="the built-in model whose training step is timed (default seed-cnn)")
    source.add_argument("--checkpoint", metavar="PATH", type=checkpoint_argument, default=None,
                        help="time the model a checkpoint holds instead (as model.save or opgrad train --save "
                             "write it; a classifier: one image input, one output of class scores)")
    parser.add_argument("--optimizer", choices=OPTIMIZER_NAMES, default="sgd",
                        help="the update every engine applies (default sgd): opgrad's and torch.optim's, step for "
                             "step the same (momentum and nesterov 0.9, adamw weight decay 0.01, as opgrad train)")
    parser.add_argument("--steps", type=positive_int, default=20, help="timed steps per engine (median; default 20)")
    parser.add_argument("--warmup", type=non_negative_int, default=3, help="untimed steps first (default 3)")
    parser.add_argument("--batch-size", type=positive_int, default=32, help="batch size (default 32, as opgrad train)")
    parser.add_argument("--skip", action="append", default=[],
                        choices=("llvm", "reference", "torch", "torch-nhwc", "jax"),
                        help="leave an engine out (repeatable)")
    parser.add_argument("--threads", type=int_range(1, MAX_THREADS, "opgrad's most worker threads"), default=None,
                        help=f"threads for opgrad and PyTorch, 1 to {MAX_THREADS} (default: $OPGRAD_NUM_THREADS, "
                             "else the CPUs this process may use, honouring affinity and the cgroup CPU quota)")
    parser.add_argument("--peak", action="store_true",
                        help="print the host, its measured fp32 FMA peak (1 thread and all used) and copy bandwidth")
    parser.add_argument("--kernels", action="store_true",
                        help="per-kernel table: GFLOP/s and %% of peak of each conv/dense pass, GB/s of the others")
    parser.add_argument("--scaling", action="store_true", help="time the step on 1, 2, 4, ... threads (children)")
    parser.add_argument("--compile-times", action="store_true",
                        help="cold (empty caches) and warm compile time of the step (children)")
    parser.add_argument("--memory", action="store_true",
                        help="peak resident memory of a process running the step, opgrad vs PyTorch (children)")
    parser.add_argument("--simulate-threads", type=int_range(2, MAX_THREADS, "threads to simulate"), nargs="+",
                        default=[], metavar="N",
                        help="how the step splits over N threads, simulated with one core: every parallel job's "
                             "N shares timed one after another (children; e.g. --simulate-threads 16 "
                             "--batch-size 256)")
    parser.add_argument("--all", action="store_true", help="all of the sections above but --simulate-threads")


def _opgrad_runner(backend: str, model_name: str, holder: dict[str, Any] | None = None,
                   optimizer: str = "sgd") -> Runner:
    def make(params: dict[str, np.ndarray], images: np.ndarray, labels: np.ndarray,
             lr: float) -> Callable[[], float]:
        from opgrad import nn

        model = bench_model(model_name)
        step = nn.TrainStep(model, nn.make_optimizer(optimizer), batch_size=len(labels), backend=backend)
        masks = bench_masks(model, len(labels))
        if holder is not None:
            holder["compiled"] = step.compiled
        # The step updates its own copy in place (donate): the other engines start from ``params`` too.
        current = {"params": {name: array.copy() for name, array in params.items()},
                   "state": {**step.optimizer.init_state(params), **model.init_buffers()}}

        def run() -> float:
            result = step(images, labels, current["params"], current["state"], lr, masks, donate=True)
            current["params"], current["state"] = result.params, result.state
            return result.loss

        return run

    return make


def torch_forward(model: Any, params: dict[str, Any], buffers: dict[str, Any], x: Any, *, training: bool,
                  masks: dict[str, Any] | None = None) -> Any:
    """The opgrad ``model``'s first output computed with ``torch.nn.functional``, layer by layer.

    ``params`` and ``buffers`` are torch tensors keyed like opgrad's; BatchNorm updates the
    buffers in place while training, as ``torch.nn.BatchNorm2d`` does. Dropout multiplies by the
    layer's mask in ``masks`` while training (opgrad's masks, so both compute the same), as
    opgrad's Dropout does. A layer without a translation raises NotImplementedError.
    """
    import torch
    import torch.nn.functional as F

    def activate(h: Any, name: str | None) -> Any:
        table: dict[str, Callable[[Any], Any]] = {
            "relu": F.relu, "leaky_relu": F.leaky_relu, "gelu": F.gelu, "sigmoid": torch.sigmoid, "tanh": torch.tanh,
            "silu": F.silu, "elu": F.elu, "softplus": F.softplus, "relu6": F.relu6, "hard_sigmoid": F.hardsigmoid,
            "hard_swish": F.hardswish}
        if name and name not in table:
            raise NotImplementedError(f"torch_forward has no translation of the activation {name!r}")
        return table[name](h) if name else h

    values = {id(t): x for t in model.inputs}
    for node in model.nodes:
        layer, kind = node.layer, node.layer.kind
        args = [values[id(t)] for t in node.inputs]
        h = args[0]
        p = {local: params[f"{layer.name}.{local}"] for local in layer.param_specs()}
        if kind == "conv":
            (top, bottom), (left, right) = layer.pads(h.shape[2], h.shape[3])
            if (top, left) != (bottom, right):
                h = F.pad(h, (left, right, top, bottom))
                top = left = 0
            h = activate(F.conv2d(h, p["weight"], p.get("bias"), stride=layer.strides, padding=(top, left),
                                  dilation=layer.dilation_rate, groups=layer.groups), layer.activation)
        elif kind == "dense":
            h = activate(F.linear(h, p["weight"], p.get("bias")), layer.activation)
        elif kind in ("maxpool", "avgpool") and layer.padding != "same":
            (top, bottom), (left, right) = layer.pads(h.shape[2], h.shape[3])
            if (top, left) != (bottom, right):
                raise NotImplementedError(f"torch_forward has no translation of layer {layer.describe()} "
                                          "(uneven padding)")
            if kind == "maxpool":
                h = F.max_pool2d(h, layer.pool_size, layer.strides, padding=(top, left), ceil_mode=layer.ceil_mode)
            else:
                h = F.avg_pool2d(h, layer.pool_size, layer.strides, padding=(top, left), ceil_mode=layer.ceil_mode,
                                 count_include_pad=layer.count_include_pad)
        elif kind == "batchnorm" and layer.momentum is None:  # F.batch_norm's momentum is a number
            raise NotImplementedError(f"torch_forward has no translation of layer {layer.describe()} "
                                      "(a cumulative average)")
        elif kind == "batchnorm":
            h = F.batch_norm(h, buffers[f"{layer.name}.running_mean"], buffers[f"{layer.name}.running_var"],
                             p["weight"], p["bias"], training=training, momentum=layer.momentum, eps=layer.epsilon)
        elif kind == "globalavgpool":
            h = h.mean(dim=(2, 3))
        elif kind == "flatten":
            h = h.flatten(1)
        elif kind == "add":
            h = sum(args[1:], args[0])
        elif kind in ("relu", "activation"):
            h = activate(h, getattr(layer, "activation", "relu"))
        elif kind == "reshape":
            h = h.reshape(h.shape[0], *layer.target_shape)
        elif kind == "layernorm":
            h = F.layer_norm(h, h.shape[layer.axis % h.ndim:], p["weight"], p["bias"], layer.epsilon)
        elif kind == "arithmetic" and layer.op == "add" and layer.operand is None:
            h = h + p["operand"]
        elif kind == "reduce" and layer.op == "mean":
            h = h.mean(dim=layer.axes, keepdim=layer.keepdims)
        elif kind == "multiheadattention" and not layer.padding_mask and not layer.key_value and not (
                training and layer.dropout):
            length = h.shape[1]
            causal = torch.triu(torch.full((length, length), float("-inf")), 1) if layer.causal else None
            sequence_first = h.transpose(0, 1)
            h = F.multi_head_attention_forward(
                sequence_first, sequence_first, sequence_first, h.shape[2], layer.num_heads, p["in_proj_weight"],
                p.get("in_proj_bias"), None, None, False, 0.0, p["out_proj_weight"], p.get("out_proj_bias"),
                training=training, need_weights=False, attn_mask=causal)[0].transpose(0, 1)
        elif kind in ("lstm", "gru"):
            h = _torch_recurrent(layer, p, h)
        elif kind == "dropout":
            if training and layer.rate > 0.0:
                if masks is None or layer.name not in masks:
                    raise ValueError(f"torch_forward: dropout layer {layer.name!r} needs its mask while training")
                h = h * masks[layer.name]
        else:
            raise NotImplementedError(f"torch_forward has no translation of layer {layer.describe()}")
        values[id(node.output)] = h
    return values[id(model.outputs[0])]


#: The PyTorch module of each recurrent layer :func:`torch_forward` has run, by the layer's id.
_TORCH_RNNS: dict[int, Any] = {}


def _torch_recurrent(layer: Any, params: dict[str, Any], x: Any) -> Any:
    """``layer`` (opgrad's LSTM or GRU) as PyTorch's ``nn.LSTM`` / ``nn.GRU`` on ``params``
    (``torch.func.functional_call``: its own fused kernels, with opgrad's weights)."""
    import torch

    module = _TORCH_RNNS.get(id(layer))
    if module is None:
        module = getattr(torch.nn, layer.kind.upper())(x.shape[2], layer.units, batch_first=True,
                                                       bidirectional=layer.bidirectional)
        module = _TORCH_RNNS[id(layer)] = module.requires_grad_(False)
    weights = {}
    for suffix in layer.directions:
        for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
            value = params.get(name + suffix)
            weights[f"{name}_l0{suffix}"] = value if value is not None else torch.zeros_like(params["bias_ih" + suffix])
    output, last = torch.func.functional_call(module, weights, (x,))
    if layer.return_sequences:
        return output
    hidden = last[0] if isinstance(last, tuple) else last  # (directions, N, units)
    return torch.cat(list(hidden), dim=1)


#: glibc's ``mallopt`` parameters (``malloc.h``) and the values :func:`keep_freed_memory` sets: the
#: largest mmap threshold glibc accepts on 64-bit, and a trim threshold far above any step's memory.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_BYTES, TRIM_THRESHOLD_BYTES = 32 << 20, 1 << 30


def keep_freed_memory() -> str:
    """Make glibc's malloc keep the memory a step frees for the next step; returns a line saying
    so, or "" where the C library is not glibc.

    By default glibc hands a large freed block straight back to the kernel (one above its mmap
    threshold, or the heap's top once more than the trim threshold is free), and the next step,
    allocating it again, takes a page fault for every 4 KiB page. PyTorch's seed-CNN step does
    so about 6000 times a step (17-20 instead of 11 ms on an AMD EPYC) until glibc raises its
    thresholds, which it does only after some larger blocks are freed: how fast PyTorch runs
    depends on what the process ran before it. PyTorch's performance guide answers with jemalloc
    or tcmalloc; raising glibc's two thresholds does the same here, for every engine in the
    process, so each is timed in its steady state. (opgrad's compiled step allocates only its
    results and never faulted.)
    """
    try:
        if not (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc"):
            return ""
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError, ValueError):  # no confstr, or no such name: not glibc
        return ""
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if not (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)):
        return ""
    return (f"glibc malloc keeps freed memory (mmap threshold {MMAP_THRESHOLD_BYTES >> 20} MiB, trim threshold "
            f"{TRIM_THRESHOLD_BYTES >> 20} MiB), so no engine's step pays page faults for the memory it freed "
            "in the step before")


def host_load_note(cpus: int) -> str:
    """A warning where other jobs keep this process's CPUs busy (the 1-minute load average above
    their count), else "". PyTorch's OpenMP threads spin while they wait for one another
    (``OMP_WAIT_POLICY``); on shared cores that spinning takes the time its working threads need,
    and its step slowed 3x on two busy cores where opgrad's pool, which sleeps after a short spin,
    slowed far less: ratios taken on a busy host overstate opgrad's lead."""
    try:
        load = os.getloadavg()[0]
    except (OSError, AttributeError):  # not POSIX
        return ""
    if load <= cpus:
        return ""
    return (f"note: load average {load:.1f} on {cpus} CPU(s): other jobs share them, and PyTorch's OpenMP threads "
            "spin while they wait (OMP_WAIT_POLICY), so its times swell more than opgrad's: compare on an idle "
            "host, or with OMP_WAIT_POLICY=PASSIVE in the environment")


def torch_optimizer(name: str, params: list[Any], lr: float) -> Any:
    """The ``torch.optim`` optimizer that updates as :func:`opgrad.nn.make_optimizer` ``(name)`` does
    (the defaults agree: Adam's betas and eps, RMSprop's alpha, AdamW's weight decay 0.01)."""
    import torch

    if name in ("momentum", "nesterov"):
        return torch.optim.SGD(params, lr=lr, momentum=0.9, nesterov=name == "nesterov")
    table = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW,
             "rmsprop": torch.optim.RMSprop}
    return table[name](params, lr=lr)


def torch_runner(model_name: str, threads: int | None = None, optimizer: str = "sgd",
                 channels_last: bool = False) -> Runner:
    """PyTorch's training step of ``model_name`` (on ``threads`` intra-op threads if given): plain
    SGD as the update written out (autograd.grad, then ``w -= lr * g``), other optimizers as
    ``torch.optim``'s. With ``channels_last`` the images and 4-D weights are in PyTorch's NHWC
    memory format, which its CPU convolutions prefer (PyTorch's performance guide)."""
    def make(params: dict[str, np.ndarray], images: np.ndarray, labels: np.ndarray,
             lr: float) -> Callable[[], float]:
        import torch
        import torch.nn.functional as F

        model = bench_model(model_name)
        if threads is not None:
            torch.set_num_threads(threads)
        layout = torch.channels_last if channels_last else torch.contiguous_format
        p = {k: torch.tensor(v).contiguous(memory_format=layout if v.ndim == 4 else torch.contiguous_format)
             .requires_grad_() for k, v in params.items()}
        buffers = {k: torch.tensor(v) for k, v in model.init_buffers().items()}
        x, y = torch.from_numpy(images), torch.from_numpy(labels)
        if x.ndim == 4:
            x = x.contiguous(memory_format=layout)
        masks = {name: torch.from_numpy(mask) for name, mask in bench_masks(model, len(labels)).items()}

        opt = None if optimizer == "sgd" else torch_optimizer(optimizer, list(p.values()), lr)

        def run() -> float:
            loss = F.cross_entropy(torch_forward(model, p, buffers, x, training=True, masks=masks), y)
            grads = torch.autograd.grad(loss, list(p.values()))
            with torch.no_grad():
                for value, grad in zip(p.values(), grads):
                    if opt is None:
                        value -= lr * grad
                    else:
                        value.grad = grad
                if opt is not None:
                    opt.step()
            return float(loss.detach())

        return run

    return make


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

    @jax.jit  # type: ignore[untyped-decorator, unused-ignore]  # typed only where jax ships its stubs
    def step(p: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        loss, grads = jax.value_and_grad(loss_fn)(p, x, y)
        return loss, {k: p[k] - lr * grads[k] for k in p}

    # On the host's CPU like the other engines, also where jax is installed with a GPU backend: the
    # step runs where its committed inputs lie.
    cpu = jax.devices("cpu")[0]
    current = {"p": {k: jax.device_put(v, cpu) for k, v in params.items()}}
    x, y = jax.device_put(images, cpu), jax.device_put(labels, cpu)

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


#: Timed steps per engine in one round of the interleaved timing, after one untimed step.
ROUND_STEPS = 4


def _prepare(name: str, runner: Runner, params: dict[str, np.ndarray], images: np.ndarray, labels: np.ndarray,
             lr: float, warmup: int, *, peer: bool) -> tuple[Row, Callable[[], float] | None]:
    """Build the engine, run its warm-up steps and record the check loss: (its row, its step) or
    (a row saying why it is absent, None)."""
    start = time.perf_counter()
    try:
        run = runner(params, images, labels, lr)
        first = run()
    except ImportError as exc:
        if peer and exc.name in ("torch", "jax"):
            return Row(name, note="not installed"), None
        return Row(name, note=f"unavailable ({type(exc).__name__}: {exc})"), None
    except AttributeError as exc:  # e.g. opgrad.compile missing while the compiler is being written
        return Row(name, note=f"unavailable ({type(exc).__name__}: {exc})"), None
    except NotImplementedError as exc:  # a peer's translation lacks one of the model's layers
        if not peer:
            raise
        return Row(name, note=f"unavailable ({exc})"), None
    setup = time.perf_counter() - start
    # Warm-up doubles as the correctness check: the third step's loss has been through two
    # backward passes and updates, so it compares gradients and SGD too, not just the forward.
    losses = [first] + [run() for _ in range(max(CHECK_STEP, warmup) - 1)]
    return Row(name, check_loss=losses[CHECK_STEP - 1], setup_s=setup), run


def time_interleaved(rows: dict[str, Row], runs: dict[str, Callable[[], float]], steps: int) -> None:
    """Time ``steps`` steps of every engine in ``runs``, the engines taking turns, and fill in their rows.

    A shared machine's speed drifts by tens of percent within seconds; engines timed one after the
    other would each see a different machine, and the ratios would move with it. Taking turns in
    rounds (one untimed step, which absorbs the switch: caches, the other engine's spinning
    threads; then :data:`ROUND_STEPS` timed), with the order rotating, spreads every drift over all
    engines alike.
    """
    times: dict[str, list[float]] = {key: [] for key in runs}
    cpu: dict[str, list[float]] = {key: [] for key in runs}
    order = list(runs)
    round_index = 0
    while any(len(t) < steps for t in times.values()):
        shift = round_index % len(order)
        for key in order[shift:] + order[:shift]:
            todo = min(ROUND_STEPS, steps - len(times[key]))
            if todo <= 0:
                continue
            runs[key]()
            for _ in range(todo):
                t0, c0 = time.perf_counter(), time.process_time()
                runs[key]()
                times[key].append(time.perf_counter() - t0)
                cpu[key].append(time.process_time() - c0)
        round_index += 1
    for key in runs:
        rows[key].ms = statistics.median(times[key]) * 1000
        rows[key].best_ms = min(times[key]) * 1000
        rows[key].cpu_ms = statistics.median(cpu[key]) * 1000


def milliseconds(ms: float) -> str:
    """``ms`` with a tenth of a millisecond from 10 ms up, else three significant digits, trailing
    zeros kept (3.10, not 3.1): a small model's step is a fraction of a millisecond."""
    return f"{ms:.1f}" if ms >= 10 else f"{ms:#.3g}"


def _setup_threads(requested: int | None) -> int:
    """Size opgrad's pool (before it exists) and return the thread count both engines use."""
    from opgrad.env import NUM_THREADS_VAR

    if requested is not None:
        os.environ[NUM_THREADS_VAR] = str(requested)
    from opgrad.compiler.threads import pool

    return pool().nthreads


def _step_flops(model_name: str, batch: int, compiled: Any, optimizer: str = "sgd") -> int:
    """FLOPs of the step's GEMM and conv kernels, from opgrad's plan (so every engine is divided alike)."""
    if compiled is None:
        from opgrad import nn
        from opgrad.compiler import plan_graph

        step = nn.TrainStep(bench_model(model_name), nn.make_optimizer(optimizer), batch_size=batch,
                            backend="reference")
        return sum(cost.flops for cost in plan_graph(step.function).step_costs)
    return sum(cost.flops for cost in compiled.plan.step_costs)


def run(args: argparse.Namespace) -> int:
    """Time each engine and print the table (and the sections asked for); returns 0."""
    from opgrad import nn
    from opgrad.nn.step import llvm_unavailable_reason

    if {"llvm", "reference"} <= set(args.skip):
        raise ConfigError("--skip llvm --skip reference: the table compares opgrad's step with its peers; keep "
                          "at least one of opgrad's engines")
    for section in ("peak", "kernels", "scaling", "compile_times", "memory"):
        setattr(args, section, getattr(args, section, False) or getattr(args, "all", False))
    if getattr(args, "checkpoint", None):
        args.model = args.checkpoint  # an absolute path: what every section and child process reads
    model = bench_model(args.model)
    params = model.init_params(seed=0)
    images, labels = bench_batch(model, args.batch_size)
    lr = 0.01
    llvm_reason = llvm_unavailable_reason()
    allocator_note = keep_freed_memory()
    busy_note = host_load_note(available_cpus())
    threads = _setup_threads(getattr(args, "threads", None)) if llvm_reason is None else (args.threads or 1)
    peak = peak_all = bandwidth = None
    if llvm_reason is None:
        from opgrad.compiler.peak import host_info, measure_bandwidth, measure_peak

        peak = measure_peak(1)
        # More threads than CPUs share them: each thread's CPU time runs at full speed, so their sum
        # would overstate what the CPUs can do; the peak is that of the CPUs there are.
        cores = min(threads, available_cpus())
        peak_all = measure_peak(cores) if cores > 1 else peak
        print(f"host: {host_info().describe()}")
        if args.peak:
            bandwidth = measure_bandwidth(1)
            shared = f" ({threads} threads share them)" if cores < threads else ""
            print(f"peak fp32 FMA: {peak:.1f} GFLOP/s on 1 thread, {peak_all:.1f} on {cores}{shared} "
                  f"({peak_all / peak:.2f}x; generated loop of independent vector FMAs, best of 10, thread CPU time); "
                  f"copy bandwidth {bandwidth:.1f} GB/s on 1 thread (8 MiB arrays)")
    torch_name = f"PyTorch {_version('torch')}".strip()
    jax_name = f"JAX {_version('jax')}".strip()
    llvm_holder: dict[str, Any] = {}
    subjects: list[tuple[str, str, Runner]] = [
        ("llvm", "opgrad llvm (compiled)", _opgrad_runner("llvm", args.model, llvm_holder, args.optimizer)),
        ("reference", "opgrad reference (numpy)", _opgrad_runner("reference", args.model, optimizer=args.optimizer)),
        ("torch", torch_name, torch_runner(args.model, threads, args.optimizer)),
        ("torch-nhwc", f"{torch_name} channels_last", torch_runner(args.model, threads, args.optimizer, True)),
        ("jax", f"{jax_name} (jit)", _jax_runner),
    ]
    update = nn.make_optimizer(args.optimizer).describe()
    print(f"opgrad bench: {args.model} training step (forward + backward + {update}), {model.num_params:,} parameters, "
          f"batch {args.batch_size}, float32, {threads} thread{'s' if threads > 1 else ''}; "
          f"median of {args.steps} steps after {max(CHECK_STEP, args.warmup)} warm-up (at least {CHECK_STEP}: the "
          f"loss check's); opgrad llvm and its peers take turns "
          f"(rounds of 1 untimed + {ROUND_STEPS} timed steps each), the reference runs after them")
    rows: dict[str, Row] = {}
    runs: dict[str, Callable[[], float]] = {}
    for key, name, runner in subjects:
        if key in args.skip:
            rows[key] = Row(name, note="skipped")
            continue
        if key == "torch-nhwc" and not any(layer.kind in ("conv", "convtranspose") for layer in model.layers):
            rows[key] = Row(name, note="skipped (no image convolution: the memory format changes nothing)")
            continue
        if key == "jax" and (args.model != "seed-cnn" or args.optimizer != "sgd"):
            differs = [f"the model is {args.model}" if args.model != "seed-cnn" else "",
                       f"the update is {args.optimizer}" if args.optimizer != "sgd" else ""]
            rows[key] = Row(name, note=f"skipped (bench's JAX twin is the seed CNN with SGD; "
                                       f"{' and '.join(d for d in differs if d)})")
            continue
        if key == "llvm" and llvm_reason is not None:
            rows[key] = Row(name, note=f"unavailable: {llvm_reason}")
            continue
        rows[key], run_step = _prepare(name, runner, params, images, labels, lr, args.warmup,
                                       peer=key in ("torch", "torch-nhwc", "jax"))
        if run_step is not None:
            runs[key] = run_step
    # The reference backend is timed on its own: its numpy BLAS threads keep spinning for a while
    # after each of its steps and would slow whichever engine took the next turn.
    reference = {key: runs.pop(key) for key in ("reference",) if key in runs}
    time_interleaved(rows, runs, args.steps)
    time_interleaved(rows, reference, args.steps)
    flops = (_step_flops(args.model, args.batch_size, llvm_holder.get("compiled"), args.optimizer)
             if llvm_reason is None else 0)
    base_key = "llvm" if rows["llvm"].ms is not None else "reference"
    base = rows[base_key].ms
    ref_loss = rows["reference"].check_loss
    width = max(28, *(len(row.name) + 1 for row in rows.values()))
    print(f"{'engine':<{width}} {'ms/step':>9} {'best':>7} {'CPU ms':>7} {'GFLOP/s':>8} {'% peak':>7} "
          f"{'vs ' + rows[base_key].name.split(' (')[0]:>20} {'setup':>8}  loss check")
    for row in rows.values():
        if row.ms is None:
            print(f"{row.name:<{width}} {row.note}")
            continue
        ratio = f"{row.ms / base:.2f}x" if base else "-"
        check = "-" if row is not rows["reference"] else "(the reference)"
        if ref_loss is not None and row.check_loss is not None and row is not rows["reference"]:
            rel = abs(row.check_loss - ref_loss) / abs(ref_loss)
            check = f"ok (rel. diff {rel:.1e})" if rel < 1e-4 else f"MISMATCH {row.check_loss:.6f} vs {ref_loss:.6f}"
        setup = f"{row.setup_s:.2f}s" if row.setup_s is not None else "-"
        rate = flops / row.ms / 1e6 if flops else None
        rate_text = f"{rate:>8.1f} {100 * rate / peak_all:>6.1f}%" if rate and peak_all else f"{'-':>8} {'-':>7}"
        print(f"{row.name:<{width}} {milliseconds(row.ms):>9} {milliseconds(row.best_ms or 0):>7} "
              f"{milliseconds(row.cpu_ms or 0):>7} {rate_text} "
              f"{ratio:>20} {setup:>8}  {check}")
    print("ms/step = median wall time, best = fastest step, CPU ms = median CPU time of the process (all its "
          "threads, spinning included) per step, the steadier figure when other jobs share the cores")
    print(f"ratio = ms/step divided by the first row that ran; GFLOP/s = the {flops / 1e9:.2f} GFLOP of the step's "
          f"conv/dense kernels per second, % of the measured peak on {min(threads, available_cpus())} CPU(s); "
          f"setup = build/compile + first step; loss check = loss of step {CHECK_STEP} (after {CHECK_STEP - 1} "
          f"{update} updates) against opgrad's reference backend")
    if allocator_note:
        print(allocator_note)
    if busy_note:
        print(busy_note)
    if llvm_reason is None and peak is not None and peak_all is not None:
        # PyTorch's row timed nothing where it was skipped, is missing or lacks one of the model's layers.
        _sections(args, threads, flops, peak, peak_all, bandwidth, with_torch=rows["torch"].ms is not None)
    return 0


def _sections(args: argparse.Namespace, threads: int, flops: int, peak: float, peak_all: float,
              bandwidth: float | None, *, with_torch: bool) -> None:
    from opgrad import benchreport
    from opgrad.compiler.peak import measure_bandwidth

    if args.kernels:
        bw = bandwidth if bandwidth is not None and threads == 1 else measure_bandwidth(threads)
        benchreport.kernels_report(args.model, args.batch_size, threads, peak_all, bw, max(args.steps, 10),
                                   optimizer=args.optimizer)
    if args.scaling:
        from opgrad.compiler.peak import available_cpus

        benchreport.scaling_report(args.model, args.batch_size, available_cpus(), flops, args.steps, with_torch,
                                   optimizer=args.optimizer)
    if getattr(args, "simulate_threads", None):
        benchreport.decomposition_report(args.model, args.batch_size, sorted(set(args.simulate_threads)), flops,
                                         peak, max(3, args.steps), optimizer=args.optimizer)
    if args.compile_times:
        benchreport.compile_report(args.model, args.batch_size, threads, optimizer=args.optimizer)
    if args.memory:
        benchreport.memory_report(args.model, args.batch_size, threads, with_torch, optimizer=args.optimizer)
