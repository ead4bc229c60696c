"""forge.tuner.stats: quantiles (checked against numpy's linear method) and the accept/reject rule."""

from __future__ import annotations

import math

import numpy as np
import pytest

from forge.tuner.stats import ACCEPT_MARGIN, Quantiles, accepts, quantile, speedup

QS = [0.0, 0.2, 0.25, 0.5, 0.8, 0.9, 0.999, 1.0]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 10, 51, 1000])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_quantile_matches_numpy_linear(n, seed):
    rng = np.random.default_rng(seed * 1000 + n)
    samples = list(rng.lognormal(mean=2.0, sigma=0.5, size=n))
    for q in QS:
        expected = float(np.quantile(samples, q, method="linear"))
        assert quantile(samples, q) == pytest.approx(expected, rel=1e-12, abs=0.0), (n, q)


def test_quantile_small_cases_by_hand():
    assert quantile([5.0], 0.0) == 5.0
    assert quantile([5.0], 0.37) == 5.0
    assert quantile([5.0], 1.0) == 5.0
    assert quantile([3.0, 1.0], 0.0) == 1.0
    assert quantile([3.0, 1.0], 0.5) == 2.0
    assert quantile([3.0, 1.0], 0.2) == pytest.approx(1.4)
    assert quantile([3.0, 1.0], 1.0) == 3.0
    assert quantile([4.0, 1.0, 3.0, 2.0, 5.0], 0.8) == pytest.approx(4.2)
    assert quantile((10, 20, 30), 0.5) == 20  # any sequence, ints too


def test_quantile_does_not_mutate_its_input():
    xs = [3.0, 1.0, 2.0]
    quantile(xs, 0.5)
    assert xs == [3.0, 1.0, 2.0]


def test_quantile_errors():
    with pytest.raises(ValueError, match="no samples"):
        quantile([], 0.5)
    for q in (-0.01, 1.01, -1.0, 2.0, math.nan):
        with pytest.raises(ValueError, match="q must be within"):
            quantile([1.0, 2.0], q)


@pytest.mark.parametrize("seed", range(5))
def test_quantiles_of_is_ordered(seed):
    rng = np.random.default_rng(seed)
    samples = list(rng.exponential(10.0, size=int(rng.integers(1, 200))))
    qs = Quantiles.of(samples)
    assert qs.p20 <= qs.p50 <= qs.p80
    assert qs.n == len(samples)
    assert qs.p50 == pytest.approx(float(np.median(samples)), rel=1e-12)
    assert min(samples) <= qs.p20 and qs.p80 <= max(samples)


def test_quantiles_dict_round_trip():
    q = Quantiles.of([1.0, 2.0, 3.0, 4.0, 10.0])
    assert q.to_dict() == pytest.approx({"p20": 1.8, "p50": 3.0, "p80": 5.2, "n": 5})
    assert Quantiles.from_dict(q.to_dict()) == q
    assert Quantiles.from_dict({"p20": 1.0, "p50": 2.0, "p80": 3.0}).n == 0


# --- the decision rule ------------------------------------------------------------------------------


def timings(center: float, spread: float, n: int = 101, seed: int = 0) -> list[float]:
    """Synthetic timings: uniform in [center - spread, center + spread], shuffled."""
    rng = np.random.default_rng(seed)
    xs = list(np.linspace(center - spread, center + spread, n))
    rng.shuffle(xs)
    return [float(x) for x in xs]


def test_margin_is_three_percent():
    assert ACCEPT_MARGIN == 1.03


def test_clear_win_is_accepted():
    eager = Quantiles.of(timings(100.0, 2.0))
    cand = Quantiles.of(timings(80.0, 2.0, seed=1))
    assert accepts(cand, eager)
    assert speedup(cand, eager) == pytest.approx(100.0 / 80.0)


def test_overlapping_distributions_are_rejected():
    eager = Quantiles.of(timings(100.0, 10.0))
    cand = Quantiles.of(timings(96.0, 10.0, seed=1))  # p50 4% better, but the spreads overlap
    assert cand.p50 < eager.p50 / ACCEPT_MARGIN
    assert not accepts(cand, eager)


def test_identical_distributions_are_rejected():
    eager = Quantiles.of(timings(50.0, 0.5))
    assert not accepts(eager, eager)
    assert not accepts(Quantiles(50.0, 50.0, 50.0, 1), Quantiles(50.0, 50.0, 50.0, 1))


def test_slower_candidate_is_rejected():
    assert not accepts(Quantiles.of(timings(120.0, 1.0)), Quantiles.of(timings(100.0, 1.0)))


def test_exact_boundary():
    eager = Quantiles(p20=103.0, p50=105.0, p80=110.0, n=50)
    threshold = eager.p20 / 1.03
    at = Quantiles(p20=90.0, p50=95.0, p80=threshold, n=50)
    below = Quantiles(p20=90.0, p50=95.0, p80=math.nextafter(threshold, 0.0), n=50)
    clearly_below = Quantiles(p20=90.0, p50=95.0, p80=threshold * (1 - 1e-9), n=50)
    above = Quantiles(p20=90.0, p50=95.0, p80=math.nextafter(threshold, math.inf), n=50)
    assert not accepts(at, eager)  # p80 == p20 / 1.03 is not "clearly faster"
    assert accepts(below, eager)
    assert accepts(clearly_below, eager)
    assert not accepts(above, eager)


def test_margin_argument():
    eager = Quantiles(p20=100.0, p50=100.0, p80=100.0, n=3)
    cand = Quantiles(p20=95.0, p50=95.0, p80=95.0, n=3)
    assert accepts(cand, eager)  # 95 < 100 / 1.03 = 97.09
    assert not accepts(cand, eager, margin=1.06)  # 95 > 100 / 1.06 = 94.34
    assert accepts(cand, eager, margin=1.0)


def test_better_median_with_long_tail_is_rejected():
    eager = Quantiles.of(timings(100.0, 1.0))
    # 70% of runs are fast, 30% are very slow: p50 is a big win, p80 is far above the threshold.
    samples = [70.0] * 70 + [150.0] * 30
    cand = Quantiles.of(samples)
    assert cand.p50 == 70.0 and cand.p80 == 150.0
    assert speedup(cand, eager) > 1.3
    assert not accepts(cand, eager)


def test_speedup():
    base = Quantiles(p20=9.0, p50=10.0, p80=11.0, n=10)
    assert speedup(Quantiles(4.0, 5.0, 6.0, 10), base) == 2.0
    assert speedup(Quantiles(19.0, 20.0, 21.0, 10), base) == 0.5
    assert speedup(None, base) is None
    assert speedup(base, None) is None
    assert speedup(Quantiles(0.0, 0.0, 0.0, 1), base) is None
    assert speedup(Quantiles(-1.0, -1.0, -1.0, 1), base) is None


def test_compare_rejects_wrong_signed_infinity_and_nan_oracle():
    import torch

    from forge.opkit import ROW_TOLERANCE
    from forge.tuner.validate import compare

    tol = ROW_TOLERANCE["float32"]
    ref = torch.tensor([1.0, float("-inf")], dtype=torch.float64)
    assert compare(torch.tensor([1.0, float("-inf")]), ref, tol) is None
    assert "infinity mismatch" in compare(torch.tensor([1.0, float("inf")]), ref, tol)
    assert "infinity mismatch" in compare(torch.tensor([1.0, 5.0]), ref, tol)
    assert "oracle produced NaN" in compare(torch.tensor([1.0, 2.0]), torch.tensor([1.0, float("nan")]), tol)
