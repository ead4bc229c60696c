"""`forge trace`: KernelBench problem files and FILE.py:function targets, region matching with reasons
for what does not match, --write-manifest (round trip through the manifest parser), --profile (time
attribution and the Amdahl estimate) and --verify (cached kernels swapped in, compared end to end)."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from typer.testing import CliRunner

from forge.tuner import manifest, stats
from forge.tuner import tracetools as tracecmd
from forge_cli import cli

runner = CliRunner()

PROBLEM = '''
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.w = nn.Parameter(torch.rand(d) + 0.5)

    def forward(self, x):
        r = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w
        return torch.softmax(r, dim=-1).cumsum(-1)


def get_inputs():
    return [torch.randn(6, 40)]


def get_init_inputs():
    return [40]
'''

FUNCS = '''
import torch


def rms(x, w):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w


def branchy(x):
    if x.sum() > 0:
        return x
    return -x


def broken(x):
    return x @ torch.ones(5, 5)


def no_tensor_ops(x):
    return x
'''


@pytest.fixture
def files(tmp_path):
    (tmp_path / "problem.py").write_text(textwrap.dedent(PROBLEM))
    (tmp_path / "funcs.py").write_text(textwrap.dedent(FUNCS))
    (tmp_path / "empty.py").write_text("x = 1\n")
    return tmp_path


def _trace(*args):
    res = runner.invoke(cli.app, ["trace", *map(str, args), "--device", "cpu", "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_problem_file_regions_and_unmatched(files):
    doc = _trace(files / "problem.py")
    assert [(r["op"], r["shape"], r["dtype"], r["tunable"]) for r in doc["regions"]] == [
        ("rmsnorm", [6, 40], "float32", True), ("softmax", [6, 40], "float32", True)]
    assert doc["regions"][0]["attrs"] == {"eps": 1e-6}
    assert [u["call"] for u in doc["unmatched"]] == ["method cumsum"]
    assert "no op family matches" in doc["unmatched"][0]["reason"]


def test_function_with_inputs_and_dtype(files):
    doc = _trace(f"{files / 'funcs.py'}:rms", "--input", "3x33:float16", "--input", "33:float16")
    assert [(r["op"], r["shape"], r["dtype"], r["attrs"]) for r in doc["regions"]] == [
        ("rmsnorm", [3, 33], "float16", {"eps": 1e-5})]
    doc = _trace(files / "problem.py", "--dtype", "bfloat16")
    assert {r["dtype"] for r in doc["regions"]} == {"bfloat16"}


@pytest.mark.parametrize(("args", "needle"), [
    (["nosuch.py"], "no such file"),
    (["empty.py"], "Model is missing"),
    (["funcs.py:rms", "--input", "3xq"], "--input '3xq'"),
    (["funcs.py:rms"], "give the function's inputs with --input"),
    (["funcs.py:nope", "--input", "3x4"], "no function 'nope'"),
    (["funcs.py:broken", "--input", "3x4"], "cannot trace: TorchDynamo could not capture it"),
    (["funcs.py:no_tensor_ops", "--input", "3x4"], "captured no graph"),
    (["problem.py", "--input", "3x4"], "--input is for FILE.py:function"),
])
def test_bad_targets_exit_2_with_a_reason(files, args, needle):
    args = [str(files / args[0]), *args[1:]]
    res = runner.invoke(cli.app, ["trace", *args, "--device", "cpu"])
    assert res.exit_code == 2, res.output
    assert needle in res.output and "Traceback" not in res.output


def test_write_manifest_round_trips(files, tmp_path):
    out = tmp_path / "forge.toml"
    doc = _trace(files / "problem.py", "--write-manifest", out)
    assert doc["manifest"] == str(out)
    m = manifest.load(out, env={})
    assert m.device == "cpu"
    assert [j.label for j in m.jobs] == ["rmsnorm 6x40 float32 eps=1e-06", "softmax 6x40 float32 dim=-1"]


def test_profile_attributes_time_and_estimates_with_amdahl(files):
    tgt = tracecmd.load_target(str(files / "problem.py"), [], "cpu")
    result = tracecmd.trace(tgt, "cpu")
    result.regions[0].speedup, result.regions[1].speedup = 4.0, 1.0
    p = tracecmd.profile(result, iters=3)
    assert p["total_us"] > 0 and 0 < p["covered_fraction"] <= 1
    assert all(r.seconds > 0 for r in result.regions) and result.unmatched[0].seconds > 0
    total = p["total_us"]
    f0, f1 = (r.seconds * 1e6 / total for r in result.regions)
    assert p["covered_fraction"] == pytest.approx(f0 + f1)
    assert p["amdahl_speedup"] == pytest.approx(1 / ((1 - f0 - f1) + f0 / 4 + f1))
    assert p["amdahl_speedup"] > 1


TUPLES = '''
import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x, y):
        a, b = torch.chunk(torch.softmax(y, dim=-1), 2, dim=0)
        return torch.softmax(x, dim=-1).cumsum(-1), a + b


def get_inputs():
    return [torch.randn(6, 40), torch.randn(8, 16)]
'''


def test_profile_ranks_every_call_matched_or_not(files):
    (files / "tuples.py").write_text(textwrap.dedent(TUPLES))
    tgt = tracecmd.load_target(str(files / "tuples.py"), [], "cpu")
    result = tracecmd.trace(tgt, "cpu")
    p = tracecmd.profile(result, iters=2)
    rank = p["ranking"]
    # every region, every unmatched call and the calls that are neither (chunk gives a tuple), each once
    assert sorted((r["kind"], r["node"]) for r in rank) == sorted(
        [("region", r.root.name) for r in result.regions] + [("unmatched", u.node.name) for u in result.unmatched]
        + [("other", "chunk")])
    assert [r["us"] for r in rank] == sorted((r["us"] for r in rank), reverse=True)
    assert sum(r["us"] for r in rank) == pytest.approx(p["total_us"])
    assert sum(r["share"] for r in rank) == pytest.approx(1.0) and rank[-1]["cumulative"] == pytest.approx(1.0)
    by_node = {r["node"]: r for r in rank}
    for r in result.regions:
        assert by_node[r.root.name]["us"] == pytest.approx(r.seconds * 1e6)
    assert p["covered_fraction"] == pytest.approx(sum(by_node[r.root.name]["share"] for r in result.regions))
    res = runner.invoke(cli.app, ["trace", str(files / "tuples.py"), "--device", "cpu", "--profile"])
    assert res.exit_code == 0, res.output
    assert "time per op, largest first" in res.stdout and "function chunk" in res.stdout


def test_write_manifest_with_profile_records_each_entry_share(files, tmp_path):
    out = tmp_path / "forge.toml"
    doc = _trace(files / "problem.py", "--profile", "--write-manifest", out)
    total = doc["profile"]["total_us"]
    want = {(r["op"], "x".join(map(str, r["shape"]))): round(r["us"] / total, 6) for r in doc["regions"]}
    m = manifest.load(out, env={})
    got = {(j.op, "x".join(map(str, j.shape))): j.share for j in m.jobs}
    assert got == pytest.approx(want) and all(0 < s < 1 for s in got.values())
    assert [j.share for j in m.jobs] == sorted(got.values(), reverse=True)  # written largest first
    assert sum(got.values()) == pytest.approx(doc["profile"]["covered_fraction"], abs=1e-5)
    # without --profile: no shares (one entry per op, dtype and attributes, its shapes listed)
    _trace(files / "problem.py", "--write-manifest", out)
    assert "share" not in out.read_text() and all(j.share is None for j in manifest.load(out, env={}).jobs)


def test_tuning_options_need_a_directory(files):
    res = runner.invoke(cli.app, ["trace", str(files / "problem.py"), "--device", "cpu", "--tune"])
    assert res.exit_code == 2 and "are for a directory of problem files" in res.output


@pytest.mark.slow
def test_verify_swaps_cached_kernels_and_compares(files, tmp_path, monkeypatch):
    monkeypatch.setattr(stats, "accepts", lambda *a, **k: True)  # the interpreter never beats eager
    out = tmp_path / "forge.toml"
    _trace(files / "problem.py", "--write-manifest", out)
    res = runner.invoke(cli.app, ["search", "--manifest", str(out), "--budget", "1", "--workers", "1", "--json"])
    assert res.exit_code == 0, res.output
    doc = _trace(files / "problem.py", "--verify")
    v = doc["verify"]
    assert v["ok"] and v["swapped"] == 2 and v["rel_error"] < 1e-5, v
    assert [r["cached"] for r in doc["regions"]] == ["kernel", "kernel"]
    # A kernel that returned wrong values would be caught end to end (exit 1, MISMATCH).
    import forge

    real = forge.shim._Binding.__call__
    monkeypatch.setattr(forge.shim._Binding, "__call__", lambda self, *a, **k: real(self, *a, **k) * 1.5)
    res = runner.invoke(cli.app, ["trace", str(files / "problem.py"), "--device", "cpu", "--verify"])
    assert res.exit_code == 1 and "MISMATCH" in res.output


def test_verify_without_cached_kernels_runs_eager(files):
    doc = _trace(files / "problem.py", "--verify")
    v = doc["verify"]
    assert v["ok"] and v["swapped"] == 0 and v["rel_error"] == 0.0
    assert all(s.startswith("eager") for s in v["regions"].values())


def test_regions_cut_at_shared_values_and_direct_inputs():
    import torch.nn.functional as F

    from forge.trace import TraceGraph

    def f(x, w):
        h = F.gelu(F.layer_norm(x, (x.shape[-1],), w))
        return torch.softmax(h * 2.0, -1)

    g = TraceGraph(f, (torch.randn(4, 16), torch.randn(16)), {})
    regions, unmatched = tracecmd.find_regions(g, "cpu")
    assert [r.op for r in regions] == ["layer_norm", "gelu", "softmax"]
    assert [u.call for u in unmatched] == ["function mul"]


HUNGRY = '''
import torch

CALLS = {{"n": 0}}


# A custom op is captured into the graph like any op (a Python condition would be specialised away by
# Dynamo), so --profile and --verify, which rerun the captured graphs, meet it again.
@torch.library.custom_op("{ns}::hungry", mutates_args=())
def hungry(x: torch.Tensor) -> torch.Tensor:
    CALLS["n"] += 1
    if CALLS["n"] > {allowed}:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB (on purpose)")
    return x.clone()


@hungry.register_fake
def _(x):
    return torch.empty_like(x)


def f(x):
    return torch.softmax(hungry(x), dim=-1)
'''


@pytest.mark.parametrize(("allowed", "flags", "needle"), [
    (0, [], "tracing: the target ran out of memory"),
    (1, ["--profile"], "profiling (--profile): the target ran out of memory"),
    (1, ["--verify"], "verifying (--verify): the target ran out of memory"),
])
def test_a_target_out_of_memory_is_exit_3_with_the_numbers(tmp_path, allowed, flags, needle):
    """Issue 15: the user's model running out of memory under trace, --profile or --verify is an environment
    limit (exit 3, the free memory, what to do), never exit 1 nor 'cannot trace'."""
    ns = f"forge_test_{tmp_path.name.replace('-', '_')}"  # a custom op name registers once per process
    (tmp_path / "hungry.py").write_text(textwrap.dedent(HUNGRY.format(ns=ns, allowed=allowed)))
    res = runner.invoke(cli.app, ["trace", f"{tmp_path / 'hungry.py'}:f", "--input", "3x8", "--device", "cpu",
                                  *flags])
    assert res.exit_code == 3, res.output
    text = " ".join(res.output.split())
    assert needle in text and "free on this host now" in text and "smaller input" in text
    assert "Traceback" not in text and "cannot trace" not in text


def test_outputs_compare_chunk_by_chunk_as_a_whole(monkeypatch):
    """compare_outputs' float64 work runs over bounded chunks and gives the whole-tensor answer."""
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(1000, 37, generator=gen).to(torch.bfloat16)
    got = (ref.float() + 1e-3 * torch.randn(1000, 37, generator=gen)).to(torch.bfloat16)
    got[3, 5] = float("inf")
    ref[3, 5] = float("inf")
    whole = tracecmd.compare_outputs(ref, got)
    monkeypatch.setattr(tracecmd, "VERIFY_CHUNK", 999)  # 38 chunks, the last one partial
    chunked = tracecmd.compare_outputs(ref, got)
    assert chunked["ok"] == whole["ok"] and chunked["max_abs_error"] == whole["max_abs_error"]
    assert chunked["rel_error"] == pytest.approx(whole["rel_error"], rel=1e-12) and whole["rel_error"] > 0
    r64, g64 = ref.double(), got.double()
    fin = torch.isfinite(r64)
    expect = float((g64[fin] - r64[fin]).norm() / r64[fin].norm())
    assert whole["rel_error"] == pytest.approx(expect, rel=1e-12)
    got[0, 0] = float("nan")  # finite in eager, not in forge's output: never ok, in any chunking
    assert not tracecmd.compare_outputs(ref, got)["ok"]
