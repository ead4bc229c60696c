"""End-to-end `forge search` on the Triton interpreter: through Typer's runner (in-process) and as a
real subprocess; cache round trip; a cache hit does no work; exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from forge import ops
from forge.cache import Cache
from forge.loader import load_module, write_source
from forge.tuner import engine, pool
from forge_cli import cli
from tests.conftest import HAS_CUDA, ROOT

pytestmark = pytest.mark.slow
runner = CliRunner()


def _search_json(*args: str) -> tuple[int, dict | None, str]:
    res = runner.invoke(cli.app, ["search", *args, "--json", "--device", "cpu"])
    data = json.loads(res.stdout) if res.exit_code in (0, 4) and res.stdout.strip() else None
    return res.exit_code, data, res.output


@pytest.mark.parametrize("op,shape,dtype", [("rmsnorm", "33x300", "float16"), ("softmax", "5x1000", "bfloat16")])
def test_search_in_process_then_cache_hit_does_no_work(op, shape, dtype, monkeypatch, tmp_path):
    code, rep, out = _search_json(op, "--shape", shape, "--dtype", dtype, "--budget", "6")
    assert code == 0, out
    assert rep["backend"] == "interpreter" and rep["timing_clock"].startswith("host")
    assert rep["cache_hit"] is False and rep["decision"] in ("kernel", "eager")
    assert len(rep["candidates"]) == 6
    assert all(c["status"] == "ok" for c in rep["candidates"]), rep["candidates"]
    assert rep["baseline"]["p20"] <= rep["baseline"]["p50"] <= rep["baseline"]["p80"]
    finals = [c for c in rep["candidates"] if c["final"]]
    assert 1 <= len(finals) <= 3
    assert set(rep["phases"]) == {"startup", "render", "validate", "time", "final"}

    # The stored entry holds what the issue lists, and its source matches its hash.
    entry = Cache(os.environ["FORGE_CACHE_DIR"] + "/forge.db").get(rep["key"])
    assert entry is not None and entry.decision == rep["decision"]
    assert entry.env["backend"] == "interpreter" and entry.template_hash == ops.get(op).template_hash
    assert len(entry.candidates) == 6 and entry.search_seconds > 0
    if entry.decision == "kernel" and not HAS_CUDA:  # in-process kernels run in the interpreter only
        import hashlib

        assert hashlib.sha256(entry.source.encode()).hexdigest() == entry.source_sha256
        # The cached source is a working kernel: load it and check it against the oracle.
        opmod = ops.get(op).module
        spec = opmod.make_spec(tuple(int(s) for s in shape.split("x")), dtype, "cpu")
        module = load_module(write_source(entry.source, tmp_path))
        from forge.tuner.validate import check_candidate

        assert check_candidate(opmod, module, spec, 123, lambda: None) is None

    # Second call: a cache hit, and no worker may be started.
    def no_pool(*a, **k):
        raise AssertionError("a cache hit must not start workers")

    monkeypatch.setattr(pool.Pool, "start", no_pool)
    code, hit, out = _search_json(op, "--shape", shape, "--dtype", dtype, "--budget", "6")
    assert code == 0, out
    assert hit["cache_hit"] is True and hit["key"] == rep["key"] and hit["decision"] == rep["decision"]
    assert hit["candidates"] == rep["candidates"]


def test_human_output_has_banner_table_decision_and_key():
    res = runner.invoke(cli.app, ["search", "softmax", "--shape", "4x70", "--dtype", "float32",
                                  "--budget", "3", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    assert "Triton interpreter on the CPU" in res.stdout
    assert "eager" in res.stdout and "(baseline)" in res.stdout
    assert "decision:" in res.stdout and "cache key:" in res.stdout
    again = runner.invoke(cli.app, ["search", "softmax", "--shape", "4x70", "--dtype", "float32",
                                    "--budget", "3", "--device", "cpu"])
    assert again.exit_code == 0 and "cache hit" in again.stdout


def test_force_searches_again_and_random_strategy_is_seeded():
    args = ["rmsnorm", "--shape", "3x40", "--dtype", "float32", "--budget", "3", "--strategy", "random"]
    code, a, out = _search_json(*args, "--seed", "1")
    assert code == 0, out
    code, b, out = _search_json(*args, "--seed", "1", "--force")
    assert code == 0, out
    assert b["cache_hit"] is False
    labels = lambda r: sorted(json.dumps([c["variant"], c["params"]]) for c in r["candidates"])  # noqa: E731
    assert labels(a) == labels(b)


def test_real_subprocess_json_stdout_is_only_json(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "forge_cli.cli", "search", "rmsnorm", "--shape", "1x7", "--dtype", "float32",
           "--budget", "2", "--device", "cpu", "--json", "--cache", str(tmp_path / "x.db")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)  # would fail on any stray print
    assert rep["spec"]["inputs"][0]["shape"] == [1, 7] and rep["cache"] == str(tmp_path / "x.db")
    proc2 = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc2.returncode == 0 and json.loads(proc2.stdout)["cache_hit"] is True


@pytest.mark.parametrize("args,code,needle", [
    (["search", "nosuchop", "--shape", "4x4", "--device", "cpu"], 2, "unknown op"),
    (["search", "rmsnorm", "--shape", "4xq", "--device", "cpu"], 2, "malformed shape"),
    (["search", "rmsnorm", "--shape", "0x4", "--device", "cpu"], 2, "malformed shape"),
    (["search", "rmsnorm", "--shape", "4x4", "--dtype", "int8", "--device", "cpu"], 2, "unknown dtype"),
    (["search", "rmsnorm", "--shape", "4x4", "--strategy", "anneal", "--device", "cpu"], 2, "unknown strategy"),
    (["search", "rmsnorm", "--shape", "4x4", "--budget", "0", "--device", "cpu"], 2, "budget"),
    (["search", "rmsnorm", "--shape", "4x4", "--attr", "alpha=1", "--device", "cpu"], 2, "attributes"),
    (["search", "softmax", "--shape", "4x4", "--attr", "dim=0", "--device", "cpu"], 2, "last dimension"),
    (["search", "rmsnorm", "--shape", "4x4", "--device", "tpu"], 2, "unknown device"),
])
def test_usage_errors_exit_2_with_a_message(args, code, needle):
    res = runner.invoke(cli.app, args)
    assert res.exit_code == code, res.output
    assert needle in res.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_device_cuda_without_gpu_is_an_environment_error():
    res = runner.invoke(cli.app, ["search", "rmsnorm", "--shape", "4x4", "--device", "cuda"])
    assert res.exit_code == 3
    assert "no CUDA GPU" in res.output


def test_every_candidate_failing_exits_4_and_caches_nothing(fault_ops):
    # Budget 5 of the faulty op in grid order without the good variant: force failures only.
    from forge.opkit import Candidate
    from forge.tuner import strategy

    bad = [Candidate.make(v, num_warps=1) for v in ("wrong", "nan", "raises")]

    class OnlyBad:
        def propose(self, space, history, n):
            return [c for c in bad if c not in history][:n]

    orig = strategy.make
    strategy.make = lambda *a, **k: OnlyBad()
    try:
        code, rep, out = _search_json("faulty", "--shape", "3x20", "--dtype", "float32", "--budget", "3")
    finally:
        strategy.make = orig
    assert code == 4, out
    assert rep["decision"] == "none" and {c["status"] for c in rep["candidates"]} == {"mismatch", "error"}
    assert Cache(os.environ["FORGE_CACHE_DIR"] + "/forge.db").entries() == []


def test_two_concurrent_searches_share_one_db(tmp_path):
    """Two real `forge search` processes on one DB and one device lock: both succeed, the second
    either searched after the first or found its decision (re-check after the lock)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    db = tmp_path / "shared.db"
    base = [sys.executable, "-m", "forge_cli.cli", "search", "--device", "cpu", "--json", "--budget", "2",
            "--cache", str(db), "--dtype", "float32", "--workers", "1"]
    procs = [subprocess.Popen(base[:4] + [op, "--shape", shape] + base[4:], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env)
             for op, shape in (("rmsnorm", "2x50"), ("softmax", "2x50"))]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    reps = [json.loads(o[0]) for o in outs]
    entries = Cache(db).entries()
    assert sorted(e.op for e in entries) == ["rmsnorm", "softmax"]
    assert {e.key for e in entries} == {r["key"] for r in reps}


def test_engine_rejects_unknown_op_before_any_work(tmp_path):
    with pytest.raises(engine.UsageError):
        engine.search("nope", (2, 2), "float32", device="cpu", cache=Cache(tmp_path / "c.db"))


def test_same_key_concurrently_is_searched_once(tmp_path):
    """Two processes asking for the same decision at once: the device lock serialises them and the
    second re-reads the cache after the lock, so exactly one of them searches."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "forge_cli.cli", "search", "softmax", "--shape", "3x33", "--device", "cpu",
           "--json", "--budget", "2", "--dtype", "float32", "--workers", "1", "--cache", str(tmp_path / "s.db")]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    reps = [json.loads(o[0]) for o in outs]
    assert sorted(r["cache_hit"] for r in reps) == [False, True]
    assert reps[0]["key"] == reps[1]["key"] and len(Cache(tmp_path / "s.db").entries()) == 1
