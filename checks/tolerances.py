"""The per-dtype tolerance table every check reads (documented in docs/checking.md).

Why these numbers. Central differences with step ``h`` have truncation error ~ h^2 |f'''| / 6 and
round-off ~ eps |f| / h. In float64 (eps 2.2e-16) with inputs of size ~2, h = 1e-6 puts both
near 1e-10, far below ``fd_rtol`` = 1e-5 (JAX's float64 gradient tolerance): a wrong gradient is
off by O(1) relative, so a factor 10^5 separates bugs from noise. Identities that need no finite
differences (linearity in the cotangent, the adjoint test, kink conventions) only see round-off,
hence ``exact_rtol``. float32 entries are used where float32 is evaluated (the backend check);
the gradient checks themselves always run in float64.

A comparison passes when ``|a - b| <= atol + rtol * max(|a|, |b|)``. The reported relative error
is ``|a - b| / max(|a|, |b|, atol / rtol)``: values smaller than ``atol / rtol`` are judged
absolutely, so a passing check never shows a large "relative" error on a near-zero element.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tolerance:
    """Tolerances for one dtype."""

    fd_step: float  # central-difference step h
    fd_rtol: float  # finite differences vs analytic (checks b, e)
    fd_atol: float
    exact_rtol: float  # identities without finite differences (checks c, d, f), relative to the scale
    backend_rtol: float  # another backend vs the numpy reference (check g)
    backend_atol: float


TOLERANCES: dict[str, Tolerance] = {
    "float64": Tolerance(fd_step=1e-6, fd_rtol=1e-5, fd_atol=1e-6, exact_rtol=1e-9,
                         backend_rtol=1e-9, backend_atol=1e-12),
    "float32": Tolerance(fd_step=1e-3, fd_rtol=2e-3, fd_atol=1e-3, exact_rtol=1e-4,
                         backend_rtol=1e-4, backend_atol=1e-6),
}

# Inputs are kept at least this far from a declared kink (relu's 0, a max-pool tie), measured by
# the op's Kink.distance. It is 1000x the float64 step, so no finite difference straddles a kink
# even along a direction whose entries reach ~4 in magnitude.
KINK_MARGIN = 1e-3


def tolerance(dtype: str) -> Tolerance:
    """The table entry for ``dtype``; a clear error for an int or unknown dtype."""
    try:
        return TOLERANCES[dtype]
    except KeyError:
        raise ValueError(f"no tolerance for dtype {dtype!r}; known: {', '.join(TOLERANCES)}") from None
