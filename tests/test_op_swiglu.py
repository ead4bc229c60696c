"""swiglu op family: silu(x @ Wg^T) * (x @ Wu^T) in one kernel at odd shapes, 2-D and 3-D x, strided x and
weights, against the float64 oracle; the validator catching a kernel that swaps gate and up; the matcher on
the spellings (forge.trace.canonical) and on a tiny HF Llama's MLP; the Backend swapping a tiny model's
linear and swiglu regions for tuned kernels (acceptance forced, as on the interpreter eager always wins).

Kernels run in the Triton interpreter on CPU (tests/conftest.py); shapes are tiny."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from forge import codegen, ops
from forge.loader import load_module, write_source
from forge.opkit import Candidate
from forge.trace import canonical
from forge.tuner.validate import check_candidate
from tests.conftest import DEVICE, HAS_CUDA

OP = ops.get("swiglu")
MOD = OP.module
SEED = 777


def tiled(bm=16, bn=16, bk=16, group=1) -> Candidate:
    return Candidate.make("tiled", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group, num_warps=4, num_stages=1)


def _check(shape, dtype, attrs, cand, tmp_path, mutate=None):
    spec = MOD.make_spec(shape, dtype, DEVICE, attrs)
    src = codegen.render(OP, spec, cand)
    if mutate is not None:
        src = mutate(src)
    module = load_module(write_source(src, tmp_path))
    sync = torch.cuda.synchronize if DEVICE == "cuda" else (lambda: None)
    return check_candidate(MOD, module, spec, SEED, sync)


@pytest.mark.parametrize(("shape", "dtype", "attrs", "cand"), [
    ((1, 5, 3), "float32", {}, tiled()),
    ((7, 5, 3), "float16", {}, tiled()),
    ((33, 17, 40), "bfloat16", {}, tiled(group=2)),
    ((2, 3, 17, 20), "float16", {}, tiled(bn=32)),
    ((3, 20, 32), "float32", {}, tiled(bk=32)),  # EVEN_K: the unmasked loop
    ((7, 5, 3), "float32", {"strides": "1,7;1,5;c"}, tiled()),  # x column-major, Wg a transposed view
    ((2, 3, 17, 20), "bfloat16", {"strides": "96,32,1;c;40,1"}, tiled()),  # row gaps in x and Wu
])
def test_swiglu_matches_the_oracle(shape, dtype, attrs, cand, tmp_path):
    assert _check(shape, dtype, attrs, cand, tmp_path) is None


def test_the_validator_catches_gate_and_up_swapped(tmp_path):
    def swap(src):
        old = "y = acc_g * tl.where(acc_g >= 0.0, 1.0, e) / (1.0 + e) * acc_u"
        assert src.count(old) == 1
        return src.replace(old, "y = acc_u * tl.where(acc_g >= 0.0, 1.0, e) / (1.0 + e) * acc_g * acc_u / acc_g")
    assert _check((7, 5, 3), "float32", {}, tiled(), tmp_path) is None
    assert _check((7, 5, 3), "float32", {}, tiled(), tmp_path, swap) is not None


def test_refusals_name_the_reason():
    with pytest.raises(ValueError, match="no attributes"):
        MOD.make_spec((4, 5, 6), "float16", "cpu", {"bias": True})
    with pytest.raises(ValueError, match="MxNxK"):
        MOD.make_spec((4, 5), "float16", "cpu")
    x, w = torch.randn(3, 8), torch.randn(5, 8)
    with pytest.raises(ValueError, match="alike"):
        MOD.problem((x, w, torch.randn(4, 8)), {})
    with pytest.raises(ValueError, match="2-D or 3-D"):
        MOD.problem((torch.randn(2, 2, 3, 8), w, w), {})


def test_the_space_counts_both_accumulators():
    """Two weight tiles and two accumulators per program: no point that matmul's rule would reject at twice
    the accumulator size (it would spill)."""
    from forge import opkit

    spec = MOD.make_spec((4096, 4096, 4096), "float16", "cuda")
    for c in MOD.space(spec).all_points():
        p = c.p
        assert 2 * p["BLOCK_M"] * p["BLOCK_N"] / (32 * p["num_warps"]) <= opkit.GEMM_MAX_ACC_PER_THREAD
    assert MOD.default(spec) in MOD.space(spec)


# --- the matcher -------------------------------------------------------------------------------------------
def f_silu(x, wg, wu):
    return F.silu(F.linear(x, wg)) * F.linear(x, wu)


def f_sigmoid(x, wg, wu):
    g = F.linear(x, wg)
    return F.linear(x, wu) * (g * torch.sigmoid(g))


class SwiGLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(8, 6, bias=False)
        self.up = nn.Linear(8, 6, bias=False)
        self.act = nn.SiLU()

    def forward(self, x):
        return self.act(self.gate(x)) * self.up(x)


def f_two_inputs(x, y, wg, wu):
    return F.silu(F.linear(x, wg)) * F.linear(y, wu)


def f_bias(x, wg, wu, b):
    return F.silu(F.linear(x, wg, b)) * F.linear(x, wu)


X, WG, WU = torch.randn(3, 8), torch.randn(6, 8), torch.randn(6, 8)


@pytest.mark.parametrize(("fn", "args", "indices"), [
    (f_silu, (X, WG, WU), [0, 1, 2]),
    (f_sigmoid, (X, WG, WU), [0, 1, 2]),
    (SwiGLU(), (X,), None),
])
def test_matcher_recognises_the_spellings(fn, args, indices):
    traced = canonical(fn, args, {})
    got = MOD.match(traced.expr)
    assert got is not None, traced.expr
    if indices is not None:
        assert got == (indices, {})
    picked = tuple(traced.tensors[i] for i in got[0])
    torch.testing.assert_close(MOD.reference(picked, {}), fn(*args), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("fn", "args"), [(f_two_inputs, (X, X.clone(), WG, WU)), (f_bias, (X, WG, WU, WG[:, 0]))])
def test_matcher_refuses_what_is_not_swiglu(fn, args):
    assert MOD.match(canonical(fn, args, {}).expr) is None


# --- a tiny HF Llama: the MLP's gate/up pair is swiglu, the projections linear -------------------------------


def test_regions_of_a_tiny_llama():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    pytest.importorskip("transformers")
    from tests.test_trace_capture import _assert_region_computes_its_node, _by_op, _ids, _llama, _trace

    result = _trace(_llama(), _ids())
    by = _by_op(result)
    assert "silu_mul" not in by
    mlp = by["swiglu"]
    assert len(mlp) == 2 and all((r.shape, r.unsupported) == ((2, 16, 128, 64), None) for r in mlp)
    assert [n.rsplit(".", 2)[-2] for n in mlp[0].inputs[1:]] == ["gate_proj", "up_proj"]
    lin = by["linear"]
    # per layer: q, k, v, o_proj, down_proj; then lm_head. Every residual add feeds the next RMSNorm: it goes
    # with that norm (add_norm, kernels/add_norm.py), not with the GEMM before it as a residual epilogue.
    names = [r.inputs[[i for i, n in enumerate(r.inputs) if n.endswith(".weight")][0]].split(".")[-2] for r in lin]
    assert names == ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"] * 2 + ["lm_head"]
    assert [r.attrs["residual"] for r in lin] == [False] * 11 and len(by["add_norm"]) == 4
    for r in mlp + lin:
        _assert_region_computes_its_node(result, r)


# --- the backend swaps these regions for tuned kernels -----------------------------------------------------------
class Block(nn.Module):
    """A pre-norm-free transformer MLP pair: x + down(silu(gate(x)) * up(x)), then gelu(fc(.))."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(16, 24, bias=False)
        self.up = nn.Linear(16, 24, bias=False)
        self.down = nn.Linear(24, 16, bias=False)
        self.fc = nn.Linear(16, 8)

    def forward(self, x):
        h = x + self.down(F.silu(self.gate(x)) * self.up(x))
        return F.gelu(self.fc(h), approximate="tanh")


def _block_through_the_backend(tmp_path):
    """Block's eager output and its output through a forge Backend (searching misses at budget 1) on the
    second call: (model, x, backend, got, ref)."""
    from forge import backend as fb

    torch.manual_seed(0)
    model, x = Block().eval(), torch.randn(2, 5, 16)
    with torch.no_grad():
        ref = model(x)
    be = fb.Backend(miss="search", budget=1, interpreter=True, cache=str(tmp_path / "cache"))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=be)
    with torch.no_grad():
        compiled(x)
        got = compiled(x)
    torch._dynamo.reset()
    return model, x, be, got, ref


@pytest.mark.skipif(HAS_CUDA, reason="exercises the interpreter path (CPU tensors)")
def test_backend_swaps_linear_and_swiglu_regions(tmp_path, monkeypatch):
    from forge.tuner import stats

    monkeypatch.setattr(stats, "accepts", lambda *a, **k: True)  # the interpreter never beats eager
    monkeypatch.setenv("FORGE_CACHE", str(tmp_path / "cache"))
    model, x, be, got, ref = _block_through_the_backend(tmp_path)
    rep = be.explain()
    used = sorted((r.op, r.uses) for r in rep.regions)
    assert used == [("linear", "kernel"), ("linear", "kernel"), ("swiglu", "kernel")], rep
    acts = sorted(r.attrs["activation"] for r in rep.regions if r.op == "linear")
    assert acts == ["gelu_tanh", "none"]
    assert all(c.calls - c.fallbacks >= 1 for c in be.kernel_calls)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(HAS_CUDA, reason="exercises the interpreter path (CPU tensors)")
def test_backend_splits_a_region_decided_eager(tmp_path, monkeypatch):
    """A SwiGLU region whose search decides eager is split: its gate and up projections and silu(g) * u become
    regions of their own, resolved on their own (silu_mul's kernel runs), as eager-decided regions are in
    `forge trace` with the same cache; the model's output is unchanged."""
    from forge import shim
    from forge.cache import Cache
    from forge.tuner import stats, tracetools

    searched: list[str] = []
    real = shim._searcher()

    def searcher(op_name, *args, **kwargs):  # swiglu's search finds no winner; every other op's kernel wins
        searched.append(op_name)
        monkeypatch.setattr(stats, "accepts", lambda *a, **k: op_name != "swiglu")
        return real(op_name, *args, **kwargs)

    monkeypatch.setattr(shim, "_search_on_miss", searcher)
    monkeypatch.setenv("FORGE_CACHE", str(tmp_path / "cache"))
    model, x, be, got, ref = _block_through_the_backend(tmp_path)
    assert searched.count("swiglu") == 1, searched  # searched once: the second round reads its eager decision
    used = sorted((r.op, r.uses) for r in be.explain().regions)
    # down + residual, gate, up, silu(g) * u and fc + gelu: every one a kernel; no swiglu region is left
    assert used == [("linear", "kernel")] * 4 + [("silu_mul", "kernel")], used
    assert all(c.calls - c.fallbacks >= 1 for c in be.kernel_calls)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)

    # forge trace with the same cache lists the same split regions
    tgt = tracetools.Target(fn=model, args=(x,), description="Block")
    with torch.no_grad():
        result = tracetools.trace(tgt, "cpu", Cache(tmp_path / "cache"), "interpreter")
    assert sorted(r.op for r in result.regions) == ["linear"] * 4 + ["silu_mul"]
    with torch.no_grad():
        whole = tracetools.trace(tgt, "cpu")  # without a cache: the largest regions, swiglu whole
    assert sorted(r.op for r in whole.regions) == ["linear", "linear", "swiglu"]
