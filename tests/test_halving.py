"""Successive halving (issue 17): strategy `halving` proposes grid's points all at once and carries a rung plan;
the engine screens every valid candidate with a quarter of the rounds, re-screens the best third (never fewer
than the finalists + 1) with all of them, and picks the finalists from those."""

from __future__ import annotations

import dataclasses
import json
import time
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from forge.cache import Cache
from forge.opkit import Candidate, row_default
from forge.tuner import engine, stats, strategy
from forge.tuner.engine import CandidateResult, Status
from forge.tuner.strategy import Grid, Halving
from forge_cli import cli
from tests.test_strategy import ALL_SMALL, drain, kernels_space, small_space, spec_for

# --- the strategy -------------------------------------------------------------------------------------------


def test_halving_is_registered_and_built_by_make():
    assert "halving" in strategy.registered() and "halving" in strategy.names()
    first = Candidate.make("a", x=1)
    h = strategy.make("halving", seed=4, first=first)
    assert isinstance(h, Halving) and h.first == first and h.rungs == Halving.RUNGS


@pytest.mark.parametrize("budget", [1, 3, 6, 50, 200])
def test_halving_proposes_the_whole_budget_at_once_spread_like_grid(budget):
    space = kernels_space()
    first = row_default(spec_for((4096, 4096)))
    got = Halving(first).propose(space, {}, budget)
    total = len(list(space.all_points()))
    assert len(got) == min(budget, total)  # one batch: the engine times them all in rung 0
    assert got == Grid(first).propose(space, {}, budget)
    assert got[0] == first and len(set(got)) == len(got) and all(c in space for c in got)
    if budget >= 3:  # every variant is represented
        assert {c.variant for c in got} == {"row", "looped", "multirow"}
    assert Halving(first).propose(space, {c: "ok" for c in got}, budget) == (
        Grid(first).propose(space, {c: "ok" for c in got}, budget))


def test_halving_is_deterministic_for_any_seed():
    assert drain(Halving(seed=1), small_space(), 3) == drain(Halving(seed=2), small_space(), 3)
    assert sorted(drain(Halving(seed=1), small_space(), 3), key=lambda c: c.key) == sorted(ALL_SMALL,
                                                                                           key=lambda c: c.key)


def test_the_rung_plan_is_read_through_the_transfer_wrapper_and_absent_elsewhere():
    assert strategy.Seeded(strategy.make("halving"), []).rungs == Halving.RUNGS
    assert getattr(strategy.Seeded(strategy.make("grid"), []), "rungs", None) is None
    for share, keep in Halving.RUNGS:
        assert 0 < share < 1 and 0 < keep < 1


# --- the engine's rules --------------------------------------------------------------------------------------


def test_rung_plan_on_each_backend():
    assert engine._rung_plan(Halving.RUNGS, 30) == [(8, 1 / 3), (30, None)]  # CUDA: 8 rounds, then 30
    assert engine._rung_plan(Halving.RUNGS, 3) == [(3, 1 / 3), (3, None)]  # the interpreter: the floor is all
    assert engine._rung_plan(((0.01, 0.5),), 30) == [(engine.RUNG_MIN_ROUNDS, 0.5), (30, None)]
    assert engine._rung_plan(None, 30) == [] and engine._rung_plan((), 30) == []


@pytest.mark.parametrize("n,share,finalists,kept", [
    (50, 1 / 3, 3, 17),  # a third, rounded up
    (6, 1 / 3, 3, 4),  # never fewer than the finalists + 1
    (3, 1 / 3, 3, 3),  # never more than there are
    (0, 1 / 3, 3, 0),
    (50, 0.14, 2, 7),  # 50 x 0.14 is 7.000000000000001 in floating point
])
def test_kept(n, share, finalists, kept):
    assert engine._kept(n, share, finalists) == kept


def test_finalists_come_from_the_highest_rung_then_by_rank():
    a, b, c = (CandidateResult(Candidate.make("v", n=i), status=Status.OK, path=p) for i, p in enumerate("abc"))
    a.screen, a.screen_eager, a.rung = stats.Quantiles.of([5.0] * 3), 10.0, 0  # best ratio, dropped at rung 0
    b.screen, b.screen_eager, b.rung = stats.Quantiles.of([9.0] * 8), 10.0, 1
    c.screen, c.screen_eager, c.rung = stats.Quantiles.of([8.0] * 8), 10.0, 1
    assert sorted([a, b, c], key=engine._finalist_rank) == [c, b, a]
    a.rung = b.rung = c.rung = None  # without rungs: _screen_rank alone
    assert sorted([a, b, c], key=engine._finalist_rank) == sorted([a, b, c], key=engine._screen_rank) == [a, c, b]


def test_rung_and_halving_keys_appear_only_with_rungs():
    r = CandidateResult(Candidate.make("v", n=1), status=Status.OK, path="p")
    assert "rung" not in r.to_dict()
    r.rung = 0
    assert r.to_dict()["rung"] == 0


# --- a search on the interpreter -----------------------------------------------------------------------------

REPS = 8  # the interpreter screens with 3 rounds, the rungs' floor: more here, so rung 0 (3 rounds) is shorter


@pytest.fixture
def spied(monkeypatch):
    """Screening with REPS rounds on the interpreter, and every _time_together call recorded: (paths timed,
    rounds, samples by path, seconds) in `.calls`; `.paths` maps each candidate's label to its source path."""
    monkeypatch.setitem(engine.SAMPLING, "interpreter",
                        dataclasses.replace(engine.SAMPLING["interpreter"], screen_reps=REPS))
    spy_log = SimpleNamespace(calls=[], paths={})
    real = engine._time_together

    def spy(pool, group, rounds, *a, **k):
        reply, timed = real(pool, group, rounds, *a, **k)
        spy_log.calls.append(([r.path for r in timed], rounds, reply.get("samples", {}), reply.get("seconds", 0.0)))
        spy_log.paths.update({r.candidate.label: r.path for r in group})
        return reply, timed

    monkeypatch.setattr(engine, "_time_together", spy)
    return spy_log


def _rank_of(samples: dict, path: str) -> float:
    return stats.Quantiles.of(samples[path]).p50 / stats.Quantiles.of(samples["eager"]).p50


@pytest.mark.slow
def test_a_halving_search_screens_short_then_retimes_the_best_with_full_rounds(tmp_path, spied):
    validated: dict[str, float] = {}  # path -> gpu seconds once validated (before any timing)

    def events(kind, **data):
        if kind == "validated":
            validated[data["result"].path] = data["result"].gpu_seconds

    opts = engine.SearchOptions(strategy="halving", budget=6, workers=2, timeout=120)
    rep = engine.search("rmsnorm", (3, 40), "float32", device="cpu", cache=Cache(tmp_path / "f.db"),
                        options=opts, events=events)
    calls = spied.calls
    rung0 = [c for c in calls if c[1] == 3]
    rung1 = [c for c in calls if c[1] == REPS]
    final = [c for c in calls if c[1] == engine.SAMPLING["interpreter"].final_rounds]
    assert len(rung0) + len(rung1) + len(final) == len(calls) and len(final) == 1
    assert calls.index(rung0[-1]) < calls.index(rung1[0]) < calls.index(final[0])  # rung 0, rung 1, final

    ok = [c for c in rep.candidates if c["status"] == "ok"]
    assert len(ok) == 6
    timed0 = [p for paths, *_ in rung0 for p in paths]
    assert sorted(timed0) == sorted(validated)  # every valid candidate, once, in rung 0
    # rung 1: the best 4 (a third of 6 is 2; the finalists + 1 is 4) by rung 0's rank against its group's eager
    by_rank = sorted(timed0, key=lambda p: next(_rank_of(s, p) for paths, _, s, _ in rung0 if p in paths))
    kept = [p for paths, *_ in rung1 for p in paths]
    assert sorted(kept) == sorted(by_rank[:4])
    # the finalists are among the kept, the best 3 by their rung 1 screening
    rung1_rank = {p: _rank_of(s, p) for paths, _, s, _ in rung1 for p in paths}
    assert sorted(final[0][0]) == sorted(sorted(kept, key=rung1_rank.get)[:opts.finalists])

    by_path = {spied.paths[Candidate.make(c["variant"], **c["params"]).label]: c for c in ok}
    assert len(by_path) == 6
    for p, c in by_path.items():
        if p in kept:
            assert c["rung"] == 1 and c["screen"]["n"] == REPS
        else:
            assert c["rung"] == 0 and c["screen"]["n"] == 3 and c["final"] is None
        # gpu seconds: its validation plus its share of every timing call it was in
        share = sum(sec / len(paths) for paths, _, _, sec in calls if p in paths)
        assert c["cost"]["gpu_seconds"] == pytest.approx(validated[p] + share, abs=2e-4)
    assert rep.to_dict()["halving"] == {"rungs": [{"rounds": 3, "keep": 0.3333}, {"rounds": REPS}],
                                        "timed": [6, 4], "kept": [4]}
    assert rep.to_dict()["screening"]["finalists"] and rep.decision in ("kernel", "eager")


@pytest.mark.slow
def test_a_deadline_between_the_rungs_decides_from_the_short_screening(tmp_path, spied):
    opts = engine.SearchOptions(strategy="halving", budget=6, workers=2, timeout=120,
                                deadline=time.monotonic() + 3600)
    seen = []

    def events(kind, **data):
        seen.append(kind)
        if kind == "retime":  # rung 0 done, rung 1 about to start: the time budget runs out
            opts.deadline = 0.0

    rep = engine.search("rmsnorm", (3, 40), "float32", device="cpu", cache=Cache(tmp_path / "f.db"),
                        options=opts, events=events)
    assert seen.count("retime") == 1 and not [c for c in spied.calls if c[1] == REPS]  # rung 1 never ran
    assert rep.cut_short is not None and "6 candidate(s) timed" in rep.cut_short
    assert rep.to_dict()["halving"]["timed"] == [6, 0] and rep.to_dict()["halving"]["kept"] == [4]
    kept = [c for c in rep.candidates if c["reason"] and c["reason"].startswith("not re-timed")]
    assert len(kept) == 4 and all(c["rung"] == 0 and c["screen"]["n"] == 3 for c in kept)
    assert kept[0]["reason"] == (f"not re-timed with {REPS} rounds: the time budget ran out "
                                 "(ranked by its 3-round screening)")
    finals = [c for c in rep.candidates if c["final"] is not None]  # still re-timed against eager: the rule needs it
    assert len(finals) == opts.finalists and all(c in kept for c in finals)


@pytest.mark.slow
def test_forge_search_strategy_halving(tmp_path):
    res = CliRunner().invoke(cli.app, ["search", "rmsnorm", "--shape", "3x40", "--dtype", "float32", "--device", "cpu",
                                       "--strategy", "halving", "--budget", "6", "--workers", "2", "--json",
                                       "--cache", str(tmp_path / "f.db")])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    # the interpreter's 3 screening rounds are the rungs' floor: rung 0 would take as long as rung 1, so it is
    # skipped and every candidate is screened once, as grid would
    assert doc["halving"] == {"rungs": [{"rounds": 3, "keep": 0.3333}, {"rounds": 3}], "timed": [0, 6], "kept": [0]}
    assert [c["rung"] for c in doc["candidates"]] == [1] * 6
    unknown = CliRunner().invoke(cli.app, ["search", "rmsnorm", "--shape", "3x40", "--device", "cpu",
                                           "--strategy", "halvng", "--cache", str(tmp_path / "f.db")])
    assert unknown.exit_code == 2 and "halving" in unknown.output
