"""`forge bench` and `forge bench --recheck`: end to end on the Triton interpreter (cached kernels produced as
in tests/test_shim.py: a real search with stats.accepts forced True), plus the GPU tier."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import sqlite3
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from forge import ops
from forge.cache import Cache
from forge.loader import source_sha256
from forge.tuner import bench, engine, stats
from forge.tuner.bench import contestants as bench_contestants
from forge.tuner.bench import peaks as bench_peaks
from forge.tuner.validate import compare
from forge_cli import cli
from forge_cli.commands import bench as cmd_bench
from tests.conftest import HAS_CUDA

runner = CliRunner()
SHAPES = ((8, 64), (4, 96))  # two cached rmsnorm kernels (float16)
CPU = pytest.mark.skipif(HAS_CUDA, reason="exercises the interpreter path (CPU tensors)")


@pytest.fixture(scope="module")
def cached(tmp_path_factory) -> dict:
    """A cache holding two rmsnorm kernel entries, searched once for the module (budget 1, one worker)."""
    if HAS_CUDA:
        pytest.skip("the CPU tier benches interpreter entries")
    root = tmp_path_factory.mktemp("bench-cache")
    db = Cache(root / "forge.db")
    keys = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FORGE_LOCK_DIR", str(root / "locks"))
        mp.setattr(stats, "accepts", lambda *a, **k: True)  # on the interpreter eager always wins
        with engine.Pools() as pools:
            for shape in SHAPES:
                rep = engine.search("rmsnorm", shape, "float16", device="cpu", cache=db, pools=pools,
                                    options=engine.SearchOptions(budget=1, workers=1))
                assert rep.decision == "kernel"
                keys[shape] = rep.key
    entries = db.entries()
    db.close()
    return {"entries": entries, "keys": keys}


def _cache_copy(cached: dict, tmp_path: Path) -> Path:
    """A private copy of the module's cache (tests edit entries)."""
    path = tmp_path / "c" / "forge.db"
    db = Cache(path)
    for e in cached["entries"]:
        db.put(e)
    db.close()
    return path


def _bench(*args: str):
    return runner.invoke(cli.app, ["bench", *args, "--device", "cpu"])


def _flat(text: str) -> str:
    """Output with Rich's line wrapping undone."""
    return " ".join(text.split())


# -- end to end -----------------------------------------------------------------------------------------
@CPU
@pytest.mark.slow
def test_bench_json_and_csv_agree_and_peaks_are_cached(cached, tmp_path, monkeypatch):
    db = _cache_copy(cached, tmp_path)
    out_csv = tmp_path / "bench.csv"
    res = _bench("rmsnorm", "--shape", "8x64", "--cache", str(db), "--skip", "compile", "--json",
                 "--csv", str(out_csv))
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep["mode"] == "bench" and rep["backend"] == "interpreter" and rep["timing_clock"].startswith("host")
    assert rep["peaks"]["cached"] is False and Path(rep["peaks"]["path"]) == db.parent / "peaks.json"
    assert rep["peaks"]["copy_tbps"] > 0 and set(rep["peaks"]["matmul_tflops"]) == {"float16", "bfloat16", "float32"}
    (t,) = rep["targets"]
    assert t["key"] == cached["keys"][(8, 64)] and t["error"] is None and t["stored"]["decision"] == "kernel"
    assert t["bound"] == "memory" and t["bytes_moved"] == 2 * 8 * 64 * 2 + 64 * 2
    by = {c["name"]: c for c in t["contestants"]}
    assert list(by) == ["forge", "eager", "fused", "compile", "liger"]
    assert by["compile"]["status"] == "skipped" and by["compile"]["reason"] == "--skip compile"
    assert by["fused"]["label"] == "F.rms_norm"
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        assert by["liger"]["status"] == "skipped" and "not installed" in by["liger"]["reason"]
    eager = by["eager"]["quantiles"]
    for name in ("forge", "eager", "fused"):
        c = by[name]
        assert c["status"] == "ok" and c["clock"] == "host", c
        q = c["quantiles"]
        assert 0 < q["p20"] <= q["p50"] <= q["p80"] and q["n"] == engine.SAMPLING["interpreter"].final_rounds
        assert c["speedup"] == pytest.approx(eager["p50"] / q["p50"], rel=1e-12)
        assert c["pct_roofline"] > 0
        assert c["achieved_tbps"] == pytest.approx(t["bytes_moved"] / (q["p50"] * 1e-6) / 1e12)
    assert by["eager"]["speedup"] == 1.0
    assert t["fastest"] == min(("forge", "eager", "fused"), key=lambda n: by[n]["quantiles"]["p50"])

    # --csv: the same numbers, exactly (full float precision).
    rows = list(csv.DictReader(out_csv.open()))
    assert [r["contestant"] for r in rows] == list(by)
    for r in rows:
        c = by[r["contestant"]]
        assert r["status"] == c["status"] and r["key"] == t["key"]
        if c["quantiles"]:
            for col, want in (("p20_us", c["quantiles"]["p20"]), ("p50_us", c["quantiles"]["p50"]),
                              ("p80_us", c["quantiles"]["p80"]), ("speedup", c["speedup"]),
                              ("pct_roofline", c["pct_roofline"])):
                assert float(r[col]) == want, (r["contestant"], col)
        else:
            assert r["p50_us"] == "" and r["speedup"] == ""

    # Second run, human output: every contestant in the table, the peaks file reused (not re-measured).
    calls = []
    real = bench_peaks._measure_peaks
    monkeypatch.setattr(bench_peaks, "_measure_peaks", lambda backend: calls.append(backend) or real(backend))
    res = _bench("rmsnorm", "--shape", "8x64", "--cache", str(db), "--skip", "compile")
    assert res.exit_code == 0, res.output
    assert calls == []
    assert "Triton interpreter on the CPU" in res.stdout and "peaks (cached" in res.stdout
    for name in ("forge", "eager", "fused", "compile", "liger", "F.rms_norm", "--skip compile", "fastest:"):
        assert name in res.stdout, name


@CPU
def test_missing_entry_is_a_clear_usage_error(cached, tmp_path):
    db = _cache_copy(cached, tmp_path)
    res = _bench("rmsnorm", "--shape", "16x64", "--cache", str(db))
    assert res.exit_code == 2, res.output
    assert "no cached decision for rmsnorm 16x64 float16" in _flat(res.output)
    assert "run `forge search rmsnorm --shape 16x64 --dtype float16 --device cpu` first" in _flat(res.output)
    assert not (db.parent / "peaks.json").exists()  # nothing to bench: no measurement either


@CPU
@pytest.mark.slow
def test_manifest_benches_cached_entries_and_reports_missing_ones(cached, tmp_path):
    db = _cache_copy(cached, tmp_path)
    m = tmp_path / "forge.toml"
    m.write_text('[defaults]\ndtype = "float16"\n\n[[op]]\nop = "rmsnorm"\nshapes = ["4x96", "2x32"]\n')
    res = _bench("--manifest", str(m), "--cache", str(db), "--skip", "compile", "--skip", "forge", "--json")
    assert res.exit_code == 2, res.output  # one entry is not cached
    rep = json.loads(res.stdout)
    assert [t["shape"] for t in rep["targets"]] == ["4x96", "2x32"] and rep["missing"] == 1
    ok, missing = rep["targets"]
    assert ok["key"] == cached["keys"][(4, 96)] and ok["error"] is None
    assert {c["name"]: c["status"] for c in ok["contestants"]}["eager"] == "ok"
    assert "no cached decision for rmsnorm 2x32" in missing["error"] and missing["contestants"] == []


# -- recheck --------------------------------------------------------------------------------------------
def _edit(path: Path, key: str, **changes) -> None:
    db = Cache(path)
    e = db.get(key)
    db.put(dataclasses.replace(e, **changes))
    db.close()


@CPU
@pytest.mark.slow
def test_recheck_flags_drifted_and_refuses_edited_source(cached, tmp_path):
    db = _cache_copy(cached, tmp_path)
    drift_key, edited_key = cached["keys"][(8, 64)], cached["keys"][(4, 96)]
    e = next(e for e in cached["entries"] if e.key == drift_key)
    # The stored kernel quantiles claim a 1000x faster kernel than the one measured.
    _edit(db, drift_key, winner={k: (v / 1000 if k != "n" else v) for k, v in e.winner.items()})
    c = sqlite3.connect(db)  # edited behind forge's back, sha256 left as it was
    c.execute("UPDATE entries SET source = source || '# edited' WHERE key = ?", (edited_key,))
    c.commit()
    c.close()
    out_csv = tmp_path / "recheck.csv"
    res = _bench("--recheck", "--cache", str(db), "--json", "--csv", str(out_csv))
    assert res.exit_code == 5, res.output  # an entry forge must not serve: the cache's exit code
    rep = json.loads(res.stdout)
    assert rep["mode"] == "recheck" and rep["invalid"] == 1 and rep["drifted"] == 1
    by = {r["key"]: r for r in rep["entries"]}
    d = by[drift_key]
    assert d["status"] == "drifted" and "re-search" in d["reason"]
    assert d["stored"]["speedup"] == pytest.approx(e.speedup * 1000)
    new = d["new"]
    assert new["speedup"] == pytest.approx(new["baseline"]["p50"] / new["winner"]["p50"], rel=1e-12)
    assert new["winner"]["p20"] <= new["winner"]["p50"] <= new["winner"]["p80"]
    assert d["ratio"] == pytest.approx(new["speedup"] / d["stored"]["speedup"])
    s = by[edited_key]
    assert s["status"] == "sha256-mismatch" and "sha256" in s["reason"] and s["new"]["winner"] is None
    rows = {r["key"]: r for r in csv.DictReader(out_csv.open())}
    assert rows[drift_key]["status"] == "drifted" and float(rows[drift_key]["new_speedup"]) == new["speedup"]
    assert rows[edited_key]["status"] == "sha256-mismatch" and rows[edited_key]["new_speedup"] == ""


WRONG = "\n_forge_launch = launch\n\ndef launch(*args):\n    _forge_launch(*args)\n    args[2].mul_(2)\n"


@CPU
@pytest.mark.slow
def test_a_wrong_kernel_with_a_consistent_hash_is_refused_unloaded(cached, tmp_path):
    db = _cache_copy(cached, tmp_path)
    key = cached["keys"][(8, 64)]
    e = next(e for e in cached["entries"] if e.key == key)
    source = e.source + WRONG  # doubles its output after computing it
    _edit(db, key, source=source, source_sha256=source_sha256(source))
    res = _bench("rmsnorm", "--shape", "8x64", "--cache", str(db), "--recheck", "--json")
    assert res.exit_code == 5, res.output
    (r,) = json.loads(res.stdout)["entries"]
    # the edited source does not re-render from the installed templates: never imported, never run
    assert r["status"] == "invalid" and "refused, not loaded" in r["reason"] and "does not re-render" in r["reason"]
    res = _bench("rmsnorm", "--shape", "8x64", "--cache", str(db), "--skip", "compile", "--json")
    assert res.exit_code == 5, res.output
    forge = json.loads(res.stdout)["targets"][0]["contestants"][0]
    assert forge["status"] == "refused" and forge["quantiles"] is None and "re-render" in forge["reason"]


@pytest.mark.parametrize("stored,new,expected", [
    # (kernel p20, p50, p80), (eager p20, p50, p80): stored vs new
    (((10, 10, 10), (50, 50, 50)), ((10, 10, 10), (50, 50, 50)), False),   # identical
    (((10, 10, 10), (50, 50, 50)), ((10.5, 10.5, 10.5), (50, 50, 50)), False),  # 5% apart: under the floor
    (((10, 10, 10), (50, 50, 50)), ((20, 20, 20), (50, 50, 50)), True),    # 2x slower, tight intervals
    (((8, 10, 14), (40, 50, 60)), ((10, 13, 15), (40, 50, 60)), False),   # 23% apart but the ranges overlap
    (((10, 10, 10), (50, 50, 50)), ((0.01, 0.01, 0.01), (50, 50, 50)), True),  # a stored speedup 1000x off
])
def test_drift_rule(stored, new, expected):
    q = [stats.Quantiles(*x, n=5) for x in (*stored, *new)]
    assert stats.drifted(*q) is expected


# -- peaks ----------------------------------------------------------------------------------------------
def test_peaks_are_measured_once_per_device_and_reused(tmp_path, monkeypatch):
    calls = []

    def fake(backend):
        calls.append(backend)
        return {"copy_tbps": 2.0, "matmul_tflops": {"float16": 100.0, "bfloat16": 100.0, "float32": 10.0},
                "method": "fake", "measured_at": "2026-12-02T00:00:00+00:00"}

    monkeypatch.setattr(bench_peaks, "_measure_peaks", fake)
    a = bench.device_peaks("interpreter", tmp_path)
    b = bench.device_peaks("interpreter", tmp_path)
    assert calls == ["interpreter"] and not a.cached and b.cached
    assert (a.copy_tbps, a.matmul_tflops) == (b.copy_tbps, b.matmul_tflops) == (2.0, fake("x")["matmul_tflops"])
    doc = json.loads((tmp_path / "peaks.json").read_text())
    assert list(doc["devices"]) == [bench.peaks_key("interpreter")]
    assert "torch" in a.device and "cpu" in a.device
    calls.clear()
    bench.device_peaks("interpreter", tmp_path, remeasure=True)
    assert calls == ["interpreter"]
    (tmp_path / "peaks.json").write_text("{ damaged")
    calls.clear()
    assert not bench.device_peaks("interpreter", tmp_path).cached and calls == ["interpreter"]


def test_roofline_picks_the_bound_by_intensity_for_gemms_only():
    peaks = bench.Peaks("d", copy_tbps=4.0, matmul_tflops={"bfloat16": 800.0}, measured_at="", method="")
    mm = ops.get("matmul").module
    big = bench.roofline_model(mm, mm.make_spec((4096, 4096, 4096), "bfloat16", "cuda"), peaks)
    decode = bench.roofline_model(mm, mm.make_spec((1, 4096, 4096), "bfloat16", "cuda"), peaks)
    assert big["ridge"] == pytest.approx(200.0) and big["bound"] == "compute" and decode["bound"] == "memory"
    pct = bench.roofline_pct(big, 1e6 * big["flops"] / 400e12, peaks, "bfloat16")  # 400 TFLOP/s
    assert pct["pct_roofline"] == pytest.approx(50.0)
    rms = ops.get("rmsnorm").module
    m = bench.roofline_model(rms, rms.make_spec((2048, 4096), "bfloat16", "cuda"), peaks)
    assert m["bound"] == "memory"
    pct = bench.roofline_pct(m, 1e6 * m["bytes_moved"] / 2e12, peaks, "bfloat16")  # 2 TB/s
    assert pct["pct_roofline"] == pytest.approx(50.0) and pct["achieved_tbps"] == pytest.approx(2.0)


# -- contestant tables ----------------------------------------------------------------------------------
SMALL = {"linear": (4, 8, 8), "swiglu": (4, 8, 8), "pointwise": (4, 32),
         "rmsnorm": (4, 32), "add_norm": (4, 32),
         "softmax": (4, 32), "log_softmax": (4, 32), "layer_norm": (4, 32), "gelu": (4, 32),
         "silu_mul": (4, 32), "reduce": (4, 32), "cross_entropy": (4, 10), "matmul": (8, 8, 8),
         "sdpa": (1, 2, 8, 8, 16), "rope": (1, 2, 4, 8), "cat": (4, 32)}


@pytest.mark.parametrize("op", sorted(ops.available()))
def test_every_op_has_a_fused_and_a_liger_entry_and_the_fused_op_is_correct(op):
    assert op in bench.FUSED, f"add {op} to bench.FUSED (a Fused, or why torch has none)"
    assert op in bench.LIGER, f"add {op} to bench.LIGER (a factory, or why Liger has none)"
    assert op in SMALL, f"give {op} a small shape in SMALL"
    fused = bench.FUSED[op]
    if isinstance(fused, str):
        return
    opmod = ops.get(op).module
    spec = opmod.make_spec(SMALL[op], "float32", "cpu")
    inputs = opmod.make_inputs(spec, 0, "normal")
    assert compare(fused.fn(inputs, spec.attrs), opmod.oracle(inputs, spec.attrs), opmod.tolerance("float32")) is None
    if fused.is_eager_call(spec.attrs, spec):  # the claim "same as eager" holds: identical results
        assert torch.equal(fused.fn(inputs, spec.attrs), opmod.reference(inputs, spec.attrs))


@CPU
def test_contestant_wiring_compile_mismatch_and_no_compiler(cached, tmp_path, monkeypatch):
    """In process, cheap: torch.compile replaced by the identity (a real CPU compile takes 20-90 s here)."""
    db = Cache(_cache_copy(cached, tmp_path))
    target = bench.resolve_target("rmsnorm", (8, 64), "float16", None, "interpreter", db)
    monkeypatch.setattr(bench_peaks, "_measure_peaks", lambda backend: {
        "copy_tbps": 1e-3, "matmul_tflops": {"float16": 1e-3}, "method": "fake", "measured_at": "now"})
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    monkeypatch.setitem(bench.FUSED, "rmsnorm", bench.Fused("wrong", lambda i, a: i[0] * 2))
    opts = bench.BenchOptions(skip=frozenset({"forge"}), max_autotune=True, rounds=2)
    rep = bench.run_bench([target], backend="interpreter", cache=db, options=opts)
    (r,) = rep.results
    st = {c.name: c for c in r.contestants}
    assert list(st) == ["forge", "eager", "fused", "compile", "compile-max-autotune", "liger"]
    assert st["forge"].status == "skipped" and st["forge"].reason == "--skip forge"
    assert st["fused"].status == "mismatch" and st["fused"].quantiles is None
    for name in ("eager", "compile", "compile-max-autotune"):
        assert st[name].status == "ok" and st[name].quantiles.n == 2, st[name]
    assert "max-autotune-no-cudagraphs" in st["compile-max-autotune"].label
    # eager outside the tolerance (the user's own code, less exact than forge must be): still timed, the
    # baseline of every speedup, marked mismatch and never the fastest
    opmod = ops.get("rmsnorm").module
    monkeypatch.setattr(opmod, "reference", lambda i, a, ref=opmod.reference:  # the float64 oracle calls it too
                        ref(i, a) * (1.0 if i[0].dtype == torch.float64 else 1.5))
    rep = bench.run_bench([target], backend="interpreter", cache=db, options=opts)
    st = {c.name: c for c in rep.results[0].contestants}
    assert st["eager"].status == "mismatch" and st["eager"].quantiles.n == 2 and "timed anyway" in st["eager"].reason
    assert st["compile"].status == "mismatch" and st["compile"].quantiles is None  # a peer: not timed
    assert rep.results[0].fastest != "eager"
    monkeypatch.undo()
    monkeypatch.setattr(bench_contestants, "_cpp_compiler", lambda: None)
    rep = bench.run_bench([target], backend="interpreter", cache=db,
                          options=dataclasses.replace(opts, skip=frozenset({"forge", "fused"})))
    st = {c.name: c for c in rep.results[0].contestants}
    assert st["compile"].status == "skipped" and "C++ compiler" in st["compile"].reason


def test_liger_norms_over_another_dim_are_skipped_not_errors(monkeypatch):
    """Liger's rms_norm / layer_norm normalize the last dim: over NCHW's C or several trailing dims they raised
    inside Liger on the H200 (reported as errors); now they are unavailable for that spec."""
    calls = []
    monkeypatch.setattr(bench_contestants, "_liger_api", lambda *a: (lambda *i: calls.append(i) or i[0]))
    for factory, args in ((bench_contestants._liger_rmsnorm, ("x", "w")),
                          (bench_contestants._liger_layer_norm, ("x", "w", "b"))):
        _, fn = factory()
        assert fn(args, {"eps": 1e-6}) == "x"
        for attrs in ({"eps": 1e-6, "dim": -3}, {"eps": 1e-6, "dims": 3}):
            with pytest.raises(bench_contestants._Unavailable, match="last dim only"):
                fn(args, attrs)
    assert len(calls) == 2


@CPU
def test_a_peer_unavailable_for_the_spec_is_skipped(cached, tmp_path, monkeypatch):
    db = Cache(_cache_copy(cached, tmp_path))
    target = bench.resolve_target("rmsnorm", (8, 64), "float16", None, "interpreter", db)
    monkeypatch.setattr(bench_peaks, "_measure_peaks", lambda backend: {
        "copy_tbps": 1e-3, "matmul_tflops": {"float16": 1e-3}, "method": "fake", "measured_at": "now"})

    def unavailable(i, a):
        raise bench_contestants._Unavailable("not for this spec")

    monkeypatch.setattr(bench_contestants, "_liger", lambda op: ("liger_x", unavailable))
    opts = bench.BenchOptions(skip=frozenset({"forge", "compile", "fused"}), rounds=2)
    st = {c.name: c for c in bench.run_bench([target], backend="interpreter", cache=db, options=opts)
          .results[0].contestants}
    assert st["liger"].status == "skipped" and st["liger"].reason == "not for this spec", st["liger"]
    assert st["eager"].status == "ok"


# -- options --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args,needle", [
    ([], "give OP and --shape"),
    (["rmsnorm"], "give OP and --shape"),
    (["--recheck", "--attr", "eps=1"], "--attr needs OP and --shape"),
    (["rmsnorm", "--shape", "8x64", "--skip", "bogus"], "unknown contestant"),
    (["rmsnorm", "--shape", "8x64", "--json", "--csv", "-"], "both want stdout"),
    (["rmsnorm", "--shape", "8xq"], "malformed shape"),
    (["nosuchop", "--shape", "8x64"], "unknown op"),
    (["rmsnorm", "--shape", "8x64", "--rounds", "0"], "--rounds"),
])
def test_usage_errors_exit_2(args, needle):
    res = _bench(*args)
    assert res.exit_code == 2, res.output
    assert needle in _flat(res.output)


def test_plot_without_matplotlib_exits_2_with_an_install_hint(monkeypatch):
    real = cmd_bench.importlib.util.find_spec
    monkeypatch.setattr(cmd_bench.importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    res = _bench("rmsnorm", "--shape", "8x64", "--plot", "x.png")
    assert res.exit_code == 2
    assert "matplotlib" in res.output and "pip install 'forge-kernel[plot]'" in _flat(res.output)


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    t = bench.Target("rmsnorm", (8, 64), "float16", {"eps": 1e-6}, key="ab" * 32)
    mk = lambda n, p50, sp: bench.ContestantResult(n, n, "ok", quantiles=stats.Quantiles(p50, p50, p50, 3),
                                                   speedup=sp)
    res = bench.TargetResult(t, [mk("forge", 1.0, 3.0), mk("eager", 3.0, 1.0), mk("fused", 2.0, 1.5)])
    rep = bench.BenchReport("interpreter", {}, "db", None, [res], bench.BenchOptions())
    cmd_bench.write_plot(tmp_path / "p.png", rep, recheck=False)
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


# -- GPU tier (the H200 through the device tool: pytest -m gpu) --------------------------------------------
@pytest.fixture(scope="module")
def tuned_cuda(tmp_path_factory):
    """One search for the GPU tests of this module (device time is scarce)."""
    root = tmp_path_factory.mktemp("bench-cuda")
    db = Cache(root / "forge.db")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FORGE_LOCK_DIR", str(root / "locks"))
        rep = engine.search("rmsnorm", (2048, 4096), "float16", device="cuda", cache=db,
                            options=engine.SearchOptions(budget=8, timeout=120))
    assert rep.decision in ("kernel", "eager")
    db.close()
    return root / "forge.db", rep


@pytest.mark.gpu
def test_bench_rmsnorm_on_cuda_has_every_contestant(tuned_cuda):
    db, search = tuned_cuda
    res = runner.invoke(cli.app, ["bench", "rmsnorm", "--shape", "2048x4096", "--cache", str(db)])
    assert res.exit_code == 0, res.output
    for name in ("forge", "eager", "fused", "compile", "liger", "F.rms_norm", "% roofline", "fastest:"):
        assert name in res.stdout, name
    res = runner.invoke(cli.app, ["bench", "rmsnorm", "--shape", "2048x4096", "--cache", str(db), "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep["backend"] == "cuda" and rep["peaks"]["cached"] is True  # measured by the first run
    assert rep["peaks"]["copy_tbps"] > 1.0 and rep["peaks"]["matmul_tflops"]["bfloat16"] > 100
    (t,) = rep["targets"]
    by = {c["name"]: c for c in t["contestants"]}
    assert list(by) == ["forge", "eager", "fused", "compile", "liger"]
    must = ["eager", "fused", "compile"] + (["forge"] if search.decision == "kernel" else [])
    for name in must:
        c = by[name]
        assert c["status"] == "ok", c
        assert c["clock"] in ("cuda-graph", "cuda-events")
        q = c["quantiles"]
        assert 0 < q["p20"] <= q["p50"] <= q["p80"] and q["n"] == engine.SAMPLING["cuda"].final_rounds
        assert 0 < c["pct_roofline"] < 110, c  # against the measured copy bandwidth
        assert c["speedup"] == pytest.approx(by["eager"]["quantiles"]["p50"] / q["p50"])
    assert t["bound"] == "memory" and math.isclose(by["eager"]["speedup"], 1.0)


@pytest.mark.gpu
def test_recheck_on_cuda_finds_the_fresh_entry_valid(tuned_cuda):
    db, search = tuned_cuda
    res = runner.invoke(cli.app, ["bench", "--recheck", "--cache", str(db), "--json"])
    assert res.exit_code == 0, res.output
    (r,) = json.loads(res.stdout)["entries"]
    if search.decision == "kernel":
        assert r["status"] in ("ok", "drifted"), r  # just searched: valid; drift only if the clock moved
        assert r["new"]["speedup"] > 0
    else:
        assert r["status"] == "skipped"


@pytest.mark.gpu
@pytest.mark.slow
def test_max_autotune_contestant_on_cuda(tuned_cuda):
    db, _ = tuned_cuda
    res = runner.invoke(cli.app, ["bench", "rmsnorm", "--shape", "2048x4096", "--cache", str(db), "--json",
                                  "--max-autotune", "--skip", "liger", "--skip", "fused"])
    assert res.exit_code == 0, res.output
    by = {c["name"]: c for c in json.loads(res.stdout)["targets"][0]["contestants"]}
    c = by["compile-max-autotune"]
    assert c["status"] == "ok" and c["clock"] in ("cuda-graph", "cuda-events"), c
