"""matmul: C = A @ B for A (M, K), B (K, N) (mm), and batched A (Bt, M, K), B (Bt, K, N) (bmm).

The problem shape is (M, N, K), or (Bt, M, N, K) when batched. Each operand is contiguous or in any
strided layout (the "strides" attribute: x @ w.t(), a transposed A, a slice), and both are of
the same dtype; the output has that dtype and is accumulated in fp32 (fp32 inputs: full-precision
`input_precision="ieee"` dots, the same arithmetic as eager fp32 matmul with TF32 off, PyTorch's
default). Not handled (the shim runs them eager, with the reason): broadcasting matmuls (3-D @ 2-D,
batch dims of 1) and 1-D operands.

Variants:
  tiled   one BLOCK_M x BLOCK_N output tile per program, looping over K; programs are ordered in
          groups of GROUP_M tile rows so that neighbours reuse A and B tiles from L2.
  splitk  for few output tiles and a long K (decode: 1 x 4096 x 4096): SPLIT_K programs per tile each
          reduce a slice of K into an fp32 workspace, and a second kernel sums the slices in a fixed
          order (deterministic: no atomics) and casts to the output dtype.
"""

from __future__ import annotations

import math

from forge import hardware, opkit
from forge.spec import ITEMSIZE, KernelSpec, TensorSpec

NAME = "matmul"
SUMMARY = "A @ B (mm, bmm; no broadcasting)"
TEMPLATES = {"tiled": "matmul_tiled.j2", "splitk": "matmul_splitk.j2"}
DEFAULT_ATTRS: dict = {}
# The default oracle (float64 A @ B) runs on blocks of A's rows x B's columns, its memory bounded
# (forge/ops.py, opkit.oracle_in_chunks).
ORACLE_CHUNK = "matmul"

# Masking shapes for tests/test_templates.py, as (M, N, K) or (Bt, M, N, K): partial tiles in every
# dimension, a single element, a batch, a decode-like row with a long K, and a K that the tested
# BLOCK_K values divide (the unmasked EVEN_K loop).
TEST_SHAPES = [(1, 1, 1), (7, 5, 3), (33, 17, 40), (2, 31, 20, 19), (1, 64, 300), (3, 20, 64)]
# For tests/test_templates.py's render-every-point test: a shape with points of both variants on both
# devices (16 rows of 1024 columns: few tiles, so split-K is in the GPU space too).
MID_SHAPE = (16, 1024, 1024)

# The SM count (hardware.GPU_SMS) only bounds which split-K points are worth timing (space(): when the
# tiled grid fills the GPU); the pipelined A and B tiles must fit hardware.SMEM_PER_PROGRAM.
# fp32 accumulator values per thread: above 128 (of 255 registers) the A/B fragments and addresses
# no longer fit and the kernel spills; below 4 a warp covers less than one MMA instruction's tile.
MAX_ACC_PER_THREAD = 128
MIN_ACC_PER_THREAD = 4
# tl.dot needs every block dimension >= 16.
MIN_BLOCK = 16


def _dims(shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    """(Bt, M, N, K) of a problem shape (Bt = 1 when not batched)."""
    if len(shape) == 3:
        return (1, *shape)
    return tuple(shape)  # type: ignore[return-value]


def make_spec(shape: tuple[int, ...], dtype: str, device: str, attrs: dict | None = None) -> KernelSpec:
    a = dict(attrs or {})
    if a:
        raise ValueError(f"matmul takes no attributes, not {sorted(a)}")
    shape = tuple(int(s) for s in shape)
    if len(shape) == 3:
        m, n, k = shape
        inputs = (TensorSpec((m, k), dtype, device=device), TensorSpec((k, n), dtype, device=device))
    elif len(shape) == 4:
        bt, m, n, k = shape
        inputs = (TensorSpec((bt, m, k), dtype, device=device), TensorSpec((bt, k, n), dtype, device=device))
    else:
        raise ValueError(f"matmul's problem shape is MxNxK or BtxMxNxK (batched), got {'x'.join(map(str, shape))}")
    return KernelSpec(NAME, inputs, {})


def problem(inputs, attrs) -> tuple[int, ...]:
    """(M, N, K) for a 2-D @ 2-D call, (Bt, M, N, K) for 3-D @ 3-D with equal batch sizes; anything
    else (what torch.matmul would broadcast) raises ValueError with the reason."""
    a, b = inputs
    if a.dim() == 1 or b.dim() == 1:
        raise ValueError(f"1-D operands (matrix-vector products) are not supported: A {tuple(a.shape)}, "
                         f"B {tuple(b.shape)}")
    if a.dim() != b.dim():
        raise ValueError(f"broadcasting matmul ({a.dim()}-D @ {b.dim()}-D) is not supported: only 2-D @ 2-D "
                         "and 3-D @ 3-D with equal batch sizes")
    if a.dim() > 3:
        raise ValueError(f"{a.dim()}-D @ {b.dim()}-D matmul is not supported: only 2-D @ 2-D and 3-D @ 3-D "
                         "(reshape leading dims into one batch dim)")
    if a.dim() == 3 and a.shape[0] != b.shape[0]:
        raise ValueError(f"broadcasting the batch dimension ({a.shape[0]} vs {b.shape[0]}) is not supported")
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"inner dimensions differ: A {tuple(a.shape)}, B {tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise ValueError(f"A and B have different dtypes ({a.dtype}, {b.dtype})")
    m, k = a.shape[-2:]
    n = b.shape[-1]
    return (m, n, k) if a.dim() == 2 else (a.shape[0], m, n, k)


# -- data, baseline and oracle ----------------------------------------------------------------------
# The root mean square of A's elements under each distribution of opkit.random_tensor (its scale
# factors: large x1e3 (fp16) or x1e5; tiny x1e-4; outliers: N(0, 1) with 0.2% of elements set to
# ±1e3 (fp16) or ±1e4, so E[a^2] = 1 + 2e-3 * big^2).
def _a_rms(distribution: str, dtype: str) -> float:
    if distribution == "large":
        return 1e3 if dtype == "float16" else 1e5
    if distribution == "tiny":
        return 1e-4
    if distribution == "outliers":
        big = 1e3 if dtype == "float16" else 1e4
        return math.sqrt(1.0 + 2e-3 * big * big)
    return 1.0


def make_inputs(spec: KernelSpec, seed: int, distribution: str = "normal"):
    """A carries the distribution; B is N(0, 1) / (sqrt(K) * rms(A)), so the outputs have standard
    deviation ~1 whatever the distribution, dtype and K.

    Why: the outputs of a correct fp32-accumulating kernel differ from the float64 oracle by ~2^-24 *
    sqrt(K) * (output scale), and an element that cancels to near zero can only be checked against
    an absolute bound (atol); a fixed atol is only meaningful when the output scale is fixed. It also
    keeps every reference finite: fp16 'large' A (1e3) times an unscaled B would overflow 65504, and
    matching infinities would make those elements vacuous (and flaky near the overflow threshold).
    'large' and 'tiny' still put extreme magnitudes into A (and the reciprocal ones into B), so a
    kernel that routes values through a narrower type (e.g. bf16's 1e5 through fp16) fails.
    The scale is the distribution's expected rms, not the drawn A's: a tiny A of one element would
    otherwise make B overflow."""
    gen = opkit.generator(seed, spec.device)
    a_spec, b_spec = spec.inputs
    k = a_spec.shape[-1]
    a = opkit.random_tensor(a_spec.shape, a_spec.dtype, a_spec.device, gen, distribution)
    scale = 1.0 / (math.sqrt(k) * _a_rms(distribution, a_spec.dtype))
    # Drawn and scaled in fp32, rounded once to the input dtype.
    b = opkit.random_tensor(b_spec.shape, "float32", b_spec.device, gen, "normal")
    return a, (b * scale).to(opkit.torch_dtype(b_spec.dtype))


def reference(inputs, attrs):
    """The eager baseline (cuBLAS on the GPU). The oracle is the contract's default: this on float64
    copies of A and B."""
    import torch

    return torch.matmul(*inputs)


# A and B may each be in any layout (x @ w.t(), a transposed A, slices): forge/ops.py's "strides" attribute;
# the strides are baked into the rendered kernel. The output is contiguous.
STRIDED_INPUTS = (0, 1)
STRIDED_ANY_ORDER = True


def alloc_output(inputs, spec: KernelSpec):
    import torch

    a, b = inputs
    return torch.empty((*a.shape[:-1], b.shape[-1]), dtype=a.dtype, device=a.device)


def run(module, inputs, out, attrs) -> None:
    a, b = inputs
    module.launch(a, b, out)


# -- search space ---------------------------------------------------------------------------------
GPU_GRID = {
    "tiled": {"BLOCK_M": [16, 32, 64, 128, 256], "BLOCK_N": [32, 64, 128, 256], "BLOCK_K": [32, 64, 128],
              "GROUP_M": [1, 8], "num_warps": [4, 8], "num_stages": [2, 3, 4, 5]},
    "splitk": {"BLOCK_M": [16, 32, 64], "BLOCK_N": [32, 64, 128], "BLOCK_K": [32, 64, 128, 256],
               "SPLIT_K": [2, 4, 8, 16, 32], "num_warps": [2, 4, 8], "num_stages": [2, 3, 4]},
}
# The interpreter: small blocks (it is slow at tl.dot), and no pipelining (num_stages means nothing).
CPU_GRID = {
    "tiled": {"BLOCK_M": [16, 32], "BLOCK_N": [16, 32], "BLOCK_K": [16, 32], "GROUP_M": [1, 2],
              "num_warps": [4], "num_stages": [1]},
    "splitk": {"BLOCK_M": [16], "BLOCK_N": [16, 32], "BLOCK_K": [16, 32], "SPLIT_K": [2, 4],
               "num_warps": [4], "num_stages": [1]},
}


def _cover(n: int, smallest: int) -> int:
    """The largest block worth trying for a dimension of size n: one block covers it."""
    return max(smallest, opkit.next_pow2(n))


def space(spec: KernelSpec) -> opkit.Space:
    bt, m, n, k = _dims(problem_shape(spec))
    on_gpu = spec.device == "cuda"
    grid = GPU_GRID if on_gpu else CPU_GRID
    itemsize = ITEMSIZE[spec.dtype]

    def valid(c: opkit.Candidate) -> bool:
        p = c.p
        bm, bn, bk, warps, stages = p["BLOCK_M"], p["BLOCK_N"], p["BLOCK_K"], p["num_warps"], p["num_stages"]
        g = grid[c.variant]
        # Blocks larger than one that covers the dimension only add masked work.
        if bm > _cover(m, g["BLOCK_M"][0]) or bn > _cover(n, g["BLOCK_N"][0]) or bk > _cover(k, g["BLOCK_K"][0]):
            return False
        if min(bm, bn, bk) < MIN_BLOCK:
            return False
        if (bm * bk + bk * bn) * itemsize * stages > hardware.SMEM_PER_PROGRAM:
            return False
        if on_gpu:
            acc = bm * bn / (32 * warps)
            if not MIN_ACC_PER_THREAD <= acc <= MAX_ACC_PER_THREAD:
                return False
            # fp32 uses FMA dots ("ieee"), whose operand slices live in registers: keep them small.
            if spec.dtype == "float32" and (bk > 64 or acc > 64):
                return False
        elif stages != 1:
            return False
        k_blocks = math.ceil(k / bk)
        tiles = bt * math.ceil(m / bm) * math.ceil(n / bn)
        if on_gpu and stages > 2 and stages > k_blocks:  # more stages than K steps buffer nothing
            return False
        if c.variant == "tiled":
            # Grouping only reorders programs when there are several tile rows and columns.
            return p["GROUP_M"] == 1 or (math.ceil(m / bm) > 1 and math.ceil(n / bn) > 1)
        split = p["SPLIT_K"]
        per_split = math.ceil(k_blocks / split)
        if math.ceil(k_blocks / per_split) != split:  # some splits would get no K at all
            return False
        # Splitting pays only when the tiles alone leave SMs idle; more than ~4 waves of split
        # programs only adds workspace traffic (SPLIT_K x the fp32 output, written and read back).
        return not on_gpu or (tiles < hardware.GPU_SMS and tiles * split <= 4 * hardware.GPU_SMS)

    return opkit.Space(variants={v: dict(g) for v, g in grid.items()}, valid=valid)


def problem_shape(spec: KernelSpec) -> tuple[int, ...]:
    """The (M, N, K) / (Bt, M, N, K) problem shape back from a spec's inputs."""
    a, b = spec.inputs
    m, k = a.shape[-2:]
    n = b.shape[-1]
    return (m, n, k) if len(a.shape) == 2 else (a.shape[0], m, n, k)


def default(spec: KernelSpec) -> opkit.Candidate:
    """An untuned but sensible choice: split-K when the output is a handful of tiles and K is long
    (decode), else 128x128 tiles (smaller for small M/N) with BLOCK_K 64 (32 for fp32), 3 stages."""
    bt, m, n, k = _dims(problem_shape(spec))
    sp = space(spec)
    if spec.device != "cuda":
        def fit(d: int) -> int:
            return min(32, _cover(d, 16))
        cand = opkit.Candidate.make("tiled", BLOCK_M=fit(m), BLOCK_N=fit(n), BLOCK_K=fit(k), GROUP_M=1,
                                    num_warps=4, num_stages=1)
        return cand if cand in sp else sp.points("tiled")[0]
    fp32 = spec.dtype == "float32"
    bm = min(128, _cover(m, 16))
    bn = min(128, _cover(n, 32))
    tiles = bt * math.ceil(m / bm) * math.ceil(n / bn)
    if tiles < hardware.GPU_SMS // 2 and k >= 1024:
        bm_s, bn_s, bk_s = min(64, _cover(m, 16)), 64, 64 if fp32 else 128
        split_tiles = bt * math.ceil(m / bm_s) * math.ceil(n / bn_s)
        for split in (32, 16, 8, 4, 2):
            cand = opkit.Candidate.make("splitk", BLOCK_M=bm_s, BLOCK_N=bn_s, BLOCK_K=bk_s, SPLIT_K=split,
                                        num_warps=4, num_stages=3)
            if split_tiles * split <= 2 * hardware.GPU_SMS and cand in sp:
                return cand
    bk = 32 if fp32 else 64
    for warps in (8, 4):
        for stages in (3, 2):
            cand = opkit.Candidate.make("tiled", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=min(bk, _cover(k, 32)),
                                        GROUP_M=8 if math.ceil(m / bm) > 1 and math.ceil(n / bn) > 1 else 1,
                                        num_warps=warps, num_stages=stages)
            if cand in sp:
                return cand
    return sp.points("tiled")[0]  # 16x32x32 tiles, 4 warps, 2 stages: valid at every shape


def render_context(spec: KernelSpec, cand: opkit.Candidate) -> dict:
    ctx = dict(cand.p)
    ctx.setdefault("SPLIT_K", 1)
    ctx.setdefault("GROUP_M", 1)
    # Triton <= 3.6's interpreter cannot take a runtime loop bound (see opkit.row_render_context):
    # there K (and the split length) are passed as constexprs; CUDA sources keep them runtime.
    ctx["K_CONSTEXPR"] = spec.device != "cuda"
    # fp32 inputs: full fp32 products (TF32 would be ~1e-3 off, and eager fp32 matmul does not use
    # TF32 unless the user turns it on).
    ctx["DOT_ARGS"] = ', input_precision="ieee"' if spec.dtype == "float32" else ""
    # The interpreter (triton 3.6 to 3.9) keeps bf16 as raw uint16 bits and its tl.dot multiplies
    # those bits as integers; widening to fp32 first is exact (bf16 products fit fp32's mantissa).
    # CUDA sources keep the native bf16 dot.
    ctx["DOT_CAST"] = ".to(tl.float32)" if spec.device != "cuda" and spec.dtype == "bfloat16" else ""
    # Strided operands (only specs that have them render this addressing; contiguous renders are as before):
    # A's (batch, m, k) and B's (batch, k, n) strides as literals, a batch stride of 0 for 2-D operands.
    a, b = spec.inputs
    ctx["STRIDED"] = not (a.contiguous and b.contiguous)
    if ctx["STRIDED"]:
        sa = (0, *a.strides) if len(a.shape) == 2 else a.strides
        sb = (0, *b.strides) if len(b.shape) == 2 else b.strides
        ctx.update(SAB=sa[0], SAM=sa[1], SAK=sa[2], SBB=sb[0], SBK=sb[1], SBN=sb[2],
                   A_STRIDES=tuple(a.strides), B_STRIDES=tuple(b.strides))
    ctx["kernel_name"] = f"forge_{NAME}_{cand.variant}"
    ctx["variant"] = cand.variant
    return ctx


def bytes_moved(spec: KernelSpec) -> int:
    a, b = spec.inputs
    bt, m, n, _ = _dims(problem_shape(spec))
    return a.nbytes + b.nbytes + bt * m * n * a.itemsize


def flops(spec: KernelSpec) -> int:
    bt, m, n, k = _dims(problem_shape(spec))
    return 2 * bt * m * n * k


# -- tolerance --------------------------------------------------------------------------------------
# The K that tolerance(dtype) assumes when it is not told K (forge/tuner/validate.py passes only the
# dtype): the bound then holds for K <= 65536. A larger K can make a correct kernel fail validation,
# which only means eager is used; see tolerance_for(spec).
K_ASSUMED = 65536


def tolerance_for_k(dtype: str, k: int) -> opkit.Tolerance:
    """Tolerance for an output of scale ~1 (make_inputs) after a K-long fp32 accumulation.

    fp32 accumulation in a different order than the oracle's float64 adds an error of RMS ~
    2^-24 * sqrt(K/2) per output (a random walk over K roundings of partial sums of size <= 1).
    Added to the norm bound (x4) and as an absolute floor (x8, covering the largest of millions of
    elements) for elements that cancel to ~0, where no relative bound can hold."""
    acc = 2.0 ** -24 * math.sqrt(max(int(k), 1))
    base = opkit.ROW_TOLERANCE[dtype]  # the output's rounding and the fp32 ops around it, as for row ops
    return opkit.Tolerance(rel_norm=base.rel_norm + 4 * acc, atol=base.atol + 8 * acc, rtol=base.rtol)


def tolerance(dtype: str) -> opkit.Tolerance:
    return tolerance_for_k(dtype, K_ASSUMED)


def tolerance_for(spec: KernelSpec) -> opkit.Tolerance:
    """The K-exact tolerance, for a validator that passes the spec (tighter for K < K_ASSUMED)."""
    return tolerance_for_k(spec.dtype, spec.inputs[0].shape[-1])


# -- template tests -----------------------------------------------------------------------------------
def test_candidates(spec: KernelSpec) -> list[opkit.Candidate]:
    """Two candidates per shape that still cover every masking path at the TEST_SHAPES (the
    interpreter is slow at tl.dot): 16-wide M/N tiles leave partial tiles in M and N; BLOCK_K 16 (32
    for K >= 64, fewer interpreted steps) leaves a K tail, except at 3x20x64 (the unmasked EVEN_K
    loops); GROUP_M=2 over 3 tile rows (33x17x40) leaves a partial last group; split-K with more
    splits than K blocks leaves empty splits, whose partials must be 0. More block sizes are covered
    in tests/test_op_matmul.py."""
    k = problem_shape(spec)[-1]
    bk = 32 if k >= 64 else 16
    split = 2 if k % (2 * bk) == 0 or math.ceil(k / bk) > 2 else 4
    return [opkit.Candidate.make("tiled", BLOCK_M=16, BLOCK_N=16, BLOCK_K=bk, GROUP_M=2, num_warps=4,
                                 num_stages=1),
            opkit.Candidate.make("splitk", BLOCK_M=16, BLOCK_N=16, BLOCK_K=bk, SPLIT_K=split, num_warps=4,
                                 num_stages=1)]


# -- recognising matmul in user code (forge/trace.py canonical forms) --------------------------------
def match(expr) -> tuple[list, dict] | None:
    """("matmul", a, b): `a @ b`, torch.matmul, torch.mm, torch.bmm, a.matmul/mm/bmm(b), with both
    operands inputs of the call. `x @ w.t()` traces as ("matmul", x, ("opaque", ...)): no match."""
    if expr[0] != "matmul" or len(expr) != 3:
        return None
    _, a, b = expr
    if a[0] != "input" or b[0] != "input":
        return None
    return [a[1], b[1]], {}

