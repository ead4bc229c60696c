"""The silu_mul op family (SwiGLU gate): every variant against the float64 oracle, the matcher on
every spelling (and which tensor is a and which is b), fallbacks with reasons, the validator on broken
kernels, and an end-to-end decorated call through a tiny interpreter search."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import forge
from forge import codegen, ops
from forge.loader import load_module, write_source
from forge.opkit import Candidate
from forge.trace import canonical
from forge.tuner import stats
from forge.tuner.validate import check_candidate
from tests.conftest import DEVICE, HAS_CUDA

SEED = 11
OP = ops.get("silu_mul")
MOD = OP.module
cpu_only = pytest.mark.skipif(HAS_CUDA, reason="exercises the interpreter path (CPU tensors)")


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _load(spec, cand, tmp_path, mutate=None):
    src = codegen.render(OP, spec, cand)
    if mutate is not None:
        src = mutate(src)
    return load_module(write_source(src, tmp_path))


FLAT = Candidate.make("flat", BLOCK=256, num_warps=2)
# On the interpreter (4 "SMs") at 3x333: 8 blocks of 128 over 4 programs, so every program loops
# twice and the last block is partly masked.
PERSISTENT = Candidate.make("persistent", BLOCK=128, num_warps=1, PROGRAMS_PER_SM=1, num_stages=1)


# --- numerics ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("cand", [FLAT, PERSISTENT], ids=lambda c: c.variant)
@pytest.mark.parametrize("shape", [(3, 333), (), (2, 1, 1)], ids=["3x333", "0d", "2x1x1"])
def test_variants_match_the_oracle(dtype, cand, shape, tmp_path):
    spec = MOD.make_spec(shape, dtype, DEVICE)
    assert check_candidate(MOD, _load(spec, cand, tmp_path), spec, SEED, _sync) is None


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_saturated_gate_values(dtype, tmp_path):
    """silu saturates to 0 (a -> -inf) and a (a -> +inf): no NaN or inf, b applied."""
    big = 6e4 if dtype == "float16" else 3e38
    a = torch.tensor([-big, -1e4, -100.0, -20.0, -1.0, -1e-4, 0.0, 1e-4, 1.0, 20.0, 100.0, 1e4, big],
                     dtype=getattr(torch, dtype), device=DEVICE)
    b = torch.linspace(-0.9, 0.9, a.numel(), device=DEVICE).to(a.dtype)  # fp16: 6e4 * b stays finite
    spec = MOD.make_spec(tuple(a.shape), dtype, DEVICE)
    y = torch.full_like(a, float("nan"))
    MOD.run(_load(spec, FLAT, tmp_path), (a, b), y, {})
    _sync()
    ref = F.silu(a.double()) * b.double()
    tol = MOD.tolerance(dtype)
    torch.testing.assert_close(y.double(), ref.to(y.device), rtol=tol.rtol, atol=tol.atol)
    assert torch.isfinite(y).all() and y[0].item() == 0.0


def test_make_spec():
    spec = MOD.make_spec((2, 5), "bfloat16", "cuda")
    assert [(t.shape, t.dtype) for t in spec.inputs] == [((2, 5), "bfloat16")] * 2 and spec.attrs == {}
    with pytest.raises(ValueError, match="inplace=True"):
        MOD.make_spec((2, 5), "bfloat16", "cuda", {"inplace": True})
    assert MOD.make_spec((2, 5), "float32", "cpu", {"inplace": False}).attrs == {}
    with pytest.raises(ValueError, match="takes only the attribute form"):
        MOD.make_spec((2, 5), "float32", "cpu", {"alpha": 2.0})


def test_space_default_and_persistent_grid():
    big = MOD.make_spec((8192, 14336), "bfloat16", "cuda")
    assert {c.variant for c in MOD.space(big).all_points()} == {"flat", "persistent"}
    assert MOD.default(big) in MOD.space(big)
    decode = MOD.make_spec((1, 4096), "float16", "cuda")
    assert {c.variant for c in MOD.space(decode).all_points()} == {"flat"}
    src = codegen.render(OP, MOD.make_spec((999,), "float32", "cpu"), PERSISTENT)
    assert "ITERS: tl.constexpr" in src  # the interpreter's loop bound (opkit.row_render_context says why)
    cuda_src = codegen.render(OP, MOD.make_spec((999,), "float32", "cuda"), PERSISTENT)
    assert "ITERS: tl.constexpr" not in cuda_src and "ITERS, BLOCK: tl.constexpr" in cuda_src


# --- the validator is not vacuous --------------------------------------------------------------------
def _replace_once(old: str, new: str):
    def mutate(src: str) -> str:
        assert src.count(old) == 1, f"expected exactly one {old!r} in the rendered source"
        return src.replace(old, new)
    return mutate


@pytest.mark.parametrize(("old", "new"), [
    ("/ (1.0 + e) * b", "/ (1.0 + e)"),          # ignores b
    ("tl.where(a >= 0.0, 1.0, e)", "1.0"),        # sigmoid wrong for negative a
    ("offs += step", "offs += step // 2"),        # persistent only: revisits blocks, leaves others unwritten
])
@pytest.mark.parametrize("cand", [FLAT, PERSISTENT], ids=lambda c: c.variant)
def test_validator_rejects_broken_kernels(old, new, cand, tmp_path):
    if old.startswith("offs +=") and cand.variant == "flat":
        pytest.skip("the flat kernel has no loop")
    # 3x33333 elements: 782 blocks of 128, more than the persistent grid on any GPU (1 program per SM) or
    # the interpreter (4), so every program loops and a wrong stride skips blocks.
    spec = MOD.make_spec((3, 33333), "float32", DEVICE)
    reason = check_candidate(MOD, _load(spec, cand, tmp_path, _replace_once(old, new)), spec, SEED, _sync)
    assert reason is not None and reason.startswith("normal inputs: "), reason


# --- recognising silu(a) * b in user code ------------------------------------------------------------
def silu_times_b(a, b):
    return F.silu(a) * b


def b_times_silu(a, b):
    return b * F.silu(a)


def sigmoid_form(a, b):
    return a * torch.sigmoid(a) * b


def sigmoid_method_form(a, b):
    return b * (a.sigmoid() * a)


def explicit_sigmoid(a, b):
    return a / (1 + torch.exp(-a)) * b


def torch_silu(a, b):
    return torch.nn.functional.silu(a, inplace=False) * b


def b_first(b, a):  # parameter order is not (a, b): indices must follow the gate's argument
    return F.silu(a) * b


def gate_of_b(a, b):  # a * sigmoid(b) * b == silu(b) * a
    return a * torch.sigmoid(b) * b


A = torch.randn(4, 24)
B = torch.randn(4, 24)


@cpu_only
@pytest.mark.parametrize(("fn", "indices"), [
    (silu_times_b, [0, 1]), (b_times_silu, [0, 1]), (sigmoid_form, [0, 1]), (sigmoid_method_form, [0, 1]),
    (explicit_sigmoid, [0, 1]), (torch_silu, [0, 1]), (b_first, [1, 0]), (gate_of_b, [1, 0]),
], ids=lambda v: getattr(v, "__name__", str(v)))
def test_spellings_match_silu_mul(fn, indices):
    # the sigmoid written out is recorded as such: the baseline runs it so, F.silu(a) * b competes
    formula = fn in (sigmoid_form, sigmoid_method_form, explicit_sigmoid, gate_of_b)
    assert MOD.match(canonical(fn, (A, B), {}).expr) == (indices, {"form": "formula"} if formula else {})
    e = forge.explain(forge.optimize(fn, interpreter=True), A, B)
    assert e.op == "silu_mul" and e.uses == "eager" and e.reason == "cache miss: would search"


def silu_plus(a, b):
    return F.silu(a) + b


def silu_times_b_times_2(a, b):
    return F.silu(a) * b * 2


def sigmoid_without_a(a, b):
    return torch.sigmoid(a) * b


def scaled_sigmoid(a, b):
    return a * torch.sigmoid(1.702 * a) * b


def silu_times_silu(a, b):
    return F.silu(a) * F.silu(b)


def exp_not_neg(a, b):
    return a / (1 + torch.exp(a)) * b


@cpu_only
@pytest.mark.parametrize("fn", [silu_plus, silu_times_b_times_2, sigmoid_without_a, scaled_sigmoid,
                                silu_times_silu, exp_not_neg], ids=lambda f: f.__name__)
def test_non_matches_fall_back(fn):
    assert MOD.match(canonical(fn, (A, B), {}).expr) is None
    f = forge.optimize(fn, interpreter=True, warn=False)
    e = forge.explain(f, A, B)
    if "silu" in fn.__name__:  # F.silu inside a larger expression: no family's
        assert e.uses == "eager" and e.op is None and "no op family matches" in e.reason
    else:  # not silu_mul; an elementwise chain, which the generic pointwise family takes as written
        assert e.uses == "eager" and e.op == "pointwise" and e.reason == "cache miss: would search"
    # as written (not searched: a pointwise search on the interpreter is most of this test's time)
    assert torch.equal(forge.optimize(fn, interpreter=True, warn=False, search=False)(A, B), fn(A, B))


def silu_inplace(a, b):
    return F.silu(a, inplace=True) * b


@cpu_only
def test_unsupported_calls_fall_back_with_a_reason():
    e = forge.explain(forge.optimize(silu_inplace, interpreter=True, warn=False), A.clone(), B)
    assert e.op == "silu_mul" and e.uses == "eager" and "inplace=True" in e.reason
    f = forge.optimize(silu_times_b, interpreter=True, warn=False)
    e = forge.explain(f, A, B[0])  # b broadcast over rows: not the kernel's layout
    assert e.op == "silu_mul" and "do not fit silu_mul's kernel" in e.reason
    assert "dtype" in forge.explain(f, A, B.half()).reason
    assert "dtype" in forge.explain(f, A.double(), B.double()).reason
    assert "non-contiguous" in forge.explain(f, A.t(), B.t()).reason


# --- end to end ---------------------------------------------------------------------------------------
@cpu_only
@pytest.mark.slow
@pytest.mark.parametrize("fn", [sigmoid_form, b_first], ids=lambda f: f.__name__)
def test_decorated_call_equals_eager_after_search(fn, monkeypatch):
    # On the interpreter eager always wins; force acceptance to exercise the kernel path.
    monkeypatch.setattr(stats, "accepts", lambda *a, **k: True)
    f = forge.optimize(fn, budget=2, interpreter=True)
    x, z = torch.randn(2, 7, 45), torch.randn(2, 7, 45)
    y = f(x, z)
    e = forge.explain(f, x, z)
    assert e.uses == "kernel" and e.op == "silu_mul" and e.variant in MOD.TEMPLATES
    torch.testing.assert_close(y, fn(x, z), rtol=1e-5, atol=1e-6)
    assert torch.equal(f(x, z), y)


def test_form_formula_is_the_users_sigmoid_spelling():
    spec = MOD.make_spec((3, 37), "float32", "cpu", {"form": "formula"})
    a, b = MOD.make_inputs(spec, 0, "normal")
    ref = MOD.reference((a, b), spec.attrs)
    assert torch.allclose(ref, a * torch.sigmoid(a) * b, rtol=0, atol=0)
    assert torch.allclose(ref, F.silu(a) * b, rtol=1e-6, atol=1e-7)
    assert MOD.make_spec((3,), "float32", "cpu").attrs == {}
    with pytest.raises(ValueError, match="form='fancy'"):
        MOD.make_spec((3,), "float32", "cpu", {"form": "fancy"})
