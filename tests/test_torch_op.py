"""Issue 14, item 6: what the user runs is the baseline; torch's fused ops are candidates.

MinGPT's tanh-GELU formula (eight eager kernels) was searched against F.gelu as its baseline, lost to it and
was cached "eager": the formula kept running. Now the matcher records the spelling (form="formula"), the
reference runs that spelling, torch's fused op (forge/fused.py) is validated and timed like any candidate,
and a "torch" decision is cached and served by the shim, forge.load, the TorchDynamo backend and bench.

On the CPU tier the interpreter's kernels are far slower than torch's, and torch's one F.gelu call is faster
than the formula's eight: the decision is "torch" (as it was for the tanh formula at 8192x8192 fp32 on the
H200, 1152 us in eager)."""

from __future__ import annotations

import json
import math
import textwrap

import pytest
import torch
import torch.nn.functional as F

import forge
from forge import fused
from forge.cache import Cache
from forge.tuner import engine
from tests.conftest import HAS_CUDA

cpu_only = pytest.mark.skipif(HAS_CUDA, reason="the interpreter's timings decide these (CPU tier)")

SHAPE = (16, 96)


@pytest.fixture(autouse=True)
def _torch_ops_on(monkeypatch):
    monkeypatch.setenv("FORGE_TORCH_OPS", "1")  # tests/conftest.py switches it off for the other tests


def tanh_formula(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def _search(tmp_path, attrs, budget=2):
    return engine.search("gelu", SHAPE, "float32", device="cpu", cache=Cache(tmp_path / "forge.db"), attrs=attrs,
                         options=engine.SearchOptions(budget=budget, workers=1, timeout=120))


def test_the_fused_op_is_a_candidate_only_where_the_baseline_is_not_that_call():
    assert fused.candidate("gelu", {"approximate": "tanh", "form": "formula"}).label == "F.gelu"
    assert fused.candidate("gelu", {"approximate": "tanh"}) is None  # the user calls F.gelu already
    assert fused.candidate("silu_mul", {"form": "formula"}).label == "F.silu(a) * b"
    assert fused.candidate("silu_mul", {}) is None
    assert fused.candidate("rope", {}) is None and isinstance(fused.get("rope"), str)
    assert isinstance(fused.get("no_such_op"), str)


@cpu_only
def test_a_formula_is_searched_against_itself_and_torchs_op_wins(tmp_path):
    rep = _search(tmp_path, {"approximate": "tanh", "form": "formula"})
    by_variant = {c["variant"]: c for c in rep.candidates}
    assert by_variant["torch"]["label"] == "F.gelu" and by_variant["torch"]["status"] == "ok"
    assert len(rep.candidates) == 3  # the budget's two kernels, plus torch's op outside the budget
    assert rep.decision == "torch", [(c["variant"], c["status"], c["speedup"]) for c in rep.candidates]
    assert rep.winner["variant"] == "torch" and rep.speedup > 1.03
    entry = Cache(tmp_path / "forge.db").get(rep.key)
    assert entry.decision == "torch" and entry.source is None and entry.variant == "torch"
    again = _search(tmp_path, {"approximate": "tanh", "form": "formula"})
    assert again.cache_hit and again.decision == "torch" and again.winner["variant"] == "torch"


@cpu_only
def test_forge_torch_ops_0_leaves_the_torch_op_out(tmp_path, monkeypatch):
    monkeypatch.setenv("FORGE_TORCH_OPS", "0")
    rep = _search(tmp_path, {"approximate": "tanh", "form": "formula"})
    assert "torch" not in {c["variant"] for c in rep.candidates} and rep.decision in ("kernel", "eager")


@cpu_only
def test_a_call_of_the_fused_op_has_no_torch_candidate(tmp_path):
    rep = _search(tmp_path, {"approximate": "tanh"})
    assert "torch" not in {c["variant"] for c in rep.candidates}
    assert rep.decision in ("kernel", "eager")


@cpu_only
def test_the_shim_serves_torchs_op_in_place_of_the_formula(tmp_path):
    db = tmp_path / "forge.db"
    f = forge.optimize(tanh_formula, interpreter=True, cache=db, budget=2, warn=False)
    x = torch.randn(*SHAPE)
    e = forge.explain(f, x)
    assert (e.op, e.uses, e.reason) == ("gelu", "eager", "cache miss: would search")
    rep = _search(tmp_path, {"approximate": "tanh", "form": "formula"})
    assert rep.decision == "torch", [(c["variant"], c["status"], c["speedup"]) for c in rep.candidates]
    y = f(x)
    e = forge.explain(f, x)
    assert e.uses == "torch" and "F.gelu" in e.reason and "faster than the code as written" in e.reason, e
    assert torch.equal(y, F.gelu(x, approximate="tanh"))  # torch's op ran, not the formula
    load = forge.load("gelu", SHAPE, "float32", device="cpu", cache=db, approximate="tanh", form="formula")
    assert torch.equal(load(x), F.gelu(x, approximate="tanh"))
    with pytest.raises(ValueError, match="takes"):
        load(torch.randn(3, 3))


@cpu_only
def test_the_backend_runs_torchs_op_for_a_region(tmp_path):
    from forge.backend import Backend

    db = tmp_path / "forge.db"
    _search(tmp_path, {"approximate": "tanh", "form": "formula"})

    def mlp(x, w):
        return tanh_formula(x) @ w

    x, w = torch.randn(*SHAPE), torch.randn(SHAPE[1], 8)
    be = Backend(miss="eager", cache=db, interpreter=True)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(mlp, backend=be, dynamic=False)
        compiled(x, w)
        got = compiled(x, w)
    finally:
        torch._dynamo.reset()
    rep = be.explain()
    gelu = [r for r in rep.regions if r.op == "gelu"]
    assert [r.uses for r in gelu] == ["torch"] and rep.torch_ops == 1 and rep.uses == "regions"
    assert "torch's fused op" in str(rep)
    assert be.kernel_names() == frozenset()  # no forge kernel among the swapped calls
    assert torch.equal(got, F.gelu(x, approximate="tanh") @ w)


@cpu_only
def test_bench_and_cache_ls_show_the_torch_decision(tmp_path):
    from typer.testing import CliRunner

    from forge_cli import cli

    db = tmp_path / "forge.db"
    _search(tmp_path, {"approximate": "tanh", "form": "formula"})
    runner = CliRunner()
    res = runner.invoke(cli.app, ["bench", "gelu", "--shape", "x".join(map(str, SHAPE)), "--dtype", "float32",
                                  "--device", "cpu", "--attr", "approximate=tanh", "--attr", "form=formula",
                                  "--rounds", "3", "--skip", "compile", "--skip", "liger", "--cache", str(db),
                                  "--json"])
    assert res.exit_code == 0, res.output
    (t,) = json.loads(res.stdout)["targets"]
    by = {c["name"]: c for c in t["contestants"]}
    assert by["forge"]["label"] == "torch op F.gelu" and by["forge"]["status"] == "ok"
    assert by["fused"]["status"] == "ok" and by["eager"]["status"] == "ok"
    assert t["stored"]["decision"] == "torch"
    ls = runner.invoke(cli.app, ["cache", "ls", "--cache", str(db), "--json"])
    assert ls.exit_code == 0 and [r["decision"] for r in json.loads(ls.stdout)["entries"]] == ["torch"]
    exp = runner.invoke(cli.app, ["export", "gelu", "--shape", "x".join(map(str, SHAPE)), "--dtype", "float32",
                                  "--device", "cpu", "--attr", "approximate=tanh", "--attr", "form=formula",
                                  "--cache", str(db), "--out", str(tmp_path / "x")])
    assert exp.exit_code == 2 and "torch's own fused op" in " ".join(exp.output.split()), exp.output


def test_a_manifest_entry_may_name_the_form(tmp_path):
    from forge.tuner import manifest

    path = tmp_path / "m.toml"
    path.write_text(textwrap.dedent("""
        [[op]]
        op = "gelu"
        shape = "4x8"
        approximate = "tanh"
        form = "formula"
        """))
    (job,) = manifest.load(path).jobs
    assert job.attrs == {"approximate": "tanh", "form": "formula"}


def test_a_bundle_torch_entry_with_a_source_is_rejected():
    import dataclasses

    from forge import key as keys
    from forge.spec import KernelSpec
    from forge.tuner import bundle
    from tests.test_cache import make_entry, make_key

    e = dataclasses.replace(make_entry(make_key("t")), decision="torch", variant="torch", params={})
    e = dataclasses.replace(e, key=keys.cache_key(KernelSpec.from_dict(e.spec), e.env))
    with pytest.raises(bundle.Rejected, match="torch decision that carries a kernel source"):
        bundle.check_integrity(e)
    bundle.check_integrity(dataclasses.replace(e, source=None, source_sha256=None))  # without one: fine
    with pytest.raises(bundle.Rejected, match="torch decision without winner"):
        bundle.check_metadata(dataclasses.replace(e, source=None, source_sha256=None, winner=None), now=2e9)


@pytest.mark.parametrize("attrs", [{}, {"weight": "kn", "bias": "linear", "activation": "gelu", "form": "formula"},
                                   {"bias": "add", "activation": "silu", "scale": 0.5, "residual": True},
                                   {"bias": "linear", "activation": "relu", "scale": 2.0}])
def test_linear_candidate_is_the_users_calls_on_the_weight_in_the_other_layout(attrs):
    """GPT-2's lm_head: cuBLAS's kernel for an odd N depends on the weight's storage order (H200: eager's
    4.4 ms vs Inductor's transposed copy + cuBLAS 0.61 ms). The candidate copies the weight transposed in
    memory on every call and runs the user's own calls; the values are the reference's."""
    from forge import ops
    from forge.tuner.validate import compare

    mod = ops.get("linear").module
    cand = fused.candidate("linear", attrs)
    assert cand is not None and "transposed" in cand.label
    for shape, dtype in (((3, 5, 33, 24), "float32"), ((2, 7, 31, 17), "bfloat16"), ((1, 4, 5, 8), "float16")):
        # odd N (33, 17, 5): the wide, zero-extended path; the copy out must be eager's layout
        spec = mod.make_spec(shape, dtype, "cpu", attrs)
        inputs = mod.make_inputs(spec, 1)
        w_before = inputs[1].clone()
        got = cand.fn(inputs, spec.attrs)
        assert torch.equal(inputs[1], w_before) and inputs[1].is_contiguous()  # the user's weight is untouched
        want = mod.reference(inputs, spec.attrs)
        assert got.shape == want.shape and got.dtype == want.dtype and got.is_contiguous()
        oracle, tolerance = mod.oracle(inputs, spec.attrs), mod.tolerance_for(spec)
        if compare(want, oracle, tolerance) is None:  # the written-out tanh formula in bf16 misses it itself
            assert compare(got, oracle, tolerance) is None
        tol = 1e-5 if dtype == "float32" else 2e-2
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype,shape", [(torch.bfloat16, (50257, 64)), (torch.float32, (7, 33)),
                                         (torch.float16, (64, 5))])
def test_the_other_order_pads_its_rows_to_128_bytes(dtype, shape):
    """cuBLAS takes an align1 kernel when an operand's rows are not 16-byte aligned: the copy in the other
    order keeps w's shape and values, its storage rows start on 128-byte boundaries."""
    w = torch.randn(shape).to(dtype)
    v = fused._other_order(w)
    assert v.shape == w.shape and torch.equal(v, w)
    assert v.stride(0) == 1 and v.stride(1) >= w.shape[0] and (v.stride(1) * w.element_size()) % 128 == 0
    assert v.stride(1) * w.element_size() - w.shape[0] * w.element_size() < 128  # padded by less than a line
    for n_dim in (0, 1):  # extended with zero rows / columns to an aligned N
        n_to = fused._pad_to(w.shape[n_dim] + 1, w.element_size())
        e = fused._other_order(w, n_dim, n_to)
        assert e.shape[n_dim] == n_to and e.shape[1 - n_dim] == w.shape[1 - n_dim]
        assert torch.equal(e.narrow(n_dim, 0, w.shape[n_dim]), w)
        assert not e.narrow(n_dim, w.shape[n_dim], n_to - w.shape[n_dim]).any()
        assert (n_to * w.element_size()) % 128 == 0


@cpu_only
def test_a_linear_search_times_the_torch_candidate(tmp_path):
    rep = engine.search("linear", (4, 8, 8), "float32", device="cpu", cache=Cache(tmp_path / "forge.db"),
                        options=engine.SearchOptions(budget=1, workers=1, timeout=120))
    (torch_cand,) = [c for c in rep.candidates if c["variant"] == "torch"]
    assert torch_cand["status"] == "ok" and "transposed" in torch_cand["label"]


@pytest.mark.parametrize("attrs", [
    {"weight": "kn", "bias": "linear", "activation": "gelu_tanh", "form": "formula"},  # GPT-2's c_fc + gelu_new
    {"bias": "linear", "activation": "gelu_tanh"},
    {"bias": "add", "activation": "relu", "residual": True},
    {"weight": "kn", "bias": "add", "activation": "relu"},
])
def test_a_bias_and_relu_or_tanh_gelu_make_cublaslt_s_epilogue_the_candidate(attrs):
    """torch._addmm_activation: the GEMM with the bias and the activation applied to cuBLASLt's fp32
    accumulator, one kernel where the user's code runs two to nine. Checked against the float64 oracle of the
    user's formula at odd shapes, 2-D and 3-D x, both weight layouts, the residual added after it."""
    from forge import ops
    from forge.tuner.validate import compare

    mod = ops.get("linear").module
    cand = fused.candidate("linear", attrs)
    assert cand is not None and "_addmm_activation" in cand.label
    assert fused.get("linear", attrs) is cand and fused.get("linear") is fused.FUSED["linear"]
    checked = 0
    for shape, dtype in (((3, 5, 33, 24), "float32"), ((7, 17, 20), "bfloat16"), ((1, 5, 8), "float16"),
                         ((1, 1, 40, 16), "float32")):
        spec = mod.make_spec(shape, dtype, "cpu", attrs)
        inputs = mod.make_inputs(spec, 2)
        got = cand.fn(inputs, spec.attrs)
        want = mod.reference(inputs, spec.attrs)
        assert got.shape == want.shape and got.dtype == want.dtype and got.is_contiguous()
        oracle, tolerance = mod.oracle(inputs, spec.attrs), mod.tolerance_for(spec)
        # where the user's own code meets the oracle (on the CPU half precision rounds the GEMM before the
        # activation), so must this
        if compare(want, oracle, tolerance) is None:
            assert compare(got, oracle, tolerance) is None, (shape, dtype)
            checked += 1
        tol = 1e-5 if dtype == "float32" else 2e-2
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert checked >= 2


def test_the_epilogue_is_no_candidate_for_what_cublaslt_does_not_compute():
    """No bias, the erf GELU, silu, or a scale between the activation and the store: the other layout."""
    for attrs in ({"activation": "gelu_tanh"}, {"bias": "linear", "activation": "gelu"},
                  {"bias": "linear", "activation": "silu"}, {"bias": "linear", "activation": "relu", "scale": 0.5},
                  {"bias": "linear"}):
        assert "transposed" in fused.candidate("linear", attrs).label, attrs


@cpu_only
def test_a_torch_decision_is_served_only_by_the_torch_op_it_timed(tmp_path, monkeypatch):
    """A cached "torch" decision names the call it timed; where this forge's torch op for the spec's
    attributes is another one (forge/fused.py changed since), the shim runs the code as written and says why,
    and bench refuses it, rather than serve a call the search never timed."""
    import dataclasses

    db = tmp_path / "forge.db"
    rep = _search(tmp_path, {"approximate": "tanh", "form": "formula"})
    assert rep.decision == "torch"
    f = forge.optimize(tanh_formula, interpreter=True, cache=db, budget=2, warn=False, search=False)
    x = torch.randn(*SHAPE)
    assert forge.explain(f, x).uses == "torch"
    cache = Cache(db)
    (entry,) = cache.entries()
    relabelled = [dict(c, label="torch.special.something_else") if c.get("variant") == "torch" else c
                  for c in entry.candidates]
    cache.put(dataclasses.replace(entry, candidates=relabelled))
    g = forge.optimize(tanh_formula, interpreter=True, cache=db, budget=2, warn=False, search=False)
    e = forge.explain(g, x)
    assert e.uses == "eager" and "something_else" in e.reason and "F.gelu" in e.reason, e
    y = g(x)
    assert torch.equal(y, tanh_formula(x))  # the formula as written ran


# --- matmul: torch.matmul on aligned copies where rows are misaligned (Inductor's pad_mm) --------------------

def _mm_spec(shape, dtype="float32", strides=None):
    from forge import ops

    mod = ops.get("matmul").module
    spec = mod.make_spec(shape, dtype, "cpu")
    if strides:
        spec = type(spec)(spec.op, tuple(type(t)(t.shape, t.dtype, st, t.device)
                                         for t, st in zip(spec.inputs, strides, strict=True)), spec.attrs)
    return spec


def test_matmul_torch_op_is_a_candidate_only_for_misaligned_rows():
    assert fused.candidate("matmul", {}, _mm_spec((64, 32, 64))) is None  # torch.matmul is the user's call
    assert fused.candidate("matmul", {}, _mm_spec((64, 32, 30))).label.startswith("torch.matmul on copies")
    assert fused.candidate("matmul", {}, _mm_spec((64, 30, 32), "bfloat16")) is not None  # 60-byte rows of B
    assert fused.candidate("matmul", {}, _mm_spec((64, 24, 40), "bfloat16")) is None  # 48- and 80-byte rows
    # a cached "torch" decision for an aligned spec (untrusted input) is not served: no such candidate there
    assert fused.candidate("matmul", {}, _mm_spec((8, 8, 8))) is None


@pytest.mark.parametrize(("a_shape", "b_shape", "dtype"), [
    ((33, 21), (21, 17), torch.float32),       # K and N misaligned: both copied, the output's columns cut
    ((20, 37), (37, 16), torch.float16),       # K misaligned, N aligned
    ((20, 32), (32, 13), torch.bfloat16),      # N misaligned only: A used as it is
    ((3, 9, 21), (3, 21, 11), torch.float32),  # batched
    ((16, 32), (32, 16), torch.float32),       # aligned: torch.matmul itself
])
def test_matmul_on_aligned_copies_equals_the_product(a_shape, b_shape, dtype, monkeypatch):
    """What cuBLAS is handed: K and N padded to 16 bytes only (Inductor's pad_mm), zero tails, rows strided to a
    multiple of 16 bytes (the copies' to 128), D contiguous; the result is the product, contiguous."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(a_shape, generator=gen).to(dtype), torch.randn(b_shape, generator=gen).to(dtype)
    seen = []
    real = torch.matmul
    monkeypatch.setattr(torch, "matmul", lambda x, y: seen.append((x, y)) or real(x, y))
    f = fused.get("matmul", {})
    out = f.fn((a, b), {})
    assert out.shape == (*a_shape[:-1], b_shape[-1]) and out.dtype == dtype and out.is_contiguous()
    torch.testing.assert_close(out.double(), a.double() @ b.double(), atol=2e-2, rtol=2e-2)
    (x, y), = seen
    e, k, n = a.element_size(), a_shape[-1], b_shape[-1]
    per16 = 16 // e
    kp, np_ = -(-k // per16) * per16, -(-n // per16) * per16
    assert x.shape[-1] == y.shape[-2] == kp and y.shape[-1] == np_
    for t in (x, y):
        assert t.stride(-1) == 1 and t.stride(-2) * e % 16 == 0
    assert not x[..., k:].any() and not y[..., k:, :].any() and not y[..., n:].any()
    if kp != k:
        assert x.stride(-2) * e % 128 == 0  # the copy's storage rows, as Inductor strides them
    else:
        assert x is a  # aligned contiguous A is used as it is


def test_matmul_on_aligned_copies_takes_misaligned_layouts():
    """A transposed A whose stride (M = 13 elements) is misaligned, K and N aligned: a candidate (the spec says
    so), and the call copies A into a contiguous buffer (cuBLAS would get the misaligned stride otherwise)."""
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(16, 13, generator=gen).t()  # (13, 16), strides (1, 13)
    b = torch.randn(16, 8, generator=gen)
    spec = _mm_spec((13, 8, 16), "float32", [a.stride(), b.stride()])
    assert fused.candidate("matmul", {}, spec) is not None
    seen = []
    real = torch.matmul
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "matmul", lambda x, y: seen.append((x.is_contiguous(), y.is_contiguous())) or real(x, y))
        out = fused.get("matmul", {}).fn((a, b), {})
    assert seen == [(True, True)]
    torch.testing.assert_close(out.double(), a.double() @ b.double(), atol=1e-5, rtol=1e-5)


@cpu_only
def test_a_misaligned_matmul_search_times_the_torch_op(tmp_path):
    rep = engine.search("matmul", (33, 17, 21), "float32", device="cpu", cache=Cache(tmp_path / "forge.db"),
                        options=engine.SearchOptions(budget=1, workers=1, timeout=120))
    torch_op = [c for c in rep.candidates if c["variant"] == "torch"]
    assert len(torch_op) == 1 and torch_op[0]["status"] == "ok", torch_op
    assert torch_op[0]["label"].startswith("torch.matmul on copies")
    aligned = engine.search("matmul", (16, 16, 16), "float32", device="cpu", cache=Cache(tmp_path / "forge.db"),
                            options=engine.SearchOptions(budget=1, workers=1, timeout=120))
    assert not [c for c in aligned.candidates if c["variant"] == "torch"]  # torch.matmul is the baseline there
