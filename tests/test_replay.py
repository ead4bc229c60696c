"""Strategies replayed on recorded tables (forge/tuner/replay.py, `forge replay`): every registered strategy
over every table, the H200's exhaustive searches (bench/results/h200-tables-2026-12-04) and the synthetic
landscapes of tests/replay_tables/, and the default strategy against every other."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from forge.cache import Cache
from forge.opkit import Candidate
from forge.tuner import engine, replay
from forge.tuner import strategy as strategies
from forge_cli import cli

TABLES = sorted(Path(__file__).parent.glob("replay_tables/*.json"))
H200 = sorted((Path(__file__).parent.parent / "bench/results/h200-tables-2026-12-04").glob("*.json"))


@pytest.fixture(scope="module")
def tables():
    return [replay.load(p) for p in (*TABLES, *H200)]


@pytest.fixture(scope="module")
def h200():
    assert len(H200) >= 8  # issue 17: at least 8 op-shapes recorded on the GPU
    return [replay.load(p) for p in H200]


@pytest.mark.parametrize("name", strategies.registered())
@pytest.mark.parametrize("fraction", [0.05, 0.25, 1.0])
def test_every_strategy_stays_in_the_space_and_the_budget_and_is_repeatable(tables, name, fraction):
    for t in tables:
        budget = max(1, round(fraction * len(t.times)))
        space, strat = t.space(), strategies.make(name, 3)
        history: dict = {}
        while len(history) < budget:
            batch = strat.propose(space, history, budget - len(history))
            if not batch:
                break
            assert len(batch) <= budget - len(history) and len(set(batch)) == len(batch)
            for c in batch:
                assert c not in history and c in t.times, (name, c.label)
                history[c] = t.times[c]
        assert len(history) == budget  # no strategy stops early while unseen points remain
        assert replay.simulate(t, name, budget, seed=3) == replay.simulate(t, name, budget, seed=3)
    if fraction == 1.0:  # the whole space: every strategy finds the exhaustive best
        assert all(replay.quality(t, name, 1.0, range(2)) == 1.0 for t in tables)


def test_evolve_beats_grid_and_random_and_reaches_99_percent_at_a_quarter_of_the_space(tables):
    res = replay.evaluate(tables, ("grid", "random", "evolve"), seeds=range(5))
    q = {n: r["mean"][0.25] for n, r in res.items()}
    assert q["evolve"] >= 0.99 and q["evolve"] >= q["grid"] and q["evolve"] >= q["random"], q


def test_the_default_is_the_best_registered_strategy_on_the_h200_tables(h200):
    """The default must earn its place on the GPU's own landscapes: 0.99 of the exhaustive best with a quarter
    of the space (issue 17's target), and no registered strategy better at 10%, 25% or 50%."""
    res = replay.evaluate(h200, seeds=range(5))
    best = res[strategies.DEFAULT]["mean"]
    assert best[0.25] >= 0.99, best
    for name, r in res.items():
        assert all(best[f] >= r["mean"][f] - 1e-9 for f in replay.FRACTIONS), (name, r["mean"], best)


def test_a_strategy_that_repeats_a_point_is_caught(tables, monkeypatch):
    class Repeats:
        def __init__(self, seed=0, first=None):
            pass

        def propose(self, space, history, n):
            return [next(iter(space.all_points()))]

    monkeypatch.setitem(strategies.REGISTRY, "repeats", Repeats)
    with pytest.raises(AssertionError, match="a repeat"):
        replay.simulate(tables[0], "repeats", 3)


def test_a_recorded_exhaustive_search_replays_to_its_own_best(tmp_path):
    """table_from_report on a real (interpreter) exhaustive search: a full-budget replay finds its best."""
    from forge import ops

    spec = ops.get("softmax").module.make_spec((4, 40), "float32", "cpu")
    n = sum(1 for _ in ops.get("softmax").module.space(spec).all_points())
    rep = engine.search("softmax", (4, 40), "float32", device="cpu", cache=Cache(tmp_path / "f.db"),
                        options=engine.SearchOptions(budget=n, workers=1, timeout=120, torch_op=False))
    doc = replay.table_from_report(rep.to_dict(), gpu="interpreter")
    assert doc["op"] == "softmax" and doc["shape"] == "4x40" and len(doc["candidates"]) == n
    base = rep.baseline.p50
    for row, c in zip(doc["candidates"], rep.candidates, strict=True):  # one scale: the final's eager
        if c["status"] == "ok":
            assert row["screen_p50_us"] == c["screen"]["p50"]
            assert row["p50_us"] == pytest.approx(c["screen"]["p50"] * base / c["screen_eager_p50"])
        else:
            assert row["p50_us"] is None
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    t = replay.load(path)
    timed = [c for c in rep.candidates if c["status"] == "ok"]
    assert len([v for v in t.times.values() if v is not None]) == len(timed)
    assert replay.simulate(t, "grid", n) == t.best
    first = Candidate.from_dict(rep.candidates[0])
    assert replay.simulate(t, "evolve", 1, first=first) == t.times[first] or t.times[first] is None


def test_cli_replay(tmp_path):
    runner = CliRunner()
    res = runner.invoke(cli.app, ["replay", *map(str, TABLES), "--json", "--seeds", "2", "--strategy", "evolve"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["version"] == 1 and set(doc["strategies"]) == {"evolve"}
    assert set(doc["tables"]) == {p.stem for p in TABLES} and 0 < doc["strategies"]["evolve"]["mean"]["0.25"] <= 1
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    res = runner.invoke(cli.app, ["replay", str(bad)])
    assert res.exit_code == 2 and "not a replay table" in res.output
    res = runner.invoke(cli.app, ["replay", str(TABLES[0]), "--strategy", "annealing"])
    assert res.exit_code == 2 and "unknown strategy" in res.output


def test_the_engine_searches_with_evolve(tmp_path):
    """Generations bred from the engine's own results (CandidateResult: status and timings)."""
    from forge import ops

    spec = ops.get("layer_norm").module.make_spec((4, 300), "float32", "cpu")
    n = sum(1 for _ in ops.get("layer_norm").module.space(spec).all_points())
    budget = min(n, strategies.Evolve.FIRST + 6)
    assert budget > strategies.Evolve.FIRST  # a second generation is bred
    rep = engine.search("layer_norm", (4, 300), "float32", device="cpu", cache=Cache(tmp_path / "f.db"),
                        options=engine.SearchOptions(budget=budget, strategy="evolve", workers=1, timeout=120,
                                                     torch_op=False))
    labels = [Candidate.from_dict(c).label for c in rep.candidates]
    assert len(labels) == budget == len(set(labels)) and rep.decision in ("kernel", "eager")
    timed = [c for c in rep.candidates if c["status"] == "ok"]
    assert strategies.score(None) is None and len(timed) >= budget // 2


def test_score_reads_the_engines_results():
    from forge.tuner import stats
    from forge.tuner.status import Status

    ok = engine.CandidateResult(Candidate.make("row", num_warps=4), status=Status.OK,
                                screen=stats.Quantiles(1.0, 2.0, 3.0, 5))
    bad = engine.CandidateResult(Candidate.make("row", num_warps=8), status=Status.MISMATCH)
    untimed = engine.CandidateResult(Candidate.make("row", num_warps=2), status=Status.OK)
    assert strategies.score(ok) == 2.0 and strategies.score(bad) is None and strategies.score(untimed) is None
    assert strategies.score(7.5) == 7.5
