"""Fault injection: test-only candidates that fail in every way (tests/fault_ops/faulty.py). The
search must finish, record each failure with its reason, replace dead workers and keep going."""

from __future__ import annotations

import pytest

from forge.cache import Cache
from forge.tuner import engine
from tests.fault_ops.faulty import EXPECTED

pytestmark = pytest.mark.slow


def test_search_survives_every_fault_and_records_reasons(tmp_path, fault_ops):
    cpu_expected = {v: s for v, s in EXPECTED.items() if v != "oob"}  # oob is a GPU-only fault
    cache = Cache(tmp_path / "forge.db")
    events = []
    opts = engine.SearchOptions(budget=len(cpu_expected), timeout=8, workers=2)
    rep = engine.search("faulty", (5, 37), "float32", device="cpu", cache=cache, options=opts,
                        events=lambda kind, **d: events.append(kind))
    by_variant = {c["variant"]: c for c in rep.candidates}
    assert {v: c["status"] for v, c in by_variant.items()} == cpu_expected
    reasons = {v: c["reason"] or "" for v, c in by_variant.items()}
    assert "SyntaxError" in reasons["syntax"]
    assert "raised on purpose" in reasons["raises"]
    assert "relative error" in reasons["wrong"]
    assert "NaN" in reasons["nan"] and "NaN" in reasons["unwritten"]
    assert "(0, 36)" in reasons["unwritten"]  # the last column, the one left unwritten
    assert "no answer within 8 s" in reasons["hang"]
    assert "status 3" in reasons["exit"]
    assert "SIGSEGV" in reasons["segfault"]
    # Only the good candidate was timed; failed ones never are.
    timed = [v for v, c in by_variant.items() if c["screen"] is not None]
    assert timed == ["good"]
    assert rep.decision in ("kernel", "eager") and "decided" in events
    # The decision is cached, with every candidate's outcome.
    entry = cache.get(rep.key)
    assert entry is not None
    assert {c["variant"]: c["status"] for c in entry.candidates} == cpu_expected


def test_worker_pool_replaces_dead_workers(tmp_path, fault_ops):
    """After crashes and a timeout the pool still answers with healthy workers."""
    from forge import codegen, ops
    from forge.loader import write_source
    from forge.opkit import Candidate
    from forge.tuner.pool import Pool

    op = ops.get("faulty")
    spec = op.module.make_spec((2, 8), "float32", "cpu")
    paths = {v: str(write_source(codegen.render(op, spec, Candidate.make(v, num_warps=1)), tmp_path))
             for v in ("exit", "good", "segfault", "hang", "good")}
    setup = {"cmd": "setup", "op": "faulty", "spec": spec.to_dict(), "seed": 0}
    with Pool("interpreter", 1, setup) as p:
        first_pid = p.workers[0].proc.pid
        got = p.map([(v, {"cmd": "validate", "path": path}) for v, path in paths.items()], timeout=6)
        assert {v: r["status"] for v, r in got.items()} == {
            "exit": "crashed", "good": "ok", "segfault": "crashed", "hang": "timeout"}
        assert p.replaced == 3 and p.workers[0].proc.pid != first_pid
        assert p.call({"cmd": "validate", "path": paths["good"]}, timeout=30)["status"] == "ok"
