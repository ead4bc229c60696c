"""Prioritised tuning (issue 13): a manifest's jobs run by share, largest first, with the Amdahl estimate
after each; a wall-clock time budget skips the jobs it leaves no time for (reported, exit 0) and cuts a
running search short (engine.SearchOptions.deadline: it decides from the candidates it timed)."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
import tomli_w
from typer.testing import CliRunner

from forge import key as keys
from forge.cache import Cache
from forge.tuner import batch, engine, stats
from forge_cli import cli

runner = CliRunner()


def _deadline_after(kind: str, opts: engine.SearchOptions, seen: list):
    """Events that move the search's deadline into the past at the first `kind` event."""

    def events(k, **data):
        seen.append(k)
        if k == kind and opts.deadline > 0:
            opts.deadline = 0.0

    return events


@pytest.mark.slow
@pytest.mark.parametrize("accept", [True, False])
def test_deadline_mid_search_decides_from_what_was_timed(tmp_path, monkeypatch, accept):
    monkeypatch.setattr(stats, "accepts", lambda *a, **k: accept)
    # screened one per group, so the deadline falls between two groups (groups are the unit it cuts)
    monkeypatch.setitem(engine.SAMPLING, "interpreter", dataclasses.replace(engine.SAMPLING["interpreter"],
                                                                            screen_group=1))
    db = Cache(tmp_path / "f.db")
    opts = engine.SearchOptions(budget=3, workers=1, deadline=time.monotonic() + 3600)
    seen: list = []
    rep = engine.search("rmsnorm", (4, 32), "float32", device="cpu", cache=db, options=opts,
                        events=_deadline_after("timed", opts, seen))
    assert seen.count("validated") == 3 and seen.count("timed") == 1  # validated before the deadline; one timed
    assert rep.cut_short is not None and "1 candidate(s) timed" in rep.cut_short
    timed = [c for c in rep.candidates if c["screen"] is not None]
    untimed = [c for c in rep.candidates if c["screen"] is None]
    assert len(timed) == 1 and len(untimed) == 2
    assert all(c["status"] == "ok" and c["reason"] == "not timed: the time budget ran out" for c in untimed)
    key = keys.request("rmsnorm", (4, 32), "float32", "interpreter", {}).key
    if accept:  # a kernel that beat eager is kept: it is correct and faster
        assert rep.decision == "kernel" and db.get(key).decision == "kernel"
    else:  # eager is not cached from a search cut short: a rerun with more time searches again
        assert rep.decision == "eager" and db.get(key) is None
    assert rep.to_dict()["cut_short"] == rep.cut_short


@pytest.mark.slow
def test_deadline_before_any_timing_decides_nothing_and_caches_nothing(tmp_path):
    db = Cache(tmp_path / "f.db")
    opts = engine.SearchOptions(budget=3, workers=1, deadline=time.monotonic() + 3600)
    seen: list = []
    rep = engine.search("softmax", (4, 16), "float32", device="cpu", cache=db, options=opts,
                        events=_deadline_after("validated", opts, seen))
    # Validation runs in chunks of the pool's size (1 worker): the two chunks after the deadline never start.
    assert seen.count("validated") == 1 and "timed" not in seen
    assert rep.decision == "none" and rep.cut_short is not None and "2 proposed but not started" in rep.cut_short
    assert len(rep.candidates) == 1 and db.entries() == []
    # batch reports such a job as skipped (time budget), not failed: exit code 0
    job = batch.Job("softmax", (4, 16), "float32", {"dim": -1}, 3, "grid", 0, 120.0, 1, 0.5)
    with engine.Pools() as pools:
        res = batch.run([job], cache=db, device="cpu", workers=1, deadline=time.monotonic() - 1, pools=pools)
    assert [(r.status, r.note, r.exit_code, r.share) for r in res] == [("skipped", "time budget", 0, 0.5)]


def _manifest(tmp_path, doc) -> str:
    p = tmp_path / "forge.toml"
    p.write_text(tomli_w.dumps(doc))
    return str(p)


@pytest.mark.slow
def test_manifest_runs_largest_share_first_and_reports_the_estimate(tmp_path, monkeypatch):
    monkeypatch.setattr(stats, "accepts", lambda *a, **k: True)
    p = _manifest(tmp_path, {"defaults": {"device": "cpu", "budget": 1, "workers": 1},
                             "op": [{"op": "softmax", "shape": "3x7", "share": 0.1},
                                    {"op": "softmax", "shape": "2x9"},
                                    {"op": "rmsnorm", "shape": "2x5", "share": 0.6},
                                    {"op": "softmax", "shape": "5x4", "share": 0.2}]})
    res = runner.invoke(cli.app, ["search", "--manifest", p, "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    entries = rep["entries"]
    assert [(e["entry"], e["share"]) for e in entries] == [(3, 0.6), (4, 0.2), (1, 0.1), (2, None)]
    assert all(e["status"] == "searched" and e["decision"] == "kernel" for e in entries)
    assert [e["started"] for e in entries] == sorted(e["started"] for e in entries)  # in that order
    shared = [e for e in entries if e["share"] is not None]
    expected = 1 / ((1 - 0.9) + sum(e["share"] / e["speedup"] for e in shared))
    assert rep["estimated_speedup"] == pytest.approx(expected) and rep["covered_share"] == pytest.approx(0.9)
    # Without --json: a line per job with the estimate so far (cache hits now), the share column, the estimate.
    res = runner.invoke(cli.app, ["search", "--manifest", p])
    assert res.exit_code == 0, res.output
    lines = [ln for ln in res.output.splitlines() if "estimated end-to-end speedup" in ln and ln.startswith("[")]
    assert [ln.split("]")[1].split(":")[0].strip() for ln in lines] == [
        "rmsnorm 2x5 float16 eps=1e-06", "softmax 5x4 float16 dim=-1", "softmax 3x7 float16 dim=-1",
        "softmax 2x9 float16 dim=-1"]
    first = entries[0]
    assert lines[0].endswith(f"{1 / (1 - 0.6 + 0.6 / first['speedup']):.2f}x")
    assert "60.0%" in res.stdout and f"(Amdahl over the shares): {expected:.2f}x" in res.stdout


@pytest.mark.slow
def test_tiny_time_budget_cuts_the_first_job_short_and_skips_the_rest(tmp_path):
    p = _manifest(tmp_path, {"defaults": {"device": "cpu", "budget": 2, "workers": 1, "time_budget": 0.2},
                             "op": [{"op": "softmax", "shape": "3x7", "share": 0.3},
                                    {"op": "rmsnorm", "shape": "2x5", "share": 0.5}]})
    res = runner.invoke(cli.app, ["search", "--manifest", p, "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep["time_budget_s"] == 0.2 and rep["skipped"] == 2 and rep["failed"] == 0
    assert [e["op"] for e in rep["entries"]] == ["rmsnorm", "softmax"]
    # Starting a worker takes longer than 0.2 s: the first job started, then stopped before timing anything.
    assert all(e["status"] == "skipped" and e["note"].startswith("time budget") for e in rep["entries"])
    assert Cache(tmp_path / "cache" / "forge.db").entries() == []


def test_single_search_with_no_time_left_starts_nothing_and_exits_0():
    res = runner.invoke(cli.app, ["search", "softmax", "--shape", "4x16", "--device", "cpu", "--json",
                                  "--time-budget", "0"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep["decision"] == "none" and rep["candidates"] == [] and "before the search started" in rep["cut_short"]
    res = runner.invoke(cli.app, ["search", "softmax", "--shape", "4x16", "--device", "cpu"],
                        env={"FORGE_TIME_BUDGET": "0"})
    assert res.exit_code == 0 and "the time budget ran out before a candidate was timed" in res.stdout
    res = runner.invoke(cli.app, ["search", "softmax", "--shape", "4x16", "--time-budget", "-2"])
    assert res.exit_code == 2 and "--time-budget: expected a number of seconds >= 0" in res.output
