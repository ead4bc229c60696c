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
  persistent  min(#tiles, #SMs) programs, each looping over output tiles (GROUP_M-swizzled, as tiled),
          A and B loaded and C stored through TMA tensor descriptors (Hopper's bulk copy engine: no
          per-element address arithmetic, OOB rows/columns zero-filled and clipped in hardware). The
          structure of triton's persistent-matmul tutorial, which is where Triton reaches cuBLAS on
          H100/H200. Valid only where TMA's rules hold (_tma_ok): 2-D, last strides 1, the other strides
          16-byte multiples (K and N multiples of 8 in bf16/fp16, of 4 in fp32). H200, 4096³ bf16: its
          best of 40 points 211.1 µs, tiled's best 214.5, cuBLAS 205.8 (h200-matmul-variants-2026-12-04).
  padded  where an operand's rows are not 16-byte aligned (K or N not a multiple of 8 in bf16/fp16, of 4
          in fp32, or a strided layout with such a stride): the launcher copies each such operand into a
          buffer with 16-element aligned rows and a zeroed K tail, and the tile loop of `tiled` runs
          unmasked, with vector loads, over the copies. The other variants read those rows element by
          element: H100, 8205x2949x5921 bf16, tiled's best 3245 µs, cuBLAS (its align-1 kernels) 2003 µs,
          torch.compile (which pads too) 466 µs (bench/results/h100-peers-gemm-search-2026-12-06.json).
"""

from __future__ import annotations

import math

from forge import hardware, opkit
from forge.spec import KernelSpec, TensorSpec

NAME = "matmul"
SUMMARY = "A @ B (mm, bmm; no broadcasting)"
TEMPLATES = {"tiled": "matmul_tiled.j2", "splitk": "matmul_splitk.j2", "persistent": "matmul_persistent.j2",
             "padded": "matmul_padded.j2"}
DEFAULT_ATTRS: dict = {}
# The default oracle (float64 A @ B) runs on blocks of A's rows x B's columns, its memory bounded
# (forge/ops.py, opkit.oracle_in_chunks).
ORACLE_CHUNK = "matmul"

# Masking shapes for tests/test_templates.py, as (M, N, K) or (Bt, M, N, K): partial tiles in every
# dimension, a single element, a batch, a decode-like row with a long K, and a K that the tested
# BLOCK_K values divide (the unmasked EVEN_K loop).
TEST_SHAPES = [(1, 1, 1), (7, 5, 3), (33, 17, 40), (2, 31, 20, 19), (1, 64, 300), (3, 20, 64)]
# ... and one where the persistent variant is valid in every dtype (N and K multiples of 8: TMA's 16-byte
# strides), with partial tiles in M, N and K (TMA's zero fill and clipped stores) and more tiles than the
# interpreter's programs (CPU_SMS), so that programs loop and the last ones get fewer tiles.
TEST_SHAPES.append((33, 24, 40))
# For tests/test_templates.py's render-every-point test: a shape with points of every variant on both
# devices: few enough 64x128 tiles (128) that split-K is in the GPU space, more than the SMs' worth of
# 64x64 ones (256) for the persistent variant. (It was 16x1024x1024 before the persistent variant, which
# has no GPU points there; that shape's golden renders are kept in tests/test_golden.py.)
MID_SHAPE = (256, 4096, 1024)
# ... and the padded variant's points, which only misaligned rows reach (N = 4090: 8180-byte rows)
MID_EXTRA_SHAPES = {"cuda": [(256, 4090, 1024)], "cpu": [(256, 4090, 1024)]}

# The SM count (hardware.GPU_SMS) only bounds which split-K points are worth timing (space(): when the
# tiled grid fills the GPU); the pipelined A and B tiles must fit hardware.SMEM_PER_PROGRAM. The space,
# its rules and the default are shared with linear and swiglu (opkit.gemm_space, which says why).
MAX_ACC_PER_THREAD = opkit.GEMM_MAX_ACC_PER_THREAD
MIN_ACC_PER_THREAD = opkit.GEMM_MIN_ACC_PER_THREAD
MIN_BLOCK = opkit.GEMM_MIN_BLOCK


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
def _a_rms(distribution: str, dtype: str) -> float:
    """The root mean square of A's elements under each distribution (opkit.distribution_rms)."""
    return opkit.distribution_rms(distribution, dtype)


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
GPU_GRID = opkit.GEMM_GPU_GRID
CPU_GRID = opkit.GEMM_CPU_GRID


def space(spec: KernelSpec) -> opkit.Space:
    variants = ("tiled", "splitk", "persistent") if _tma_ok(spec) else ("tiled", "splitk")
    if misaligned(spec):
        variants += ("padded",)
    return opkit.gemm_space(_dims(problem_shape(spec)), spec.device, spec.dtype, variants=variants)


def misaligned(spec: KernelSpec) -> bool:
    """Whether some operand has a row that is not 16-byte aligned: a stride (of a dim longer than 1) that
    is not 1 and not a multiple of 16 bytes, or no unit stride at all. Such rows cannot be loaded as
    vectors, which the padded variant's copy cures; elsewhere it would only add the copy."""
    for t in spec.inputs:
        real = [s for n, s in zip(t.shape, t.strides, strict=True) if n > 1]
        if real and 1 not in real:
            return True
        if any(s != 1 and s * t.itemsize % opkit.TMA_ALIGN for s in real):
            return True
    return False


def _tma_ok(spec: KernelSpec) -> bool:
    """Whether the persistent (TMA) variant may render for this spec: 2-D operands (bmm would need 3-D
    descriptors whose tiles must not cross a batch: left to `tiled`), and A (M, K), B (K, N) and the
    contiguous C (M, N) each with a last stride of 1 and a 16-byte multiple as the row stride: so K and
    N must be multiples of 8 (bf16/fp16) or 4 (fp32), and a transposed operand (x @ w.t(): B's last
    stride is K) is excluded. The base pointers are the shim's concern: it runs only 16-byte aligned
    inputs through forge's kernels (forge/shim.py ALIGNMENT), and the output is freshly allocated.

    Hopper (compute capability >= 9.0) is where the descriptors become TMA copies; the spec does not name
    the GPU (the cache key's environment does), so this cannot gate on it. On an older GPU triton either
    lowers the descriptor loads to ordinary loads or fails to compile, and the engine records a failed
    candidate, so the search stays correct either way. The interpreter (triton 3.6 and 3.9) implements
    the descriptors in software: the tests run the variant there."""
    if not opkit.tma_available():  # a triton without host-side descriptors
        return False
    a, b = spec.inputs
    if len(a.shape) != 2:
        return False
    m, k = a.shape
    n = b.shape[-1]
    item = a.itemsize
    # opkit.tma_row_stride: a last stride of 1 and a 16-byte multiple row stride; a single row's stride
    # never matters (and is not checked by the shim), only the dims that are real must satisfy TMA.
    return (k * item % opkit.TMA_ALIGN == 0 and n * item % opkit.TMA_ALIGN == 0 and m >= 1
            and opkit.tma_row_stride(m, k, a.strides[0], a.strides[1], item) is not None
            and opkit.tma_row_stride(k, n, b.strides[0], b.strides[1], item) is not None)


def problem_shape(spec: KernelSpec) -> tuple[int, ...]:
    """The (M, N, K) / (Bt, M, N, K) problem shape back from a spec's inputs."""
    a, b = spec.inputs
    m, k = a.shape[-2:]
    n = b.shape[-1]
    return (m, n, k) if len(a.shape) == 2 else (a.shape[0], m, n, k)


def default(spec: KernelSpec) -> opkit.Candidate:
    """An untuned but sensible choice: split-K when the output is a handful of tiles and K is long
    (decode), else 128x128 tiles (smaller for small M/N) with BLOCK_K 64 (32 for fp32), 3 stages."""
    sp = space(spec)
    cand = opkit.gemm_default(_dims(problem_shape(spec)), spec.device, spec.dtype, sp)
    # Misaligned operands of a large problem: the copy is cheap next to element-wise loads of every tile.
    bt, m, n, k = _dims(problem_shape(spec))
    padded = opkit.Candidate.make("padded", **cand.p)
    if cand.variant == "tiled" and min(m, n, k) >= 256 and padded in sp:
        return padded
    return cand


def render_context(spec: KernelSpec, cand: opkit.Candidate) -> dict:
    ctx = dict(cand.p)
    ctx.setdefault("SPLIT_K", 1)
    ctx.setdefault("GROUP_M", 1)
    # Triton <= 3.6's interpreter cannot take a runtime loop bound (see opkit.row_render_context):
    # there K (and the split length) are passed as constexprs; CUDA sources keep them runtime.
    ctx["K_CONSTEXPR"] = spec.device != "cuda"
    ctx["CPU_SMS"] = hardware.CPU_SMS
    ctx.update(opkit.gemm_dot_context(spec.dtype, spec.device))
    # Strided operands (only specs that have them render this addressing; contiguous renders are as before):
    # A's (batch, m, k) and B's (batch, k, n) strides as literals, a batch stride of 0 for 2-D operands.
    a, b = spec.inputs
    ctx["STRIDED"] = not (a.contiguous and b.contiguous)
    if ctx["STRIDED"]:
        sa = (0, *a.strides) if len(a.shape) == 2 else a.strides
        sb = (0, *b.strides) if len(b.shape) == 2 else b.strides
        ctx.update(SAB=sa[0], SAM=sa[1], SAK=sa[2], SBB=sb[0], SBK=sb[1], SBN=sb[2],
                   A_STRIDES=tuple(a.strides), B_STRIDES=tuple(b.strides))
    if cand.variant == "persistent":
        # The descriptors' strides: the spec's, except that a leading dim of size 1 (whose stride the
        # shim does not check and TMA never steps) gets the row length, which _tma_ok made 16-byte aligned.
        ctx.update(A_DESC_STRIDES=[a.strides[0] if a.shape[0] > 1 else a.shape[1], 1],
                   B_DESC_STRIDES=[b.strides[0] if b.shape[0] > 1 else b.shape[1], 1])
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
# The K that tolerance(dtype) assumes when it is not told K (opkit.GEMM_K_ASSUMED says why).
K_ASSUMED = opkit.GEMM_K_ASSUMED


def tolerance_for_k(dtype: str, k: int) -> opkit.Tolerance:
    """Tolerance for an output of scale ~1 (make_inputs) after a K-long fp32 accumulation
    (opkit.gemm_tolerance)."""
    return opkit.gemm_tolerance(dtype, k)


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
    splits than K blocks leaves empty splits, whose partials must be 0. The persistent variant where
    TMA allows it in every dtype (the test runs these candidates in all three: N and K multiples of 8,
    2-D), its 16-wide tiles over GROUP_M=2 leaving partial tiles and groups; the padded variant where a
    row is misaligned. More block sizes are covered in tests/test_op_matmul.py."""
    shape = problem_shape(spec)
    k = shape[-1]
    bk = 32 if k >= 64 else 16
    split = 2 if k % (2 * bk) == 0 or math.ceil(k / bk) > 2 else 4
    out = [opkit.Candidate.make("tiled", BLOCK_M=16, BLOCK_N=16, BLOCK_K=bk, GROUP_M=2, num_warps=4,
                                num_stages=1),
           opkit.Candidate.make("splitk", BLOCK_M=16, BLOCK_N=16, BLOCK_K=bk, SPLIT_K=split, num_warps=4,
                                num_stages=1)]
    if len(shape) == 3 and shape[1] % 8 == 0 and k % 8 == 0 and spec.inputs[0].contiguous and spec.inputs[1].contiguous:
        out.append(opkit.Candidate.make("persistent", BLOCK_M=16, BLOCK_N=16, BLOCK_K=bk, GROUP_M=2, num_warps=4,
                                        num_stages=1, FLATTEN=False))
    if misaligned(spec):  # rows copied into aligned buffers: 16-wide tiles over the same tails
        out.append(opkit.Candidate.make("padded", BLOCK_M=16, BLOCK_N=16, BLOCK_K=bk, GROUP_M=2, num_warps=4,
                                        num_stages=1))
    return out


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

