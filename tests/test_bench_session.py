"""bench/h200_session.py's models and pad parts: what they run and what they report, with bench/models.py and
bench/pad_probe.py faked (the real runs need a GPU); the pad probe's schemes' values on CPU."""

from __future__ import annotations

import json
import types

import pytest
import torch

from tests.conftest import load_bench


def test_models_part_runs_bench_models_and_reports_every_contestant(tmp_path, monkeypatch):
    hs = load_bench("h200_session")
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    out.mkdir()
    seen = {}
    doc = {"rows": [
        {"model": "gpt2", "contestants": {
            "eager": {"ms_per_forward": 6.72, "speedup_vs_eager": 1.0},
            "forge-auto": {"ms_per_forward": 1.9, "speedup_vs_eager": 3.54,
                           "cudagraphs": ["graph 0: 1 capture(s), 5 replay(s) of 9 call(s); auto: kept"]},
            "compile-cudagraphs": {"error": "RuntimeError: boom"}},
         "device": {"eager_ms": 6.42, "forge_ms": 1.58}},
    ]}

    def fake_run(cmd, limit, log):
        seen["cmd"], seen["limit"] = cmd, limit
        (work / "models").mkdir()
        (work / "models" / "models.json").write_text(json.dumps(doc))
        return 0, 12.0

    monkeypatch.setattr(hs, "run", fake_run)
    args = types.SimpleNamespace(models_list="gpt2,decode", models_modes="eager,forge-auto", models_budget=16,
                                 models_limit=140.0)
    lines = hs.models(out, work, args)
    cmd = seen["cmd"]
    assert cmd[1] == "bench/models.py" and cmd[cmd.index("--models") + 1] == "gpt2,decode"
    assert cmd[cmd.index("--modes") + 1] == "eager,forge-auto" and cmd[cmd.index("--model-limit") + 1] == "140.0"
    assert seen["limit"] == 140.0 * 2 + 60
    assert json.loads((out / "models.json").read_text()) == doc
    assert lines[0] == "models: rc 0, 12 s"
    text = "\n".join(lines)
    assert "gpt2    forge-auto         1.900 ms (3.54x eager) graph 0: 1 capture(s)" in text
    assert "compile-cudagraphs error: RuntimeError: boom" in text
    assert "device: eager 6.420 ms, forge 1.580 ms" in text


def test_models_part_without_a_result_says_so(tmp_path, monkeypatch):
    hs = load_bench("h200_session")
    monkeypatch.setattr(hs, "run", lambda cmd, limit, log: ("timeout after 340 s", 340.0))
    args = types.SimpleNamespace(models_list="gpt2", models_modes="eager", models_budget=16, models_limit=280.0)
    assert hs.models(tmp_path, tmp_path, args) == ["models: rc timeout after 340 s, 340 s", "  (no models.json)"]


def test_pad_part_runs_the_probe_and_reports_each_scheme_against_compile(tmp_path, monkeypatch):
    hs = load_bench("h200_session")
    work, out = tmp_path / "work", tmp_path / "out"
    out.mkdir()
    doc = {"results": {"bfloat16": {"eager": {"p50": 2100.0}, "strided": {"p50": 520.0},
                                    "compile": {"p50": 473.0}}}}
    seen = {}

    def fake_run(cmd, limit, log):
        seen["cmd"], seen["limit"] = cmd, limit
        (work / "pad").mkdir(parents=True)
        (work / "pad" / "pad-probe.json").write_text(json.dumps(doc))
        return 0, 80.0

    monkeypatch.setattr(hs, "run", fake_run)
    lines = hs.pad(out, work, types.SimpleNamespace(pad_limit=150.0))
    assert seen["cmd"][1:] == ["bench/pad_probe.py", "--out", str(work / "pad")] and seen["limit"] == 150.0
    assert json.loads((out / "pad-probe.json").read_text()) == doc
    assert lines == ["pad: rc 0, 80 s", "  bfloat16  eager        2100.0 us (4.440x compile)",
                     "  bfloat16  strided       520.0 us (1.099x compile)",
                     "  bfloat16  compile       473.0 us (1.000x compile)"]
    monkeypatch.setattr(hs, "run", lambda cmd, limit, log: ("timeout after 150 s", 150.0))
    assert hs.pad(out, tmp_path / "other", types.SimpleNamespace(pad_limit=150.0))[1] == "  (no pad-probe.json)"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_pad_probe_schemes_are_the_product_in_their_layouts(dtype):
    """bench/pad_probe.py's padding schemes (timed on a GPU) at a small misaligned shape: each is A @ B; every
    scheme but the view returns eager's contiguous layout; `padded` zero-fills what it adds."""
    from forge import fused

    pp = load_bench("pad_probe")
    calls, padded = pp.schemes(torch, fused)
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(37, 29, generator=gen).to(dtype), torch.randn(29, 19, generator=gen).to(dtype)
    want = a.double() @ b.double()
    assert sorted(calls) == ["forge", "pad128", "pad16m", "pad16view", "strided", "stridedc"]
    for name, call in calls.items():
        got = call([a, b])
        assert got.shape == (37, 19) and got.dtype == dtype and got.is_contiguous() == (name != "pad16view"), name
        torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=5e-2, msg=lambda m, n=name: f"{n}: {m}")
    a2, b2 = padded(a, b, 16, 16, 16)
    per = 16 // a.element_size()
    assert a2.shape == (-(-37 // per) * per, -(-29 // per) * per) and b2.shape == (a2.shape[1], -(-19 // per) * per)
    assert not a2[37:].any() and not a2[:, 29:].any() and not b2[29:].any() and not b2[:, 19:].any()
