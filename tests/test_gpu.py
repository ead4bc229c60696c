"""GPU tier: run on the H200 through the device tool (`pytest -m gpu`); skipped without CUDA."""

from __future__ import annotations

import pytest

from forge.cache import Cache
from forge_cli import engine
from tests.fault_ops.faulty import EXPECTED

pytestmark = pytest.mark.gpu


def test_search_rmsnorm_on_cuda_decides_and_caches(tmp_path):
    cache = Cache(tmp_path / "forge.db")
    opts = engine.SearchOptions(budget=8, timeout=120)
    rep = engine.search("rmsnorm", (2048, 4096), "float16", device="cuda", cache=cache, options=opts)
    assert rep.backend == "cuda" and not rep.cache_hit
    assert rep.env["gpu"] and rep.env["cc"] and rep.env["sm_count"] > 0
    assert [c["status"] for c in rep.candidates] == ["ok"] * 8
    assert rep.decision in ("kernel", "eager")
    assert 0 < rep.baseline.p20 <= rep.baseline.p50 <= rep.baseline.p80
    if rep.decision == "kernel":
        q = rep.winner["quantiles"]
        assert q["p80"] < rep.baseline.p20 / 1.03
    again = engine.search("rmsnorm", (2048, 4096), "float16", device="cuda", cache=cache, options=opts)
    assert again.cache_hit and again.key == rep.key and again.decision == rep.decision


def test_fault_injection_on_cuda_records_every_failure(tmp_path, fault_ops):
    cache = Cache(tmp_path / "forge.db")
    opts = engine.SearchOptions(budget=len(EXPECTED), timeout=20, workers=4)
    rep = engine.search("faulty", (64, 1000), "float32", device="cuda", cache=cache, options=opts)
    got = {c["variant"]: c["status"] for c in rep.candidates}
    assert got == EXPECTED, {v: (c["status"], c["reason"]) for v, c in
                             ((c["variant"], c) for c in rep.candidates)}
    assert rep.decision in ("kernel", "eager")


@pytest.mark.parametrize("op", ["rmsnorm", "softmax"])
def test_timing_is_stable_run_to_run(tmp_path, op):
    """Two forced searches of the same spec: the winner's p50 agrees within 5%."""
    cache = Cache(tmp_path / "forge.db")
    opts = engine.SearchOptions(budget=4, force=True, timeout=120)
    a = engine.search(op, (4096, 4096), "bfloat16", device="cuda", cache=cache, options=opts)
    b = engine.search(op, (4096, 4096), "bfloat16", device="cuda", cache=cache, options=opts)
    assert a.baseline.p50 == pytest.approx(b.baseline.p50, rel=0.05)
