"""Screening under the final's conditions (issue 17): candidates are screened in groups interleaved with eager,
ranked against eager's p50 in their own group, a member that fails while being timed is recorded and the
others are timed again without it, and every search reports each finalist's screening-to-final error."""

from __future__ import annotations

import pytest

from forge.cache import Cache
from forge.opkit import Candidate
from forge.tuner import engine, stats
from forge.tuner.engine import CandidateResult, Status


class _Pool:
    """Answers "time" requests as a worker would; `fail` maps a path to the failure it reports."""

    def __init__(self, fail=None, anonymous=False):
        self.fail, self.anonymous, self.calls = dict(fail or {}), anonymous, []

    def call(self, msg, timeout):
        self.calls.append(list(msg["paths"]))
        for path in msg["paths"]:
            if path in self.fail:
                reply = {"status": Status.ERROR, "reason": self.fail[path]}
                return reply if self.anonymous else {**reply, "failed": path}
        samples = {p: [10.0 + i] * msg["rounds"] for i, p in enumerate(msg["paths"])}
        return {"status": Status.OK, "samples": {**samples, "eager": [20.0] * msg["rounds"]}, "seconds": 0.3}


def _results(*names):
    return [CandidateResult(Candidate.make("v", n=i), status=Status.OK, path=name) for i, name in enumerate(names)]


def test_a_member_that_fails_is_recorded_and_the_rest_are_timed_without_it():
    group = _results("a", "b", "c")
    pool = _Pool(fail={"b": "replay raised"})
    reply, timed = engine._time_together(pool, group, rounds=4, settle_ms=0, timeout=1, mem=None, what="t")
    assert [r.path for r in timed] == ["a", "c"] and pool.calls == [["a", "b", "c"], ["a", "c"]]
    assert group[1].status == Status.ERROR and group[1].reason == "replay raised"
    assert reply["samples"]["a"] == [10.0] * 4 and reply["samples"]["eager"] == [20.0] * 4


def test_a_failure_the_worker_cannot_attribute_fails_the_whole_group():
    group = _results("a", "b")
    reply, timed = engine._time_together(_Pool(fail={"a": "worker died"}, anonymous=True), group, 4, 0, 1, None, "t")
    assert timed == [] and reply == {} and all(r.status == Status.ERROR for r in group)


def test_finalists_rank_against_eager_in_their_own_group():
    """Two groups timed at different clocks: b is slower in absolute µs but faster against its group's eager."""
    a, b = _results("a", "b")
    a.screen, a.screen_eager = stats.Quantiles.of([10.0] * 5), 12.0  # 0.83 of eager
    b.screen, b.screen_eager = stats.Quantiles.of([11.0] * 5), 16.0  # 0.69 of eager
    assert sorted([a, b], key=engine._screen_rank) == [b, a]


def test_screen_to_final_reports_each_finalists_error():
    a, b, c = _results("a", "b", "c")
    a.screen, a.final = stats.Quantiles.of([9.0] * 5), stats.Quantiles.of([10.0] * 5)
    b.screen, b.final = stats.Quantiles.of([10.5] * 5), stats.Quantiles.of([10.0] * 5)
    c.screen = stats.Quantiles.of([30.0] * 5)  # screened, not a finalist
    rep = engine.screen_to_final([a, b, c], engine.SAMPLING["cuda"])
    assert [f["error"] for f in rep["finalists"]] == [-0.1, 0.05] and rep["max_abs_error"] == 0.1
    assert rep["group"] == engine.SAMPLING["cuda"].screen_group and engine.screen_to_final([c], None) is None
    assert "max_abs_estimate_error" not in rep  # no group eager, no final eager: no estimate
    # a's group ran at a faster clock (eager 18 there, 20 in the final): its estimate is 9 x 20/18 = 10
    a.screen_eager, b.screen_eager = 18.0, 21.0
    rep = engine.screen_to_final([a, b], engine.SAMPLING["cuda"], stats.Quantiles.of([20.0] * 5))
    assert [f["estimate_p50"] for f in rep["finalists"]] == pytest.approx([10.0, 10.0])
    assert rep["max_abs_estimate_error"] == 0.0 and rep["max_abs_error"] == 0.1


@pytest.mark.slow
def test_a_search_screens_in_groups_and_reports_the_error(tmp_path):
    rep = engine.search("rmsnorm", (3, 40), "float32", device="cpu", cache=Cache(tmp_path / "forge.db"),
                        options=engine.SearchOptions(budget=6, workers=2, timeout=120))
    screened = [c for c in rep.candidates if c["screen"] is not None]
    assert len(screened) >= 2 and all(c["screen_eager_p50"] > 0 for c in screened)
    doc = rep.to_dict()["screening"]
    finals = [c for c in rep.candidates if c["final"] is not None]
    assert {(f["variant"], str(f["params"])) for f in doc["finalists"]} == {(c["variant"], str(c["params"]))
                                                                          for c in finals}
    for f in doc["finalists"]:
        assert f["error"] == pytest.approx(f["screen_p50"] / f["final_p50"] - 1, abs=1e-4)
        assert f["estimate_error"] == pytest.approx(f["estimate_p50"] / f["final_p50"] - 1, abs=1e-4)
    assert doc["max_abs_error"] == max(abs(f["error"]) for f in doc["finalists"])
    assert doc["max_abs_estimate_error"] == max(abs(f["estimate_error"]) for f in doc["finalists"])


@pytest.mark.slow
def test_a_worker_names_the_candidate_that_failed_while_being_timed(tmp_path, fault_ops):
    from forge import codegen, ops
    from forge.loader import write_source
    from forge.tuner.pool import Pool
    from tests.fault_ops import faulty

    op = ops.get("faulty")
    spec = op.module.make_spec((2, 8), "float32", "cpu")
    paths = {v: str(write_source(codegen.render(op, spec, Candidate.make(v, num_warps=1)), tmp_path))
             for v in ("good", "flaky")}
    with Pool("interpreter", 1, {"cmd": "setup", "op": "faulty", "spec": spec.to_dict(), "seed": 0}) as p:
        assert p.call({"cmd": "validate", "path": paths["flaky"]}, 60)["status"] == Status.OK
        reply = p.call({"cmd": "time", "paths": [paths["good"], paths["flaky"]], "baseline": True,
                        "rounds": faulty.FLAKY_AFTER + 1, "reps": 1}, 60)
        assert reply["status"] == Status.ERROR and reply["failed"] == paths["flaky"]
        assert "on purpose" in reply["reason"]
        again = p.call({"cmd": "time", "paths": [paths["good"]], "baseline": True, "rounds": 3, "reps": 1}, 60)
        assert again["status"] == Status.OK and len(again["samples"]["eager"]) == 3
