"""LLM-proposed candidates over rounds (forge/tuner/llm.py): the command protocol, propose_fn, validation of
proposals against the space, failed rounds as outcomes, token accounting, `forge search --strategy llm`. No
network: a stand-in command (tests/fake_llm.py) and Python functions."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from forge import ops
from forge.cache import Cache
from forge.errors import EnvironmentProblem, UsageError
from forge.opkit import Candidate
from forge.tuner import engine, llm
from forge_cli import cli

FAKE = f"{sys.executable} {Path(__file__).parent / 'fake_llm.py'}"
MOD = ops.get("softmax").module
SPEC = MOD.make_spec((4, 40), "float32", "cpu")
SPACE = MOD.space(SPEC)


def _strategy(client, rounds=3, per_round=2, first=None):
    return llm.LLMStrategy(client, "softmax", SPEC.to_dict(), rounds, per_round, first=first)


def test_validation_rejects_with_the_reason():
    pts = list(SPACE.all_points())
    good = pts[0]
    assert llm.validate(SPACE, good.to_dict(), set()) == (good, None)
    cases = [("nope", "not an object"), ({"variant": "zz", "params": {}}, "unknown variant"),
             ({"variant": good.variant, "params": {}}, "takes exactly"),
             ({"variant": good.variant, "params": {k: 12345 for k in good.p}}, "is not one of"),
             (good.to_dict(), "tried already")]
    for proposal, why in cases:
        cand, reason = llm.validate(SPACE, proposal, {good} if why == "tried already" else set())
        assert cand is None and why in reason, (proposal, reason)


def test_the_command_protocol_rounds_and_usage():
    s = _strategy(llm.CommandClient(FAKE + " good"))
    history: dict = {}
    seen_docs = []
    for _ in range(5):
        batch = s.propose(SPACE, history, 10)
        if not batch:
            break
        assert all(c in SPACE and c not in history for c in batch) and len(batch) <= 2
        for c in batch:
            history[c] = 10.0 + len(history)
        seen_docs.append(len(history))
    u = s.usage()
    assert u["rounds"] == 3 and len(history) == 6  # 3 rounds of 2
    assert u["input_tokens"] == 100 * 3 + (0 + 2 + 4) and u["output_tokens"] == 60
    assert sum("unknown variant" in r["reason"] for r in u["rejected"]) == 3  # one per round


def test_the_document_carries_spec_space_history_and_hardware():
    docs = []

    def fn(doc):
        docs.append(doc)
        pts = list(SPACE.all_points())
        return {"candidates": [pts[len(docs)].to_dict()], "usage": {"input_tokens": 5, "output_tokens": 1}}

    s = llm.LLMStrategy(llm.FunctionClient(fn), "softmax", SPEC.to_dict(), 2, 1, hardware={"gpu": "H200"})
    c1 = s.propose(SPACE, {}, 5)
    s.propose(SPACE, {c1[0]: 3.5}, 5)
    d = docs[1]
    assert d["op"] == "softmax" and d["spec"] == SPEC.to_dict() and d["hardware"] == {"gpu": "H200"}
    assert set(d["space"]["variants"]) == set(SPACE.variants) and d["n"] == 1 and d["round"] == 2
    assert d["history"] == [{"variant": c1[0].variant, "params": c1[0].p, "status": "ok", "p50_us": 3.5}]


@pytest.mark.parametrize("mode", ["fail", "garbage"])
def test_a_failing_proposer_is_a_failed_round_not_a_failed_search(mode):
    s = _strategy(llm.CommandClient(f"{FAKE} {mode}"), rounds=2)
    assert s.propose(SPACE, {}, 5) == []
    assert [r["round"] for r in s.usage()["failed_rounds"]] == [1, 2]
    assert ("exited 3: quota exceeded" if mode == "fail" else "no JSON") in s.usage()["failed_rounds"][0]["reason"]


def test_a_slow_command_times_out_and_a_raising_fn_fails_its_round():
    s = _strategy(llm.CommandClient(f"{FAKE} slow", timeout=1.0), rounds=1)
    assert s.propose(SPACE, {}, 5) == [] and "timed out" in s.usage()["failed_rounds"][0]["reason"]

    def boom(doc):
        raise KeyError("x")

    s = _strategy(llm.FunctionClient(boom), rounds=1)
    assert s.propose(SPACE, {}, 5) == [] and "propose_fn raised KeyError" in s.usage()["failed_rounds"][0]["reason"]


def test_the_default_candidate_goes_first():
    first = MOD.default(SPEC)
    s = _strategy(llm.CommandClient(FAKE), first=first)
    assert s.propose(SPACE, {}, 5) == [first] and s.usage()["rounds"] == 0


def test_optimize_rounds_with_a_propose_fn(tmp_path):
    pts = list(SPACE.all_points())

    def fn(doc):
        tried = {json.dumps(h["params"], sort_keys=True) + h["variant"] for h in doc["history"]}
        new = [c for c in pts if json.dumps(c.p, sort_keys=True) + c.variant not in tried][:doc["n"]]
        return {"candidates": [c.to_dict() for c in new], "usage": {"input_tokens": 7, "output_tokens": 3}}

    res = llm.optimize_rounds(("softmax", (4, 40), "float32"), fn, n_rounds=2, candidates_per_round=2,
                              device="cpu", cache=tmp_path / "f.db")
    rep = res["report"]
    kernels = [c for c in rep.candidates if c["variant"] != "torch"]
    assert len(kernels) == 1 + 2 * 2  # the default, then 2 rounds of 2
    assert res["usage"]["rounds"] == 2 and res["usage"]["input_tokens"] == 14 and res["usage"]["output_tokens"] == 6
    assert res["best"] is not None and Candidate.make(res["best"]["variant"], **res["best"]["params"]) in SPACE
    assert res["benchmark_seconds"] > 0 and res["decision"] in ("kernel", "eager", "torch")


def test_cli_strategy_llm_with_a_command(tmp_path):
    runner = CliRunner()
    res = runner.invoke(cli.app, ["search", "softmax", "--shape", "4x40", "--dtype", "float32", "--device", "cpu",
                                  "--strategy", "llm", "--rounds", "2", "--budget", "5", "--llm-command",
                                  FAKE, "--json", "--workers", "1", "--cache", str(tmp_path / "c.db")])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["llm"]["rounds"] == 2 and doc["llm"]["input_tokens"] > 0
    assert len([c for c in doc["candidates"] if c["variant"] != "torch"]) == 5  # default + 2 rounds of 2
    bad = runner.invoke(cli.app, ["search", "softmax", "--shape", "4x40", "--device", "cpu", "--rounds", "2"])
    assert bad.exit_code == 2 and "need --strategy llm" in bad.output


def test_the_anthropic_client_needs_a_key(monkeypatch):
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    with pytest.raises(EnvironmentProblem, match="ANTHROPIC_API_KEY is not set"):
        llm.make_client()
    runner = CliRunner()
    res = runner.invoke(cli.app, ["search", "softmax", "--shape", "4x40", "--device", "cpu", "--strategy", "llm"])
    assert res.exit_code == 3 and "ANTHROPIC_API_KEY" in res.output


def test_engine_refuses_llm_without_a_proposer(tmp_path):
    with pytest.raises(UsageError, match="needs a proposer"):
        engine.search("softmax", (4, 40), "float32", device="cpu", cache=Cache(tmp_path / "f.db"),
                      options=engine.SearchOptions(strategy="llm", budget=3, workers=1))
