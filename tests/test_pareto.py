"""Speed against cost (forge/tuner/pareto.py): per-candidate GPU seconds and LLM tokens, the frontier, the
lambda recommendation, `forge search --pareto --lambda`."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from forge.cache import Cache
from forge.tuner import engine, pareto
from forge_cli import cli


def _c(name, speedup, gpu, tokens=0):
    return {"variant": name, "params": {}, "speedup": speedup, "cost": {"gpu_seconds": gpu, "tokens": tokens}}


def test_frontier_and_lambda():
    cands = [_c("fast-dear", 2.0, 10.0), _c("good-cheap", 1.9, 1.0), _c("slow-dear", 1.5, 9.0),
             _c("slow-cheapest", 1.2, 0.5), _c("failed", None, 3.0)]
    p = pareto.frontier(cands, 0.0)
    assert [r["variant"] for r in p["frontier"]] == ["slow-cheapest", "good-cheap", "fast-dear"]  # by cost
    assert p["recommended"]["variant"] == "fast-dear"  # lambda 0: speed only
    assert pareto.frontier(cands, 0.1)["recommended"]["variant"] == "good-cheap"  # 0.95 - 0.01 > 1.0 - 0.1
    assert pareto.frontier(cands, 5.0)["recommended"]["variant"] == "good-cheap"  # 0.95 - 0.5 > 0.6 - 0.25
    assert pareto.frontier(cands, 20.0)["recommended"]["variant"] == "slow-cheapest"  # cost first
    assert pareto.frontier([_c("x", None, 1.0)]) is None
    with pytest.raises(ValueError, match="lambda"):
        pareto.frontier(cands, -1)


def test_tokens_count_as_a_second_cost_component():
    cands = [_c("a", 2.0, 1.0, tokens=1000), _c("b", 2.0, 1.0, tokens=10)]
    p = pareto.frontier(cands, 0.1)
    assert [r["variant"] for r in p["frontier"]] == ["b"] and p["recommended"]["variant"] == "b"


def test_a_search_reports_costs_and_its_frontier(tmp_path):
    rep = engine.search("softmax", (4, 40), "float32", device="cpu", cache=Cache(tmp_path / "f.db"),
                        options=engine.SearchOptions(budget=3, workers=1, timeout=120, pareto_lambda=1.0))
    kernels = [c for c in rep.candidates if c["variant"] != "torch"]
    assert all(c["cost"]["gpu_seconds"] > 0 and c["cost"]["tokens"] == 0 for c in kernels)
    assert rep.pareto["lambda"] == 1.0 and rep.pareto["recommended"] in rep.pareto["frontier"]
    assert json.loads(json.dumps(rep.to_dict()))["pareto"]["frontier"]


def test_cli_pareto(tmp_path):
    runner = CliRunner()
    args = ["search", "softmax", "--shape", "4x40", "--dtype", "float32", "--device", "cpu", "--budget", "3",
            "--workers", "1", "--cache", str(tmp_path / "c.db")]
    res = runner.invoke(cli.app, [*args, "--pareto", "--lambda", "0.5"])
    assert res.exit_code == 0, res.output
    assert "speed against cost (lambda 0.5" in res.output and "(recommended)" in res.output
    res = runner.invoke(cli.app, [*args, "--lambda", "-2"])
    assert res.exit_code == 2 and "--lambda" in res.output
