"""Window arithmetic shared by the pooling operator files (not an operator module)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from opgrad.dtypes import TensorType
from opgrad.op import Attr, Case, int_tuple, require


def _strides(value: Any, types: Sequence[TensorType], attrs: dict[str, Any]) -> tuple[int, int]:
    if value is None:  # Keras' convention: non-overlapping windows
        return attrs["pool_size"]
    return int_tuple(2, minimum=1)(value)  # type: ignore[return-value]


def pool_attrs() -> list[Attr]:
    return [
        Attr("pool_size", default=(2, 2), convert=int_tuple(2, minimum=1), doc="(kh, kw)"),
        Attr("strides", default=None, convert=_strides, uses_types=True, doc="(sh, sw); None means pool_size"),
        Attr("padding", default=(0, 0), convert=int_tuple(2, minimum=0), doc="(ph, pw), each < pool size"),
    ]


def pooled_hw(hw: Sequence[int], attrs: Any) -> tuple[int, int]:
    (kh, kw), (sh, sw), (ph, pw) = attrs["pool_size"], attrs["strides"], attrs["padding"]
    require(
        ph < kh and pw < kw,
        f"padding {attrs['padding']} must be smaller than pool_size {attrs['pool_size']} "
        "(a window of padding only has no value)",
    )
    oh = (hw[0] + 2 * ph - kh) // sh + 1
    ow = (hw[1] + 2 * pw - kw) // sw + 1
    require(
        oh >= 1 and ow >= 1,
        f"the {kh}x{kw} pool does not fit the {hw[0]}x{hw[1]} input with padding {attrs['padding']}",
    )
    return oh, ow


def pool_shape(data: TensorType, attrs: Any) -> TensorType:
    require(data.ndim == 4, f"data must be 4-D NCHW, got shape {data.shape}")
    oh, ow = pooled_hw(data.shape[2:], attrs)
    return TensorType((data.shape[0], data.shape[1], oh, ow), data.dtype)


def windows(data: np.ndarray, pool_size: Any, strides: Any, padding: Any, fill: float) -> np.ndarray:
    """View (N, C, OH, OW, KH, KW) of the windows, padding with ``fill``."""
    (ph, pw) = padding
    padded = np.pad(data, ((0, 0), (0, 0), (ph, ph), (pw, pw)), constant_values=fill)
    oh, ow = pooled_hw(data.shape[2:], {"pool_size": pool_size, "strides": strides, "padding": padding})
    view = sliding_window_view(padded, tuple(pool_size), axis=(2, 3))[:, :, :: strides[0], :: strides[1]]
    return view[:, :, :oh, :ow]


def scatter_windows(values: np.ndarray, positions: tuple[np.ndarray, np.ndarray] | None, data_shape: Sequence[int],
                    pool_size: Any, strides: Any, padding: Any) -> np.ndarray:
    """Adjoint of window extraction: add (N, C, OH, OW, KH, KW) ``values`` back onto the input grid.

    With ``positions`` (row, col offsets inside each window, shaped (N, C, OH, OW)), ``values``
    is (N, C, OH, OW) and lands at that single position per window.
    """
    n, c, h, w = data_shape
    (kh, kw), (sh, sw), (ph, pw) = pool_size, strides, padding
    padded = np.zeros((n, c, h + 2 * ph, w + 2 * pw), dtype=values.dtype)
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


def draw_pool_case(d: Any, layout: str) -> Case:
    """A checker case for the pooling ops: pool size, strides (or None), padding < pool size, an
    input the window fits. ``layout`` names the inputs: "data", "pooled,data" or "data,data"."""
    n, c = d.int(1, 2), d.int(1, 3)
    pool = (d.int(1, 3), d.int(1, 3))
    strides = None if d.bool() else (d.int(1, 3), d.int(1, 3))
    padding = (d.int(0, pool[0] - 1), d.int(0, pool[1] - 1))
    hw = tuple(max(1, pool[i] - 2 * padding[i]) + d.int(0, 4) for i in range(2))
    attrs = {"pool_size": pool, "strides": strides, "padding": padding}
    out = pooled_hw(hw, {**attrs, "strides": strides or pool})
    shapes = {"data": (n, c, *hw), "pooled": (n, c, *out)}
    return Case([shapes[name] for name in layout.split(",")], attrs)
