"""bench/peers_table.py: issue 16's verdict per row, computed from a forge bench document, and the README's
block kept equal to what the script makes of the committed files."""

from __future__ import annotations

import json

import pytest

from tests.conftest import ROOT, load_bench

pt = load_bench("peers_table")
COPY = 4.0  # TB/s


def _c(name, p50=None, status="ok"):
    c = {"name": name, "status": status, "reason": None}
    if p50 is not None:
        c["quantiles"] = {"p20": p50, "p50": p50, "p80": p50, "n": 40}
    return c


def _target(op, shape, dtype="bfloat16", contestants=(), bytes_moved=0, flops=0, gemm=False, decision="kernel"):
    return {"op": op, "shape": shape, "dtype": dtype, "attrs": {}, "bytes_moved": bytes_moved, "flops": flops,
            "gemm": gemm, "stored": {"decision": decision}, "contestants": list(contestants)}


def test_memory_bound_row_met_needs_the_ratio_and_the_bandwidth():
    mb = 256 * 2**20  # large: the %BW target applies
    floor = mb / (COPY * 1e12) * 1e6  # 67.1 us
    forge = floor / 0.96  # 96% of the copy bandwidth
    t = _target("rmsnorm", "32768x4096", bytes_moved=mb,
                contestants=[_c("forge", forge), _c("eager", 500.0), _c("compile", forge / 0.96)])
    r = pt.row(t, COPY)
    assert r["best"] == "compile" and r["ratio"] == pytest.approx(0.96)
    assert r["pct_bw"] == pytest.approx(96.0)
    assert r["met"] is True and r["target"] == "<= 0.97x, >= 95% BW"
    # the same ratio at a bandwidth below 95%: not met
    slow = _target("rmsnorm", "32768x4096", bytes_moved=mb,
                   contestants=[_c("forge", forge * 1.2), _c("compile", forge / 0.96 * 1.2)])
    assert pt.row(slow, COPY)["met"] is False


def test_a_ratio_target_below_the_copy_floor_says_so():
    mb = 256 * 2**20
    floor = mb / (COPY * 1e12) * 1e6
    t = _target("softmax", "32768x4096", bytes_moved=mb,
                contestants=[_c("forge", floor * 1.01), _c("liger", floor * 1.02)])
    r = pt.row(t, COPY)
    assert r["met"] is False and "below the copy floor" in r["why"]
    assert r["floor_us"] == pytest.approx(floor)


def test_the_seed_shape_needs_ten_microseconds():
    t = _target("rmsnorm", "2048x4096", "float16", bytes_moved=32 * 2**20,
                contestants=[_c("forge", 10.4), _c("compile", 11.0)])
    r = pt.row(t, COPY)
    assert r["ratio"] == pytest.approx(10.4 / 11.0) and r["ratio"] <= 0.97
    assert r["met"] is False and "< 10 us" in r["target"]  # ahead, but not under 10 us
    t["contestants"][0] = _c("forge", 9.9)
    assert pt.row(t, COPY)["met"] is True


def test_an_eager_decision_runs_eager_and_a_mismatched_peer_is_not_the_best():
    t = _target("reduce", "32768x4096", bytes_moved=256 * 2**20, decision="eager",
                contestants=[_c("forge", status="skipped"), _c("eager", 60.0), _c("compile", 55.0),
                             _c("compile-max-autotune", status="mismatch")])
    r = pt.row(t, COPY)
    assert r["forge_runs"] == "eager" and r["forge_p50"] == 60.0
    assert r["best"] == "compile" and r["ratio"] == pytest.approx(60 / 55)


def test_matmul_and_sdpa_targets():
    mm = _target("matmul", "4096x4096x4096", flops=2 * 4096**3, gemm=True,
                 contestants=[_c("forge", 200.0), _c("eager", 205.0), _c("compile-max-autotune", 190.0)])
    r = pt.row(mm, COPY)
    assert r["met"] is True and r["ratio_vs"] == pytest.approx(200 / 205)  # cuBLAS is the bar, not max-autotune
    assert r["tflops"] == pytest.approx(2 * 4096**3 / 200e-6 / 1e12)
    pre = _target("sdpa", "4x32x2048x2048x128", contestants=[_c("forge", 104.0), _c("eager", 100.0)])
    assert pt.row(pre, COPY)["met"] is True  # 96% of SDPA's speed
    pre["contestants"][0] = _c("forge", 106.0)
    assert pt.row(pre, COPY)["met"] is False
    # decided eager: forge runs SDPA / cuBLAS itself, which meets neither target
    assert pt.row(_target("sdpa", "4x32x2048x2048x128", decision="eager",
                          contestants=[_c("forge", status="skipped"), _c("eager", 100.0)]), COPY)["met"] is False
    assert pt.row(_target("matmul", "4096x4096x4096", decision="eager", gemm=True, flops=1,
                          contestants=[_c("forge", status="skipped"), _c("eager", 100.0)]), COPY)["met"] is False
    dec = _target("sdpa", "1x32x1x8192x128", contestants=[_c("forge", 100.0), _c("eager", 100.0)])
    assert pt.row(dec, COPY)["met"] is False  # decode: strictly ahead
    dec["contestants"][0] = _c("forge", 90.0)
    assert pt.row(dec, COPY)["met"] is True


def _doc(targets):
    return {"gpu": "GPU", "driver": "1", "torch": "t", "triton": "3.6.0", "date": "2026-12-06", "commit": "abc",
            "command": "forge bench", "rounds": 40, "peaks": {"copy_tbps": COPY}, "targets": targets}


def test_table_and_readme_block_round_trip(tmp_path):
    doc = tmp_path / "bench.json"
    doc.write_text(json.dumps(_doc([
        _target("rmsnorm", "8192x8192", bytes_moved=256 * 2**20,
                contestants=[_c("forge", 70.0), _c("compile", 68.0), _c("liger", status="skipped")]),
        _target("matmul", "16x4096x4096", flops=2 * 16 * 4096**2, gemm=True,
                contestants=[_c("forge", 12.0), _c("eager", 13.0)]),
    ])))
    text = pt.table([doc])
    assert "| rmsnorm 8192x8192 | 70.0 | — | — | 68.0 | — | skipped | 1.029 (compile) |" in text
    assert "1 of 2 rows meet their target. matmul at or above cuBLAS on 1 of 1 rows, 1 distinct shapes" in text
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{pt.PEERS_BEGIN}\nold\n{pt.PEERS_END}\n\nafter\n")
    pt.main(["--readme", str(readme), str(doc)])
    files, block = pt.readme_block(readme)
    assert files == ["bench.json"] and block == text
    assert readme.read_text().endswith(f"{pt.PEERS_END}\n\nafter\n")


def test_a_row_measured_again_in_a_later_file_is_superseded(tmp_path):
    """The later run's row is the verdict; the earlier one is shown, marked, and not counted."""
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps(_doc([
        _target("matmul", "8205x2949x5921", flops=1, gemm=True, decision="eager",
                contestants=[_c("forge", status="skipped"), _c("eager", 2000.0)]),
        _target("matmul", "16x4096x4096", flops=1, gemm=True, contestants=[_c("forge", 12.0), _c("eager", 13.0)]),
    ])))
    second.write_text(json.dumps(_doc([
        _target("matmul", "8205x2949x5921", flops=1, gemm=True, contestants=[_c("forge", 600.0), _c("eager", 2000.0)]),
    ])))
    text = pt.table([first, second])
    assert text.startswith("run a: `a.json`") and "\nrun b: `b.json`" in text
    assert "| matmul 8205x2949x5921 (run a) | eager |" in text
    assert text.count("superseded by run b (no)") == 1
    assert "| matmul 8205x2949x5921 (run b) | 600.0 |" in text and "| yes |" in text
    assert "2 of 2 rows meet their target. matmul at or above cuBLAS on 2 of 2 rows, 2 distinct shapes" in text
    # run a's row was decided eager (cuBLAS itself): not met, and superseded
    readme = tmp_path / "README.md"
    readme.write_text(f"{pt.PEERS_BEGIN}\n{pt.PEERS_END}\n")
    pt.main(["--readme", str(readme), str(first), str(second)])
    assert pt.readme_block(readme) == (["a.json", "b.json"], text)


def test_a_row_a_later_run_did_not_measure_keeps_its_earlier_verdict(tmp_path):
    """A target the later run has no contestant for (its search was cut: no cached decision) is no row there:
    the earlier run's measurement stays the verdict, and the later run's header names what it left out."""
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps(_doc([
        _target("rope", "4x32x2048x128", contestants=[_c("forge", 40.0), _c("compile", 46.0)]),
    ])))
    missing = {**_target("rope", "4x32x2048x128"), "stored": None, "error": "no cached decision"}
    second.write_text(json.dumps(_doc([
        missing, _target("softmax", "1x32000", contestants=[_c("forge", 3.0), _c("liger", 5.0)]),
    ])))
    text = pt.table([first, second])
    assert "| rope 4x32x2048x128 (run a) | 40.0 |" in text and "superseded" not in text
    assert "(run b)" in text and "rope 4x32x2048x128 (run b)" not in text
    assert "Not measured in this run (no contestant timed): rope 4x32x2048x128 bfloat16." in text
    assert "2 of 2 rows meet their target." in text


def test_the_readme_block_is_what_the_committed_results_make():
    """README's issue-16 table is generated: regenerating it from the files it names gives the same text."""
    files, block = pt.readme_block(ROOT / "README.md")
    assert files, "the README's peers block names no results file"
    assert block == pt.table([ROOT / "bench" / "results" / f for f in files])
