"""`forge trace DIR/` (forge.tuner.kernelbench): a directory of KernelBench problem files traced, tuned
(--tune, by share, one time budget for all), verified end to end and scored with fast_p; a broken problem
is not correct, with its reason, and the others go on."""

from __future__ import annotations

import json
import textwrap

import pytest
from typer.testing import CliRunner

from forge.tuner import kernelbench, stats
from forge_cli import cli

runner = CliRunner()

RMS = '''
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.w = nn.Parameter(torch.rand(d) + 0.5)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w


def get_inputs():
    return [torch.randn(4, 32)]


def get_init_inputs():
    return [32]
'''

SOFTMAX = '''
import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return torch.softmax(x, dim=-1)


def get_inputs():
    return [torch.randn(4, 16)]
'''

NOTHING = '''
import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return torch.softmax(x.t(), dim=-1).cumsum(-1).max(dim=-1).values


def get_inputs():
    return [torch.randn(4, 16)]
'''

BROKEN_IMPORT = '''
import torch
import forge_no_such_module_for_tests
'''

BROKEN_FORWARD = '''
import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return x @ torch.ones(5, 5)


def get_inputs():
    return [torch.randn(3, 4)]
'''


@pytest.fixture
def problems(tmp_path):
    d = tmp_path / "level1"
    d.mkdir()
    for name, text in (("1_rmsnorm.py", RMS), ("2_softmax.py", SOFTMAX), ("3_cumsum.py", NOTHING),
                       ("4_broken_import.py", BROKEN_IMPORT), ("5_broken_forward.py", BROKEN_FORWARD),
                       ("__init__.py", ""), ("notes.txt", "not a problem")):
        (d / name).write_text(textwrap.dedent(text))
    return d


def _run(*args) -> dict:
    res = runner.invoke(cli.app, ["trace", *map(str, args), "--device", "cpu", "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def _fast_p(rows: list[dict], p: float) -> float:
    return sum(1 for r in rows if r["correct"] and r["speedup"] is not None and r["speedup"] > p) / len(rows)


def _check_score(doc: dict) -> None:
    rows = doc["problems"]
    assert doc["p_values"] == [1.0, 1.25, 1.5, 2.0]
    assert doc["score"] == {"fast_0": pytest.approx(sum(r["correct"] for r in rows) / len(rows)),
                            **{f"fast_{p}": pytest.approx(_fast_p(rows, p)) for p in doc["p_values"]}}


def _check_broken(rows: dict) -> None:
    imp, fwd = rows["4_broken_import.py"], rows["5_broken_forward.py"]
    assert not imp["correct"] and imp["stage"] == "load" and imp["speedup"] is None
    assert "importing it failed: ModuleNotFoundError" in imp["error"]
    assert not fwd["correct"] and fwd["stage"] == "trace" and "cannot trace" in fwd["error"]


def test_directory_traces_and_verifies_every_problem_without_tuning(problems):
    doc = _run(problems)
    rows = {r["name"]: r for r in doc["problems"]}
    assert list(rows) == ["1_rmsnorm.py", "2_softmax.py", "3_cumsum.py", "4_broken_import.py",
                          "5_broken_forward.py"]  # files in name order; __init__.py and notes.txt are no problems
    for name in ("1_rmsnorm.py", "2_softmax.py", "3_cumsum.py"):
        r = rows[name]
        assert r["correct"] and r["error"] is None and r["stage"] is None, r
        assert r["swapped"] == 0 and r["jobs"] == [] and r["speedup"] > 0  # nothing cached: eager under Dynamo
        assert r["verify"]["ok"] and r["verify"]["rel_error"] == 0.0
    assert (rows["1_rmsnorm.py"]["regions"], rows["1_rmsnorm.py"]["tunable"]) == (1, 1)
    nothing = rows["3_cumsum.py"]  # a softmax of a transposed (non-contiguous) view, a cumsum, a max
    assert (nothing["regions"], nothing["tunable"]) == (1, 0)
    assert nothing["not_tunable"] == ["softmax (softmax): a layout softmax's kernels do not take: input 0: the last "
                                     "dimension must be contiguous (stride 1), got strides (1, 16)"]
    assert nothing["unmatched"] == {"method t": 1, "method cumsum": 1, "function getitem": 1}
    _check_broken(rows)
    _check_score(doc)
    assert doc["score"]["fast_0"] == pytest.approx(3 / 5)
    assert doc["time_budget_s"] is None and doc["tuning_s"] == 0.0 and doc["backend"] == "interpreter"
    # the table: one row per problem, the reasons, the score
    res = runner.invoke(cli.app, ["trace", str(problems), "--device", "cpu"])
    assert res.exit_code == 0, res.output
    for needle in ("1_rmsnorm.py", "5_broken_forward.py", "method cumsum", "layout",
                   "ModuleNotFoundError", "fast_1.0"):
        assert needle in res.stdout, needle


@pytest.mark.slow
def test_directory_tune_then_verify_and_score(problems, monkeypatch):
    monkeypatch.setattr(stats, "accepts", lambda *a, **k: True)  # the interpreter never beats eager
    doc = _run(problems, "--tune", "--profile", "--budget", "1", "--workers", "1")
    rows = {r["name"]: r for r in doc["problems"]}
    for name, op in (("1_rmsnorm.py", "rmsnorm"), ("2_softmax.py", "softmax")):
        r = rows[name]
        assert r["correct"] and r["swapped"] == 1 and r["verify"]["rel_error"] < 1e-5, r
        assert [(j["op"], j["status"], j["decision"]) for j in r["jobs"]] == [(op, "searched", "kernel")]
        assert 0 < r["jobs"][0]["share"] <= 1 and r["profile"]["covered_fraction"] > 0
    assert rows["3_cumsum.py"]["correct"] and rows["3_cumsum.py"]["jobs"] == []
    _check_broken(rows)
    _check_score(doc)
    assert doc["tuning_s"] > 0
    # Tuned kernels are cached: a second run without --tune verifies with them.
    again = {r["name"]: r for r in _run(problems)["problems"]}
    assert again["1_rmsnorm.py"]["swapped"] == 1 and again["2_softmax.py"]["swapped"] == 1


def test_directory_time_budget_spent_skips_tuning_but_still_verifies(problems):
    doc = _run(problems, "--tune", "--budget", "1", "--workers", "1", "--time-budget", "0")
    rows = {r["name"]: r for r in doc["problems"]}
    for name in ("1_rmsnorm.py", "2_softmax.py"):
        r = rows[name]
        assert [(j["status"], j["note"]) for j in r["jobs"]] == [("skipped", "time budget")]
        assert r["correct"] and r["swapped"] == 0
    assert doc["time_budget_s"] == 0.0
    _check_score(doc)


@pytest.mark.parametrize(("args", "needle"), [
    (["--budget", "2"], "--budget and --time-budget need --tune"),
    (["--write-manifest", "x.toml"], "--write-manifest takes one target"),
    (["--input", "3x4"], "--input is for FILE.py:function"),
    (["--tune", "--time-budget", "-1"], "--time-budget: expected a number of seconds >= 0"),
])
def test_directory_usage_errors(problems, args, needle):
    res = runner.invoke(cli.app, ["trace", str(problems), "--device", "cpu", *args])
    assert res.exit_code == 2 and needle in res.output, res.output


def test_empty_directory_is_a_usage_error(tmp_path):
    res = runner.invoke(cli.app, ["trace", str(tmp_path), "--device", "cpu"])
    assert res.exit_code == 2 and "no problem files" in res.output


def test_fast_p_counts_correct_and_strictly_faster_over_all_problems():
    P = kernelbench.Problem
    rows = [P("a", "a", correct=True, speedup=2.5), P("b", "b", correct=True, speedup=1.25),
            P("c", "c", correct=False, speedup=3.0), P("d", "d", correct=True, speedup=0.5), P("e", "e")]
    assert kernelbench.fast_p(rows) == {"fast_0": 0.6, "fast_1.0": 0.4, "fast_1.25": 0.2, "fast_1.5": 0.2,
                                        "fast_2.0": 0.2}
    assert kernelbench.fast_p([]) == {"fast_0": 0.0, "fast_1.0": 0.0, "fast_1.25": 0.0, "fast_1.5": 0.0,
                                      "fast_2.0": 0.0}


SWIGLU = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(16, 24, bias=False)
        self.up = nn.Linear(16, 24, bias=False)

    def forward(self, x):
        return F.silu(self.gate(x)) * self.up(x)


def get_inputs():
    return [torch.randn(5, 16)]
'''


@pytest.mark.slow
def test_a_region_decided_eager_is_traced_again_and_its_parts_tuned(tmp_path, monkeypatch):
    """--tune in rounds: the SwiGLU region's search decides eager (no kernel wins here), the next trace splits
    it as the backend does, and its parts (the two projections, silu(g) * u) are tuned in the next round and
    swapped in at verification."""
    from forge.tuner import engine

    real = engine.search

    def search(op_name, *args, **kwargs):  # swiglu finds no winner; every other op's kernel wins
        monkeypatch.setattr(stats, "accepts", lambda *a, **k: op_name != "swiglu")
        return real(op_name, *args, **kwargs)
    monkeypatch.setattr(engine, "search", search)
    d = tmp_path / "mlp"
    d.mkdir()
    (d / "1_swiglu.py").write_text(textwrap.dedent(SWIGLU))
    (row,) = _run(d, "--tune", "--budget", "1", "--workers", "1")["problems"]
    jobs = [(j["op"], j["decision"]) for j in row["jobs"]]
    assert jobs[0] == ("swiglu", "eager") and sorted(jobs[1:]) == [("linear", "kernel"), ("silu_mul", "kernel")], jobs
    assert row["correct"] and row["swapped"] == 3, row
