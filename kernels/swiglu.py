"""swiglu: y = silu(x @ Wg^T) * (x @ Wu^T), the SwiGLU MLP's gate and up projections as one op.

x is (M, K) or (B, S, K) (rows flattened to M = B * S); Wg and Wu are (N, K), nn.Linear's layout, with no
bias. x and both weights may be in any strided layout (the "strides" attribute). The problem shape is
(M, N, K), or (B, S, N, K) for a 3-D x. Baseline (reference): the user's code as written, two F.linear
and F.silu(g) * u (four kernels; g and u written and read back).

Variants:
  tiled   one BLOCK_M x BLOCK_N output tile per program, two fp32 accumulators (gate and up) fed from one
          load of each x tile per K step; silu(g) * u on the accumulators, one rounding at the store.
  persistent  the same tile work in min(#tiles, #SMs) programs looping over GROUP_M-swizzled tiles, x, Wg
          and Wu loaded through TMA tensor descriptors (matmul's persistent variant); valid where TMA can
          read x's flattened rows and both weights (_tma_strides).
Not here: a split-K variant for decode (M of 1..16) and a concatenated [Wg; Wu] weight (one tensor holding
both, as some models store it): the matcher only sees two separate nn.Linear weights.
"""

from __future__ import annotations

import math

from forge import opkit
from forge.spec import KernelSpec, TensorSpec

NAME = "swiglu"
SUMMARY = "F.silu(x @ Wg^T) * (x @ Wu^T) (the SwiGLU MLP's two projections and gate in one kernel)"
TEMPLATES = {"tiled": "swiglu_tiled.j2", "persistent": "swiglu_persistent.j2"}
DEFAULT_ATTRS: dict = {}

# Masking shapes for tests/test_templates.py ((M, N, K) or (B, S, N, K)): a single row, tails in M, N
# and K, a 3-D x, and a K that BLOCK_K divides.
TEST_SHAPES = [(1, 5, 3), (7, 5, 3), (33, 17, 40), (2, 3, 17, 20), (3, 20, 32)]
# The persistent (TMA) variant renders where K is a multiple of 8: at 33x17x40 (an odd N: pointer stores)
# and here (a TMA-aligned N: descriptor stores; a 3-D x; more tiles than the interpreter's programs).
TEST_SHAPES.append((2, 20, 24, 24))
# A shape with points of both variants on both devices. (It was 16x1024x1024, which has no persistent points
# on the GPU: 16 rows make too few tiles; that shape's golden renders are kept in tests/test_golden.py.)
# Here 64x64 tiles outnumber the SMs (256).
MID_SHAPE = (256, 4096, 1024)


def _dims(shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    if len(shape) == 3:
        return (1, *shape)
    b, s, n, k = shape
    return (1, b * s, n, k)


def make_spec(shape: tuple[int, ...], dtype: str, device: str, attrs: dict | None = None) -> KernelSpec:
    if attrs:
        raise ValueError(f"swiglu takes no attributes, not {sorted(attrs)}")
    shape = tuple(int(s) for s in shape)
    if len(shape) == 3:
        m, n, k = shape
        lead: tuple[int, ...] = (m,)
    elif len(shape) == 4:
        b, s, n, k = shape
        lead = (b, s)
    else:
        raise ValueError(f"swiglu's problem shape is MxNxK or BxSxNxK (a 3-D x), got {'x'.join(map(str, shape))}")
    if min(shape) < 1:
        raise ValueError(f"empty problem {'x'.join(map(str, shape))}")
    w = TensorSpec((n, k), dtype, device=device)
    return KernelSpec(NAME, (TensorSpec((*lead, k), dtype, device=device), w, w), {})


def problem(inputs, attrs) -> tuple[int, ...]:
    """(M, N, K) for a 2-D x, (B, S, N, K) for a 3-D one; ValueError for what the kernel does not take."""
    x, wg, wu = inputs
    if x.dim() not in (2, 3):
        raise ValueError(f"x must be 2-D or 3-D, got shape {tuple(x.shape)}")
    if wg.dim() != 2 or tuple(wg.shape) != tuple(wu.shape):
        raise ValueError(f"gate and up weights must be (N, K) alike, got {tuple(wg.shape)} and {tuple(wu.shape)}")
    if x.shape[-1] != wg.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and the weights {tuple(wg.shape)} differ in K")
    if any(t.dtype != x.dtype for t in inputs):
        raise ValueError(f"inputs of different dtypes {[str(t.dtype) for t in inputs]}")
    n, k = wg.shape
    return (x.shape[0], n, k) if x.dim() == 2 else (x.shape[0], x.shape[1], n, k)


def problem_shape(spec: KernelSpec) -> tuple[int, ...]:
    x, w = spec.inputs[0], spec.inputs[1]
    return (*x.shape[:-1], w.shape[0], x.shape[-1])


def make_inputs(spec: KernelSpec, seed: int, distribution: str = "normal"):
    """x carries the distribution; both weights N(0, 1) / (sqrt(K) * rms(x)), so g and u have scale ~1
    (matmul's make_inputs says why)."""
    gen = opkit.generator(seed, spec.device)
    xs, ws, _ = spec.inputs
    x = opkit.random_tensor(xs.shape, xs.dtype, xs.device, gen, distribution)
    scale = 1.0 / (math.sqrt(xs.shape[-1]) * opkit.distribution_rms(distribution, xs.dtype))
    dt = opkit.torch_dtype(ws.dtype)
    wg = opkit.random_tensor(ws.shape, "float32", ws.device, gen, "normal")
    wu = opkit.random_tensor(ws.shape, "float32", ws.device, gen, "normal")
    return x, (wg * scale).to(dt), (wu * scale).to(dt)


def reference(inputs, attrs):
    """The eager baseline as a SwiGLU MLP writes it: two F.linear, then F.silu(g) * u."""
    import torch.nn.functional as F

    x, wg, wu = inputs
    return F.silu(F.linear(x, wg)) * F.linear(x, wu)


def oracle(inputs, attrs):
    """reference() in float64, in blocks of x's rows x the weights' rows (opkit.oracle_in_row_col_blocks)."""
    x, wg, wu = inputs
    k, n = x.shape[-1], wg.shape[0]
    x2 = x.reshape(-1, k)

    def block(r0, r1, c0, c1):
        return reference((x2[r0:r1].double(), wg[c0:c1].double(), wu[c0:c1].double()), attrs)

    out = opkit.oracle_in_row_col_blocks(block, x2.shape[0], n, k, opkit.tensors_nbytes(inputs))
    return out.reshape(*x.shape[:-1], n)


STRIDED_INPUTS = (0, 1, 2)
STRIDED_ANY_ORDER = True


def alloc_output(inputs, spec: KernelSpec):
    import torch

    x, wg, _ = inputs
    return torch.empty((*x.shape[:-1], wg.shape[0]), dtype=x.dtype, device=x.device)


def run(module, inputs, out, attrs) -> None:
    x, wg, wu = inputs
    module.launch(x, wg, wu, out)


# -- search space: the GEMM space's tiled points, with two weight tiles and two accumulators per program
def space(spec: KernelSpec) -> opkit.Space:
    variants = ("tiled", "persistent") if opkit.tma_available() and _tma_strides(spec) else ("tiled",)
    return opkit.gemm_space(_dims(problem_shape(spec)), spec.device, spec.dtype, variants=variants, b_operands=2)


def _tma_strides(spec: KernelSpec) -> tuple[int, int, int] | None:
    """The descriptors' row strides of x's flattened rows, Wg and Wu, or None where TMA cannot read one of
    them (opkit.tma_row_stride; linear's _tma_strides says when)."""
    x, wg, wu = spec.inputs
    _, m, n, k = _dims(problem_shape(spec))
    item = x.itemsize
    out = (opkit.tma_row_stride(m, k, opkit.flat_rows(x.shape, x.strides), x.strides[-1], item),
           opkit.tma_row_stride(n, k, wg.strides[0], wg.strides[1], item),
           opkit.tma_row_stride(n, k, wu.strides[0], wu.strides[1], item))
    return None if None in out else out


def default(spec: KernelSpec) -> opkit.Candidate:
    return opkit.gemm_default(_dims(problem_shape(spec)), spec.device, spec.dtype, space(spec))


def render_context(spec: KernelSpec, cand: opkit.Candidate) -> dict:
    ctx = dict(cand.p)
    _, m, n, k = _dims(problem_shape(spec))
    x, wg, wu = spec.inputs
    sx = x.strides if len(x.shape) == 3 else (0, *x.strides)
    ctx.update(M=m, N=n, K=k, SEQ=x.shape[1] if len(x.shape) == 3 else m, SXB=sx[0], SXS=sx[1], SXK=sx[2],
               SGN=wg.strides[0], SGK=wg.strides[1], SUN=wu.strides[0], SUK=wu.strides[1],
               X_SHAPE=tuple(x.shape), X_STRIDES=tuple(x.strides), G_STRIDES=tuple(wg.strides),
               U_STRIDES=tuple(wu.strides), EVEN_K=k % ctx["BLOCK_K"] == 0)
    ctx.update(opkit.gemm_dot_context(spec.dtype, spec.device))
    if cand.variant == "persistent":
        ctx.update(opkit.persistent_gemm_context(cand, spec.device))
        ctx["X_ROW_STRIDE"], ctx["G_ROW_STRIDE"], ctx["U_ROW_STRIDE"] = _tma_strides(spec)
        ctx["Y_TMA"] = n * x.itemsize % opkit.TMA_ALIGN == 0  # the contiguous output's rows
    ctx["kernel_name"] = f"forge_{NAME}_{cand.variant}"
    ctx["variant"] = cand.variant
    return ctx


def bytes_moved(spec: KernelSpec) -> int:
    _, m, n, _ = _dims(problem_shape(spec))
    return sum(t.nbytes for t in spec.inputs) + m * n * spec.inputs[0].itemsize


def flops(spec: KernelSpec) -> int:
    _, m, n, k = _dims(problem_shape(spec))
    return 4 * m * n * k + 5 * m * n


# -- tolerance: silu(g) * u carries the accumulation error of both GEMMs (each ~2^-24 sqrt(K), matmul's
# bound); bounded as one accumulation twice as long in error, i.e. of 4K terms.
def tolerance(dtype: str) -> opkit.Tolerance:
    return opkit.gemm_tolerance(dtype, 4 * opkit.GEMM_K_ASSUMED)


def tolerance_for(spec: KernelSpec) -> opkit.Tolerance:
    return opkit.gemm_tolerance(spec.dtype, 4 * spec.inputs[0].shape[-1])


def test_candidates(spec: KernelSpec) -> list[opkit.Candidate]:
    """For tests/test_templates.py: 16-wide tiles (partial tiles in M and N, a K tail unless K is a
    multiple of 16) with GROUP_M=2 (a partial last group at 33 rows); the persistent variant likewise where
    TMA can read the operands."""
    out = [opkit.Candidate.make("tiled", BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=1)]
    # where TMA can read the operands in every dtype the test runs these in (K a multiple of 8)
    if "persistent" in space(spec).variants and problem_shape(spec)[-1] % 8 == 0:
        out.append(opkit.Candidate.make("persistent", BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=4,
                                        num_stages=1, FLATTEN=False))
    return out


# -- recognising SwiGLU in user code (forge/trace.py canonical forms) ----------------------------------
def _proj(e) -> tuple | None:
    """(x, w) of ("linear", x, w, None) with x and w inputs, else None."""
    if e[0] == "linear" and len(e) == 4 and e[1][0] == "input" and e[2][0] == "input" and e[3] == ("const", None):
        return e[1], e[2]
    return None


def match(expr) -> tuple[list, dict] | None:
    """F.silu(gate(x)) * up(x), gate and up bias-free nn.Linear / F.linear of one x (any order of the
    product; gate(x) * sigmoid(gate(x)) is the same silu). F.silu(..., inplace=True) is not matched (it
    also overwrites the gate projection)."""
    if expr[0] != "mul":
        return None
    factors = list(expr[1:])
    if len(factors) == 2:
        silus = [f for f in factors if f[0] == "silu" and f[2] == ("const", False) and _proj(f[1]) is not None]
        if len(silus) != 1:
            return None
        factors.remove(silus[0])
        gate = silus[0][1]
    elif len(factors) == 3:
        sig = [f for f in factors if f[0] == "sigmoid" and f[1] in factors]
        if len(sig) != 1:
            return None
        gate = sig[0][1]
        factors.remove(sig[0])
        factors.remove(gate)
    else:
        return None
    g, u = _proj(gate), _proj(factors[0])
    if g is None or u is None or g[0] != u[0]:
        return None
    return [g[0][1], g[1][1], u[1][1]], {}
