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
from forge.tuner import strategy
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
    assert [j.seed for j in m.jobs] == [3, 3] and m.jobs[0].strategy == strategy.DEFAULT == "evolve"  # built-in
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
          "device", "workers", "cache", "share", "time_budget", "bogus"]
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


# --- share and time_budget (issue 13: profile, prioritise) -----------------------------------------
def test_share_is_kept_on_each_job_split_over_the_entry(tmp_path):
    p = write(tmp_path, {"op": [{"op": "softmax", "shape": "4x8", "share": 0.5},
                                {"op": "rmsnorm", "shapes": ["4x8", "2x8"], "dtypes": ["float16", "float32"],
                                 "share": 0.2},
                                {"op": "softmax", "shape": "2x8", "share": 0},
                                {"op": "softmax", "shape": "3x8"}]})
    m = load(p, env={})
    assert [(j.label, j.share) for j in m.jobs] == [
        ("softmax 4x8 float16 dim=-1", 0.5),
        ("rmsnorm 4x8 float16 eps=1e-06", pytest.approx(0.05)), ("rmsnorm 4x8 float32 eps=1e-06", pytest.approx(0.05)),
        ("rmsnorm 2x8 float16 eps=1e-06", pytest.approx(0.05)), ("rmsnorm 2x8 float32 eps=1e-06", pytest.approx(0.05)),
        ("softmax 2x8 float16 dim=-1", 0.0), ("softmax 3x8 float16 dim=-1", None)]
    # A --dtype override collapses the dtype list: the entry's share is split over what is left.
    m = load(p, cli={"dtype": "float32"}, env={})
    assert [j.share for j in m.jobs if j.op == "rmsnorm"] == [pytest.approx(0.1)] * 2


@pytest.mark.parametrize(("doc", "needle"), [
    ({"op": [{"op": "softmax", "shape": "4x8", "share": 1.5}]},
     "[[op]] #1 (softmax): field 'share': expected a fraction of the model's time, a number from 0 to 1, got 1.5"),
    ({"op": [{"op": "softmax", "shape": "4x8", "share": -0.1}]}, "[[op]] #1 (softmax): field 'share'"),
    ({"op": [{"op": "softmax", "shape": "4x8", "share": "30%"}]}, "field 'share': expected a fraction"),
    ({"op": [{"op": "softmax", "shape": "4x8", "share": True}]}, "field 'share': expected a fraction"),
    ({"op": [{"op": "softmax", "shape": "4x8", "share": float("nan")}]}, "field 'share'"),
    ({"op": [{"op": "softmax", "shape": "4x8"}, {"op": "rmsnorm", "shape": "4x8", "share": [0.1]}]},
     "[[op]] #2 (rmsnorm): field 'share'"),
    ({"op": [{"op": "softmax", "shape": "4x8", "share": 0.7}, {"op": "rmsnorm", "shape": "4x8", "share": 0.6}]},
     "field 'share': the entries' shares add up to 1.3, more than 1"),
    ({"defaults": {"share": 0.5}, "op": [{"op": "softmax", "shape": "4x8"}]},
     "[defaults]: field 'share' belongs to an [[op]] entry"),
    ({"defaults": {"time_budget": -1}, "op": [{"op": "softmax", "shape": "4x8"}]},
     "[defaults]: field 'time_budget': expected a number of seconds >= 0, got -1"),
    ({"defaults": {"time_budget": "1h"}, "op": [{"op": "softmax", "shape": "4x8"}]}, "field 'time_budget'"),
    ({"op": [{"op": "softmax", "shape": "4x8", "time_budget": 60}]}, "field 'time_budget' is run-wide"),
])
def test_share_and_time_budget_errors_name_file_entry_and_field(tmp_path, doc, needle):
    p = write(tmp_path, doc)
    with pytest.raises(ManifestError) as exc:
        load(p, env={})
    assert str(exc.value).startswith(str(p)) and needle in str(exc.value), str(exc.value)


def test_time_budget_precedence_cli_env_defaults(tmp_path):
    p = write(tmp_path, {"defaults": {"time_budget": 60}, "op": [{"op": "softmax", "shape": "4x8"}]})
    assert load(p, env={}).time_budget == 60.0
    assert load(p, env={"FORGE_TIME_BUDGET": "30"}).time_budget == 30.0
    assert load(p, cli={"time_budget": 0.0}, env={"FORGE_TIME_BUDGET": "30"}).time_budget == 0.0
    assert load(write(tmp_path, {"op": [{"op": "softmax", "shape": "4x8"}]}, "b.toml"), env={}).time_budget is None
    with pytest.raises(UsageError, match="FORGE_TIME_BUDGET='soon': expected a number"):
        load(p, env={"FORGE_TIME_BUDGET": "soon"})
    with pytest.raises(UsageError, match="FORGE_TIME_BUDGET.*>= 0"):
        load(p, env={"FORGE_TIME_BUDGET": "-5"})


def test_jobs_run_by_share_largest_first_then_the_rest_in_file_order():
    from forge.tuner import batch

    def job(n, share):
        return Job("softmax", (n, 8), "float16", {"dim": -1}, 1, "grid", 0, 1.0, n, share)

    jobs = [job(1, None), job(2, 0.1), job(3, 0.5), job(4, None), job(5, 0.1), job(6, 0.3)]
    assert [j.entry for j in batch.by_share(jobs)] == [3, 6, 2, 5, 1, 4]


def test_estimated_speedup_is_amdahl_over_the_shares():
    from forge.tuner import batch

    assert batch.estimated_speedup([(None, 2.0)]) is None
    assert batch.estimated_speedup([(0.5, 2.0)]) == pytest.approx(1 / (0.5 + 0.25))
    assert batch.estimated_speedup([(0.5, 2.0), (0.3, 1.0), (0.2, 4.0)]) == pytest.approx(1 / (0.25 + 0.3 + 0.05))
    # eager decisions, failures, skipped and not yet run jobs count speedup 1
    res = [batch.JobResult(1, "softmax", "4x8", "float16", {}, "searched", decision="kernel", speedup=3.0),
           batch.JobResult(2, "softmax", "5x8", "float16", {}, "searched", decision="eager", speedup=None),
           batch.JobResult(3, "softmax", "6x8", "float16", {}, "skipped")]
    jobs = [Job("softmax", (n, 8), "float16", {}, 1, "grid", 0, 1.0, n, 0.2) for n in (4, 5, 6, 7)]
    assert batch.run_estimate(jobs, res) == pytest.approx(1 / (0.2 + 0.2 / 3 + 0.2 + 0.2 + 0.2))
    assert batch.run_estimate(jobs, {0: res[0]}) == pytest.approx(1 / (0.2 + 0.2 / 3 + 0.6))


def test_cli_bad_time_budget_is_exit_2(tmp_path):
    p = write(tmp_path, {"op": [{"op": "softmax", "shape": "4x8", "share": 2}]})
    res = runner.invoke(cli.app, ["search", "--manifest", str(p)])
    assert res.exit_code == 2 and "field 'share'" in res.output and "Traceback" not in res.output
    p = write(tmp_path, {"op": [{"op": "softmax", "shape": "4x8"}]})
    res = runner.invoke(cli.app, ["search", "--manifest", str(p), "--time-budget", "-1"])
    assert res.exit_code == 2 and "--time-budget: expected a number of seconds >= 0" in res.output


def test_cli_time_budget_spent_skips_every_job_and_exits_0(tmp_path):
    p = write(tmp_path, {"defaults": {"device": "cpu", "budget": 1, "workers": 1},
                         "op": [{"op": "softmax", "shape": "3x7", "share": 0.25},
                                {"op": "rmsnorm", "shape": "2x5", "share": 0.5}, {"op": "softmax", "shape": "2x9"}]})
    res = runner.invoke(cli.app, ["search", "--manifest", str(p), "--json", "--time-budget", "0"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep["time_budget_s"] == 0.0 and rep["skipped"] == 3 and rep["failed"] == 0
    assert [(e["op"], e["shape"], e["status"], e["note"], e["share"]) for e in rep["entries"]] == [
        ("rmsnorm", "2x5", "skipped", "time budget", 0.5), ("softmax", "3x7", "skipped", "time budget", 0.25),
        ("softmax", "2x9", "skipped", "time budget", None)]
    assert rep["covered_share"] == 0.75 and rep["estimated_speedup"] == 1.0
    res = runner.invoke(cli.app, ["search", "--manifest", str(p)], env={"FORGE_TIME_BUDGET": "0"})
    assert res.exit_code == 0, res.output
    assert res.stdout.count("skipped: time budget") == 3, res.stdout
    assert "3 job(s) not started" in res.output and "estimated end-to-end speedup" in res.stdout


def test_every_attribute_a_spec_carries_round_trips_through_a_manifest(tmp_path):
    """What `forge trace --write-manifest` writes (a spec's attrs: defaults, optional ones such as form,
    dims, dim, input_shapes, scale, and the layout) a manifest reads back to the same spec, for every
    built-in op and every attribute set the golden tests use. An attribute missing from an op's
    DEFAULT_ATTRS / OPTIONAL_ATTRS would make the manifest refuse the entry."""
    from forge import ops
    from forge.spec import DTYPES
    from forge.tuner import manifest
    from tests import test_golden as g

    seen = 0
    for op_name, shape, dtype, attrs, _backend in g._key_cases():
        if dtype != DTYPES[0] or _backend != "interpreter":
            continue
        mod = ops.get(op_name).module
        try:
            spec = mod.make_spec(tuple(shape), dtype, "cpu", dict(attrs))
        except ValueError:
            continue  # a refused spec (part of the golden record) has nothing to write
        shape_text = "x".join(map(str, mod.problem_shape(spec) if hasattr(mod, "problem_shape") else shape))
        path = tmp_path / f"{seen}.toml"
        path.write_text(manifest.dumps([{"op": op_name, "shapes": [shape_text], "dtype": dtype,
                                         **{k: v for k, v in spec.attrs.items() if v is not None}}],
                                       {"device": "cpu"}))
        (job,) = manifest.load(path).jobs
        again = mod.make_spec(job.shape, job.dtype, "cpu", job.attrs)
        assert again == spec, (op_name, shape, attrs)
        seen += 1
    assert seen > 50
