"""The gelu op family: both approximate modes against the float64 oracle in every variant, the matcher
on every spelling (and not on near-misses with a wrong constant), the validator on broken kernels,
and an end-to-end decorated call through a tiny interpreter search."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import forge
from forge import codegen, ops
from forge.loader import load_module, write_source
from forge.opkit import Candidate
from forge.trace import canonical
from forge.tuner import stats
from forge.tuner.validate import check_candidate, compare
from tests.conftest import DEVICE, HAS_CUDA

SEED = 7
OP = ops.get("gelu")
MOD = OP.module
# Shim tests use CPU tensors: the interpreter path.
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
@pytest.mark.parametrize("mode", ["none", "tanh"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("cand", [FLAT, PERSISTENT], ids=lambda c: c.variant)
def test_both_modes_match_the_oracle(mode, dtype, cand, tmp_path):
    spec = MOD.make_spec((3, 333), dtype, DEVICE, {"approximate": mode})
    module = _load(spec, cand, tmp_path)
    assert check_candidate(MOD, module, spec, SEED, _sync) is None


@pytest.mark.parametrize("mode", ["none", "tanh"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_extreme_values_are_exact_limits(mode, dtype, tmp_path):
    """Saturated tails (x -> -inf gives -0, x -> +inf gives x) without NaN or inf, compared with
    F.gelu in float64."""
    big = 6e4 if dtype == "float16" else 3e38
    x = torch.tensor([-big, -1e4, -30.0, -9.0, -5.0, -1.0, -1e-4, 0.0, 1e-4, 1.0, 5.0, 9.0, 30.0, 1e4, big],
                     dtype=getattr(torch, dtype), device=DEVICE)
    spec = MOD.make_spec(tuple(x.shape), dtype, DEVICE, {"approximate": mode})
    module = _load(spec, FLAT, tmp_path)
    y = torch.full_like(x, float("nan"))
    MOD.run(module, (x,), y, spec.attrs)
    _sync()
    ref = F.gelu(x.double(), approximate=mode)
    assert torch.isfinite(y).all(), y
    tol = MOD.tolerance(dtype)
    torch.testing.assert_close(y.double(), ref.to(y.device), rtol=tol.rtol, atol=tol.atol)
    assert y[-1].item() == x[-1].item() and y[0].item() == 0.0


@pytest.mark.parametrize("cand", [FLAT, PERSISTENT], ids=lambda c: c.variant)
def test_erf_mode_keeps_relative_precision_in_the_negative_tail(cand, tmp_path):
    """gelu(x) for x in [-10, -4] is 1e-4 .. 1e-22: fp32 1 + erf(x / sqrt(2)) (PyTorch's formula) is 5% off
    at -5 and 0 below -5.7; the kernel's erfc form stays within 2e-5 relative."""
    x = torch.linspace(-10.0, -4.0, 1001, device=DEVICE)
    spec = MOD.make_spec(tuple(x.shape), "float32", DEVICE)
    y = torch.full_like(x, float("nan"))
    MOD.run(_load(spec, cand, tmp_path), (x,), y, spec.attrs)
    _sync()
    xd = x.double()
    ref = xd * 0.5 * torch.special.erfc(-xd / math.sqrt(2))  # F.gelu cancels to 0 below -8.3 even in float64
    assert float(((y.double() - ref) / ref).abs().max()) < 2e-5


def test_zero_dim_tensor(tmp_path):
    spec = MOD.make_spec((), "float32", DEVICE, {"approximate": "tanh"})
    assert check_candidate(MOD, _load(spec, PERSISTENT, tmp_path), spec, SEED, _sync) is None


def test_make_spec_normalises_and_rejects_modes():
    assert MOD.make_spec((4,), "float16", "cpu", {"approximate": "TANH"}).attrs == {"approximate": "tanh"}
    assert MOD.make_spec((4,), "float16", "cpu").attrs == {"approximate": "none"}
    with pytest.raises(ValueError, match="approximate='sigmoid' is not supported"):
        MOD.make_spec((4,), "float16", "cpu", {"approximate": "sigmoid"})
    with pytest.raises(ValueError, match="not \\['eps'\\]"):
        MOD.make_spec((4,), "float16", "cpu", {"eps": 1e-5})


# --- the space --------------------------------------------------------------------------------------
def test_space_rules():
    big = MOD.make_spec((8192, 14336), "bfloat16", "cuda")
    pts = list(MOD.space(big).all_points())
    assert {c.variant for c in pts} == {"flat", "persistent"}
    for c in pts:  # at least one 16-byte vector per thread, at most 32 values
        assert 8 <= c.p["BLOCK"] / (32 * c.p["num_warps"]) <= 32
    # decode-sized: one block; a persistent grid would never loop, blocks above 4096 only mask lanes
    small = MOD.make_spec((1, 4096), "bfloat16", "cuda")
    pts = list(MOD.space(small).all_points())
    assert {c.variant for c in pts} == {"flat"} and max(c.p["BLOCK"] for c in pts) == 4096
    assert MOD.default(small) in MOD.space(small)
    assert MOD.default(big) == Candidate.make("flat", BLOCK=2048, num_warps=4)
    tiny = MOD.make_spec((1,), "float32", "cuda")
    assert MOD.default(tiny) in MOD.space(tiny)


def test_persistent_grid_loops_and_offsets_are_int64(tmp_path):
    spec = MOD.make_spec((1, 65537), "float32", "cpu")
    cand = Candidate.make("persistent", BLOCK=256, num_warps=2, PROGRAMS_PER_SM=1, num_stages=1)
    src = codegen.render(OP, spec, cand)
    assert "tl.program_id(0).to(tl.int64)" in src and "tl.num_programs(0).to(tl.int64)" in src
    module = load_module(write_source(src, tmp_path))
    x = torch.empty(65537)
    # 257 blocks over 4 interpreter "SMs": 65 rounds, the last one only partly used
    assert module._grid(x, 65537, BLOCK=256, PROGRAMS_PER_SM=1) == (4, 65)
    assert module._grid(x, 7, BLOCK=256, PROGRAMS_PER_SM=8) == (1, 1)


# --- the validator is not vacuous --------------------------------------------------------------------
def _replace_once(old: str, new: str):
    def mutate(src: str) -> str:
        assert src.count(old) == 1, f"expected exactly one {old!r} in the rendered source"
        return src.replace(old, new)
    return mutate


@pytest.mark.parametrize(("mode", "old", "new"), [
    ("none", "tl.abs(x) * 0.7071067811865476", "tl.abs(x) * 0.7"),  # erfc(x / sqrt(2)) at x / 1.43
    ("none", "tl.where(x < 0.0, 0.5 * c, 1.0 - 0.5 * c)", "(1.0 - 0.5 * c)"),  # Phi wrong for x < 0
    ("tanh", "0.044715 * x", "0.04 * x"),                # the cubic coefficient of the tanh approximation
    ("tanh", "tl.where(u >= 0.0, 1.0, e)", "1.0"),       # sigmoid(2u) wrong for negative u
])
@pytest.mark.parametrize("cand", [FLAT, PERSISTENT], ids=lambda c: c.variant)
def test_validator_rejects_wrong_math(mode, old, new, cand, tmp_path):
    spec = MOD.make_spec((3, 333), "float32", DEVICE, {"approximate": mode})
    module = _load(spec, cand, tmp_path, _replace_once(old, new))
    reason = check_candidate(MOD, module, spec, SEED, _sync)
    assert reason is not None and reason.startswith("normal inputs: "), reason


def test_validator_catches_an_unwritten_last_element(tmp_path):
    n = 999
    spec = MOD.make_spec((n,), "float32", DEVICE)
    module = _load(spec, FLAT, tmp_path, _replace_once("y.to(Y.dtype.element_ty), mask=mask)",
                                                       "y.to(Y.dtype.element_ty), mask=offs < numel - 1)"))
    reason = check_candidate(MOD, module, spec, SEED, _sync)
    assert reason == f"normal inputs: NaN in output (1 of {n} elements, first at ({n - 1},))"


# --- recognising gelu in user code -------------------------------------------------------------------
def gelu_default(x):
    return F.gelu(x)


def gelu_tanh_kw(x):
    return F.gelu(x, approximate="tanh")


def gelu_none_kw(x):
    return torch.nn.functional.gelu(x, approximate="none")


def erf_formula(x):
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def erf_formula_const(x):
    return x * 0.5 * (1.0 + torch.erf(x * 0.7071067811865476))


def erf_formula_halved(x):
    return x * (1.0 + torch.special.erf(x / 1.4142135623730951)) / 2


def erf_formula_distributed(x):
    return x * (0.5 + 0.5 * torch.erf(x * 0.70710678))


def tanh_formula_cube(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x * x * x)))


def tanh_formula_fast(x):  # Hugging Face's FastGELUActivation
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


def tanh_formula_pow(x):  # the task's spelling (and Hugging Face's NewGELUActivation)
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * torch.pow(x, 3))))


X = torch.randn(5, 37)

SPELLINGS = [
    (gelu_default, "none"), (gelu_tanh_kw, "tanh"), (gelu_none_kw, "none"),
    (torch.nn.GELU(), "none"), (torch.nn.GELU("tanh"), "tanh"), (torch.nn.GELU(approximate="none"), "none"),
    (erf_formula, "none"), (erf_formula_const, "none"), (erf_formula_halved, "none"),
    (erf_formula_distributed, "none"), (tanh_formula_cube, "tanh"), (tanh_formula_fast, "tanh"),
    (tanh_formula_pow, "tanh"),
]


def _id(fn) -> str:
    return getattr(fn, "__name__", None) or repr(fn)


@cpu_only
@pytest.mark.parametrize(("fn", "mode"), SPELLINGS,
                         ids=[_id(s.values[0] if hasattr(s, "values") else s[0]) for s in SPELLINGS])
def test_spellings_match_gelu(fn, mode):
    # A written-out formula is recorded as such (form="formula"): the search's baseline is then that formula
    # as the user runs it, with torch's F.gelu one more candidate (forge/fused.py).
    called = fn in (gelu_default, gelu_tanh_kw, gelu_none_kw) or isinstance(fn, torch.nn.GELU)
    want = {"approximate": mode} if called else {"approximate": mode, "form": "formula"}
    assert MOD.match(canonical(fn, (X,), {}).expr) == ([0], want)
    e = forge.explain(forge.optimize(fn, interpreter=True), X)
    assert e.op == "gelu" and e.uses == "eager" and e.reason == "cache miss: would search"


def test_matcher_reads_an_expanded_pow():
    """What tanh_formula_pow becomes once forge/trace.py expands integer powers (x**3 -> x*x*x)."""
    x = ("input", 0)
    cube = ("mul", ("const", 0.044715), x, x, x)
    expr = ("mul", ("add", ("const", 1), ("tanh", ("mul", ("add", x, cube), ("const", math.sqrt(2 / math.pi))))),
            ("const", 0.5), x)
    assert MOD.match(expr) == ([0], {"approximate": "tanh", "form": "formula"})


def wrong_erf_scale(x):
    return 0.5 * x * (1 + torch.erf(x / 1.5))


def wrong_half(x):
    return 0.45 * x * (1 + torch.erf(x / math.sqrt(2)))


def wrong_offset(x):
    return 0.5 * x * (2 + torch.erf(x / math.sqrt(2)))


def wrong_cubic(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.04 * x * x * x)))


def wrong_sqrt_2_pi(x):
    return 0.5 * x * (1 + torch.tanh(0.8 * (x + 0.044715 * x * x * x)))


def wrong_power(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x * x)))


def rounded_constant(x):  # 1e-5 off sqrt(2/pi): close, but a different function
    return 0.5 * x * (1 + torch.tanh(0.79788 * (x + 0.044715 * x * x * x)))


def erf_of_x_squared(x):
    return 0.5 * x * (1 + torch.erf(x * x / math.sqrt(2)))


def tanh_in_erf_formula(x):  # tanh with erf's argument
    return 0.5 * x * (1 + torch.tanh(x / math.sqrt(2)))


def two_inputs(x, z):
    return 0.5 * z * (1 + torch.erf(x / math.sqrt(2)))


def no_outer_x(x):
    return 0.5 * (1 + torch.erf(x / math.sqrt(2)))


@cpu_only
@pytest.mark.parametrize("fn", [wrong_erf_scale, wrong_half, wrong_offset, wrong_cubic, wrong_sqrt_2_pi,
                                wrong_power, rounded_constant, erf_of_x_squared, tanh_in_erf_formula,
                                two_inputs, no_outer_x], ids=_id)
def test_near_misses_do_not_match(fn):
    args = (X, X.clone()) if fn is two_inputs else (X,)
    assert MOD.match(canonical(fn, args, {}).expr) is None
    f = forge.optimize(fn, interpreter=True, warn=False)
    e = forge.explain(f, *args)
    # Not gelu; an elementwise chain, which the generic pointwise family takes as written.
    assert e.uses == "eager" and e.op == "pointwise" and e.reason == "cache miss: would search"
    # run as written (not searched: a pointwise search on the interpreter is what cost this test 6 s a case)
    assert torch.equal(forge.optimize(fn, interpreter=True, warn=False, search=False)(*args), fn(*args))


def test_unknown_mode_is_matched_so_make_spec_names_it():
    res = MOD.match(("gelu", ("input", 0), ("const", "Sigmoid")))
    assert res == ([0], {"approximate": "sigmoid"})
    with pytest.raises(ValueError, match="approximate='sigmoid'"):
        MOD.make_spec((4,), "float32", "cpu", res[1])


@cpu_only
def test_fallbacks_name_the_reason():
    f = forge.optimize(gelu_default, interpreter=True, warn=False)
    assert "dtype" in forge.explain(f, X.double()).reason
    assert "non-contiguous" in forge.explain(f, X.t()).reason
    assert "require grad" in forge.explain(f, X.clone().requires_grad_()).reason


# --- end to end ---------------------------------------------------------------------------------------
@cpu_only
@pytest.mark.slow
@pytest.mark.parametrize(("fn", "mode"), [(erf_formula, "none"), (torch.nn.GELU("tanh"), "tanh")],
                         ids=["erf_formula", "GELU_tanh"])
def test_decorated_call_equals_eager_after_search(fn, mode, monkeypatch):
    # On the interpreter eager always wins; force acceptance to exercise the kernel path.
    monkeypatch.setattr(stats, "accepts", lambda *a, **k: True)
    f = forge.optimize(fn, budget=2, interpreter=True)
    x = torch.randn(3, 5, 41)
    y = f(x)
    e = forge.explain(f, x)
    assert e.uses == "kernel" and e.op == "gelu" and e.variant in MOD.TEMPLATES
    torch.testing.assert_close(y, F.gelu(x, approximate=mode), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(y, fn(x), rtol=1e-5, atol=1e-6)
    # the same signature again: the bound kernel, same values
    assert torch.equal(f(x), y)


@pytest.mark.parametrize("mode", ["none", "tanh"])
def test_form_formula_runs_the_formula_as_written_and_keys_apart(mode):
    """form="formula": the reference (the search's baseline) is the user's written-out formula, equal to the
    oracle within the tolerance; the fused-call spec and the formula spec are different specs and keys."""
    from forge import key as keys

    spec = MOD.make_spec((3, 37), "float32", "cpu", {"approximate": mode, "form": "formula"})
    assert spec.attrs == {"approximate": mode, "form": "formula"}
    (x,) = MOD.make_inputs(spec, 0, "normal")
    ref = MOD.reference((x,), spec.attrs)
    assert not torch.equal(ref, torch.nn.functional.gelu(x, approximate=mode)) or mode == "none"
    assert compare(ref, MOD.oracle((x,), spec.attrs), MOD.tolerance("float32")) is None
    fused = MOD.make_spec((3, 37), "float32", "cpu", {"approximate": mode})
    op = ops.get("gelu")
    assert keys.locate(op, spec, "interpreter", None).key != keys.locate(op, fused, "interpreter", None).key
    with pytest.raises(ValueError, match="form='sketch'"):
        MOD.make_spec((3,), "float32", "cpu", {"form": "sketch"})
