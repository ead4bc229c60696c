"""The rope op family: both variants against the oracle and against eager torch on realistic cos/sin
tables, the validator catching broken kernels, its space and default, the spellings the shim
recognises (and the wrong rotate_halfs it must not), layouts it refuses with a reason, and a
decorated call after a search."""

from __future__ import annotations

import re

import pytest
import torch

import forge
from forge import codegen, ops
from forge.loader import load_module, write_source
from forge.opkit import Candidate
from forge.tuner import engine, stats
from forge.tuner.validate import check_candidate
from tests.conftest import DEVICE, HAS_CUDA

SEED = 777
cpu_only = pytest.mark.skipif(HAS_CUDA, reason="exercises the interpreter path (CPU tensors)")


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _op():
    return ops.get("rope")


def _module(spec, cand, tmp_path, mutate=None):
    src = codegen.render(_op(), spec, cand)
    if mutate is not None:
        src = mutate(src)
    return load_module(write_source(src, tmp_path))


def _run(module, spec, inputs):
    op = _op().module
    out = op.alloc_output(inputs, spec)
    op.run(module, inputs, out, spec.attrs)
    _sync()
    return out


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def hf_tables(s: int, d: int, dtype, base: float = 10000.0):
    """cos/sin as Hugging Face builds them: the same frequencies in both halves."""
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = torch.outer(torch.arange(s, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype).to(DEVICE), emb.sin().to(dtype).to(DEVICE)


CANDIDATES = [Candidate.make("tile", BLOCK_S=4, HEADS=2, num_warps=1),
              Candidate.make("tile", BLOCK_S=8, HEADS=1, num_warps=4),
              Candidate.make("rows", BLOCK_Q=4, num_warps=2)]


# --- numerics ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("cand", CANDIDATES, ids=lambda c: c.label)
def test_variants_match_the_oracle(cand, dtype, tmp_path):
    """B*H = 3 rows (a partial head group of 2), S = 7 (a partial tile), D = 64 and D = 12 (a half of 6
    padded to 8 lanes)."""
    op = _op()
    for shape in [(1, 3, 7, 64), (3, 1, 7, 12)]:
        spec = op.module.make_spec(shape, dtype, DEVICE)
        assert check_candidate(op.module, _module(spec, cand, tmp_path), spec, SEED, _sync) is None, shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cand", CANDIDATES, ids=lambda c: c.label)
def test_matches_eager_on_real_rope_tables(cand, dtype, tmp_path):
    """On Hugging Face style cos/sin (not make_inputs' grids) the kernel agrees with the eager
    expression to within eager's own rounding (eager rounds 3 times in x's dtype, the kernel once)."""
    b, h, s, d = 2, 3, 9, 32
    name = str(dtype).removeprefix("torch.")
    spec = _op().module.make_spec((b, h, s, d), name, DEVICE)
    x = torch.randn(b, h, s, d, generator=torch.Generator().manual_seed(5)).to(dtype).to(DEVICE)
    cos, sin = hf_tables(s, d, dtype)
    y = _run(_module(spec, cand, tmp_path), spec, (x, cos, sin))
    exact = x.double() * cos.double() + rotate_half(x.double()) * sin.double()
    eager = x * cos + rotate_half(x) * sin
    ulp = {torch.float32: 2**-23, torch.float16: 2**-10, torch.bfloat16: 2**-7}[dtype]
    noise = 4 * 2**-23 * x.abs().max().item()  # fp32 arithmetic on terms up to |x|
    # one rounding to x's dtype: within one ulp of the exact value
    assert torch.allclose(y.double(), exact, rtol=ulp, atol=noise)
    assert torch.allclose(y.double(), eager.double(), rtol=4 * ulp, atol=4 * ulp)


def test_make_inputs_make_fp32_exact_and_halves_differ():
    """The comment in make_inputs: on its grids fp32 evaluates y exactly, so the oracle compare sees
    only the final rounding; and cos differs between halves, so a half-swapping kernel fails."""
    op = _op().module
    for dist in ("normal", "large", "tiny", "outliers"):
        spec = op.make_spec((2, 2, 5, 16), "float32", DEVICE)
        x, cos, sin = op.make_inputs(spec, 3, dist)
        assert (x != 0).all() and (cos != 0).all() and (sin != 0).all()
        assert cos.abs().max() <= 1 and sin.abs().max() <= 1
        y32 = x * cos + rotate_half(x) * sin                 # fp32, three roundings ...
        assert torch.equal(y32.double(), op.oracle((x, cos, sin), {})), dist  # ... none of them inexact
        assert not torch.equal(cos[:, :8], cos[:, 8:])


# --- the validator is not vacuous ---------------------------------------------------------------------

def _replace_once(old: str, new: str):
    def mutate(src: str) -> str:
        assert src.count(old) == 1, f"expected exactly one {old!r} in the rendered source"
        return src.replace(old, new)
    return mutate


@pytest.mark.parametrize("cand,old,new", [
    (CANDIDATES[0], "x1 * c1 - x2 * s1", "x1 * c1 + x2 * s1"),          # rotate_half without the minus
    (CANDIDATES[0], "x2 * c2 + x1 * s2", "x2 * c1 + x1 * s1"),          # the lower half's cos/sin for both
    (CANDIDATES[0], "if r < R:", "if r < R - 1:"),                      # last row unwritten (NaN poison)
    (CANDIDATES[2], "x1 * c1 - x2 * s1", "-x1 * c1 + x2 * s1"),         # minus on the wrong half
    (CANDIDATES[2], "(q % S)", "((q + 1) % S)"),                         # the next position's cos/sin
    (CANDIDATES[2], "q[:, None] < Q", "q[:, None] < Q - 1"),             # last row unwritten
])
def test_validator_rejects_broken_kernels(cand, old, new, tmp_path):
    op = _op()
    spec = op.module.make_spec((1, 3, 7, 16), "float16", DEVICE)
    module = _module(spec, cand, tmp_path, _replace_once(old, new))
    reason = check_candidate(op.module, module, spec, SEED, _sync)
    assert reason is not None and reason.startswith("normal inputs: "), reason
    # control: the unmutated candidate passes the same check
    assert check_candidate(op.module, _module(spec, cand, tmp_path), spec, SEED, _sync) is None


# --- spec, space, default -----------------------------------------------------------------------------

@pytest.mark.parametrize("device", ["cuda", "cpu"])
@pytest.mark.parametrize("shape", [*ops.get("rope").module.SPACE_SHAPES, ops.get("rope").module.MID_SHAPE])
def test_default_is_in_space_and_every_point_renders(shape, device):
    """(tests/test_templates.py's versions of these assume row shapes and row variants.)"""
    op = _op()
    for dtype in ("float16", "bfloat16", "float32"):
        spec = op.module.make_spec(shape, dtype, device)
        space = op.module.space(spec)
        assert op.module.default(spec) in space, (shape, dtype)
    points = list(space.all_points())
    assert points
    if shape in ((1, 32, 4096, 128), op.module.MID_SHAPE):
        assert {c.variant for c in points} == {"tile", "rows"}
        sources = set()
        for cand in points:
            src = codegen.render(op, spec, cand)
            compile(src, cand.label, "exec")
            assert f"forge_rope_{cand.variant}" in src
            for key, value in cand.params:
                assert re.search(rf"\b{key}={value}\b", src), (cand.label, key)
            sources.add(src)
        assert len(sources) == len(points)
    if shape[-1] == op.module.MAX_D:  # 8192 values per half-row: only rows' 16 warps hold them
        assert {c.variant for c in points} == {"rows"}


def test_test_candidates_exercise_masking():
    op = _op().module
    for shape in op.TEST_SHAPES:
        spec = op.make_spec(shape, "float32", "cpu")
        cands = op.test_candidates(spec)
        assert {c.variant for c in cands} == set(op.TEMPLATES)
        b, h, s, d = shape
        tile = cands[0].p
        assert s % tile["BLOCK_S"] or s < tile["BLOCK_S"]  # a partial S tile
        assert (b * h) % tile["HEADS"]                     # a partial head group
        assert (b * h * s) % cands[2].p["BLOCK_Q"]         # a partial block of rows


def test_make_spec_checks_shape_and_split():
    mk = _op().module.make_spec
    spec = mk((2, 4, 16, 8), "float16", "cpu", {"split": 4})
    assert spec.attrs == {} and spec == mk((2, 4, 16, 8), "float16", "cpu")  # one key for every spelling
    assert [t.shape for t in spec.inputs] == [(2, 4, 16, 8), (16, 8), (16, 8)]
    for shape, attrs, needle in [((2, 4, 16, 8), {"split": 3}, r"splits the last dim at 3, not at its middle"),
                                 ((2, 4, 16, 7), {}, "even head dim"), ((16, 8), {}, r"\(B, H, S, D\)"),
                                 ((2, 4, 16, 8), {"eps": 1}, "the attribute cos_batch only"),
                                 ((2, 4, 16, 8), {"cos_batch": 3}, "k = 1 or B = 2"),
                                 ((1, 1, 2, 32768), {}, "head dims above 16384")]:
        with pytest.raises(ValueError, match=needle):
            mk(shape, "float16", "cpu", attrs)


# --- the shim: spellings, non-matches, refused layouts, a decorated call after a search ------------------

def rope_slices(x, cos, sin):
    h = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * sin


def rope_chunk(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def rope_helper(q, cos, sin):
    return (q * cos) + (rotate_half(q) * sin)


def rope_reordered(x, cos, sin):
    return sin * rotate_half(x) + cos * x


def rope_split_neg(x, cos, sin):
    x1, x2 = torch.split(x, x.shape[-1] // 2, dim=-1)
    return torch.cat([x2.neg(), x1], dim=3) * sin + x * cos


def rope_explicit_dims(x, cos, sin):
    return x * cos + torch.cat((-x[:, :, :, 8:], x[:, :, :, :8]), dim=-1) * sin


def rope_off_center(x, cos, sin):
    h = x.shape[-1] // 2 - 1
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * sin


def rope_no_minus(x, cos, sin):
    h = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., h:], x[..., :h]), dim=-1) * sin


def rope_minus_on_lower(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((x2, -x1), dim=-1) * sin


def rope_halves_swapped(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x1, x2), dim=-1) * sin


def rope_mismatched_slices(x, cos, sin):
    return x * cos + torch.cat((-x[..., 8:], x[..., :7], x[..., 7:8]), dim=-1) * sin


def rope_other_tensor(x, cos, sin):
    return x * cos + rotate_half(sin) * sin


def rope_minus_sign(x, cos, sin):
    return x * cos - rotate_half(x) * sin


B, H, S, D = 2, 3, 5, 16
X = torch.randn(B, H, S, D)
COS, SIN = torch.randn(S, D), torch.randn(S, D)


@cpu_only
@pytest.mark.parametrize("fn", [rope_slices, rope_chunk, rope_helper, rope_reordered, rope_split_neg,
                                rope_explicit_dims])
def test_spellings_match_rope(fn):
    e = forge.explain(forge.optimize(fn, interpreter=True), X, COS, SIN)
    assert e.op == "rope" and e.uses == "eager" and e.reason == "cache miss: would search", e.reason
    assert e.key == forge.explain(forge.optimize(rope_chunk, interpreter=True), X, COS, SIN).key


@cpu_only
@pytest.mark.parametrize("fn", [rope_no_minus, rope_minus_on_lower, rope_halves_swapped, rope_mismatched_slices,
                                rope_other_tensor, rope_minus_sign])
def test_wrong_rotate_half_does_not_match(fn):
    f = forge.optimize(fn, interpreter=True, warn=False)
    e = forge.explain(f, X, COS, SIN)
    assert e.uses == "eager" and e.op is None and "no op family matches" in e.reason, e.reason
    # as written (not searched: its first call would search the regions Dynamo finds, 5 s a case here)
    assert torch.equal(forge.optimize(fn, interpreter=True, warn=False, search=False)(X, COS, SIN), fn(X, COS, SIN))


@cpu_only
def test_off_center_split_falls_back_with_the_reason():
    """x[..., 7:] / x[..., :7] of D = 16 has rotate_half's structure; only the shape shows that 7 is
    not the middle, so the matcher hands the split to make_spec, which refuses it."""
    f = forge.optimize(rope_off_center, interpreter=True, warn=False)
    e = forge.explain(f, X, COS, SIN)
    assert e.uses == "eager" and e.op == "rope"
    assert "splits the last dim at 7, not at its middle (D/2 = 8)" in e.reason, e.reason
    assert torch.equal(f(X, COS, SIN), rope_off_center(X, COS, SIN))


@cpu_only
def test_hugging_face_layouts_are_taken():
    """HF's call: q a transposed (B, S, H, D) projection, cos/sin (1 or B, 1, S, D) tables."""
    f = forge.optimize(rope_chunk, interpreter=True, warn=False, search=False)
    xq = torch.randn(B, S, H, D).transpose(1, 2)
    for cos, sin in ((COS[None, None], SIN[None, None]),
                     (COS.expand(B, 1, S, D).contiguous(), SIN.expand(B, 1, S, D).contiguous())):
        for x in (X, xq):
            e = forge.explain(f, x, cos, sin)
            assert e.uses == "eager" and e.op == "rope" and e.reason.startswith("cache miss"), e.reason


@cpu_only
@pytest.mark.parametrize("args,needle", [
    ((X, COS[None, None], SIN), "cos (1, 1, 5, 16) and sin (5, 16) must have one shape"),
    ((X, COS.expand(1, H, S, D).contiguous(), SIN.expand(1, H, S, D).contiguous()),
     f"cos and sin must be (S, D) = (5, 16) or (1 or B, 1, S, D), got (1, {H}, 5, 16)"),
    ((X, COS.t().contiguous().t(), SIN), "non-contiguous input 1"),
    ((X[0], COS, SIN), "x must be 4-D"),
    ((X, COS.half(), SIN.half()), "must share one dtype"),
    ((torch.randn(B, H, D, S).transpose(-1, -2), COS, SIN), "last dimension must be contiguous"),
])
def test_unsupported_layouts_fall_back_with_a_reason(args, needle):
    f = forge.optimize(rope_chunk, interpreter=True, warn=False)
    e = forge.explain(f, *args)
    assert e.uses == "eager" and e.op == "rope" and needle in e.reason, e.reason
    assert torch.equal(f(*args), rope_chunk(*args))


@cpu_only
@pytest.mark.slow
def test_decorated_call_equals_eager_after_a_search(monkeypatch):
    # On the interpreter eager always wins; force acceptance to exercise the kernel path.
    monkeypatch.setattr(stats, "accepts", lambda *a, **k: True)
    searches = []
    real = engine.search
    monkeypatch.setattr(engine, "search", lambda *a, **k: searches.append(a) or real(*a, **k))
    f = forge.optimize(rope_helper, budget=2, interpreter=True)
    x = torch.randn(2, 4, 6, 32)
    cos, sin = hf_tables(6, 32, torch.float32)
    y = f(x, cos, sin)
    assert len(searches) == 1
    e = forge.explain(f, x, cos, sin)
    assert e.uses == "kernel" and e.op == "rope" and e.variant in ("tile", "rows"), e.reason
    exact = rope_helper(x.double(), cos.double(), sin.double())
    assert torch.allclose(y.double(), exact, rtol=1e-6, atol=1e-6)
    assert torch.allclose(y, rope_helper(x, cos, sin), rtol=1e-5, atol=1e-6)
    # another spelling, same signature: a cache hit, no search
    monkeypatch.setattr(engine, "search", lambda *a, **k: pytest.fail("cache hit must not search"))
    g = forge.optimize(rope_chunk, interpreter=True)
    assert forge.explain(g, x, cos, sin).uses == "kernel"
    assert torch.equal(g(x, cos, sin), y)
