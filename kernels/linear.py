"""linear: y = act(x @ W^T + bias) * scale + residual, one GEMM with its epilogue fused.

x is (M, K) or (B, S, K) (its rows flattened to M = B * S); the weight is (N, K) as nn.Linear stores it
(attribute weight="nk", F.linear) or (K, N) as GPT-2's Conv1D stores it (weight="kn", torch.addmm); x and
the weight may be in any strided layout (the "strides" attribute: w.t(), slices), bias (N,) and residual
(..., N) contiguous. The problem shape is (M, N, K), or (B, S, N, K) for a 3-D x. Attributes name the
epilogue, applied in fp32 to the accumulator in this fixed order, then one rounding to the output dtype:
  bias        "none" | "linear" (passed to F.linear / addmm) | "add" (`+ b` after a bias-free linear)
  activation  "none" | "gelu" (erf) | "gelu_tanh" | "silu" | "relu"
  scale       a float multiplying the activation's output (absent: no multiply)
  residual    True: + r, r of the output's shape (last)
Other orders (a scale inside the activation, a residual under it, a bias add after it) are not this op:
the matcher leaves them to eager. Baseline (reference): exactly the calls the user's code makes, eager.

Variants:
  tiled   one BLOCK_M x BLOCK_N output tile per program, looping over K, programs in groups of GROUP_M
          tile rows (L2 reuse), the epilogue applied to the accumulator before the one store.
  splitk  for few output tiles and a long K (decode, M = 1..16): SPLIT_K programs per tile reduce K
          slices into an fp32 workspace; the reduction kernel sums them in a fixed order (no atomics)
          and applies the epilogue.
  persistent  min(#tiles, #SMs) programs looping over GROUP_M-swizzled tiles (matmul's persistent
          variant), x and W loaded through TMA tensor descriptors; the epilogue on the accumulator, the
          output stored through a descriptor where its rows are 16-byte aligned, else with masked pointer
          stores (GPT-2's lm_head: N = 50257, while x and W are TMA-aligned). Valid where TMA can read x's
          flattened rows and W (_tma_ok).
"""

from __future__ import annotations

import math

from forge import formulas, opkit
from forge.spec import KernelSpec, TensorSpec

NAME = "linear"
SUMMARY = "act(x @ W^T + b) * scale + residual (F.linear / addmm with its epilogue)"
TEMPLATES = {"tiled": "linear_tiled.j2", "splitk": "linear_splitk.j2", "persistent": "linear_persistent.j2"}
DEFAULT_ATTRS: dict = {"weight": "nk", "bias": "none", "activation": "none", "residual": False}
# form="formula": the activation is written out in the user's code (GPT-2's gelu_new, x * sigmoid(x)); the
# reference, the search's baseline, runs it so (several eager kernels). Absent: torch's one call.
OPTIONAL_ATTRS = ("form", "scale")
WEIGHTS = ("nk", "kn")
BIASES = ("none", "linear", "add")
ACTIVATIONS = ("none", "gelu", "gelu_tanh", "silu", "relu")
# The matcher's note of the output's leading dims when GPT-2's Conv1D views the addmm's (M, N) result
# back to x's (B, S, N): problem() checks it against x and takes it out before make_spec sees it.
OUT_LEAD = "_out_lead"

# Masking shapes for tests/test_templates.py, as (M, N, K) or (B, S, N, K): a single row (decode), tails
# in M, N and K, a 3-D x, and a K that BLOCK_K divides (the unmasked loop).
TEST_SHAPES = [(1, 5, 3), (7, 5, 3), (33, 17, 40), (2, 3, 17, 20), (3, 20, 32)]
# The persistent (TMA) variant renders where K is a multiple of 8 (every dtype): at 33x17x40 with an odd
# N (stored through pointers, as GPT-2's lm_head) and here with a TMA-aligned N (stored through a
# descriptor), a 3-D x, and more tiles than the interpreter's programs.
TEST_SHAPES.append((2, 20, 24, 24))
# A shape with points of every variant on both devices. (It was 16x1024x1024, which has no persistent
# points on the GPU: 16 rows make too few tiles; that shape's golden renders are kept in
# tests/test_golden.py.) Here 64x128 tiles are few enough (128) for split-K's GPU points, and 64x64 ones
# outnumber the SMs (256) for the persistent variant's.
MID_SHAPE = (256, 4096, 1024)


def _dims(shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    """(1, M, N, K) of a problem shape, M the flattened rows (the GEMM space's (Bt, M, N, K))."""
    if len(shape) == 3:
        return (1, *shape)
    b, s, n, k = shape
    return (1, b * s, n, k)


def _flag(value, name: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ValueError(f"{name}={value!r}: expected true or false")


def make_spec(shape: tuple[int, ...], dtype: str, device: str, attrs: dict | None = None) -> KernelSpec:
    a = {**DEFAULT_ATTRS, **(attrs or {})}
    scale = a.pop("scale", None)
    form = a.pop("form", None)
    unknown = set(a) - set(DEFAULT_ATTRS)
    if unknown:
        raise ValueError(f"linear takes attributes {sorted([*DEFAULT_ATTRS, 'scale'])}, not {sorted(unknown)}")
    if a["weight"] not in WEIGHTS:
        raise ValueError(f"weight={a['weight']!r}: 'nk' (nn.Linear's (N, K)) or 'kn' (Conv1D's (K, N))")
    if a["bias"] not in BIASES:
        raise ValueError(f"bias={a['bias']!r}: one of {', '.join(BIASES)}")
    if a["activation"] not in ACTIVATIONS:
        raise ValueError(f"activation={a['activation']!r} is not supported (only {', '.join(ACTIVATIONS)})")
    a["residual"] = _flag(a["residual"], "residual")
    if form is not None:
        if form != "formula" or a["activation"] not in ("gelu", "gelu_tanh", "silu"):
            raise ValueError(f"form={form!r}: linear knows form='formula' (a gelu or silu activation written out) "
                             "or no form")
        a["form"] = form
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale):
            raise ValueError(f"scale={scale!r}: expected a finite number")
        a["scale"] = float(scale)
    shape = tuple(int(s) for s in shape)
    if len(shape) == 3:
        m, n, k = shape
        lead: tuple[int, ...] = (m,)
    elif len(shape) == 4:
        b, s, n, k = shape
        lead = (b, s)
    else:
        raise ValueError(f"linear's problem shape is MxNxK or BxSxNxK (a 3-D x), got {'x'.join(map(str, shape))}")
    if min(shape) < 1:
        raise ValueError(f"empty problem {'x'.join(map(str, shape))}")
    inputs = [TensorSpec((*lead, k), dtype, device=device),
              TensorSpec((n, k) if a["weight"] == "nk" else (k, n), dtype, device=device)]
    if a["bias"] != "none":
        inputs.append(TensorSpec((n,), dtype, device=device))
    if a["residual"]:
        inputs.append(TensorSpec((*lead, n), dtype, device=device))
    return KernelSpec(NAME, tuple(inputs), a)


def problem(inputs, attrs) -> tuple[int, ...]:
    """(M, N, K) for a 2-D x, (B, S, N, K) for a 3-D one; ValueError for what the kernels do not take.
    An addend the matcher could only place by shape (`linear(x, w) + t`: a bias of shape (N,), or a
    residual of the output's shape) is settled here, in attrs."""
    lead = attrs.pop(OUT_LEAD, None)
    x, w = inputs[0], inputs[1]
    if x.dim() not in (2, 3):
        raise ValueError(f"x must be 2-D or 3-D, got shape {tuple(x.shape)}")
    if w.dim() != 2:
        raise ValueError(f"the weight must be 2-D, got shape {tuple(w.shape)}")
    if any(t.dtype != x.dtype for t in inputs):
        raise ValueError(f"inputs of different dtypes {[str(t.dtype) for t in inputs]}")
    weight = attrs.get("weight", "nk")
    n, k = (w.shape[0], w.shape[1]) if weight == "nk" else (w.shape[1], w.shape[0])
    if x.shape[-1] != k:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(w.shape)} ({weight}) differ in K")
    if lead is not None and tuple(lead) != tuple(x.shape[:-1]):
        raise ValueError(f"the output is viewed as {(*lead, n)}, not x's rows {tuple(x.shape[:-1])} x N")
    out_shape = (*x.shape[:-1], n)
    rest = list(inputs[2:])
    if attrs.get("bias", "none") == "add" and rest and tuple(rest[0].shape) != (n,):
        if tuple(rest[0].shape) != out_shape:
            raise ValueError(f"linear(x, w) + t with t of shape {tuple(rest[0].shape)}: only a bias ({n},) or a "
                             f"residual {out_shape} (broadcasting adds are not fused)")
        if attrs.get("activation", "none") != "none" or "scale" in attrs or _flag(attrs.get("residual", False),
                                                                                   "residual"):
            raise ValueError("a residual added under the activation or the scale is not this op's order")
        attrs["bias"], attrs["residual"] = "none", True
    has_bias = attrs.get("bias", "none") != "none"
    has_res = _flag(attrs.get("residual", False), "residual")
    if len(rest) != has_bias + has_res:
        raise ValueError(f"{len(inputs)} inputs for bias={attrs.get('bias')}, residual={has_res}")
    if has_bias and tuple(rest[0].shape) != (n,):
        raise ValueError(f"bias of shape {tuple(rest[0].shape)}, expected ({n},)")
    if has_res and tuple(rest[-1].shape) != out_shape:
        raise ValueError(f"residual of shape {tuple(rest[-1].shape)}, expected the output's {out_shape} "
                         "(broadcasting is not fused)")
    return (x.shape[0], n, k) if x.dim() == 2 else (x.shape[0], x.shape[1], n, k)


def problem_shape(spec: KernelSpec) -> tuple[int, ...]:
    x, w = spec.inputs[0], spec.inputs[1]
    n = w.shape[0] if spec.attrs["weight"] == "nk" else w.shape[1]
    return (*x.shape[:-1], n, x.shape[-1])


# -- data, baseline and oracle ----------------------------------------------------------------------
def make_inputs(spec: KernelSpec, seed: int, distribution: str = "normal"):
    """x carries the distribution; the weight is N(0, 1) / (sqrt(K) * rms(x)) so x @ W^T has scale ~1
    whatever the distribution (matmul's make_inputs says why); bias and residual N(0, 1)."""
    gen = opkit.generator(seed, spec.device)
    xs, ws = spec.inputs[0], spec.inputs[1]
    k = xs.shape[-1]
    x = opkit.random_tensor(xs.shape, xs.dtype, xs.device, gen, distribution)
    scale = 1.0 / (math.sqrt(k) * opkit.distribution_rms(distribution, xs.dtype))
    w = opkit.random_tensor(ws.shape, "float32", ws.device, gen, "normal")
    out = [x, (w * scale).to(opkit.torch_dtype(ws.dtype))]
    for t in spec.inputs[2:]:
        out.append(opkit.random_tensor(t.shape, t.dtype, t.device, gen, "normal"))
    return tuple(out)


def _split(inputs, attrs):
    # By index, not `x, w, *rest = inputs` and rest.pop(): TorchDynamo (torch 2.11) made rest a tuple when it
    # traced this for forge bench's torch.compile contestant ("'tuple' object has no attribute 'pop'").
    has_b = attrs.get("bias", "none") != "none"
    b = inputs[2] if has_b else None
    r = inputs[2 + has_b] if attrs.get("residual") else None
    return inputs[0], inputs[1], b, r


def reference(inputs, attrs):
    """The eager baseline, the calls the user's code makes: F.linear (nn.Linear) or torch.addmm on x's
    flattened rows viewed back (GPT-2's Conv1D; x @ w without a bias), then each epilogue op."""
    import torch
    import torch.nn.functional as F

    x, w, b, r = _split(inputs, attrs)
    if attrs["weight"] == "nk":
        y = F.linear(x, w, b if attrs["bias"] == "linear" else None)
    elif attrs["bias"] == "linear":
        y = torch.addmm(b, x.reshape(-1, x.shape[-1]), w).view(*x.shape[:-1], w.shape[1])
    else:
        y = torch.matmul(x, w)
    if attrs["bias"] == "add":
        y = y + b
    act = attrs["activation"]
    if attrs.get("form") == "formula" and act == "silu":  # the activation as the user wrote it out
        y = y * torch.sigmoid(y)
    elif attrs.get("form") == "formula":
        c = math.sqrt(2.0 / math.pi)
        y = (0.5 * y * (1.0 + torch.tanh(c * (y + 0.044715 * torch.pow(y, 3.0)))) if act == "gelu_tanh"
             else 0.5 * y * (1.0 + torch.erf(y / math.sqrt(2.0))))
    elif act in ("gelu", "gelu_tanh"):
        y = F.gelu(y, approximate="tanh" if act == "gelu_tanh" else "none")
    elif act == "silu":
        y = F.silu(y)
    elif act == "relu":
        y = F.relu(y)
    if "scale" in attrs:
        y = y * attrs["scale"]
    if r is not None:
        y = y + r
    return y


def oracle(inputs, attrs):
    """reference() in float64, in blocks of x's rows x the weight's columns (opkit.oracle_in_row_col_blocks:
    its float64 working set stays bounded; K is never split)."""
    x, w, b, r = _split(inputs, attrs)
    k = x.shape[-1]
    nk = attrs["weight"] == "nk"
    n = w.shape[0] if nk else w.shape[1]
    x2 = x.reshape(-1, k)
    r2 = r.reshape(-1, n) if r is not None else None

    def block(r0, r1, c0, c1):
        part = [x2[r0:r1].double(), (w[c0:c1] if nk else w[:, c0:c1]).double()]
        if b is not None:
            part.append(b[c0:c1].double())
        if r2 is not None:
            part.append(r2[r0:r1, c0:c1].double())
        return reference(tuple(part), attrs)

    out = opkit.oracle_in_row_col_blocks(block, x2.shape[0], n, k, opkit.tensors_nbytes(inputs))
    return out.reshape(*x.shape[:-1], n)


# x and the weight in any layout (w.t(), slices): forge/ops.py's "strides" attribute; the render bakes
# every stride in. Bias and residual contiguous; the output contiguous.
STRIDED_INPUTS = (0, 1)
STRIDED_ANY_ORDER = True


def alloc_output(inputs, spec: KernelSpec):
    import torch

    x, w = inputs[0], inputs[1]
    n = w.shape[0] if spec.attrs["weight"] == "nk" else w.shape[1]
    return torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)


def run(module, inputs, out, attrs) -> None:
    module.launch(*inputs, out)


# -- search space: the GEMM space (opkit.gemm_space; matmul's rules) --------------------------------
def space(spec: KernelSpec) -> opkit.Space:
    variants = ("tiled", "splitk", "persistent") if _tma_ok(spec) else ("tiled", "splitk")
    return opkit.gemm_space(_dims(problem_shape(spec)), spec.device, spec.dtype, variants=variants)


def _tma_strides(spec: KernelSpec) -> tuple[int, int] | None:
    """The descriptors' row strides (x's rows flattened to one (M, K) matrix, W as stored), or None where TMA
    cannot read them (opkit.tma_row_stride): x's rows unevenly spaced (a 3-D slice), a last stride that is
    not 1 (x.t(), w.t() of the other layout), or a row stride that is not a 16-byte multiple (K not a
    multiple of 8 in half precision for nn.Linear's (N, K) weight; N for Conv1D's (K, N))."""
    x, w = spec.inputs[0], spec.inputs[1]
    _, m, n, k = _dims(problem_shape(spec))
    item = x.itemsize
    xs = opkit.tma_row_stride(m, k, opkit.flat_rows(x.shape, x.strides), x.strides[-1], item)
    ws = opkit.tma_row_stride(w.shape[0], w.shape[1], w.strides[0], w.strides[1], item)
    if xs is None or ws is None:
        return None
    return xs, ws


def _tma_ok(spec: KernelSpec) -> bool:
    """Whether the persistent (TMA) variant may render for this spec. The output is allocated contiguous, so
    it needs no rule: where its rows are not 16-byte aligned it is stored through pointers. As for matmul
    (kernels/matmul.py _tma_ok), Hopper is where descriptors become TMA copies, and a GPU where they fail
    to compile only records failed candidates."""
    return opkit.tma_available() and _tma_strides(spec) is not None


# An output whose rows are not 16-byte aligned (GPT-2's lm_head, N = 50257) starts from the persistent
# variant's best point of the H200's budget-40 search of 4096x50257x1024 bf16 (h200-gemm-2026-12-06-a.json):
# 706.6 us, where the best tiled point timed 993.4 us and every one of its 8 best persistent points beat it.
_ODD_N_DEFAULT = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 3,
                  "FLATTEN": True}


def default(spec: KernelSpec) -> opkit.Candidate:
    sp = space(spec)
    dims = _dims(problem_shape(spec))
    if spec.device == "cuda" and dims[2] * spec.inputs[0].itemsize % opkit.TMA_ALIGN and "persistent" in sp.variants:
        cand = opkit.Candidate.make("persistent", **_ODD_N_DEFAULT)
        if cand in sp:
            return cand
    return opkit.gemm_default(dims, spec.device, spec.dtype, sp)


# The epilogue on the fp32 accumulator `acc`, with `cols` (the output column of each element), `offs`
# (its flat index in the contiguous output) and `mask` (inside the output) in scope. Shared by both
# variants; written here (in the op file, so its hash covers it) rather than in one template.
_GELU_ERF = """\
# Phi(x) through erfc with Numerical Recipes' erfcc (relative error < 1.2e-7), as the gelu family
# computes it: 1 + erf(x / sqrt(2)) cancels for x << 0.
z = tl.abs(acc) * 0.7071067811865476
t = 1.0 / (1.0 + 0.5 * z)
p = -0.82215223 + t * 0.17087277
p = 1.48851587 + t * p
p = -1.13520398 + t * p
p = 0.27886807 + t * p
p = -0.18628806 + t * p
p = 0.09678418 + t * p
p = 0.37409196 + t * p
p = 1.00002368 + t * p
p = -1.26551223 + t * p
c = t * tl.exp(p - z * z)
acc = acc * tl.where(acc < 0.0, 0.5 * c, 1.0 - 0.5 * c)"""
_GELU_TANH = """\
# 0.5 * (1 + tanh(u)) == sigmoid(2u), with e = exp(-2|u|) <= 1: no cancellation, no overflow.
u = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
e = tl.exp(-2.0 * tl.abs(u))
acc = acc * tl.where(u >= 0.0, 1.0, e) / (1.0 + e)"""
_SILU = """\
# sigmoid as 1 / (1 + e) or e / (1 + e) with e = exp(-|x|) <= 1: never overflows.
e = tl.exp(-tl.abs(acc))
acc = acc * tl.where(acc >= 0.0, 1.0, e) / (1.0 + e)"""
# acc < 0 is false for NaN, which then passes through as torch.relu passes it (a max would drop it).
_RELU = "acc = tl.where(acc < 0.0, 0.0, acc)"
_ACT = {"none": "", "gelu": _GELU_ERF, "gelu_tanh": _GELU_TANH, "silu": _SILU, "relu": _RELU}


def epilogue(attrs: dict, indent: str = "    ") -> str:
    lines = []
    if attrs["bias"] != "none":
        lines.append("acc += tl.load(BIAS + cols, mask=cols < N, other=0.0).to(tl.float32)")
    if _ACT[attrs["activation"]]:
        lines.extend(_ACT[attrs["activation"]].splitlines())
    if "scale" in attrs:
        lines.append(f"acc = acc * {float(attrs['scale'])!r}")
    if attrs["residual"]:
        lines.append("acc += tl.load(RES + offs, mask=mask, other=0.0).to(tl.float32)")
    return "\n".join(indent + line for line in lines)


def render_context(spec: KernelSpec, cand: opkit.Candidate) -> dict:
    ctx = dict(cand.p)
    ctx.setdefault("SPLIT_K", 1)
    ctx.setdefault("GROUP_M", 1)
    _, m, n, k = _dims(problem_shape(spec))
    x, w = spec.inputs[0], spec.inputs[1]
    # x's rows flattened: row r is (r // SEQ, r % SEQ) of a 3-D x; a 2-D x is one "batch" of M rows.
    sx = x.strides if len(x.shape) == 3 else (0, *x.strides)
    seq = x.shape[1] if len(x.shape) == 3 else m
    # the weight's (n, k) element: n * SWN + k * SWK, whichever way it is stored
    swn, swk = (w.strides[0], w.strides[1]) if spec.attrs["weight"] == "nk" else (w.strides[1], w.strides[0])
    ctx.update(M=m, N=n, K=k, SEQ=seq, SXB=sx[0], SXS=sx[1], SXK=sx[2], SWN=swn, SWK=swk,
               X_SHAPE=tuple(x.shape), X_STRIDES=tuple(x.strides), W_STRIDES=tuple(w.strides),
               HAS_BIAS=spec.attrs["bias"] != "none", HAS_RES=bool(spec.attrs["residual"]),
               EPILOGUE=epilogue(spec.attrs, " " * (8 if cand.variant == "persistent" else 4)),
               ATTRS=", ".join(f"{a}={spec.attrs[a]}" for a in sorted(spec.attrs)))
    # Every K slice whole: no masks in the K loop.
    ctx["EVEN_K"] = k % (ctx["BLOCK_K"] * ctx["SPLIT_K"]) == 0
    ctx.update(opkit.gemm_dot_context(spec.dtype, spec.device))
    if cand.variant == "persistent":
        ctx.update(opkit.persistent_gemm_context(cand, spec.device))
        ctx["X_ROW_STRIDE"], ctx["W_ROW_STRIDE"] = _tma_strides(spec)
        ctx["W_NK"] = spec.attrs["weight"] == "nk"
        # the output (M, N), contiguous: its rows are TMA-aligned when N is a 16-byte multiple
        ctx["Y_TMA"] = n * x.itemsize % opkit.TMA_ALIGN == 0
    ctx["kernel_name"] = f"forge_{NAME}_{cand.variant}"
    ctx["variant"] = cand.variant
    return ctx


def bytes_moved(spec: KernelSpec) -> int:
    _, m, n, _ = _dims(problem_shape(spec))
    return sum(t.nbytes for t in spec.inputs) + m * n * spec.inputs[0].itemsize


def flops(spec: KernelSpec) -> int:
    _, m, n, k = _dims(problem_shape(spec))
    return 2 * m * n * k + 4 * m * n  # the GEMM, and a few ops per output for the epilogue


# -- tolerance: matmul's, growing with K (opkit.gemm_tolerance), the accumulation error scaled by |scale|
def tolerance(dtype: str) -> opkit.Tolerance:
    return opkit.gemm_tolerance(dtype, opkit.GEMM_K_ASSUMED)


def tolerance_for(spec: KernelSpec) -> opkit.Tolerance:
    """The K-exact tolerance; a scale multiplies the accumulator's error, so the absolute floor with it."""
    k = spec.inputs[0].shape[-1]
    tol = opkit.gemm_tolerance(spec.dtype, k)
    s = max(1.0, abs(float(spec.attrs.get("scale", 1.0))))
    return opkit.Tolerance(rel_norm=tol.rel_norm, atol=tol.atol * s, rtol=tol.rtol)


def test_candidates(spec: KernelSpec) -> list[opkit.Candidate]:
    """For tests/test_templates.py: 16-wide tiles (partial tiles in M and N), BLOCK_K 16 (a K tail unless
    K is a multiple), GROUP_M=2 (a partial last group at 33 rows); split-K with more splits than K
    blocks where K is short (empty splits must add 0)."""
    k = problem_shape(spec)[-1]
    split = 2 if math.ceil(k / 16) > 2 else 4
    out = [opkit.Candidate.make("tiled", BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=1),
           opkit.Candidate.make("splitk", BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, SPLIT_K=split, num_warps=4,
                                num_stages=1)]
    # 16-wide tiles over GROUP_M=2 (partial tiles and groups, programs that loop), where TMA can read the
    # operands in every dtype the test runs these in (K a multiple of 8: 16-byte rows in half precision)
    if _tma_ok(spec) and k % 8 == 0:
        out.append(opkit.Candidate.make("persistent", BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=4,
                                        num_stages=1, FLATTEN=False))
    return out


# -- recognising linear and its epilogue in user code (forge/trace.py canonical forms) -----------------
_P = ("input", -1)  # stands in for the GEMM inside the epilogue while the epilogue is read


def _one(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and v == 1


def _gemm(e: tuple) -> tuple[list, dict] | None:
    """(input indices [x, w, (b)], attrs) of a GEMM form, or None:
      ("linear", x, w, b)                      F.linear / nn.Linear, b an input or None
      ("addmm", b, x, w, 1, 1)                 torch.addmm (Conv1D on a 2-D x)
      ("view", ("addmm", b, ("view", x, (M, K)), w, 1, 1), (..., N))
                                               GPT-2's Conv1D: x's rows flattened, the result viewed back"""
    lead = None
    if e[0] == "view" and e[1][0] == "addmm" and len(e[1]) == 6 and e[1][2][0] == "view":
        out_shape, inner = e[2][1], e[1][2]
        if not (isinstance(out_shape, tuple) and len(out_shape) >= 2 and math.prod(out_shape[:-1]) == inner[2][1][0]):
            return None
        lead = tuple(out_shape[:-1])
        e = (*e[1][:2], inner[1], *e[1][3:])  # ("addmm", b, x, w, beta, alpha) on x itself
    if e[0] == "linear" and len(e) == 4:
        _, x, w, b = e
        if x[0] != "input" or w[0] != "input":
            return None
        if b == ("const", None):
            return [x[1], w[1]], {"weight": "nk", "bias": "none"}
        return ([x[1], w[1], b[1]], {"weight": "nk", "bias": "linear"}) if b[0] == "input" else None
    if e[0] == "addmm" and len(e) == 6:
        _, b, x, w, beta, alpha = e
        if not all(t[0] == "input" for t in (b, x, w)):
            return None
        if not (beta[0] == "const" and _one(beta[1]) and alpha[0] == "const" and _one(alpha[1])):
            return None
        attrs = {"weight": "kn", "bias": "linear"}
        if lead is not None:
            attrs[OUT_LEAD] = lead
        return [x[1], w[1], b[1]], attrs
    return None


def _find_gemms(e, found: list) -> None:
    if not isinstance(e, tuple) or not e or not isinstance(e[0], str):
        if isinstance(e, tuple):
            for c in e:
                _find_gemms(c, found)
        return
    if _gemm(e) is not None:
        if e not in found:
            found.append(e)
        return
    for c in e[1:]:
        _find_gemms(c, found)


def _replace(e, old, new):
    if e == old:
        return new
    if not isinstance(e, tuple) or not e or e[0] in ("input", "const"):
        return e
    kids = [_replace(c, old, new) for c in e[1:]] if isinstance(e[0], str) else None
    if kids is None:
        return tuple(_replace(c, old, new) for c in e)
    return (e[0], *kids)


def _activation(e) -> str | None:
    """The activation `e` applies to _P ("none" for _P itself), or None."""
    if e == _P:
        return "none"
    if e[0] == "relu" and e[1:] == (_P,):
        return "relu"
    if e[0] == "silu" and e[1] == _P and e[2] == ("const", False):
        return "silu"
    if e[0] == "mul" and len(e) == 3 and set(e[1:]) == {_P, ("sigmoid", _P)}:
        return "silu"
    got = formulas.match_gelu(e)  # F.gelu, nn.GELU and the written-out formulas (gelu_new)
    if got is not None and got[0] == [_P[1]]:
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(got[1]["approximate"])
    return None


def _written_out(e) -> bool:
    """Whether the activation `e` is spelled as a formula (x * sigmoid(x), gelu_new's tanh formula) rather
    than torch's one call: the user's code then runs several eager kernels for it (the baseline does too)."""
    if e[0] == "mul" and len(e) == 3 and set(e[1:]) == {_P, ("sigmoid", _P)}:
        return True
    got = formulas.match_gelu(e)
    return got is not None and got[1].get("form") == "formula"


def _const(e) -> float | None:
    if e[0] == "const" and isinstance(e[1], int | float) and not isinstance(e[1], bool) and math.isfinite(e[1]):
        return float(e[1])
    if e[0] == "recip" and (c := _const(e[1])) not in (None, 0.0):
        return 1.0 / c
    return None


def match(expr) -> tuple[list, dict] | None:
    """A linear and the epilogue after it: F.linear(x, w[, b]) / nn.Linear / torch.addmm(b, x, w) (GPT-2's
    Conv1D, viewed back to 3-D), then, in this order and each optional: + b (bias-free linear), gelu (F.gelu
    either mode, nn.GELU, the written-out formulas: gelu_new), silu (F.silu, x * sigmoid(x)), relu,
    * a constant (or / one), + another input (residual). The operands must be inputs of the region.
    `linear(x, w) + t` is a bias or a residual by t's shape: problem() settles which. Refused (None, so
    eager): other orders, two adds folded into one (bias-free linear + b + r: which is which is lost),
    the GEMM's result used outside the activation."""
    found: list = []
    _find_gemms(expr, found)
    if len(found) != 1:
        return None
    indices, attrs = _gemm(found[0])
    attrs.update(activation="none", residual=False)
    e = _replace(expr, found[0], _P)
    if e == _P:
        return indices, attrs
    if e[0] == "add" and len(e) == 3:
        a, b = e[1:]
        if _P in (a, b):  # linear(...) + t, nothing between
            t = b if a == _P else a
            if t[0] != "input":
                return None
            indices.append(t[1])
            if attrs["bias"] == "none":
                attrs["bias"] = "add"  # or a residual: problem() looks at t's shape
            else:
                attrs["residual"] = True
            return indices, attrs
        outer = [t for t in (a, b) if t[0] == "input"]
        if len(outer) != 1:
            return None
        residual = outer[0]
        e = b if a is residual else a
    else:
        residual = None
    act = _activation(e)
    if act is None and e[0] == "mul" and len(e) == 3:  # * scale (after gelu: its formula is a mul too)
        consts = [t for t in e[1:] if _const(t) is not None]
        if len(consts) == 1:
            attrs["scale"] = _const(consts[0])
            e = e[2] if e[1] is consts[0] else e[1]
            act = _activation(e)
    if act is None:  # an activation of (linear(x, w) + b)
        adds: list = []
        _find_adds(e, adds)
        if len(adds) != 1 or attrs["bias"] != "none":
            return None
        b = adds[0][2] if adds[0][1] == _P else adds[0][1]
        e = _replace(e, adds[0], _P)
        act = _activation(e)
        if act is None or b[0] != "input":
            return None
        indices.append(b[1])
        attrs["bias"] = "add"
    attrs["activation"] = act
    if act != "none" and _written_out(e):
        attrs["form"] = "formula"
    if residual is not None:
        indices.append(residual[1])
        attrs["residual"] = True
    return indices, attrs


def _find_adds(e, found: list) -> None:
    """The ("add", _P, t) subtrees of e."""
    if not isinstance(e, tuple) or not e or not isinstance(e[0], str) or e[0] in ("input", "const"):
        return
    if e[0] == "add" and len(e) == 3 and _P in e[1:]:
        if e not in found:
            found.append(e)
        return
    for c in e[1:]:
        _find_adds(c, found)
