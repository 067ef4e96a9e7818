"""A small, dependency-free progress bar for ``opgrad train``.

Why not tqdm: opgrad's core install stays numpy/hypothesis/llvmlite only, and training needs just
one bar per epoch that looks like::

    epoch 3/10 [######################........]  80/125 loss 0.1234 38.2 steps/s

On a terminal the line is redrawn in place with ``\\r`` (throttled to ~10 redraws/s so drawing
never slows training). When the stream is not a TTY (CI logs, ``> train.log``) carriage
returns would pile up into one enormous line, so instead a plain line is printed each time
another ~10% of the total is done, and :meth:`ProgressBar.close` prints the final line with
the elapsed time.

The steps/s figure is the inverse of the *median* per-step time over the last
:data:`RATE_WINDOW` updates: the first step of a run includes kernel compilation and can take
seconds, and a mean would report a misleadingly low rate for a long time after it.
"""

from __future__ import annotations

import math
import numbers
import shutil
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from types import TracebackType
from typing import TextIO

__all__ = ["RATE_WINDOW", "ProgressBar", "format_duration", "format_metric"]

#: Number of recent updates whose per-step times feed the steps/s median.
RATE_WINDOW = 32

Metric = float | int | str


def format_metric(value: Metric) -> str:
    """``0.12345`` -> ``0.1234``; tiny or huge floats in scientific notation; ints and str as-is."""
    if isinstance(value, str):
        return value
    if isinstance(value, numbers.Integral):  # includes numpy integers
        return str(int(value))
    v = float(value)
    if not math.isfinite(v):
        return str(v)
    if v != 0.0 and (abs(v) < 1e-3 or abs(v) >= 1e5):
        return f"{v:.3e}"
    return f"{v:.4f}"


def format_duration(seconds: float) -> str:
    """``3.21`` -> ``3.2s``; ``75`` -> ``1m15s``; ``3725`` -> ``1h02m05s``."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    return f"{minutes}m{secs:02d}s"


def _is_tty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # closed or unusual streams
        return False


class ProgressBar:
    """Progress of ``total`` steps, drawn on ``stream`` (default: ``sys.stderr``).

    ``update(n, **metrics)`` advances by ``n`` steps and merges ``metrics`` (e.g. ``loss=0.12``)
    into the values shown; metrics persist until overwritten. Use as a context manager or call
    :meth:`close` so the final line is printed. ``total=None`` shows a count without a bar (and
    in non-TTY mode prints a line every ``log_every_unknown`` steps).

    ``tty`` forces the drawing mode (default: ``stream.isatty()``); ``clock`` is injectable so
    tests can control time.
    """

    def __init__(
        self,
        total: int | None,
        desc: str = "",
        *,
        stream: TextIO | None = None,
        width: int = 30,
        tty: bool | None = None,
        unit: str = "steps",
        min_redraw_interval: float = 0.1,
        log_every_unknown: int = 100,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if total is not None and total < 0:
            raise ValueError(f"total must be >= 0 or None, got {total}")
        self.total = total
        self.desc = desc
        self.stream: TextIO = stream if stream is not None else sys.stderr
        self.width = max(1, width)
        self.tty = _is_tty(self.stream) if tty is None else tty
        self.unit = unit
        self.min_redraw_interval = min_redraw_interval
        self.log_every_unknown = max(1, log_every_unknown)
        self._clock = clock
        self.count = 0
        self.metrics: dict[str, Metric] = {}
        self._start = clock()
        self._last_update = self._start
        self._step_times: deque[float] = deque(maxlen=RATE_WINDOW)
        self._last_draw = -math.inf
        self._drawn_len = 0
        self._reported_decile = 0  # non-TTY: deciles of `total` already printed
        self._closed = False

    # ------------------------------------------------------------------ public API

    def update(self, n: int = 1, /, **metrics: Metric) -> None:
        """Advance by ``n`` steps, record the time they took, and show ``metrics``.

        ``n`` is positional-only so a metric may itself be called ``n``.
        """
        if self._closed:
            raise RuntimeError("update() on a closed ProgressBar")
        now = self._clock()
        if n > 0:
            self._step_times.append((now - self._last_update) / n)
            self._last_update = now
        self.count += n
        self.metrics.update(metrics)
        if self.tty:
            done = self.total is not None and self.count >= self.total
            if done or now - self._last_draw >= self.min_redraw_interval:
                self._redraw(self.line())
                self._last_draw = now
        elif self._crossed_report_point():
            self._print(self.line())

    def write(self, message: str) -> None:
        """Print ``message`` on its own line without garbling the bar (which is then redrawn)."""
        if self.tty and self._drawn_len:
            self.stream.write("\r" + " " * self._drawn_len + "\r")
            self._drawn_len = 0
        self._print(message)
        if self.tty and not self._closed:
            self._redraw(self.line())

    def close(self, **metrics: Metric) -> None:
        """Print the final line (with elapsed time) and end it with a newline. Idempotent."""
        if self._closed:
            return
        self.metrics.update(metrics)
        self._closed = True
        final = f"{self.line()} in {format_duration(self.elapsed)}"
        if self.tty:
            self._redraw(final)
            self.stream.write("\n")
            self.stream.flush()
            self._drawn_len = 0
        else:
            self._print(final)

    @property
    def elapsed(self) -> float:
        """Seconds since the bar was created."""
        return self._clock() - self._start

    @property
    def rate(self) -> float | None:
        """Steps per second from the median recent per-step time, or None before any step."""
        if not self._step_times:
            return None
        median = statistics.median(self._step_times)
        return 1.0 / median if median > 0 else None

    def line(self) -> str:
        """The current status line (without ``\\r`` or newline)."""
        parts: list[str] = []
        if self.desc:
            parts.append(self.desc)
        if self.total is not None:
            fraction = min(1.0, self.count / self.total) if self.total else 1.0
            filled = int(fraction * self.width)
            parts.append("[" + "#" * filled + "." * (self.width - filled) + "]")
            parts.append(f"{self.count:>{len(str(self.total))}}/{self.total}")
        else:
            parts.append(f"{self.count} {self.unit}")
        parts.extend(f"{key} {format_metric(value)}" for key, value in self.metrics.items())
        rate = self.rate
        if rate is not None:
            parts.append(f"{rate:.1f} {self.unit}/s")
        return " ".join(parts)

    # ------------------------------------------------------------------ context manager

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ drawing

    def _crossed_report_point(self) -> bool:
        """Non-TTY: True when another 10% (or ``log_every_unknown`` steps) has been done.

        The 100% line is left to :meth:`close`, which adds the elapsed time, so a finished
        epoch is logged once, not twice.
        """
        if self.total is None:
            decile = self.count // self.log_every_unknown
        elif self.count >= self.total:
            return False
        else:
            decile = self.count * 10 // self.total
        if decile > self._reported_decile:
            self._reported_decile = decile
            return True
        return False

    def _redraw(self, text: str) -> None:
        columns = shutil.get_terminal_size(fallback=(120, 24)).columns
        if len(text) >= columns:  # a wrapped line can't be redrawn with \r
            text = text[: max(1, columns - 4)] + "..."
        pad = " " * max(0, self._drawn_len - len(text))
        self.stream.write("\r" + text + pad)
        self.stream.flush()
        self._drawn_len = len(text)

    def _print(self, text: str) -> None:
        self.stream.write(text + "\n")
        self.stream.flush()
