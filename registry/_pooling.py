"""Window arithmetic shared by the pooling operator files (not an operator module)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from opgrad.dtypes import TensorType
from opgrad.op import Attr, Attrs, Case, int_tuple, require

if TYPE_CHECKING:  # types only: the compiler and the checker sit above the registry
    from opgrad.checks.strategies import CaseDraw


def _strides(value: Any, types: Sequence[TensorType], attrs: dict[str, Any]) -> tuple[int, int]:
    if value is None:  # Keras' convention: non-overlapping windows
        pool_size: tuple[int, int] = attrs["pool_size"]
        return pool_size
    return int_tuple(2, minimum=1)(value)  # type: ignore[return-value]


def _flag(value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"expected True or False, got {value!r}")
    return bool(value)


def pool_attrs(avg: bool = False) -> list[Attr]:
    attrs = [
        Attr("pool_size", default=(2, 2), convert=int_tuple(2, minimum=1), doc="(kh, kw)"),
        Attr("strides", default=None, convert=_strides, uses_types=True, doc="(sh, sw); None means pool_size"),
        Attr("padding", default=(0, 0), convert=int_tuple(2, minimum=0), doc="(ph, pw), each < pool size"),
        Attr("ceil_mode", default=False, convert=_flag,
             doc="PyTorch's ceil_mode: round the output size up, keeping only windows that start inside "
                 "the input or its left/top padding"),
    ]
    if avg:
        attrs.append(Attr("count_include_pad", default=True, convert=_flag,
                          doc="PyTorch's: the divisor counts the zero padding (not what overhangs it in ceil "
                              "mode); False divides by the input elements in the window only"))
    return attrs


def pool_output_size(size: int, kernel: int, stride: int, pad: int, ceil_mode: bool) -> int:
    """PyTorch's pooling output length; in ceil mode the last window must start inside the input
    or the left padding (otherwise it would cover padding only)."""
    out = (size + 2 * pad - kernel + (stride - 1 if ceil_mode else 0)) // stride + 1
    if ceil_mode and (out - 1) * stride >= size + pad:
        out -= 1
    return out


def pool_padding_problem(pool_size: Sequence[int], padding: Sequence[int]) -> str | None:
    """Why ``padding`` does not suit ``pool_size``, or None: each pad must be smaller than its window."""
    if all(p < k for p, k in zip(padding, pool_size)):
        return None
    return (f"padding {tuple(padding)} must be smaller than pool_size {tuple(pool_size)} "
            "(a window of padding only has no value)")


def pooled_hw(hw: Sequence[int], attrs: Attrs) -> tuple[int, int]:
    """The (height, width) a 2-D pool gives an input of ``hw``; ``ShapeError`` when it does not fit.

    ``attrs`` holds pool_size, strides, padding (symmetric, per axis) and optionally ceil_mode.
    The pooling operators' shape rules and ``opgrad.nn``'s pooling layers both use it.
    """
    (kh, kw), (sh, sw), (ph, pw) = attrs["pool_size"], attrs["strides"], attrs["padding"]
    problem = pool_padding_problem((kh, kw), (ph, pw))
    require(problem is None, problem or "")
    ceil = attrs.get("ceil_mode", False)
    oh = pool_output_size(hw[0], kh, sh, ph, ceil)
    ow = pool_output_size(hw[1], kw, sw, pw, ceil)
    require(
        oh >= 1 and ow >= 1,
        f"the {kh}x{kw} pool does not fit the {hw[0]}x{hw[1]} input with padding {attrs['padding']}",
    )
    return oh, ow


def pool_shape(data: TensorType, attrs: Attrs) -> TensorType:
    """The output type of a 2-D pool of NCHW ``data``."""
    require(data.ndim == 4, f"data must be 4-D NCHW, got shape {data.shape}")
    oh, ow = pooled_hw(data.shape[2:], attrs)
    return TensorType((data.shape[0], data.shape[1], oh, ow), data.dtype)


def pooled_pair_shape(op: str, pooled: TensorType, data: TensorType, attrs: Attrs, pooled_name: str) -> TensorType:
    """The shape rule of a pool's backward op: ``pooled`` must have the shape ``op`` gives ``data``;
    the result has data's shape and pooled's dtype."""
    expect = pool_shape(data, attrs).shape
    require(pooled.shape == expect,
            f"{pooled_name} has shape {pooled.shape} but {op} of data {data.shape} gives {expect}")
    return TensorType(data.shape, pooled.dtype)


def _grid(hw: Sequence[int], pool_size: Any, strides: Any, padding: Any, ceil_mode: bool) -> tuple[tuple[int, int],
                                                                                                   tuple[int, int]]:
    """Output size, and the padded extent every window fits in: ceil mode's last window may
    overhang the bottom/right padding."""
    out = pooled_hw(hw, {"pool_size": pool_size, "strides": strides, "padding": padding, "ceil_mode": ceil_mode})
    extent = tuple(max(hw[i] + 2 * padding[i], (out[i] - 1) * strides[i] + pool_size[i]) for i in range(2))
    return out, extent


def windows(data: np.ndarray, pool_size: Any, strides: Any, padding: Any, fill: float,
            ceil_mode: bool = False) -> np.ndarray:
    """View (N, C, OH, OW, KH, KW) of the windows, padding (and any ceil-mode overhang) with ``fill``."""
    (ph, pw) = padding
    (oh, ow), extent = _grid(data.shape[2:], pool_size, strides, padding, ceil_mode)
    pads = ((0, 0), (0, 0), (ph, extent[0] - data.shape[2] - ph), (pw, extent[1] - data.shape[3] - pw))
    padded = np.pad(data, pads, constant_values=fill)
    view = sliding_window_view(padded, tuple(pool_size), axis=(2, 3))[:, :, :: strides[0], :: strides[1]]
    return view[:, :, :oh, :ow]


def avg_divisors(hw: Sequence[int], pool_size: Any, strides: Any, padding: Any, ceil_mode: bool,
                 count_include_pad: bool) -> np.ndarray:
    """(OH, OW) divisors of avg_pool2d, as PyTorch: each window clipped to the padded input, then,
    without count_include_pad, to the input itself."""
    out, _ = _grid(hw, pool_size, strides, padding, ceil_mode)
    counts = []
    for i in range(2):
        start = np.arange(out[i]) * strides[i] - padding[i]
        end = np.minimum(start + pool_size[i], hw[i] + padding[i])
        if not count_include_pad:
            start, end = np.maximum(start, 0), np.minimum(end, hw[i])
        counts.append(end - start)
    return np.outer(counts[0], counts[1])


def scatter_windows(values: np.ndarray, positions: tuple[np.ndarray, np.ndarray] | None, data_shape: Sequence[int],
                    pool_size: Any, strides: Any, padding: Any, ceil_mode: bool = False) -> np.ndarray:
    """Adjoint of window extraction: add (N, C, OH, OW, KH, KW) ``values`` back onto the input grid.

    With ``positions`` (row, col offsets inside each window, shaped (N, C, OH, OW)), ``values``
    is (N, C, OH, OW) and lands at that single position per window.
    """
    n, c, h, w = data_shape
    (kh, kw), (sh, sw), (ph, pw) = pool_size, strides, padding
    _, extent = _grid((h, w), pool_size, strides, padding, ceil_mode)
    padded = np.zeros((n, c, *extent), dtype=values.dtype)
    oh, ow = values.shape[2], values.shape[3]
    if positions is None:
        for i in range(kh):
            for j in range(kw):
                padded[:, :, i : i + sh * (oh - 1) + 1 : sh, j : j + sw * (ow - 1) + 1 : sw] += values[..., i, j]
    else:
        rows = positions[0] + (np.arange(oh) * sh)[None, None, :, None]
        cols = positions[1] + (np.arange(ow) * sw)[None, None, None, :]
        nn, cc = np.meshgrid(np.arange(n), np.arange(c), indexing="ij")
        np.add.at(padded, (nn[:, :, None, None], cc[:, :, None, None], rows, cols), values)
    return padded[:, :, ph : ph + h, pw : pw + w]


def draw_pool_case(d: CaseDraw, layout: str, avg: bool = False) -> Case:
    """A checker case for the pooling ops: pool size, strides (or None), padding < pool size,
    ceil_mode (and count_include_pad for avg), an input the window fits. ``layout`` names the
    inputs: "data", "pooled,data" or "data,data"."""
    n, c = d.int(1, 2), d.int(1, 3)
    pool = (d.int(1, 3), d.int(1, 3))
    # Explicit strides two times in three, and room for several windows: a gradient that takes the
    # strides for the pool size differs only where windows are spaced otherwise.
    strides = None if d.int(0, 2) == 0 else (d.int(1, 3), d.int(1, 3))
    padding = (d.int(0, pool[0] - 1), d.int(0, pool[1] - 1))
    hw = tuple(max(1, pool[i] - 2 * padding[i]) + d.int(0, 5) for i in range(2))
    attrs: dict[str, Any] = {"pool_size": pool, "strides": strides, "padding": padding, "ceil_mode": d.bool()}
    if avg:
        attrs["count_include_pad"] = d.bool()
    out = pooled_hw(hw, {**attrs, "strides": strides or pool})
    shapes = {"data": (n, c, *hw), "pooled": (n, c, *out)}
    return Case([shapes[name] for name in layout.split(",")], attrs)
