"""matmul op family: spellings the shim recognises, fallbacks with reasons, masking tails in M, N and K,
split-K (empty splits, determinism), the validator rejecting broken kernels, the search space, the
K-dependent tolerance, and an end-to-end decorated call after a tiny interpreter search.

Kernels run on the GPU where there is one, else in the Triton interpreter (tests/conftest.py)."""

from __future__ import annotations

import math

import pytest
import torch

import forge
from forge import codegen, ops
from forge.loader import load_module, write_source
from forge.opkit import DISTRIBUTIONS, ROW_TOLERANCE, Candidate
from forge.spec import DTYPES
from forge.tuner import stats
from forge.tuner.validate import check_candidate, compare, poison
from tests.conftest import DEVICE, HAS_CUDA

OP = ops.get("matmul")
MOD = OP.module
SEED = 31_337
# Tests that put CPU tensors through the shim (the interpreter path), as in tests/test_shim.py.
cpu_only = pytest.mark.skipif(HAS_CUDA, reason="exercises the interpreter path (CPU tensors)")
# Interpreter candidates are tiny, GPU ones need pipelining stages (num_stages=1 is valid there too).
STAGES = 1


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def tiled(bm=16, bn=16, bk=16, group=1) -> Candidate:
    return Candidate.make("tiled", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group, num_warps=4,
                          num_stages=STAGES)


def persistent(bm=16, bn=16, bk=16, group=2) -> Candidate:
    return Candidate.make("persistent", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group, num_warps=4,
                          num_stages=STAGES, FLATTEN=False)


def splitk(split, bm=16, bn=16, bk=16) -> Candidate:
    return Candidate.make("splitk", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=4,
                          num_stages=STAGES)


def _module(spec, cand, tmp_path, mutate=None):
    src = codegen.render(OP, spec, cand)
    if mutate is not None:
        src = mutate(src)
    return load_module(write_source(src, tmp_path))


def _replace_once(old: str, new: str):
    def mutate(src: str) -> str:
        assert src.count(old) == 1, f"expected exactly one {old!r} in the rendered source"
        return src.replace(old, new)
    return mutate


def _run(spec, module, distribution="normal", seed=SEED):
    """(output, float64 oracle) for one input set, output poisoned with NaN beforehand."""
    inputs = MOD.make_inputs(spec, seed, distribution)
    out = MOD.alloc_output(inputs, spec)
    poison(out)
    MOD.run(module, inputs, out, spec.attrs)
    _sync()
    return out, MOD.oracle(inputs, spec.attrs)


# --- spellings -----------------------------------------------------------------------------------

def at(a, b):
    return a @ b


def t_matmul(a, b):
    return torch.matmul(a, b)


def t_matmul_kw(a, b):
    return torch.matmul(input=a, other=b)


def t_mm(a, b):
    return torch.mm(a, b)


def t_bmm(a, b):
    return torch.bmm(a, b)


def m_matmul(a, b):
    return a.matmul(b)


def m_mm(a, b):
    return a.mm(b)


def m_bmm(a, b):
    return a.bmm(b)


def x_wt(x, w):
    return x @ w.t()


A2, B2 = torch.randn(6, 40), torch.randn(40, 9)
A3, B3 = torch.randn(3, 6, 40), torch.randn(3, 40, 9)


@cpu_only
@pytest.mark.parametrize("fn,args,shape", [
    (at, (A2, B2), (6, 9, 40)), (t_matmul, (A2, B2), (6, 9, 40)), (t_matmul_kw, (A2, B2), (6, 9, 40)),
    (t_mm, (A2, B2), (6, 9, 40)), (m_matmul, (A2, B2), (6, 9, 40)), (m_mm, (A2, B2), (6, 9, 40)),
    (at, (A3, B3), (3, 6, 9, 40)), (t_matmul, (A3, B3), (3, 6, 9, 40)), (t_bmm, (A3, B3), (3, 6, 9, 40)),
    (m_bmm, (A3, B3), (3, 6, 9, 40)), (m_matmul, (A3, B3), (3, 6, 9, 40)),
])
def test_spellings_match_matmul(fn, args, shape):
    e = forge.explain(forge.optimize(fn, interpreter=True), *args)
    assert e.op == "matmul" and e.uses == "eager" and e.reason == "cache miss: would search"
    # The key is the one of the spec built from the problem shape (M, N, K) / (Bt, M, N, K).
    assert MOD.problem(args, {}) == shape


def test_match_reads_the_canonical_form():
    assert MOD.match(("matmul", ("input", 1), ("input", 0))) == ([1, 0], {})
    assert MOD.match(("matmul", ("input", 0), ("opaque", "t(input)"))) is None
    assert MOD.match(("mul", ("input", 0), ("input", 1))) is None


@cpu_only
@pytest.mark.parametrize("fn,args,needle", [
    (at, (A3, B2), "broadcasting matmul (3-D @ 2-D) is not supported"),
    (at, (A2, B3), "broadcasting matmul (2-D @ 3-D) is not supported"),
    (at, (torch.randn(1, 6, 40), B3), "broadcasting the batch dimension (1 vs 3) is not supported"),
    (at, (torch.randn(2, 3, 6, 40), torch.randn(2, 3, 40, 9)), "4-D @ 4-D matmul is not supported"),
    (at, (A2, torch.randn(40)), "1-D operands (matrix-vector products) are not supported"),
    (at, (torch.randn(40), B2), "1-D operands"),
    (x_wt, (A2, torch.randn(9, 40)), "no op family matches"),  # traced as matmul(x, opaque t(w))
    (at, (A2, torch.randn(40, 1).expand(40, 9)), "overlap or are not positive"),  # a broadcast (stride 0) B
    (at, (A2.double(), B2.double()), "unsupported dtype"),
])
def test_unsupported_calls_fall_back_with_a_reason(fn, args, needle):
    f = forge.optimize(fn, interpreter=True, warn=False)
    e = forge.explain(f, *args)
    assert e.uses == "eager" and needle in e.reason, e.reason
    # the value as written (not searched: a first call searches the regions Dynamo finds, seconds a case here)
    assert torch.equal(forge.optimize(fn, interpreter=True, warn=False, search=False)(*args), fn(*args))


def test_problem_rejects_what_the_kernels_do_not_index():
    assert MOD.problem((A2, torch.randn(9, 40).t()), {}) == (A2.shape[0], 9, 40)  # w.t(): a strided layout
    with pytest.raises(ValueError, match="different dtypes"):
        MOD.problem((A2, B2.half()), {})
    with pytest.raises(ValueError, match="inner dimensions differ"):
        MOD.problem((A2, torch.randn(41, 9)), {})


def test_make_spec_shapes_and_errors():
    spec = MOD.make_spec((5, 7, 3), "float16", "cuda")
    assert [(t.shape, t.dtype, t.contiguous) for t in spec.inputs] == [((5, 3), "float16", True),
                                                                       ((3, 7), "float16", True)]
    spec = MOD.make_spec((2, 5, 7, 3), "bfloat16", "cpu")
    assert [t.shape for t in spec.inputs] == [(2, 5, 3), (2, 3, 7)] and spec.attrs == {}
    assert MOD.problem_shape(spec) == (2, 5, 7, 3)
    with pytest.raises(ValueError, match="MxNxK or BtxMxNxK"):
        MOD.make_spec((64, 1000), "float16", "cuda")
    with pytest.raises(ValueError, match="takes no attributes"):
        MOD.make_spec((5, 7, 3), "float16", "cuda", {"transpose_b": True})
    with pytest.raises(ValueError, match=">= 1"):
        MOD.make_spec((0, 7, 3), "float16", "cuda")


def test_bytes_and_flops():
    spec = MOD.make_spec((2, 5, 7, 3), "float16", "cuda")
    assert MOD.flops(spec) == 2 * 2 * 5 * 7 * 3
    assert MOD.bytes_moved(spec) == 2 * (2 * 5 * 3 + 2 * 3 * 7 + 2 * 5 * 7)
    assert MOD.flops(MOD.make_spec((1, 4096, 4096), "bfloat16", "cuda")) == 2 * 4096 * 4096


# --- inputs and tolerance --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_inputs_give_finite_unit_scale_outputs_for_every_distribution(dtype):
    """The reason the tolerance can have a fixed atol: outputs have std ~1 whatever the distribution,
    and nothing overflows (fp16 'large' A is 1e3; B is scaled down by the same factor)."""
    spec = MOD.make_spec((64, 48, 1024), dtype, "cpu")
    for dist in DISTRIBUTIONS:
        a, b = MOD.make_inputs(spec, SEED, dist)
        assert a.dtype == b.dtype == getattr(torch, dtype) and (a != 0).any() and (b != 0).any()
        ref = MOD.oracle((a, b), {})
        assert torch.isfinite(ref).all()
        assert 0.5 < float(ref.std()) < 2.0, (dist, float(ref.std()))
        amax = float(a.float().abs().max())
        if dist == "large":
            assert amax > (1e3 if dtype == "float16" else 1e5)  # extreme magnitudes are still in A
        if dist == "tiny":
            assert amax < 1e-3


def test_tolerance_grows_with_k():
    for dtype in DTYPES:
        small, large = MOD.tolerance_for_k(dtype, 16), MOD.tolerance_for_k(dtype, 1 << 20)
        assert small.rel_norm < large.rel_norm and small.atol < large.atol and small.rtol == large.rtol
        # fp32 accumulation error grows as sqrt(K): 4096x the K, 64x the accumulation term.
        base = ROW_TOLERANCE[dtype].atol  # the row ops' bound, before accumulation
        assert (large.atol - base) / (small.atol - base) == pytest.approx(math.sqrt((1 << 20) / 16))
        assert MOD.tolerance(dtype) == MOD.tolerance_for_k(dtype, MOD.K_ASSUMED)
    spec = MOD.make_spec((2, 3, 5, 300), "float16", "cpu")
    assert MOD.tolerance_for(spec) == MOD.tolerance_for_k("float16", 300)


# --- numerics: tails, batches, split-K ---------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,cand", [
    ((33, 17, 40), tiled(group=2)),             # partial tiles in M (33), N (17) and K (40); partial group
    ((2, 31, 20, 19), tiled(bn=32, bk=32)),     # batched, one block wider than N and K
    ((3, 20, 64), tiled(bk=32)),                # K a multiple of BLOCK_K: the unmasked EVEN_K loop
])
def test_tiled_tails_match_the_oracle(shape, cand, dtype, tmp_path):
    spec = MOD.make_spec(shape, dtype, DEVICE)
    module = _module(spec, cand, tmp_path)
    assert check_candidate(MOD, module, spec, SEED, _sync) is None
    out, ref = _run(spec, module)
    # The K-exact bound holds too, and the last row and column (in the partial tiles) are right.
    tol = MOD.tolerance_for(spec)
    assert compare(out, ref, tol) is None
    assert compare(out[..., -1:, :], ref[..., -1:, :], tol) is None
    assert compare(out[..., :, -1:], ref[..., :, -1:], tol) is None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,cand", [
    ((7, 5, 19), splitk(4)),                    # 2 K blocks over 4 splits: splits 2 and 3 are empty
    ((1, 64, 300), splitk(4, bn=32, bk=32)),    # decode-like: 10 K blocks as 3+3+3+1, K tail in the last
    ((2, 9, 20, 64), splitk(2, bk=32)),         # batched, K = SPLIT_K * BLOCK_K: EVEN_K
])
def test_splitk_matches_the_oracle_and_is_deterministic(shape, cand, dtype, tmp_path):
    spec = MOD.make_spec(shape, dtype, DEVICE)
    module = _module(spec, cand, tmp_path)
    assert check_candidate(MOD, module, spec, SEED, _sync) is None
    out, ref = _run(spec, module)
    assert compare(out, ref, MOD.tolerance_for(spec)) is None
    again, _ = _run(spec, module)
    assert torch.equal(out, again)  # fixed-order reduction, no atomics


@pytest.mark.parametrize("cand", [tiled(bn=32), splitk(2)])
def test_alignment_factors_of_n_and_k(cand, tmp_path):
    """N and K reach the kernels divided by their power-of-two factors (up to 16) and are multiplied
    back inside: 24 and 40 (factor 8), 20 (4), 18 (2), 17 (1) and 48 (16) must all come out right."""
    for shape in [(5, 24, 40), (4, 20, 18), (3, 17, 48), (2, 3, 48, 20)]:
        spec = MOD.make_spec(shape, "float16", DEVICE)
        out, ref = _run(spec, _module(spec, cand, tmp_path))
        assert compare(out, ref, MOD.tolerance_for(spec)) is None, shape


def test_launch_refuses_non_contiguous_operands(tmp_path):
    spec = MOD.make_spec((4, 16, 16), "float32", DEVICE)
    a, b = MOD.make_inputs(spec, SEED)
    for cand in (tiled(), splitk(2)):
        module = _module(spec, cand, tmp_path)
        with pytest.raises(ValueError, match="contiguous"):
            module.launch(a, b.t(), torch.empty(4, 16, device=a.device))


def test_splitk_and_tiled_agree_with_eager_matmul(tmp_path):
    spec = MOD.make_spec((33, 17, 40), "float32", DEVICE)
    inputs = MOD.make_inputs(spec, SEED, "normal")
    outs = []
    for cand in (tiled(group=2), splitk(2)):
        out = MOD.alloc_output(inputs, spec)
        MOD.run(_module(spec, cand, tmp_path), inputs, out, {})
        _sync()
        outs.append(out)
    eager = MOD.reference(inputs, {})
    for out in outs:
        assert out.shape == eager.shape == (33, 17) and out.dtype == eager.dtype
        assert torch.allclose(out, eager, rtol=1e-4, atol=1e-5)


# --- the validator is not vacuous ----------------------------------------------------------------------

SHAPE = (33, 17, 40)  # partial tiles in every dimension; 3 K blocks of 16, the last one partial


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_validator_rejects_a_wrong_k_loop_bound(dtype, tmp_path):
    """Stopping one BLOCK_K early drops K columns 32..39 of 40: ~45% of the output's norm."""
    spec = MOD.make_spec(SHAPE, dtype, DEVICE)
    module = _module(spec, tiled(group=2), tmp_path,
                     _replace_once("for k in range(0, K, BLOCK_K):", "for k in range(0, K - BLOCK_K, BLOCK_K):"))
    reason = check_candidate(MOD, module, spec, SEED, _sync)
    assert reason is not None and reason.startswith("normal inputs: relative error"), reason


@pytest.mark.parametrize("old,new", [
    # every split reads the first slice of K instead of its own
    ("rk = split * K_SPLIT + tl.arange(0, BLOCK_K)", "rk = tl.arange(0, BLOCK_K)"),
    # the reduction leaves out the last split's partials
    ("tl.static_range(1, SPLIT_K)", "tl.static_range(1, SPLIT_K - 1)"),
])
def test_validator_rejects_broken_splitk(old, new, tmp_path):
    spec = MOD.make_spec((1, 64, 300), "float16", DEVICE)
    module = _module(spec, splitk(4, bn=32, bk=32), tmp_path, _replace_once(old, new))
    reason = check_candidate(MOD, module, spec, SEED, _sync)
    assert reason is not None and reason.startswith("normal inputs: relative error"), reason


def test_validator_rejects_a_partial_last_group_mapped_wrongly(tmp_path):
    """3 tile rows in groups of GROUP_M=2: assuming full groups maps the last row's tiles off the
    matrix, so rows 32.. are never written and keep the NaN poison."""
    spec = MOD.make_spec(SHAPE, "float32", DEVICE)
    module = _module(spec, tiled(group=2), tmp_path,
                     _replace_once("group_m = tl.minimum(grid_m - first_m, GROUP_M)", "group_m = GROUP_M"))
    reason = check_candidate(MOD, module, spec, SEED, _sync)
    assert reason is not None and reason.startswith("normal inputs: NaN in output"), reason


def test_validator_catches_an_unwritten_last_column(tmp_path):
    m, n, _ = SHAPE
    spec = MOD.make_spec(SHAPE, "float32", DEVICE)
    module = _module(spec, tiled(), tmp_path,
                     _replace_once("(rn[None, :] < N))", "(rn[None, :] < N - 1))"))
    reason = check_candidate(MOD, module, spec, SEED, _sync)
    assert reason == f"normal inputs: NaN in output ({m} of {m * n} elements, first at (0, {n - 1}))"


def test_unmutated_sources_pass_the_same_checks(tmp_path):
    """The control for the negative tests above."""
    for shape, dtype, cand in [(SHAPE, "float32", tiled(group=2)), (SHAPE, "float16", tiled(group=2)),
                               ((1, 64, 300), "float16", splitk(4, bn=32, bk=32))]:
        spec = MOD.make_spec(shape, dtype, DEVICE)
        assert check_candidate(MOD, _module(spec, cand, tmp_path), spec, SEED, _sync) is None


# --- search space and default ------------------------------------------------------------------------

GPU_SHAPES = [(2048, 4096, 4096), (4096, 4096, 4096), (1, 4096, 4096), (16, 4096, 4096), (1000, 1000, 1000),
              (32, 128, 128, 64), (8, 512, 512, 64), (7, 5, 3), (1, 1, 1)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_gpu_space_respects_the_hardware_limits(shape, dtype):
    spec = MOD.make_spec(shape, dtype, "cuda")
    sp = MOD.space(spec)
    points = list(sp.all_points())
    assert points
    itemsize = spec.inputs[0].itemsize
    for c in points:
        p = c.p
        assert min(p["BLOCK_M"], p["BLOCK_N"], p["BLOCK_K"]) >= 16  # tl.dot's minimum
        assert (p["BLOCK_M"] * p["BLOCK_K"] + p["BLOCK_K"] * p["BLOCK_N"]) * itemsize * p["num_stages"] \
            <= 200 * 1024
        assert 4 <= p["BLOCK_M"] * p["BLOCK_N"] / (32 * p["num_warps"]) <= 128  # no spills, no idle lanes
    assert MOD.default(spec) in sp


def test_gpu_space_fits_the_problem():
    big = MOD.space(MOD.make_spec((2048, 4096, 4096), "float16", "cuda"))
    decode = MOD.space(MOD.make_spec((1, 4096, 4096), "float16", "cuda"))
    # A 2048x4096 output fills the GPU with tiles alone: no split-K; a few hundred tiled points.
    assert big.points("splitk") == [] and 100 < len(big.points("tiled")) < 1000
    assert {c.p["BLOCK_M"] for c in big.points("tiled")} == {16, 32, 64, 128, 256}
    # Decode: BLOCK_M 16 only (M = 1), and split-K points.
    assert {c.p["BLOCK_M"] for c in decode.all_points()} == {16}
    # 4096 columns are >= 32 tiles: 32 splits would be over 4 waves of programs with one K step each.
    assert {c.p["SPLIT_K"] for c in decode.points("splitk")} == {2, 4, 8, 16}
    assert MOD.default(MOD.make_spec((1, 4096, 4096), "float16", "cuda")).variant == "splitk"
    # a large half-precision GEMM starts from 128x256x64 tiles, 4 stages (forge/opkit.py gemm_default says why);
    # a smaller one, or fp32, from 128x128 tiles, 3 stages
    assert MOD.default(MOD.make_spec((2048, 4096, 4096), "float16", "cuda")) == Candidate.make(
        "tiled", BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=1, num_warps=8, num_stages=4)
    assert MOD.default(MOD.make_spec((512, 4096, 4096), "float16", "cuda")) == Candidate.make(
        "tiled", BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)
    assert MOD.default(MOD.make_spec((2048, 4096, 4096), "float32", "cuda")).p["BLOCK_N"] == 128


@pytest.mark.parametrize("shape", [*MOD.TEST_SHAPES, (64, 64, 64)])
def test_interpreter_space_is_small_and_unpipelined(shape):
    spec = MOD.make_spec(shape, "float32", "cpu")
    sp = MOD.space(spec)
    points = list(sp.all_points())
    assert points and len(points) <= 40
    assert all(c.p["num_stages"] == 1 and max(c.p["BLOCK_M"], c.p["BLOCK_N"], c.p["BLOCK_K"]) <= 32
               for c in points)
    assert MOD.default(spec) in sp


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_every_point_renders_to_a_distinct_module(device):
    shape = (1, 4096, 4096) if device == "cuda" else (33, 17, 40)
    spec = MOD.make_spec(shape, "bfloat16", device)
    points = list(MOD.space(spec).all_points())
    # N = 17 (cpu) and one row of tiles (cuda): no persistent points there (its tests are below); padded
    # only where N = 17 leaves B's rows misaligned (cpu)
    absent = {"persistent", "padded"} if device == "cuda" else {"persistent"}
    assert {c.variant for c in points} == set(MOD.TEMPLATES) - absent
    sources = set()
    for cand in points:
        src = codegen.render(OP, spec, cand)
        compile(src, f"<{cand.label}>", "exec")
        assert f"forge_matmul_{cand.variant}" in src
        for key, value in cand.params:
            assert f"{key}={value}" in src, (cand.label, key)
        # Runtime loop bounds on CUDA (one compile serves every K); constexprs on the interpreter.
        bound = {"tiled": "N_DIV, K: tl.constexpr", "padded": "KL: tl.constexpr"}.get(cand.variant,
                                                                                   "K_DIV, K_SPLIT: tl.constexpr")
        assert (bound in src) == (device == "cpu")
        sources.add(src)
    assert len(sources) == len(points)


# --- end to end ----------------------------------------------------------------------------------------

@cpu_only
@pytest.mark.slow
def test_decorated_bmm_equals_eager_after_a_search(monkeypatch):
    # On the interpreter eager always wins the timing; force acceptance to exercise the kernel path.
    monkeypatch.setattr(stats, "accepts", lambda *a, **k: True)
    f = forge.optimize(t_bmm, budget=2, interpreter=True)
    a, b = torch.randn(2, 31, 19), torch.randn(2, 19, 20)
    y = f(a, b)
    e = forge.explain(f, a, b)
    assert e.uses == "kernel" and e.op == "matmul" and e.variant in MOD.TEMPLATES
    assert y.shape == (2, 31, 20) and y.dtype == a.dtype
    assert torch.allclose(y, t_bmm(a, b), rtol=1e-4, atol=1e-5)
    # New data, same signature: the bound kernel, no new search; the `@` spelling hits the same entry.
    monkeypatch.setattr("forge.tuner.engine.search", lambda *a, **k: pytest.fail("cache hit must not search"))
    a2, b2 = torch.randn(2, 31, 19), torch.randn(2, 19, 20)
    assert torch.allclose(f(a2, b2), a2 @ b2, rtol=1e-4, atol=1e-5)
    g = forge.optimize(at, interpreter=True)
    assert forge.explain(g, a2, b2).uses == "kernel"
    assert torch.allclose(g(a2, b2), a2 @ b2, rtol=1e-4, atol=1e-5)


# --- persistent (TMA descriptors) ----------------------------------------------------------------------

@pytest.mark.parametrize("shape,dtype,cand", [
    ((32, 48, 64), "bfloat16", persistent(bk=32)),          # whole tiles; 6 tiles over 4 programs: 2 loop
    ((64, 64, 128), "float16", persistent(32, 32, 32)),     # whole tiles, 4 K steps
    ((64, 64, 128), "float32", persistent(bm=32)),
    ((40, 24, 32), "float32", persistent()),                # partial tiles in M and N (zero fill, clipped store)
    ((33, 16, 32), "bfloat16", persistent(group=8)),        # one partial row of tiles; a group wider than M
    ((33, 24, 40), "float16", persistent(32, 32, 32)),      # partial tiles in M, N and K (K tail of 8)
])
def test_persistent_matches_the_oracle(shape, dtype, cand, tmp_path):
    spec = MOD.make_spec(shape, dtype, DEVICE)
    assert cand.variant in MOD.space(spec).variants  # TMA-valid
    module = _module(spec, cand, tmp_path)
    assert check_candidate(MOD, module, spec, SEED, _sync) is None
    out, ref = _run(spec, module)
    tol = MOD.tolerance_for(spec)
    assert compare(out, ref, tol) is None
    assert compare(out[-1:, :], ref[-1:, :], tol) is None  # the partial last tile row and column
    assert compare(out[:, -1:], ref[:, -1:], tol) is None


def test_persistent_on_a_strided_but_tma_valid_layout(tmp_path):
    """A's rows padded to 48 elements (a slice of a wider matrix): last stride 1, row stride 96 bytes."""
    spec = MOD.make_spec((20, 16, 40), "float16", DEVICE)
    a, b = spec.inputs
    spec = type(spec)(spec.op, (type(a)(a.shape, a.dtype, (48, 1), a.device), b), spec.attrs)
    assert "persistent" in MOD.space(spec).variants
    src = codegen.render(OP, spec, persistent())
    assert "TensorDescriptor(a, [m, k], [48, 1]" in src
    module = load_module(write_source(src, tmp_path))
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(20, 48, generator=gen).to(torch.float16).to(DEVICE)
    x, w = wide[:, :40], torch.randn(40, 16, generator=gen).to(torch.float16).to(DEVICE)
    out = torch.empty(20, 16, dtype=torch.float16, device=DEVICE)
    module.launch(x, w, out)
    _sync()
    torch.testing.assert_close(out.float(), (x.double() @ w.double()).float(), atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("shape,dtype,why", [
    ((33, 17, 40), "float32", "N = 17: rows of B and C are 68 bytes"),
    ((32, 20, 64), "bfloat16", "N = 20: 40-byte rows"),
    ((32, 16, 36), "float16", "K = 36: 72-byte rows of A"),
    ((32, 32, 30), "float32", "K = 30: 120-byte rows of A"),
    ((1, 1, 1), "float32", "1-element rows"),
    ((2, 32, 32, 32), "float16", "batched: not a 2-D descriptor"),
])
def test_persistent_is_excluded_where_tma_cannot_load(shape, dtype, why):
    for device in ("cuda", "cpu"):
        sp = MOD.space(MOD.make_spec(shape, dtype, device))
        assert "persistent" not in sp.variants, why
        assert all(c.variant != "persistent" for c in sp.all_points()), why


@pytest.mark.parametrize("strides,ok", [
    (((1, 64), (32, 1)), False),      # A transposed (a.t() of a K x M matrix): A's last stride is M
    (((64, 1), (1, 64)), False),      # x @ w.t(): B's last stride is K
    (((72, 1), (32, 1)), True),       # A's rows padded to 72 elements (144 bytes): still 16-byte aligned
    (((68, 1), (32, 1)), False),      # rows padded to 68 elements (136 bytes): not
])
def test_persistent_needs_unit_last_strides_and_aligned_rows(strides, ok):
    spec = MOD.make_spec((64, 32, 64), "bfloat16", "cuda")
    a, b = spec.inputs
    spec = type(spec)(spec.op, (type(a)(a.shape, a.dtype, strides[0], a.device),
                                type(b)(b.shape, b.dtype, strides[1], b.device)), spec.attrs)
    assert ("persistent" in MOD.space(spec).variants) == ok


def test_persistent_gpu_space_is_modest_and_large_tiled():
    """A budget-50 search of 4096^3 bf16 must still be able to sample it: at most 200 points, >= 64-row
    tiles (a Hopper warpgroup MMA), within the shared-memory and register rules (checked above for every
    point), and none where the tiles would not outnumber the SMs (then it is just `tiled`)."""
    pts = MOD.space(MOD.make_spec((4096, 4096, 4096), "bfloat16", "cuda")).points("persistent")
    assert 50 <= len(pts) <= 200
    assert min(c.p["BLOCK_M"] for c in pts) >= 64 and {c.p["FLATTEN"] for c in pts} == {False, True}
    few = MOD.space(MOD.make_spec((1024, 1024, 4096), "bfloat16", "cuda")).points("persistent")
    assert few and all(1024 // c.p["BLOCK_M"] * (1024 // c.p["BLOCK_N"]) > 132 for c in few)
    assert not MOD.space(MOD.make_spec((512, 512, 4096), "bfloat16", "cuda")).points("persistent")
    # the interpreter renders the persistent loop with constexpr bounds, CUDA with tl.range(flatten=)
    for device, needle in (("cuda", "tl.range(pid, num_tiles, NUM_PROGRAMS, flatten=FLATTEN)"),
                           ("cpu", "for i in range(ITERS):")):
        spec = MOD.make_spec((2048, 2048, 256), "bfloat16", device)
        assert needle in codegen.render(OP, spec, MOD.space(spec).points("persistent")[0])


# --- padded (misaligned rows copied into aligned buffers) ------------------------------------------------

def padded(bm=16, bn=16, bk=16, group=1) -> Candidate:
    return Candidate.make("padded", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group, num_warps=4,
                          num_stages=STAGES)


@pytest.mark.parametrize("shape,dtype,cand", [
    ((33, 17, 40), "bfloat16", padded()),              # N = 17: B copied (rows padded to 32), A read in place
    ((20, 32, 37), "float16", padded(bk=32)),         # K = 37: A copied, its K tail zeroed; B in place, masked K tail
    ((17, 19, 23), "float32", padded(group=2)),       # both copied, partial tiles everywhere, a partial group
    ((2, 9, 21, 19), "bfloat16", padded()),           # batched, both copied
    ((1, 3, 300), "float16", padded(bk=32)),          # one row, long K
])
def test_padded_matches_the_oracle(shape, dtype, cand, tmp_path):
    spec = MOD.make_spec(shape, dtype, DEVICE)
    assert "padded" in MOD.space(spec).variants
    module = _module(spec, cand, tmp_path)
    assert check_candidate(MOD, module, spec, SEED, _sync) is None
    out, ref = _run(spec, module)
    tol = MOD.tolerance_for(spec)
    assert compare(out, ref, tol) is None
    assert compare(out[..., -1:, :], ref[..., -1:, :], tol) is None  # the partial last tile row and column
    assert compare(out[..., :, -1:], ref[..., :, -1:], tol) is None


def test_padded_never_reads_the_uninitialised_padding(tmp_path, monkeypatch):
    """The copies are made with new_empty: their columns past N are never zeroed. Filled with NaN here
    (as stale memory may be), the result is still exact: those columns are never stored, and the K tail
    that is read is zeroed."""
    spec = MOD.make_spec((24, 17, 21), "float32", DEVICE)
    module = _module(spec, padded(), tmp_path)
    real_empty = torch.Tensor.new_empty
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda t, *a, **k: real_empty(t, *a, **k).fill_(float("nan")))
    gen = torch.Generator().manual_seed(3)
    a, b = (torch.randn(24, 21, generator=gen).to(DEVICE), torch.randn(21, 17, generator=gen).to(DEVICE))
    out = torch.full((24, 17), float("nan"), device=DEVICE)
    module.launch(a, b, out)
    _sync()
    torch.testing.assert_close(out.double(), a.double() @ b.double(), atol=1e-4, rtol=1e-4)


def test_padded_takes_any_layout(tmp_path):
    """x @ w.t() with a misaligned K (B's row stride 21 elements) and a transposed A: each is copied into
    an aligned buffer, whatever its strides. The rendered kernel does not bake them in."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(21, 18, generator=gen).to(torch.float16).to(DEVICE).t()   # (18, 21), strides (1, 18)
    w = torch.randn(13, 21, generator=gen).to(torch.float16).to(DEVICE)       # B = w.t(): (21, 13), (1, 21)
    spec = MOD.make_spec((18, 13, 21), "float16", DEVICE)
    a_s, b_s = spec.inputs
    spec = type(spec)(spec.op, (type(a_s)(a_s.shape, a_s.dtype, x.stride(), a_s.device),
                                type(b_s)(b_s.shape, b_s.dtype, w.t().stride(), b_s.device)), spec.attrs)
    assert "padded" in MOD.space(spec).variants
    module = _module(spec, padded(), tmp_path)
    out = torch.empty(18, 13, dtype=torch.float16, device=DEVICE)
    module.launch(x, w.t(), out)
    _sync()
    torch.testing.assert_close(out.float(), (x.double() @ w.t().double()).float(), atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("shape,dtype,strides,ok", [
    ((8205, 2949, 5921), "bfloat16", None, True),   # the misaligned shape: every row odd
    ((64, 32, 36), "float16", None, True),          # K = 36: 72-byte rows of A
    ((64, 20, 32), "bfloat16", None, True),         # N = 20: 40-byte rows of B and C
    ((64, 30, 32), "float32", None, True),          # N = 30: 120-byte rows
    ((64, 24, 40), "bfloat16", None, False),        # 48- and 80-byte rows: tiled vectorises them
    ((4096, 4096, 4096), "float16", None, False),
    ((64, 32, 64), "bfloat16", ((64, 1), (1, 64)), False),  # x @ w.t(), K = 64: aligned columns of B
    ((64, 32, 64), "bfloat16", ((68, 1), (32, 1)), True),   # A's rows padded to 68 elements (136 bytes)
    ((2, 16, 32, 32), "float16", None, False),
    ((2, 16, 30, 32), "float16", None, True),
])
def test_padded_is_in_the_space_only_for_misaligned_rows(shape, dtype, strides, ok):
    for device in ("cuda", "cpu"):
        spec = MOD.make_spec(shape, dtype, device)
        if strides:
            a, b = spec.inputs
            spec = type(spec)(spec.op, (type(a)(a.shape, a.dtype, strides[0], a.device),
                                        type(b)(b.shape, b.dtype, strides[1], b.device)), spec.attrs)
        sp = MOD.space(spec)
        assert ("padded" in sp.variants) == ok
        assert any(c.variant == "padded" for c in sp.all_points()) == ok


def test_padded_is_the_default_for_a_large_misaligned_problem():
    spec = MOD.make_spec((8205, 2949, 5921), "bfloat16", "cuda")
    d = MOD.default(spec)
    assert d.variant == "padded" and d in MOD.space(spec)
    # small or aligned problems keep their default
    assert MOD.default(MOD.make_spec((4096, 4096, 4096), "bfloat16", "cuda")).variant == "tiled"
    assert MOD.default(MOD.make_spec((1, 4096, 4095), "bfloat16", "cuda")).variant != "padded"
