"""The one statistics module: quantiles of timing samples and the accept/reject decision."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# A candidate must beat eager by a clear margin, not by noise: its slow end (p80) must be below
# eager's fast end (p20) divided by this. The p20-p80 spread of the winners measured on the H200 was
# under 1.5% (docs/notes.md), so a 3% margin is not decided by noise.
ACCEPT_MARGIN = 1.03


def quantile(samples: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default method), 0 <= q <= 1."""
    if not samples:
        raise ValueError("quantile of no samples")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be within [0, 1], got {q}")
    xs = sorted(samples)
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class Quantiles:
    p20: float
    p50: float
    p80: float
    n: int

    @classmethod
    def of(cls, samples: Sequence[float]) -> Quantiles:
        return cls(quantile(samples, 0.2), quantile(samples, 0.5), quantile(samples, 0.8), len(samples))

    def to_dict(self) -> dict[str, float]:
        return {"p20": self.p20, "p50": self.p50, "p80": self.p80, "n": self.n}

    @classmethod
    def from_dict(cls, d: dict) -> Quantiles:
        return cls(d["p20"], d["p50"], d["p80"], int(d.get("n", 0)))


def accepts(candidate: Quantiles, baseline: Quantiles, margin: float = ACCEPT_MARGIN) -> bool:
    """The decision rule: accept only if p80(candidate) < p20(baseline) / margin."""
    return candidate.p80 < baseline.p20 / margin


def speedup(candidate: Quantiles | None, baseline: Quantiles | None) -> float | None:
    if candidate is None or baseline is None or candidate.p50 <= 0:
        return None
    return baseline.p50 / candidate.p50


# --- drift between a stored and a re-measured speedup (forge bench --recheck; docs/bench.md) ---
#
# A stored speedup and a re-measured one are "drifted" when (1) their p20-p80 speedup intervals do not
# overlap, i.e. the difference is larger than either measurement's own spread, and (2) they differ by
# more than DRIFT_FLOOR. (1) scales with the noise actually observed: ~1.5% p20-p80 spread on the H200,
# tens of percent for 5 host-clock samples on the interpreter. (2) bounds what is left when both spreads
# are tiny: two forced searches of the same spec gave eager p50s 5% apart on the H200
# (tests/test_gpu.py::test_timing_is_stable_run_to_run, docs/notes.md), and a speedup is a ratio of two
# p50s, so a run-to-run change up to ~2 x 5% = 10% is not evidence that anything changed.
DRIFT_FLOOR = 0.10


def speedup_interval(kernel: Quantiles, baseline: Quantiles) -> tuple[float, float]:
    """The p20-p80 range of baseline/kernel: (fast baseline / slow kernel, slow baseline / fast kernel)."""
    return baseline.p20 / kernel.p80, baseline.p80 / kernel.p20


def drifted(stored_kernel: Quantiles, stored_baseline: Quantiles, new_kernel: Quantiles,
            new_baseline: Quantiles, floor: float = DRIFT_FLOOR) -> bool:
    """True if the new p50 speedup is outside the noise of both measurements and off by more than `floor`."""
    old = speedup(stored_kernel, stored_baseline)
    new = speedup(new_kernel, new_baseline)
    if old is None or new is None:
        return False
    lo_old, hi_old = speedup_interval(stored_kernel, stored_baseline)
    lo_new, hi_new = speedup_interval(new_kernel, new_baseline)
    apart = lo_new > hi_old or hi_new < lo_old
    return apart and max(new / old, old / new) > 1.0 + floor
