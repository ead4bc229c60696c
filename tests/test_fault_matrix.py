"""Faults a demanding user meets (issue 12): a killed parent leaves no worker or log directory behind,
the worker count is bounded by the machine, and bad shapes, attributes and lock directories are usage
errors (exit 2) named as such, never internal errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from forge.cache import Cache
from forge.errors import ExitCode, UsageError
from forge.tuner import engine, pool
from tests.conftest import FAULT_OPS, ROOT

# A parent that starts one worker and hands it a candidate that never returns.
_PARENT = textwrap.dedent("""
    import sys
    from forge import codegen, ops
    from forge.loader import write_source
    from forge.opkit import Candidate
    from forge.tuner.pool import Pool

    op = ops.get("faulty")
    spec = op.module.make_spec((2, 8), "float32", "cpu")
    path = str(write_source(codegen.render(op, spec, Candidate.make("hang", num_warps=1)), sys.argv[1]))
    with Pool("interpreter", 1, {"cmd": "setup", "op": "faulty", "spec": spec.to_dict(), "seed": 0}) as p:
        print("worker", p.workers[0].proc.pid, flush=True)
        p.map([("hang", {"cmd": "validate", "path": path})], timeout=600)
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_killed_parent_leaves_no_worker_and_no_files(tmp_path, sig):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "FORGE_OPS_PATH": str(FAULT_OPS), "TMPDIR": str(tmp), "TRITON_INTERPRET": "1",
           "PYTHONPATH": str(ROOT)}
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, str(tmp_path / "src")], stdout=subprocess.PIPE,
                              text=True, env=env, cwd=tmp_path)
    try:
        line = parent.stdout.readline()
        assert line.startswith("worker "), line
        worker = int(line.split()[1])
        time.sleep(3.0)  # the worker is inside the hanging candidate now
        assert _alive(worker)
        parent.send_signal(sig)
        parent.wait(30)
        deadline = time.monotonic() + 20
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(worker), f"worker {worker} outlived its parent killed by {sig.name}"
        assert [p.name for p in tmp.iterdir() if p.name.startswith("forge")] == []
    finally:
        if parent.poll() is None:
            parent.kill()


def test_a_worker_whose_parent_is_gone_exits_at_once(tmp_path):
    """Between fork and PR_SET_PDEATHSIG the parent may already have died: the worker checks."""
    env = {**os.environ, "FORGE_WORKER_PARENT": "1", "PYTHONPATH": str(ROOT)}
    code = "from forge.tuner.worker import die_with_parent; die_with_parent(); print('still here')"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "still here" not in out.stdout


def test_the_worker_count_is_capped_by_cores_and_memory(monkeypatch):
    cores = os.cpu_count() or 1
    monkeypatch.setattr(pool, "_available_host_memory", lambda: 64 * 2**30)
    assert pool.capped_size(1, "interpreter") == (1, None)
    size, why = pool.capped_size(100_000, "interpreter")
    assert size == min(cores, 64) and why.startswith("100000 workers requested; starting")
    assert "CPU core" in why
    monkeypatch.setattr(pool, "_available_host_memory", lambda: int(1.5 * 2**30))
    size, why = pool.capped_size(cores + 10, "cuda")
    assert size == 1 and "1.5 GiB of available host memory at 1 GiB per worker" in why
    monkeypatch.setattr(pool, "_available_host_memory", lambda: 2**20)  # never below one worker
    assert pool.capped_size(4, "interpreter")[0] == 1


class _Stop(Exception):
    pass


def test_a_capped_request_is_announced_before_any_worker_starts(tmp_path, monkeypatch):
    def no_pool(*a, **k):
        raise _Stop

    monkeypatch.setattr(engine, "Pool", no_pool)
    monkeypatch.setattr(engine, "_announced", set())
    events = []
    opts = engine.SearchOptions(budget=1, workers=100_000)
    with pytest.raises(_Stop):
        engine.search("softmax", (2, 8), "float32", device="cpu", cache=Cache(tmp_path / "f.db"), options=opts,
                      events=lambda kind, **d: events.append((kind, d)))
    assert events[0][0] == "workers-capped" and "100000 workers requested" in events[0][1]["message"]
    assert events[1][0] == "start" and events[1][1]["workers"] <= (os.cpu_count() or 1)
    events.clear()
    with pytest.raises(_Stop):  # announced once per process, not once per manifest entry
        engine.search("softmax", (2, 8), "float32", device="cpu", cache=Cache(tmp_path / "f.db"), options=opts,
                      events=lambda kind, **d: events.append((kind, d)))
    assert [k for k, _ in events] == ["start"]


@pytest.mark.parametrize(("shape", "needle"), [
    ((1_000_000_000, 1_000_000_000), "more than this host's memory"),
    ((99999999999999999999, 4), "beyond 64-bit indexing"),
    ((4, 9223372036854775807), "beyond 64-bit indexing"),
])
def test_shapes_too_big_to_try_are_usage_errors_before_any_worker(tmp_path, monkeypatch, shape, needle):
    monkeypatch.setattr(engine, "Pool", lambda *a, **k: pytest.fail("a worker pool was started"))
    with pytest.raises(UsageError, match=needle) as exc:
        engine.search("rmsnorm", shape, "float32", device="cpu", cache=Cache(tmp_path / "f.db"))
    assert exc.value.exit_code == ExitCode.USAGE


@pytest.mark.parametrize(("value", "needle"), [
    (float("nan"), "eps=nan is not a finite number"), (float("inf"), "eps=inf is not a finite number"),
    ([1], "eps=[1] is not a plain number"), ({"a": 1}, "is not a plain number"),
])
def test_non_finite_and_non_scalar_attributes_are_usage_errors(tmp_path, value, needle):
    with pytest.raises(UsageError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        engine.search("rmsnorm", (4, 8), "float32", device="cpu", cache=Cache(tmp_path / "f.db"),
                      attrs={"eps": value})


def test_a_long_bad_value_is_cut_in_the_message(tmp_path):
    with pytest.raises(UsageError) as exc:
        engine.search("rmsnorm", (4, 8), "float32", device="cpu", cache=Cache(tmp_path / "f.db"),
                      attrs={"eps": "x" * 10_000_000})
    assert len(str(exc.value)) < 400


def test_a_lock_dir_that_is_a_file_is_a_usage_error(tmp_path, monkeypatch):
    monkeypatch.setenv("FORGE_LOCK_DIR", os.devnull)
    with pytest.raises(UsageError, match="FORGE_LOCK_DIR") as exc:
        engine.search("softmax", (2, 8), "float32", device="cpu", cache=Cache(tmp_path / "f.db"))
    assert exc.value.exit_code == ExitCode.USAGE and Path(os.devnull).exists()


def test_the_signature_tells_a_meta_tensor_from_a_cpu_tensor():
    import torch

    from forge import shim

    cpu, meta = torch.empty(4, 8), torch.empty(4, 8, device="meta")
    assert (cpu.get_device(), cpu.is_cuda) == (meta.get_device(), meta.is_cuda)  # what the key had before
    assert shim._tensor_sig(cpu) != shim._tensor_sig(meta)
    assert shim._signature((cpu,), {}) != shim._signature((meta,), {})


def test_a_large_manifest_loads_in_seconds_and_a_huge_value_is_cut(tmp_path):
    from forge.tuner import manifest

    n = 100_000
    body = "".join(f'[[op]]\nop = "softmax"\nshape = [{1 + i // 1000}, {8 + i % 1000}]\ndtype = "float32"\n'
                   for i in range(n))
    path = tmp_path / "big.toml"
    path.write_text(body + '[[op]]\nop = "softmax"\nshape = [100, 1007]\ndtype = "float32"\n')  # the last: a duplicate
    t0 = time.monotonic()
    with pytest.raises(manifest.ManifestError, match=rf"#{n + 1} \(softmax\): duplicate of \[\[op\]\] #{n}"):
        manifest.load(path)
    assert time.monotonic() - t0 < 60  # was 220 s for 166,053 entries (an op lookup per entry)
    path.write_text(body[: body.index("[[op]]", 1000)])
    assert len(manifest.load(path).jobs) > 10
    huge = "x" * 10_000_000
    path.write_text(f'[[op]]\nop = "{huge}"\nshape = "4x8"\n')
    with pytest.raises(manifest.ManifestError) as exc:
        manifest.load(path)
    assert len(str(exc.value)) < 1000 and "unknown op" in str(exc.value)


def test_a_manifest_attribute_that_is_not_finite_is_named(tmp_path):
    from forge.tuner import manifest

    path = tmp_path / "m.toml"
    path.write_text('[[op]]\nop = "rmsnorm"\nshape = "4x8"\neps = nan\n')
    with pytest.raises(manifest.ManifestError, match="field 'eps': attribute eps=nan is not a finite number"):
        manifest.load(path)


def test_the_cli_names_bad_input_with_exit_2(tmp_path):
    from typer.testing import CliRunner

    from forge_cli import cli

    runner = CliRunner()
    base = ["search", "rmsnorm", "--device", "cpu", "--cache", str(tmp_path / "f.db")]
    for attr in ("eps=NaN", "eps=Infinity", "eps=1e400", "eps=[1]"):
        res = runner.invoke(cli.app, [*base, "--shape", "4x8", "--attr", attr])
        assert res.exit_code == 2 and "eps=" in res.output, (attr, res.output)
    res = runner.invoke(cli.app, [*base, "--shape", "99999999999999999999x4"])
    assert res.exit_code == 2 and "64-bit indexing" in res.output, res.output
    res = runner.invoke(cli.app, ["cache", "ls", "--cache", str(tmp_path / "typo" / "forge.db")])
    assert res.exit_code == 0 and not (tmp_path / "typo").exists()


def test_a_long_error_message_is_not_wrapped_on_stderr(tmp_path):
    deep = tmp_path / ("d" * 120) / ("e" * 120)
    deep.mkdir(parents=True)
    bad = deep / "forge.db"
    bad.write_bytes(b"this is not a database" * 100)
    out = subprocess.run([sys.executable, "-m", "forge", "cache", "ls", "--cache", str(bad)], capture_output=True,
                         text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert out.returncode == 5
    advice = [line for line in out.stderr.splitlines() if "mv " in line]
    assert len(advice) == 1 and f"{bad}.bak" in advice[0], out.stderr  # the command on one line, whole


def test_an_eager_baseline_out_of_memory_is_exit_3_with_the_footprint(tmp_path, fault_ops):
    from typer.testing import CliRunner

    from forge_cli import cli

    res = CliRunner().invoke(cli.app, ["search", "hungry", "--shape", "4x8", "--dtype", "float32", "--device", "cpu",
                                       "--budget", "1", "--workers", "1", "--cache", str(tmp_path / "f.db")])
    assert res.exit_code == ExitCode.ENVIRONMENT, res.output
    text = " ".join(res.output.split())
    assert "ran out of memory" in text and "its inputs take" in text and "fewer --workers" in text
