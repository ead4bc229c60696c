"""The TOML manifest: parsing, precedence, errors that name file/entry/field, sharding, the batch
`forge search --manifest` run (idempotent reruns, failing entries named), and a hypothesis fuzz of
the parser (it raises ManifestError or returns jobs, never anything else)."""

from __future__ import annotations

import json
import string
from pathlib import Path

import pytest
import tomli_w
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from forge.errors import UsageError
from forge.tuner.manifest import Job, ManifestError, load, parse_shard, shard
from forge_cli import cli
from tests.conftest import ROOT

runner = CliRunner()


def write(tmp_path: Path, doc: dict | str, name: str = "forge.toml") -> Path:
    p = tmp_path / name
    p.write_text(doc if isinstance(doc, str) else tomli_w.dumps(doc))
    return p


def test_example_manifest_parses(tmp_path):
    m = load(ROOT / "forge.toml.example", env={})
    labels = [j.label for j in m.jobs]
    assert labels == ["rmsnorm 2048x4096 float16 eps=1e-06", "rmsnorm 2048x4096 bfloat16 eps=1e-06",
                      "rmsnorm 8192x8192 float16 eps=1e-06", "rmsnorm 8192x8192 bfloat16 eps=1e-06",
                      "softmax 32768x4096 bfloat16 dim=-1"]
    assert [j.budget for j in m.jobs] == [50, 50, 50, 50, 80]
    assert m.device == "cuda" and m.jobs[0].timeout == 120.0


def test_precedence_cli_over_env_over_entry_over_defaults_over_builtin(tmp_path):
    doc = {"defaults": {"budget": 20, "seed": 3},
           "op": [{"op": "softmax", "shape": "4x8", "budget": 10}, {"op": "softmax", "shape": "5x8"}]}
    p = write(tmp_path, doc)
    m = load(p, env={})
    assert [j.budget for j in m.jobs] == [10, 20]  # entry > [defaults]
    assert [j.seed for j in m.jobs] == [3, 3] and m.jobs[0].strategy == "grid"  # built-in
    m = load(p, env={"FORGE_BUDGET": "7"})
    assert [j.budget for j in m.jobs] == [7, 7]  # environment > entry
    m = load(p, cli={"budget": 5}, env={"FORGE_BUDGET": "7"})
    assert [j.budget for j in m.jobs] == [5, 5]  # command line > environment
    m = load(p, env={"FORGE_BUDGET": ""})
    assert [j.budget for j in m.jobs] == [10, 20]  # empty variable = unset


def test_dtype_override_collapses_an_entry_dtype_list(tmp_path):
    p = write(tmp_path, {"op": [{"op": "softmax", "shape": "4x8", "dtypes": ["float16", "bfloat16"]}]})
    assert [j.dtype for j in load(p, env={}).jobs] == ["float16", "bfloat16"]
    assert [j.dtype for j in load(p, env={"FORGE_DTYPE": "float32"}).jobs] == ["float32"]


def test_cache_path_is_relative_to_the_manifest(tmp_path):
    p = write(tmp_path, {"defaults": {"cache": "sub/f.db"}, "op": [{"op": "softmax", "shape": "4x8"}]})
    assert load(p, env={}).cache == tmp_path / "sub" / "f.db"
    assert load(p, env={"FORGE_CACHE_DIR": "/x"}).cache is None  # the environment wins
    assert load(p, cli={"cache": Path("/y.db")}, env={}).cache == Path("/y.db")


@pytest.mark.parametrize(("doc", "needle"), [
    ({"op": [{"op": "nosuch", "shape": "4x8"}]}, "[[op]] #1 (nosuch): field 'op': unknown op 'nosuch'"),
    ({"op": [{"op": "softmax", "shape": "4xq"}]}, "[[op]] #1 (softmax): field 'shape'"),
    ({"op": [{"op": "softmax", "shapes": ["4x8", [4, 0]]}]}, "field 'shapes': [4, 0] is not a shape"),
    ({"op": [{"op": "softmax", "shape": "4x8", "dtype": "float8"}]},
     "field 'dtype': unknown dtype 'float8'; expected one of"),
    ({"op": [{"op": "softmax", "shape": "4x8", "budget": "10"}]}, "field 'budget': expected an integer >= 1"),
    ({"op": [{"op": "softmax", "shape": "4x8", "budget": True}]}, "field 'budget'"),
    ({"op": [{"op": "softmax", "shape": "4x8", "timeout": -1}]}, "field 'timeout'"),
    ({"op": [{"op": "softmax", "shape": "4x8"}, {"op": "softmax", "shapes": ["2x2", "4x8"]}]},
     "[[op]] #2 (softmax): duplicate of [[op]] #1: softmax 4x8 float16"),
    ({"op": [{"op": "softmax", "shape": "4x8", "colour": 1}]}, "unknown field(s) 'colour'"),
    ({"op": [{"op": "rmsnorm", "shape": "4x8", "eps": [1]}]}, "field 'eps': an attribute must be"),
    ({"op": [{"op": "softmax", "shape": "4x8", "dim": 0}]}, "shape 4x8 float16: softmax kernels reduce"),
    ({"op": [{"op": "softmax", "shape": "4x8", "device": "cpu"}]}, "field 'device' is run-wide"),
    ({"op": [{"op": "softmax"}]}, "give exactly one of 'shape' or 'shapes'"),
    ({"op": [{"op": "softmax", "shapes": []}]}, "expected a non-empty list"),
    ({"op": [{"shape": "4x8"}]}, "[[op]] #1: field 'op': expected an op name"),
    ({"defaults": {"budget": 0}, "op": [{"op": "softmax", "shape": "4x8"}]}, "[defaults]: field 'budget'"),
    ({"defaults": {"colour": 1}, "op": [{"op": "softmax", "shape": "4x8"}]}, "[defaults]: unknown field"),
    ({"ops": [{"op": "softmax", "shape": "4x8"}]}, "unknown top-level key(s) 'ops'"),
    ({"defaults": {"device": "cpu"}}, "no [[op]] entries"),
    ("[[op]]\nop = 'softmax'\nshape = \n", "invalid TOML"),
    ("defaults = 3\n[[op]]\nop='softmax'\nshape='4x8'\n", "'defaults' must be a table"),
    ("op = 'softmax'\n", "'op' must be an array of tables"),
])
def test_errors_name_the_file_entry_and_field(tmp_path, doc, needle):
    p = write(tmp_path, doc)
    with pytest.raises(ManifestError) as exc:
        load(p, env={})
    assert str(exc.value).startswith(str(p)) and needle in str(exc.value), str(exc.value)


def test_unreadable_files_and_bad_environment(tmp_path):
    with pytest.raises(ManifestError, match="cannot read"):
        load(tmp_path / "missing.toml", env={})
    p = tmp_path / "bin.toml"
    p.write_bytes(b"\xff\xfe[[op]]")
    with pytest.raises(ManifestError, match="not UTF-8"):
        load(p, env={})
    ok = write(tmp_path, {"op": [{"op": "softmax", "shape": "4x8"}]})
    with pytest.raises(UsageError, match="FORGE_BUDGET='many': expected an integer"):
        load(ok, env={"FORGE_BUDGET": "many"})
    with pytest.raises(UsageError, match="FORGE_DEVICE"):
        load(ok, env={"FORGE_DEVICE": "tpu"})


def _jobs(n: int) -> list[Job]:
    return [Job("softmax", (i + 1, 8), "float16", {"dim": -1}, 1, "grid", 0, 1.0, i + 1) for i in range(n)]


@pytest.mark.parametrize("n_jobs", [0, 1, 5, 13])
@pytest.mark.parametrize("n_shards", [1, 2, 4, 7])
def test_shards_partition_the_jobs_evenly_and_independently_of_order(n_jobs, n_shards):
    jobs = _jobs(n_jobs)
    parts = [shard(jobs, i, n_shards) for i in range(n_shards)]
    flat = [j for p in parts for j in p]
    assert sorted(j.identity for j in flat) == sorted(j.identity for j in jobs)
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    assert [shard(list(reversed(jobs)), i, n_shards) for i in range(n_shards)] == parts


@pytest.mark.parametrize("text", ["", "1", "1/0", "4/4", "-1/4", "a/b", "1/2/3"])
def test_bad_shard_specs(text):
    with pytest.raises(UsageError):
        parse_shard(text)
    assert parse_shard("3/4") == (3, 4)


# --- fuzzing: whatever the bytes, load() returns a manifest or raises ManifestError ---------------
FIELDS = ["op", "shape", "shapes", "dtype", "dtypes", "budget", "strategy", "seed", "timeout", "eps", "dim",
          "device", "workers", "cache", "bogus"]
values = st.one_of(st.none(), st.booleans(), st.integers(-3, 70000), st.floats(allow_nan=True),
                   st.sampled_from(["rmsnorm", "softmax", "4x8", "3x7x5", "0x4", "float16", "bfloat16", "grid",
                                    "random", "cpu", "cuda", "x", ""]),
                   st.lists(st.sampled_from(["4x8", "2x3", "9", "float32", "float16"]), max_size=3),
                   st.lists(st.integers(-1, 9), max_size=3))
entry = st.dictionaries(st.sampled_from(FIELDS), values, max_size=6)
doc = st.fixed_dictionaries({}, optional={"defaults": st.dictionaries(st.sampled_from(FIELDS), values, max_size=4),
                                          "op": st.lists(entry, max_size=4)})


def _dumpable(d):
    if d is None:
        return "none"
    if isinstance(d, dict):
        return {k: _dumpable(v) for k, v in d.items() if v is not None}
    if isinstance(d, list):
        return [_dumpable(v) for v in d]
    return d


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc)
def test_fuzz_structured_documents(tmp_path, d):
    p = write(tmp_path, tomli_w.dumps(_dumpable(d)))
    try:
        m = load(p, env={})
    except ManifestError as exc:
        assert str(exc).startswith(str(p))
        return
    assert m.jobs and all(j.op in ("rmsnorm", "softmax") for j in m.jobs)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(alphabet=string.printable + "é\x00", max_size=200) | st.binary(max_size=200).map(
    lambda b: b.decode("latin-1")))
def test_fuzz_arbitrary_text(tmp_path, text):
    p = tmp_path / "fuzz.toml"
    p.write_bytes(text.encode("utf-8", "surrogatepass"))
    try:
        load(p, env={})
    except ManifestError:
        pass


# --- the CLI ---------------------------------------------------------------------------------------
def test_cli_bad_manifest_is_exit_2_without_traceback(tmp_path):
    p = write(tmp_path, {"op": [{"op": "softmax", "shape": "4x8", "budget": "ten"}]})
    res = runner.invoke(cli.app, ["search", "--manifest", str(p)])
    assert res.exit_code == 2
    assert "field 'budget'" in res.output and "Traceback" not in res.output
    res = runner.invoke(cli.app, ["search", "softmax", "--manifest", str(p)])
    assert res.exit_code == 2 and "replaces OP" in res.output
    res = runner.invoke(cli.app, ["search", "softmax", "--shape", "4x8", "--shard", "0/2"])
    assert res.exit_code == 2 and "--shard needs --manifest" in res.output
    res = runner.invoke(cli.app, ["search", "--manifest", str(p), "--budget", "0"])
    assert res.exit_code == 2 and "--budget" in res.output


@pytest.mark.slow
def test_cli_manifest_run_is_idempotent_and_shardable(tmp_path, monkeypatch):
    monkeypatch.delenv("FORGE_CACHE_DIR")  # else it would win over the manifest's cache
    p = write(tmp_path, {"defaults": {"device": "cpu", "budget": 1, "workers": 1, "cache": "f.db"},
                         "op": [{"op": "softmax", "shapes": ["3x7", "2x9"]}, {"op": "rmsnorm", "shape": "2x5"}]})
    first = runner.invoke(cli.app, ["search", "--manifest", str(p), "--json"])
    assert first.exit_code == 0, first.output
    rep = json.loads(first.stdout)
    assert rep["jobs"] == 3 and rep["failed"] == 0 and rep["cache"] == str(tmp_path / "f.db")
    assert {e["status"] for e in rep["entries"]} == {"searched"}
    assert all(e["decision"] in ("kernel", "eager") and e["key"] for e in rep["entries"])
    again = json.loads(runner.invoke(cli.app, ["search", "--manifest", str(p), "--json"]).stdout)
    assert {e["status"] for e in again["entries"]} == {"cached"}
    assert [e["key"] for e in again["entries"]] == [e["key"] for e in rep["entries"]]
    halves = [json.loads(runner.invoke(cli.app, ["search", "--manifest", str(p), "--json", "--shard", f"{i}/2"])
                         .stdout) for i in range(2)]
    assert sorted(e["key"] for h in halves for e in h["entries"]) == sorted(e["key"] for e in rep["entries"])
    table = runner.invoke(cli.app, ["search", "--manifest", str(p)])
    assert table.exit_code == 0 and "cached" in table.stdout and "softmax" in table.stdout


def test_cli_failing_entries_are_named_and_exit_nonzero(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA (every --device cuda entry then fails)")
    p = write(tmp_path, {"defaults": {"device": "cuda"}, "op": [{"op": "softmax", "shapes": ["3x7", "2x9"]}]})
    res = runner.invoke(cli.app, ["search", "--manifest", str(p), "--json"])
    assert res.exit_code == 3
    rep = json.loads(res.stdout)
    assert rep["failed"] == 2 and all("no CUDA GPU" in e["error"] for e in rep["entries"])
    res = runner.invoke(cli.app, ["search", "--manifest", str(p)])
    assert res.exit_code == 3 and "failed: [[op]] #1 softmax 3x7 float16" in res.output
