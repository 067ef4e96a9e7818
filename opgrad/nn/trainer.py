"""``Trainer``: parameters, optimizer state, step counter and seeded randomness around the steps.

Why a class around the two steps: everything that makes a run reproducible lives here and only
here. All randomness is derived from ``seed`` and a position, never from a generator that
carries state across steps:

* initial weights: one generator per parameter (``opgrad.nn.init``);
* batch order of epoch ``e``: ``PCG64([seed, e])`` via ``opgrad.data.iterate_batches``;
* dropout masks and augmentation shifts of global step ``t``: ``PCG64([seed, tag, t])``.

So the same seed gives the same numbers, and a run resumed from a checkpoint (which stores the
parameters, the optimizer state, the step and epoch counters) continues *exactly* as the
uninterrupted run would have, with nothing but arrays and JSON in the checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import math
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from opgrad.checkpoint import CheckpointError, json_default
from opgrad.data import iterate_batches
from opgrad.errors import NonFiniteLossError, ShapeError
from opgrad.history import TrainingHistory
from opgrad.nn.losses import (
    CLASS_LABEL_LOSS,
    accuracy,
    check_class_labels,
    check_position_labels,
    check_targets,
    cross_entropy_numpy,
)
from opgrad.nn.model import Model
from opgrad.nn.optim import Optimizer
from opgrad.nn.schedules import LRSchedule, Schedule, constant_lr, cosine_lr
from opgrad.nn.step import (
    BACKENDS,
    EvalStep,
    NanLossError,
    TrainStep,
    check_batch_inputs,
    check_loss_weights,
    check_optimizer,
    dataset_loss,
    per_output,
    resolve_losses,
)

__all__ = ["Inputs", "LRSchedule", "Labels", "Trainer", "affine_images", "constant_lr", "cosine_lr", "cut_labels",
           "first_labels", "label_rows", "noise_rng", "shift_images", "shift_rng"]

#: The inputs of a batch or a dataset: one array for a model with one input, else one array per
#: input in ``model.inputs`` order (as ``TrainStep`` and ``Model.predict`` take them).
Inputs = np.ndarray | Sequence[np.ndarray]
#: What Trainer methods take as labels: one array serving every output, or a list of one per
#: output (a model with several heads): class indices for a cross-entropy output, targets of the
#: output's shape for another loss.
Labels = np.ndarray | Sequence[np.ndarray]


def label_rows(labels: Labels) -> int:
    """The number of examples ``labels`` (one array, or one per output) label."""
    return len(labels if isinstance(labels, np.ndarray) else labels[0])


def cut_labels(labels: Labels, rows: Any) -> Labels:
    """``labels`` at ``rows`` (a slice or an index array), every output's alike."""
    if isinstance(labels, np.ndarray):
        return np.ascontiguousarray(labels[rows])
    return [np.ascontiguousarray(array[rows]) for array in labels]


def first_labels(labels: Labels) -> np.ndarray:
    """The labels of the first output, which evaluation scores."""
    return labels if isinstance(labels, np.ndarray) else labels[0]

_NOISE_TAG = 0x6E6F6973  # "nois": dropout masks
_SHIFT_TAG = 0x73686966  # "shif": augmentation shifts


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"Trainer: {name} must be a positive integer, got {value!r}")


def _check_lr(lr: object) -> float:
    """``lr`` as a float, or a ``ValueError`` unless it is finite and >= 0 (as PyTorch's optimizers)."""
    try:
        value = float(lr)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"Trainer: lr must be a finite number >= 0 or a schedule (opgrad.nn.schedules), "
                         f"got {lr!r}") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"Trainer: lr must be a finite number >= 0, got {lr!r}")
    return value


def _takes_one_image(model: Model) -> bool:
    """Whether ``model`` has the single float ``(channels, height, width)`` input augmentation moves."""
    return len(model.inputs) == 1 and model.inputs[0].dtype == "float" and len(model.inputs[0].shape) == 3


def _describe_inputs(model: Model) -> str:
    """``model``'s inputs as an error message lists them: ``'a' (4,) float, 'b' (3,) int64``."""
    return ", ".join(f"{t.name!r} {t.shape} {t.dtype}" for t in model.inputs)


def _first_difference(saved: Any, mine: Any, where: str = "") -> str:
    """Where two model configurations first differ, as ``layers[1].config.activation: 'relu' in
    the checkpoint, 'tanh' here``."""
    if isinstance(saved, dict) and isinstance(mine, dict):
        for key in sorted(set(saved) | set(mine)):
            if saved.get(key) != mine.get(key):
                return _first_difference(saved.get(key), mine.get(key), f"{where}.{key}" if where else str(key))
    if isinstance(saved, list) and isinstance(mine, list) and len(saved) == len(mine):
        for i, (a, b) in enumerate(zip(saved, mine, strict=True)):
            if a != b:
                return _first_difference(a, b, f"{where}[{i}]")
    return f"{where or 'the configuration'}: {saved!r} in the checkpoint, {mine!r} here"


def _step_rng(seed: int, tag: int, step: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64([seed, tag, step]))


def noise_rng(seed: int, step: int) -> np.random.Generator:
    """The generator of global step ``step``'s dropout masks (drawn for the whole batch)."""
    return _step_rng(seed, _NOISE_TAG, step)


def shift_rng(seed: int, step: int) -> np.random.Generator:
    """The generator of global step ``step``'s augmentation (shifts or affine maps, drawn for the whole batch)."""
    return _step_rng(seed, _SHIFT_TAG, step)


def epoch_shuffle_seed(seed: int, epoch: int) -> int:
    """An int for ``iterate_batches`` that depends on both the run seed and the epoch."""
    return int(np.random.SeedSequence([seed, epoch]).generate_state(1, np.uint64)[0])


def shift_images(images: np.ndarray, rng: np.random.Generator, max_shift: int) -> np.ndarray:
    """Translate each NCHW image by up to ``max_shift`` pixels in each direction, zero-filled.

    The cheapest augmentation that helps on a 4,000-digit training set: it teaches the model
    that a digit a pixel off-center is the same digit. Done in numpy outside the graph, because
    it has nothing to differentiate.
    """
    if max_shift <= 0:
        return images
    n, c, h, w = images.shape
    k = max_shift
    padded = np.zeros((n, c, h + 2 * k, w + 2 * k), images.dtype)
    padded[:, :, k : k + h, k : k + w] = images
    dy = rng.integers(-k, k + 1, size=n)
    dx = rng.integers(-k, k + 1, size=n)
    # Every image's (2k+1)^2 windows as a view; one gather picks each image's own window.
    windows = np.lib.stride_tricks.sliding_window_view(padded, (h, w), axis=(2, 3))
    return np.ascontiguousarray(windows[np.arange(n), :, k + dy, k + dx])


def affine_images(images: np.ndarray, rng: np.random.Generator, max_degrees: float, max_scale: float,
                  max_shift: float) -> np.ndarray:
    """Rotate each NCHW image by up to ``max_degrees``, scale it by a factor in
    ``[1 - max_scale, 1 + max_scale]`` and translate it by up to ``max_shift`` pixels per axis, all
    drawn uniformly per image, about the image centre; bilinear sampling, zero outside the image
    (Keras' RandomRotation + RandomZoom + RandomTranslation with ``fill_mode="constant"``).

    Handwriting varies in slant and size as well as position, so on a few thousand digits these
    draws generalize further than shifts alone.
    """
    n, c, h, w = images.shape
    theta = np.deg2rad(rng.uniform(-max_degrees, max_degrees, n))
    scale = rng.uniform(1.0 - max_scale, 1.0 + max_scale, n)
    shift_y, shift_x = rng.uniform(-max_shift, max_shift, (2, n))
    cy, cx = (h - 1) / 2.0, (w - 1) / 2.0
    ys, xs = np.meshgrid(np.arange(h) - cy, np.arange(w) - cx, indexing="ij")
    # Output pixel p comes from source R(-theta) (p - t) / s + centre.
    cos, sin = (np.cos(theta) / scale)[:, None, None], (np.sin(theta) / scale)[:, None, None]
    oy, ox = ys[None] - shift_y[:, None, None], xs[None] - shift_x[:, None, None]
    src_y = cos * oy - sin * ox + cy
    src_x = sin * oy + cos * ox + cx
    y0, x0 = np.floor(src_y).astype(np.int64), np.floor(src_x).astype(np.int64)
    fy, fx = (src_y - y0).astype(images.dtype), (src_x - x0).astype(images.dtype)
    flat = images.reshape(n, c, h * w)
    out = np.zeros_like(images)
    for dy, dx, weight in ((0, 0, (1 - fy) * (1 - fx)), (0, 1, (1 - fy) * fx), (1, 0, fy * (1 - fx)),
                           (1, 1, fy * fx)):
        yy, xx = y0 + dy, x0 + dx
        inside = (yy >= 0) & (yy < h) & (xx >= 0) & (xx < w)
        index = np.where(inside, yy * w + xx, 0).reshape(n, 1, h * w)
        values = np.take_along_axis(flat, np.broadcast_to(index, (n, c, h * w)), axis=2).reshape(n, c, h, w)
        out += values * (weight * inside)[:, None]
    return out


class Trainer:
    """Trains ``model`` with ``optimizer`` on fixed-size batches with the chosen backend.

    ``backend`` is ``"reference"`` or ``"llvm"``; the steps are built on first use and reused.
    Methods that take data take :data:`Inputs`, one array per model input: float inputs are
    cast to ``dtype``, integer inputs (token ids) stay integers. ``params`` defaults to the
    model's weights where it holds some (assigned to ``model.params``, loaded, imported, or trained
    by another Trainer; :attr:`~opgrad.nn.Model.weights_assigned`), else to a fresh initialization
    from ``seed`` with fresh running statistics; kept or given weights keep the model's buffers.
    With ``stop_on_nan`` (the default) a step whose loss is nan or infinite raises
    :class:`~opgrad.errors.NonFiniteLossError` naming the epoch, step, loss and learning rate, and
    leaves the parameters as they were before that step; without it training carries on with
    whatever the updates produce.
    """

    def __init__(self, model: Model, optimizer: Optimizer, *, lr: float | Schedule = 1e-3,
                 batch_size: int = 32, seed: int = 0, dtype: str = "float32", backend: str = "reference",
                 eval_batch_size: int = 100, augment_shift: int = 0, augment_rotate: float = 0.0,
                 augment_scale: float = 0.0, params: Mapping[str, np.ndarray] | None = None,
                 stop_on_nan: bool = True, loss_weights: Sequence[float] | None = None,
                 loss: str | Sequence[str] = CLASS_LABEL_LOSS) -> None:
        #: Each output's loss (a :data:`~opgrad.nn.losses.LOSSES` name): class labels for cross-entropy,
        #: float targets of the output's shape for the others.
        self.losses = resolve_losses(model, loss, "Trainer")
        _check_positive_int("batch_size", batch_size)
        _check_positive_int("eval_batch_size", eval_batch_size)
        if isinstance(augment_shift, bool) or not isinstance(augment_shift, (int, np.integer)) or augment_shift < 0:
            raise ValueError(f"Trainer: augment_shift must be an integer >= 0, got {augment_shift!r}")
        if not (isinstance(augment_rotate, (int, float)) and 0 <= augment_rotate <= 180):
            raise ValueError(f"Trainer: augment_rotate must be degrees in [0, 180], got {augment_rotate!r}")
        if not (isinstance(augment_scale, (int, float)) and 0 <= augment_scale < 1):
            raise ValueError(f"Trainer: augment_scale must be a fraction in [0, 1), got {augment_scale!r}")
        if backend not in BACKENDS:
            raise ValueError(f"Trainer: unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        check_optimizer(optimizer, "Trainer")
        check_loss_weights(model, loss_weights)
        #: Each output's weight in the loss (one softmax cross-entropy per output), None for 1 each.
        self.loss_weights = None if loss_weights is None else [float(w) for w in loss_weights]
        augments = bool(augment_shift or augment_rotate or augment_scale)
        if augments and not _takes_one_image(model):
            raise ValueError(f"Trainer: augment_shift, augment_rotate and augment_scale move the pixels of one image "
                             f"input (channels, height, width); model {model.name!r} takes {_describe_inputs(model)}")
        self.model, self.optimizer = model, optimizer
        self._augments = augments
        # What the step takes per input: float inputs in ``dtype``, integer inputs in their own type.
        self._input_dtypes = tuple(v.dtype for v in model.input_vars(1, dtype))
        self.schedule: Schedule = lr if isinstance(lr, Schedule) else constant_lr(_check_lr(lr))
        _check_lr(self.schedule.base)
        self.batch_size, self.seed, self.dtype, self.backend = batch_size, seed, dtype, backend
        self.eval_batch_size, self.augment_shift = eval_batch_size, augment_shift
        self.augment_rotate, self.augment_scale = float(augment_rotate), float(augment_scale)
        self.stop_on_nan = stop_on_nan
        self._optimizer_state: dict[str, np.ndarray] = {}
        # The model's own weights where it holds some (assigned, loaded, imported or trained, as
        # Keras' fit and a PyTorch optimizer take them), else a fresh draw from ``seed``.
        keeps_weights = params is not None or model.weights_assigned
        if params is None and model.weights_assigned:
            if seed != 0 and model.weights_drawn_at_first_use:
                warnings.warn(f"Trainer(seed={seed}): the model already holds weights, seed 0's draw made when "
                              "they were first used (predict or params), and trains those; the seed draws the "
                              f"batch order and random layers only. To start from seed {seed}'s draw, assign "
                              f"model.params = model.init_params({seed}) first (or pass params=)",
                              UserWarning, stacklevel=2)
            params = model.params
        # Kept or given weights in the trainer's dtype, as its buffers are (a float32 model trained in float64).
        self.params = ({k: np.asarray(v).astype(dtype, copy=False) for k, v in params.items()} if params is not None
                       else model.init_params(seed, dtype))
        # Kept weights come with their running statistics; fresh weights start from fresh statistics.
        buffers = ({k: v.astype(dtype, copy=False) for k, v in model.buffers.items()} if keeps_weights
                   else model.init_buffers(dtype))
        #: The trainable parameters the training steps were built for (:meth:`follow_trainable`).
        self._trainable = tuple(model.trainable_param_names())
        params = self.params
        self.state = {**optimizer.init_state({name: params[name] for name in self._trainable}), **buffers}
        self.step = 0
        self.epoch = 0
        self.history = TrainingHistory()
        self._train_step: TrainStep | None = None
        self._eval_step: EvalStep | None = None

    # ----- the weights live in the model (Keras' habit: after training, model.predict uses them) -----

    @property
    def params(self) -> dict[str, np.ndarray]:
        return self.model.params

    @params.setter
    def params(self, values: Mapping[str, np.ndarray]) -> None:
        self.model.params = values

    @property
    def state(self) -> dict[str, np.ndarray]:
        """The optimizer's state followed by the model's buffers (running statistics)."""
        return {**self._optimizer_state, **self.model.buffers}

    @state.setter
    def state(self, values: Mapping[str, np.ndarray]) -> None:
        buffers = self.model.buffer_shapes()
        self._optimizer_state = {k: v for k, v in values.items() if k not in buffers}
        if buffers:
            self.model.buffers = {k: values[k] if k in values else self.model.buffers[k] for k in buffers}

    # ----- the two compiled functions, built once -----

    def follow_trainable(self) -> None:
        """Rebuild the training step where layers were frozen or unfrozen since it was built (Keras
        recompiles for this): a layer unfrozen for the first time starts with zero optimizer slots
        (moments, momentum), one frozen keeps its slots for when it trains again. Adam's bias
        correction counts the optimizer's steps, as Keras' does (PyTorch counts each parameter's)."""
        trainable = tuple(self.model.trainable_param_names())
        if trainable == self._trainable:
            return
        self._trainable = trainable
        self.reset_steps()
        params = self.params
        self.state = {**self.optimizer.init_state({name: params[name] for name in trainable}), **self.state}

    def kept_state(self, stepped: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The state after a step that returned ``stepped``: its entries, and the optimizer state of
        layers frozen now, which the step does not carry, kept for when they train again (as
        PyTorch's optimizers keep a frozen parameter's moments)."""
        return {**self._optimizer_state, **stepped}

    def reset_steps(self) -> None:
        """Forget the built training step, so the next use builds it anew."""
        self._train_step = None

    @property
    def train_step(self) -> TrainStep:
        self.follow_trainable()
        if self._train_step is None:
            self._train_step = TrainStep(self.model, self.optimizer, batch_size=self.batch_size,
                                         dtype=self.dtype, backend=self.backend, loss_weights=self.loss_weights,
                                         loss=self.losses)
        return self._train_step

    @property
    def eval_step(self) -> EvalStep:
        if self._eval_step is None:
            self._eval_step = EvalStep(self.model, batch_size=self.eval_batch_size, dtype=self.dtype,
                                       backend=self.backend)
        return self._eval_step

    # ----- inputs: one array per model input -----

    def _input_arrays(self, inputs: Inputs, labels: Labels, who: str, classes: bool = True) -> list[np.ndarray]:
        """One array per model input, in ``model.inputs`` order, checked against the model: how
        many, their per-example shapes, integers for an integer input (a float id would be
        truncated), and one row per label; the labels of a cross-entropy output one integer class
        per row (per position for a ``(length, classes)`` output), with ``classes`` within the
        output's classes; the targets of another loss real numbers of the output's shape.

        Not cast yet: a dataset is cast batch by batch, so uint8 pixels are never all held as floats.
        """
        outputs = self.model.outputs
        label_arrays = [labels] * len(outputs) if isinstance(labels, np.ndarray) else list(labels)
        if len(label_arrays) != len(outputs) or not all(isinstance(y, np.ndarray) for y in label_arrays):
            raise TypeError(f"Trainer.{who}: labels must be one array, which serves every output, or a list "
                            f"of {len(outputs)} (one per output of model {self.model.name!r}); got "
                            f"{type(labels).__name__} of {len(label_arrays)}")
        rows = label_rows(labels)
        for tensor, y, loss in zip(outputs, label_arrays, self.losses, strict=True):
            node = tensor.node
            head = f" (output {node.layer.describe()})" if node is not None and len(outputs) > 1 else ""
            if loss != CLASS_LABEL_LOSS:
                check_targets(y, (rows, *tensor.shape), loss, f"Trainer.{who}{head}")
            elif len(tensor.shape) == 2:  # (length, classes): a class per position
                check_position_labels(y, (rows, tensor.shape[0]), tensor.shape[1] if classes else None,
                                      f"Trainer.{who}{head}")
            else:
                count = tensor.shape[0] if classes and len(tensor.shape) == 1 else None  # each head its own classes
                check_class_labels(y, rows, count, f"Trainer.{who}{head}")
        tensors = self.model.inputs
        arrays = [inputs] if isinstance(inputs, np.ndarray) else [np.asarray(a) for a in inputs]
        if len(arrays) != len(tensors):
            raise ValueError(f"Trainer.{who}: model {self.model.name!r} takes {len(tensors)} input array(s) "
                             f"({_describe_inputs(self.model)}), got {len(arrays)}")
        for tensor, array in zip(tensors, arrays):
            if tuple(array.shape[1:]) != tensor.shape:
                raise ShapeError(f"Trainer.{who}: input {tensor.name!r} has shape {array.shape}; model "
                                 f"{self.model.name!r} expects (N, {', '.join(map(str, tensor.shape))})")
        check_batch_inputs(self.model, arrays, self._input_dtypes, f"Trainer.{who}")
        if any(len(array) != rows for array in arrays):
            counts = ", ".join(f"{t.name!r} {len(a)}" for t, a in zip(tensors, arrays))
            raise ValueError(f"Trainer.{who}: every input needs one row per label; got {rows} labels and "
                             f"rows {counts}")
        return arrays

    def _one_or_list(self, arrays: list[np.ndarray]) -> Inputs:
        """One bare array for a model with one input (what callers of :meth:`epoch_batches` and
        wrappers of the steps have always been given), else the list."""
        return arrays[0] if len(arrays) == 1 else arrays

    def _augmented(self, arrays: Sequence[np.ndarray], step: int) -> list[np.ndarray]:
        """A batch's inputs with the image input augmented as global step ``step`` draws it, when asked
        (the constructor allows augmentation only for a model with one image input)."""
        return [self.augment(arrays[0], step)] if self._augments else list(arrays)

    def _step_inputs(self, arrays: Sequence[np.ndarray], step: int) -> list[np.ndarray]:
        """A batch's inputs as global step ``step`` takes them: augmented, float inputs cast to the
        trainer's dtype and integer inputs to their own (never a float: ``_input_arrays`` refuses it)."""
        return [a.astype(dtype, copy=False) for a, dtype in zip(self._augmented(arrays, step), self._input_dtypes)]

    # ----- training -----

    def augment(self, images: np.ndarray, step: int) -> np.ndarray:
        """The training images of global step ``step`` as augmented (drawn from the run's seed and the
        step, so a resumed run draws the same): integer shifts alone, or a random affine map when a
        rotation or scale range is set."""
        rng = shift_rng(self.seed, step)
        if self.augment_rotate or self.augment_scale:
            return affine_images(images, rng, self.augment_rotate, self.augment_scale, self.augment_shift)
        if self.augment_shift:
            return shift_images(images, rng, self.augment_shift)
        return images

    def _quiet_while_stopping(self) -> contextlib.AbstractContextManager[Any]:
        """With ``stop_on_nan``, numpy's overflow warnings off: the stop reports a diverging step,
        and the reference backend's warnings would only say the same earlier, without a step."""
        if self.stop_on_nan:
            return np.errstate(over="ignore", invalid="ignore", divide="ignore")
        return contextlib.nullcontext()

    def train_batch(self, inputs: Inputs, labels: Labels) -> float:
        """One optimizer step on one batch; returns its loss (before the update).

        ``inputs`` is one array per model input (a bare array for a model with one input), each of
        ``batch_size`` rows, the one batch size of the compiled step.
        Raises :class:`~opgrad.errors.NonFiniteLossError` for a nan or infinite loss when
        ``stop_on_nan`` is set, without applying the step.
        """
        arrays = self._input_arrays(inputs, labels, "train_batch")
        self._check_batch_rows(labels, "train_batch")
        return self._train_batch(arrays, labels, epoch_step=None)

    def _check_batch_rows(self, labels: Labels, who: str) -> None:
        """A ValueError unless the batch (already checked to have one row per label in every input)
        has ``batch_size`` rows: the compiled step has that one batch size."""
        rows = label_rows(labels)
        if rows != self.batch_size:
            first = self.model.inputs[0].name
            raise ValueError(f"Trainer.{who}: input {first!r} has {rows} rows; this trainer steps batches of "
                             f"batch_size={self.batch_size} (its compiled step has that one size): give batches "
                             f"of {self.batch_size} rows and leave out a smaller last one (train_epoch drops it, "
                             f"as PyTorch's drop_last=True)")

    def _train_batch(self, inputs: list[np.ndarray], labels: Labels, *, epoch_step: int | None) -> float:
        arrays = self._step_inputs(inputs, self.step)
        masks = self.model.sample_noise(noise_rng(self.seed, self.step), label_rows(labels), self.dtype)
        lr = self.schedule(self.step)
        with self._quiet_while_stopping():
            result = self.train_step(arrays, self.step_labels(labels), self.params, self.state, lr, masks)
        if self.stop_on_nan and not math.isfinite(result.loss):
            raise NonFiniteLossError(float(result.loss), epoch=self.epoch + 1, step=self.step + 1, lr=lr,
                                     epoch_step=epoch_step)
        self.params, self.state = result.params, self.kept_state(result.state)
        self.step += 1
        self.history.record_step(result.loss)
        return result.loss

    def train_batches(self, batches: Sequence[tuple[Inputs, Labels]]) -> list[float]:
        """Consecutive optimizer steps in ONE call (:meth:`TrainStep.run_steps`); returns their losses.

        Each batch is ``(inputs, labels)`` as :meth:`train_batch` takes them. The numbers equal
        :meth:`train_batch` on each batch in order: shifts, dropout masks and
        learning rates are drawn per step exactly as there, then stacked batch-major. With
        ``stop_on_nan`` the native loop stops at a NaN loss: the steps before it are kept and
        :class:`~opgrad.errors.NonFiniteLossError` names the step.
        """
        checked = []
        for i, (inputs, labels) in enumerate(batches):
            checked.append((self._input_arrays(inputs, labels, f"train_batches (batch {i})"), labels))
            self._check_batch_rows(labels, f"train_batches (batch {i})")
        return self._train_batches(checked, epoch_step=None)

    def _train_batches(self, batches: Sequence[tuple[list[np.ndarray], Labels]], *,
                       epoch_step: int | None) -> list[float]:
        if not batches:
            return []
        xs: list[list[np.ndarray]] = [[] for _ in self.model.inputs]  # per input, the batches in order
        ys: list[Labels] = []
        masks: dict[str, list[np.ndarray]] = {}
        lrs: list[float] = []
        for i, (inputs, labels) in enumerate(batches):
            step = self.step + i
            for column, array in zip(xs, self._step_inputs(inputs, step)):
                column.append(array)
            for name, mask in self.model.sample_noise(noise_rng(self.seed, step), label_rows(labels),
                                                      self.dtype).items():
                masks.setdefault(name, []).append(mask)
            ys.append(self.step_labels(labels))
            lrs.append(self.schedule(step))
        try:
            with self._quiet_while_stopping():
                stacked: Labels = (np.concatenate(ys) if isinstance(ys[0], np.ndarray)
                                   else [np.concatenate(head) for head in zip(*ys, strict=True)])
                result = self.train_step.run_steps([np.concatenate(column) for column in xs], stacked,
                                                   self.params, self.state, np.asarray(lrs, dtype=self.dtype),
                                                   {name: np.concatenate(m) for name, m in masks.items()},
                                                   stop_on_nan=self.stop_on_nan)
        except NanLossError as stopped:
            self.params, self.state = stopped.params, self.kept_state(stopped.state)
            for loss in stopped.losses[: stopped.step]:
                self.history.record_step(float(loss))
            self.step += stopped.step
            raise NonFiniteLossError(float(stopped.losses[stopped.step]), epoch=self.epoch + 1, step=self.step + 1,
                                     lr=lrs[stopped.step],
                                     epoch_step=None if epoch_step is None else epoch_step + stopped.step) from None
        self.params, self.state = result.params, self.kept_state(result.state)
        self.step += len(batches)
        losses = [float(loss) for loss in result.losses]
        for loss in losses:
            self.history.record_step(loss)
        return losses

    def epoch_batches(self, inputs: Inputs, labels: Labels) -> Iterator[tuple[Inputs, Labels]]:
        """This epoch's batches: shuffled by ``(seed, epoch)``, last partial batch dropped, every input
        cut by the same rows. A batch's inputs are one array for a model with one input, else a list."""
        # Only cut here: what the labels index is the steps' to check.
        batches = self._epoch_batches(self._input_arrays(inputs, labels, "epoch_batches", classes=False), labels)
        return ((self._one_or_list(x), y) for x, y in batches)

    def _epoch_batches(self, arrays: list[np.ndarray], labels: Labels) -> Iterator[tuple[list[np.ndarray], Labels]]:
        # The epoch's order is iterate_batches' order of the row numbers, so every input and the
        # labels are cut by the same rows, and a one-input model gets what iterate_batches gives it.
        # (iterate_batches is typed for images, but only indexes what it is given.)
        row_numbers: Any = np.arange(label_rows(labels))
        order = iterate_batches(row_numbers, row_numbers, self.batch_size,
                                shuffle_seed=epoch_shuffle_seed(self.seed, self.epoch), drop_last=True)
        return (([np.ascontiguousarray(array[rows]) for array in arrays], cut_labels(labels, rows))
                for rows, _ in order)

    def steps_per_epoch(self, num_examples: int) -> int:
        return num_examples // self.batch_size

    def train_epoch(self, inputs: Inputs, labels: Labels, *,
                    on_step: Callable[[int, float], None] | None = None, max_steps: int | None = None,
                    steps_per_call: int = 1, on_chunk: Callable[[list[float]], None] | None = None) -> float:
        """Run one epoch (or its first ``max_steps`` steps); returns the mean batch loss.

        ``inputs`` is one array per model input (a bare array for a model with one input), each
        shuffled by the same rows. The epoch counter advances even when ``max_steps`` cut it
        short, so a smoke run's next epoch still gets a new batch order. ``steps_per_call > 1``
        runs that many steps per call of the native loop (:meth:`train_batches`), with the same
        numbers; ``on_step`` is then called for each step of a chunk after the chunk, and
        ``on_chunk`` once with the chunk's losses (a progress display times chunks: their steps
        all end together).
        """
        if steps_per_call < 1:
            raise ValueError(f"steps_per_call must be >= 1, got {steps_per_call}")
        arrays = self._input_arrays(inputs, labels, "train_epoch")
        examples = label_rows(labels)
        if examples < self.batch_size and max_steps != 0:
            # An epoch takes whole batches only (the compiled step has one batch size), so this
            # epoch would train nothing and report a nan loss that reads like a diverged run.
            remedy = f"give batch_size <= {examples}" if examples else "give it examples"
            raise ValueError(f"Trainer.train_epoch: {examples} examples make no whole batch of {self.batch_size} "
                             f"(an epoch drops the last partial batch); {remedy}")
        losses: list[float] = []
        chunk: list[tuple[list[np.ndarray], Labels]] = []

        def flush() -> None:
            first = len(losses) + 1
            done = ([self._train_batch(*chunk[0], epoch_step=first)] if steps_per_call == 1
                    else self._train_batches(chunk, epoch_step=first))
            chunk.clear()
            for loss in done:
                losses.append(loss)
                if on_step is not None:
                    on_step(len(losses), loss)
            if on_chunk is not None:
                on_chunk(list(done))

        for i, (x, y) in enumerate(self._epoch_batches(arrays, labels)):
            if max_steps is not None and i >= max_steps:
                break
            chunk.append((x, y))
            if len(chunk) == steps_per_call:
                flush()
        if chunk:
            flush()
        self.epoch += 1
        return float(np.mean(losses)) if losses else math.nan

    def step_labels(self, labels: Labels) -> Labels:
        """Labels as the training step takes them: class indices int64 (int32, uint8 cast, as the
        float inputs are to the dtype), the targets of other losses in the trainer's dtype."""
        cast = [y.astype(np.int64 if loss == CLASS_LABEL_LOSS else self.dtype, copy=False)
                for y, loss in zip(per_output(labels, len(self.losses)), self.losses, strict=True)]
        return cast[0] if len(cast) == 1 else cast

    def evaluate(self, inputs: Inputs, labels: Labels) -> tuple[float, float]:
        """``(accuracy, mean cross-entropy)`` of the current parameters on the first output, dropout off,
        for a classifier (a first output trained with cross-entropy, one class per example);
        :meth:`evaluate_loss` scores any model.

        ``inputs`` is one array per model input (a bare array for a model with one input).
        """
        self.check_classifier("Trainer.evaluate")
        arrays = self._input_arrays(inputs, labels, "evaluate")
        first = first_labels(labels)
        if not len(first):
            raise ValueError("Trainer.evaluate: no examples; accuracy and loss need at least one")
        logits = self.eval_step.logits(arrays, {**self.params, **self.model.buffers})
        return accuracy(logits, first), cross_entropy_numpy(logits, first)

    def check_classifier(self, who: str) -> None:
        """A ValueError naming ``who`` unless the first output is a classifier's (cross-entropy,
        one class per example), which accuracy needs."""
        first_output = self.model.outputs[0]
        if self.losses[0] != CLASS_LABEL_LOSS or len(first_output.shape) != 1:
            raise ValueError(f"{who}: accuracy needs a classifier, one class per example; model "
                             f"{self.model.name!r} trains output 0 {tuple(first_output.shape)} with "
                             f"{self.losses[0]!r}: use evaluate_loss(inputs, targets)")

    def evaluate_loss(self, inputs: Inputs, labels: Labels) -> float:
        """The training loss of the current parameters over every example, dropout off and
        BatchNorm on its running statistics (Keras' ``evaluate``): each output's loss, weighted as
        in training, as the mean over all examples (and positions), computed in float64."""
        arrays = self._input_arrays(inputs, labels, "evaluate_loss")
        if not label_rows(labels):
            raise ValueError("Trainer.evaluate_loss: no examples; a mean loss needs at least one")
        outputs = self.eval_step.outputs(arrays, {**self.params, **self.model.buffers})
        return dataset_loss(self.model, outputs, per_output(labels, len(outputs)), self.losses, self.loss_weights)

    # ----- checkpoints -----

    def expected_arrays(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """name -> (shape, dtype) of everything a checkpoint of this trainer must hold."""
        return {name: (value.shape, value.dtype.name) for name, value in {**self.params, **self.state}.items()}

    def checkpoint(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """``(arrays, meta)`` for ``opgrad.checkpoint.save_checkpoint``."""
        meta = {
            "model": self.model.name,
            "architecture": self.model.get_config(),
            "optimizer": self.optimizer.describe(),
            "step": self.step,
            "epoch": self.epoch,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "dtype": self.dtype,
            "history": self.history.to_dict(),
        }
        if any(loss != CLASS_LABEL_LOSS for loss in self.losses):  # the default is left out, as before
            meta["losses"] = list(self.losses)
        return {**self.params, **self.state}, meta

    def check_resumable(self, meta: Mapping[str, Any]) -> None:
        """A ``CheckpointError`` (a ``ValueError``) where a checkpoint with metadata ``meta`` is
        of another model or was trained with another optimizer: said before its arrays are
        compared, whose names then differ by the dozen."""
        if meta.get("model") != self.model.name:
            raise CheckpointError(f"checkpoint is of model {meta.get('model')!r}, not {self.model.name!r}")
        saved = meta.get("architecture")
        if isinstance(saved, dict):
            mine = json.loads(json.dumps(self.model.get_config(), default=json_default))
            frozen = {str(entry.get("name")): entry.get("trainable", True) is False
                      for entry in saved.get("layers", []) if isinstance(entry, dict)}
            for layer in self.model.layers:
                if layer.name in frozen and frozen[str(layer.name)] == layer.trainable:
                    raise CheckpointError(
                        f"checkpoint has layer {layer.name!r} {'frozen' if frozen[str(layer.name)] else 'trainable'} "
                        f"and model {self.model.name!r} has it {'trainable' if layer.trainable else 'frozen'}: set "
                        f"layer.trainable = {not frozen[str(layer.name)]} to resume (its optimizer state follows)")
            if saved != mine:
                raise CheckpointError(f"checkpoint is of another architecture than model {self.model.name!r} "
                                      f"({_first_difference(saved, mine)}); rebuild the model it was trained "
                                      "with (nn.load reads it from the checkpoint)")
        saved_losses = meta.get("losses", [CLASS_LABEL_LOSS] * len(self.losses))
        if meta.get("optimizer") is not None and saved_losses != list(self.losses):
            raise CheckpointError(f"checkpoint was trained with loss {saved_losses}; resume it with the same losses "
                                  f"(this run uses {list(self.losses)})")
        if meta.get("optimizer") is None:  # model.save, an import: weights without a training run
            raise CheckpointError("checkpoint holds a model's weights but no optimizer state to resume; start "
                                  "a new run from its weights (opgrad train --init, or nn.load and a Trainer)")
        if meta.get("optimizer") != self.optimizer.describe():
            raise CheckpointError(
                f"checkpoint was trained with {meta.get('optimizer')!r}; resume it with the same optimizer "
                f"(this run uses {self.optimizer.describe()!r})"
            )

    def restore(self, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> None:
        """Load what :meth:`checkpoint` produced (shapes already checked by ``load_checkpoint``).

        A checkpoint of another model or optimizer is a ``CheckpointError`` (a ``ValueError``).
        """
        self.check_resumable(meta)
        # np.array, not np.ascontiguousarray: the latter turns Adam's 0-d scalars into shape (1,).
        self.params = {name: np.array(arrays[name], order="C") for name in self.params}
        self.state = {name: np.array(arrays[name], order="C") for name in self.state}
        self.step = int(meta["step"])
        self.epoch = int(meta["epoch"])
        self.history = TrainingHistory.from_dict(meta.get("history", {}))
