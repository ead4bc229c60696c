"""rope: rotate-half rotary position embedding, y = x * cos + rotate_half(x) * sin, with
rotate_half(x) = cat((-x[..., D/2:], x[..., :D/2]), -1).

Problem shape (B, H, S, D): x is (B, H, S, D), contiguous or any view with D contiguous (Hugging Face's
q and k: (B, S, H, D) projections transposed; the "strides" attribute); cos and sin are (S, D),
broadcast over B and H, or Hugging Face's (k, 1, S, D) tables with k = 1 or B (attribute cos_batch;
with k = B each sequence has its own positions). The output has the layout eager's formula gives it
(torch.empty_like(x): alloc_output says why). Other layouts are refused
by problem() with the reason, so the shim runs them eagerly: the spec names every input's shape
exactly, and from a trace the matcher cannot tell which layout a call will use.

Written as it is computed: y[:D/2] = x1*cos1 - x2*sin1 and y[D/2:] = x2*cos2 + x1*sin2 (x1, x2 the
halves of x), fp32 arithmetic, one rounding to x's dtype at the store.
"""

from __future__ import annotations

import math

from forge import opkit
from forge.spec import KernelSpec, TensorSpec

NAME = "rope"
SUMMARY = "x * cos + rotate_half(x) * sin; x (B,H,S,D), cos/sin (S,D)"
TEMPLATES = {"tile": "rope_tile.j2", "rows": "rope_rows.j2"}
# cos_batch: the tables' layout. None: cos and sin are (S, D); k: they are (k, 1, S, D), Hugging Face's
# cos.unsqueeze(1) of (k, S, D) tables, k = 1 (one set of positions) or B (positions per sequence). A
# spec without it keeps the attributes it always had ({}): (S, D) keys did not change.
DEFAULT_ATTRS: dict = {"cos_batch": None}
# x may be strided with D contiguous (HF's q and k are (B, S, H, D) projections transposed); cos and sin
# stay contiguous; the output takes x's layout as torch.empty_like does.
STRIDED_INPUTS = (0,)
# The default oracle (float64 reference) runs on chunks of rows, its memory bounded (forge/ops.py).
ORACLE_CHUNK = "rows"
# The output takes input 0's layout as torch.empty_like gives it (alloc_output): the backend lays out what a
# swapped rope region hands the regions after it the same way (forge/backend.py kernel_stride).
OUTPUT_LIKE = 0


# Values per thread of one BLOCK x D/2 tile above which the variants would spill on Hopper: both keep
# six such tiles live (cos and sin halves, x1, x2) plus 64-bit addresses, ~8 registers per value.
MAX_TILE_ELEMS_PER_THREAD = 16
# The widest head dim any point fits at that bound: one row of D/2 = 8192 over 16 warps.
MAX_D = 16384

# Why two variants. Both load x1 and x2 once as [rows, D/2] tiles (contiguous half-rows, 16-byte
# vector loads; an element-wise flat kernel would gather each element's partner and its cos/sin with
# per-element index arithmetic the compiler cannot prove contiguous, i.e. scalar loads).
#   tile: positions x HEADS (batch, head) rows per program; the cos/sin tile is loaded once and reused
#         for every head, so it reads cos/sin 1/HEADS as often. Needs S >= BLOCK_S to fill a program.
#   rows: BLOCK_Q consecutive rows of the (B*H*S, D) view, cos/sin rows by row mod S; programs fill the
#         same whatever S is, so it covers decode (S = 1, many heads) where a tile holds one position.

# (B, H, S, D) shapes for tests/test_templates.py: D = 2 (the smallest), a half that is not a power of
# two (3 -> padded to 4 lanes), S and B*H that leave partial tiles and partial head groups, D = 128.
TEST_SHAPES = [(1, 1, 1, 2), (1, 1, 3, 6), (2, 3, 5, 8), (1, 3, 33, 16), (2, 1, 9, 128)]
# Shapes for the space/default tests: decode, prefill, long context, tiny, odd S, D from 2 to 256, and a
# head dim too wide for the tile variant (8 warps at most). MID_SHAPE: a space with points of both variants.
SPACE_SHAPES = [(1, 32, 1, 128), (64, 32, 1, 128), (1, 32, 4096, 128), (2, 8, 2048, 64), (1, 1, 1, 2),
                (3, 5, 7, 6), (1, 16, 32768, 256), (4, 1, 100, 32), (1, 1, 3, MAX_D)]
MID_SHAPE = (2, 8, 512, 128)


def make_spec(shape: tuple[int, ...], dtype: str, device: str, attrs: dict | None = None) -> KernelSpec:
    a = dict(attrs or {})
    # "split": where the traced rotate_half cut the last dim (slicing spellings carry the number; only
    # the shape can say whether it is the middle). It describes the user's code, not the kernel, so
    # it is checked here and left out of the spec (one cache key for every spelling).
    split = a.pop("split", None)
    cos_batch = a.pop("cos_batch", None)
    if a:
        raise ValueError(f"rope takes the attribute cos_batch only, not {sorted(a)}")
    if len(shape) != 4:
        raise ValueError(f"rope's problem shape is x's (B, H, S, D), got {tuple(shape)}")
    b, h, s, d = (int(v) for v in shape)
    if d % 2:
        raise ValueError(f"rotate-half RoPE needs an even head dim, got D={d}")
    if split is not None and int(split) != d // 2:
        raise ValueError(f"rotate_half splits the last dim at {split}, not at its middle (D/2 = {d // 2})")
    if d > MAX_D:
        raise ValueError(f"head dims above {MAX_D} are not supported, got D={d}")
    if s * d >= 2**31 or b * h * s >= 2**31:
        raise ValueError(f"{b * h * s} rows of cos/sin of {s}x{d} exceed 32-bit row indexing")
    if cos_batch is None:
        table, attrs = (s, d), {}
    else:
        if isinstance(cos_batch, bool) or not isinstance(cos_batch, int) or cos_batch not in (1, b):
            raise ValueError(f"cos_batch={cos_batch!r}: the (k, 1, S, D) tables take k = 1 or B = {b}")
        table, attrs = (int(cos_batch), 1, s, d), {"cos_batch": int(cos_batch)}
    return KernelSpec(NAME, (TensorSpec((b, h, s, d), dtype, device=device),
                             TensorSpec(table, dtype, device=device),
                             TensorSpec(table, dtype, device=device)), attrs)


def problem(inputs, attrs) -> tuple[int, ...]:
    """(B, H, S, D) of a call, or ValueError naming what does not fit (the shim then runs eager)."""
    x, cos, sin = inputs
    if x.ndim != 4:
        raise ValueError(f"x must be 4-D (B, H, S, D), got shape {tuple(x.shape)}")
    b, s, d = x.shape[0], x.shape[-2], x.shape[-1]
    if tuple(cos.shape) != tuple(sin.shape):
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must have one shape")
    if cos.ndim == 4 and cos.shape[1] == 1 and tuple(cos.shape[2:]) == (s, d) and cos.shape[0] in (1, b):
        attrs["cos_batch"] = int(cos.shape[0])  # HF's (k, 1, S, D) tables (recorded in place, as sdpa's kv_heads)
    elif tuple(cos.shape) != (s, d):
        raise ValueError(f"cos and sin must be (S, D) = {(s, d)} or (1 or B, 1, S, D), got {tuple(cos.shape)}")
    if not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("cos and sin must be contiguous")
    if not (x.dtype == cos.dtype == sin.dtype):
        raise ValueError(f"x, cos and sin must share one dtype, got {x.dtype}, {cos.dtype}, {sin.dtype}")
    return tuple(x.shape)


def _smallest_subnormal(dtype) -> float:
    import torch

    fi = torch.finfo(dtype)
    return fi.tiny * fi.eps


def make_inputs(spec: KernelSpec, seed: int, distribution: str = "normal"):
    """x from the distribution, on a grid of 2^-14 of its largest magnitude; cos/sin in [-1, 1] on a
    grid of 2^-7, different in the two halves (so a kernel that reads one half's cos for both fails).

    Why the grids: y = x1*cos1 - x2*sin1 cancels to ~0 for some elements, where any fp32 evaluation
    is off by ~eps32*|x| — beyond an element-wise rtol against float64 once |x| is large (measured on
    the CPU: fp32 math on unrounded fp32 "large" inputs of 1x32x512x128 put 133 elements outside the
    fp32 tolerance, worst |err| 0.036 at y = -2.58). On these grids each product is a multiple of
    g*2^-7 below 2^21 of those units and the sum below 2^22, so fp32 computes y exactly (with or
    without FMA) and the only error is the final rounding to x's dtype."""
    import torch

    gen = opkit.generator(seed, spec.device)
    xs, cs, ss = spec.inputs
    x = opkit.random_tensor(xs.shape, xs.dtype, xs.device, gen, distribution)
    d = x.double()
    top = float(d.abs().max())
    g = 2.0 ** (math.ceil(math.log2(top)) - 14) if top > 0 else 1.0
    q = torch.round(d / g) * g
    tiny = max(g, _smallest_subnormal(x.dtype))
    x = torch.where(q == 0, torch.where(d < 0, -tiny, tiny), q).to(x.dtype)  # never zero

    def unit(shape):
        z = opkit.random_tensor(shape, "float32", cs.device, gen, "normal")
        v = torch.clamp(torch.round(z * 64), -128, 128)
        return (torch.where(v == 0, 1.0, v) / 128).to(opkit.torch_dtype(cs.dtype))

    return (x, unit(cs.shape), unit(ss.shape))


def rotate_half(x):
    import torch

    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def reference(inputs, attrs):
    """The eager baseline, as a user writes it (in x's dtype)."""
    x, cos, sin = inputs
    return x * cos + rotate_half(x) * sin


def alloc_output(inputs, spec: KernelSpec):
    """The layout eager's x * cos + rotate_half(x) * sin gives (torch.empty_like's: x's own strides where x is a
    dense permutation, e.g. Hugging Face's (B, S, H, D) projection read as (B, H, S, D); else dense strides in
    x's dimension order). Why not contiguous: attention after rope writes its output in q's layout (torch's
    flash and cuDNN kernels both), and `o.transpose(1, 2).reshape(B, S, -1)` is then a view; a contiguous q
    made that reshape a copy, 20 µs of the d=4096 block's 1.33 ms on the H100 (h100-models-2026-12-06-d)."""
    import torch

    return torch.empty_like(inputs[0], memory_format=torch.preserve_format)


def output_strides(spec: KernelSpec) -> tuple[int, ...]:
    """alloc_output's strides for x's layout in the spec (what the templates store with)."""
    x = spec.inputs[0]
    return opkit.empty_like_strides(x.shape, x.strides)


def run(module, inputs, out, attrs) -> None:
    x, cos, sin = inputs
    module.launch(x, cos, sin, out)


def _dims(spec: KernelSpec) -> tuple[int, int, int]:
    """(R = B*H rows of (S, D), S, D)."""
    b, h, s, d = spec.inputs[0].shape
    return b * h, s, d


def space(spec: KernelSpec) -> opkit.Space:
    r, s, d = _dims(spec)
    block_h = opkit.next_pow2(d // 2)

    batched = (spec.attrs.get("cos_batch") or 1) > 1

    def valid(c: opkit.Candidate) -> bool:
        p = c.p
        warps = p["num_warps"]
        if c.variant == "tile" and batched:
            return False  # tile shares one cos/sin tile across head rows that may belong to other sequences
        if c.variant == "tile":
            # No tile taller than S or head group larger than B*H: those lanes would all be masked.
            if p["BLOCK_S"] > opkit.next_pow2(s) or p["HEADS"] > opkit.next_pow2(r):
                return False
            rows = p["BLOCK_S"]
        else:
            rows = p["BLOCK_Q"]
            if rows > opkit.next_pow2(r * s):
                return False
        per_thread = rows * block_h / (32 * warps)
        return per_thread <= MAX_TILE_ELEMS_PER_THREAD and (warps == 1 or per_thread >= 1)

    return opkit.Space(
        variants={
            "tile": {"BLOCK_S": [1, 2, 4, 8, 16, 32, 64], "HEADS": [1, 2, 4, 8], "num_warps": [1, 2, 4, 8]},
            "rows": {"BLOCK_Q": [1, 2, 4, 8, 16, 32, 64], "num_warps": [1, 2, 4, 8, 16]},
        },
        valid=valid,
    )


def default(spec: KernelSpec) -> opkit.Candidate:
    """Untuned but sensible for any S: `rows` with ~1024 values per half-tile (8 per thread once it
    is >= 256 values; fewer rows, more warps for wide heads)."""
    r, s, d = _dims(spec)
    block_h = opkit.next_pow2(d // 2)
    block_q = min(64, opkit.next_pow2(r * s), max(1, 1024 // block_h))
    warps = min(16, max(1, block_q * block_h // 256))
    return opkit.Candidate.make("rows", BLOCK_Q=block_q, num_warps=warps)


def test_candidates(spec: KernelSpec) -> list[opkit.Candidate]:
    """For tests/test_templates.py: tiles that leave a partial last S block and a partial last head
    group, one-row tiles, and row blocks that leave a partial last block."""
    r, s, d = _dims(spec)
    block_s = 4 if s % 4 else 8
    heads = 2 if r % 2 else 4
    block_q = 4
    while (r * s) % block_q == 0:
        block_q *= 2
    # Masking first: BLOCK_S > S or HEADS > B*H (tiny shapes) is outside space() but must work too.
    rows = [opkit.Candidate.make("rows", BLOCK_Q=block_q, num_warps=1)]
    if (spec.attrs.get("cos_batch") or 1) > 1:
        return rows  # per-sequence tables: rows only (space())
    return [opkit.Candidate.make("tile", BLOCK_S=block_s, HEADS=heads, num_warps=1),
            opkit.Candidate.make("tile", BLOCK_S=1, HEADS=1, num_warps=1), *rows]


def render_context(spec: KernelSpec, cand: opkit.Candidate) -> dict:
    _, _, d = _dims(spec)
    ctx = dict(cand.p)
    ctx.update(HALF=d // 2, BLOCK_H=opkit.next_pow2(d // 2), kernel_name=f"forge_{NAME}_{cand.variant}",
               variant=cand.variant)
    # Only specs that need them render the (b, h, s) addressing: (S, D) and (1, 1, S, D) tables with a
    # contiguous x render exactly as before.
    x = spec.inputs[0]
    ctx["STRIDED"] = not x.contiguous
    ctx["COS_BATCHED"] = (spec.attrs.get("cos_batch") or 1) > 1
    ctx["COS_4D"] = spec.attrs.get("cos_batch") is not None  # (k, 1, S, D) tables: launch() reads S, D last
    if ctx["STRIDED"] or ctx["COS_BATCHED"]:
        ctx.update(H=x.shape[1], XSB=x.strides[0], XSH=x.strides[1], XSS=x.strides[2])
    if ctx["STRIDED"]:  # the output in alloc_output's layout (x's own where x is a dense permutation)
        ysb, ysh, yss, _ = output_strides(spec)
        ctx.update(YSB=ysb, YSH=ysh, YSS=yss)
    return ctx


def bytes_moved(spec: KernelSpec) -> int:
    x, cos, sin = spec.inputs
    return 2 * x.nbytes + cos.nbytes + sin.nbytes


def flops(spec: KernelSpec) -> int:
    return 3 * spec.inputs[0].numel


# tolerance: the contract's default, opkit.ROW_TOLERANCE (forge/ops.py). Exact up to the output
# rounding on make_inputs' grids; the row ops' bounds are ample.


# -- recognising rope in user code (forge/trace.py canonical forms) -------------------------------
_FULL = slice(None, None, None)


def _last_dim_slice(index) -> slice | None:
    """The slice of `x[..., s]` or `x[:, :, :, s]` (the 4-D spelling; problem() insists on 4-D x)."""
    if not isinstance(index, tuple):
        return None
    if len(index) == 2 and index[0] is Ellipsis and isinstance(index[1], slice):
        return index[1]
    if len(index) == 4 and all(i == _FULL for i in index[:3]) and isinstance(index[3], slice):
        return index[3]
    return None


def _halves(hi: tuple, lo: tuple):
    """(x, split) if `hi` is x's upper half and `lo` its lower half along the last dim, else None.
    split is None when the spelling guarantees the middle (chunk(2)), else the cut position."""
    if hi[0] == "getitem" and lo[0] == "getitem" and hi[1] == lo[1]:
        x = hi[1]
        if x[0] == "chunk" and x[1][0] == "input" and x[2:] == (("const", 2), ("const", -1)):
            if hi[2] == ("const", 1) and lo[2] == ("const", 0):
                return x[1], None
            return None
        if x[0] == "split" and x[1][0] == "input" and x[3] == ("const", -1) and isinstance(x[2][1], int):
            # x.split(h, -1) -> (x[:h], x[h:]) and a third piece if D > 2h; problem() then refuses the
            # call via make_spec's split check, as 2h != D.
            if hi[2] == ("const", 1) and lo[2] == ("const", 0):
                return x[1], x[2][1]
            return None
        if x[0] != "input" or hi[2][0] != "const" or lo[2][0] != "const":
            return None
        up, down = _last_dim_slice(hi[2][1]), _last_dim_slice(lo[2][1])
        if up is None or down is None or up.step not in (None, 1) or down.step not in (None, 1):
            return None
        h = up.start
        if not isinstance(h, int) or h == 0 or down.start not in (None, 0) or down.stop != h:
            return None
        if h < 0:  # x[..., -h:] and x[..., :-h]: the halves iff D == 2h, checked by make_spec
            return (x, -h) if up.stop is None else None
        if up.stop is not None and up.stop != 2 * h:  # x[..., h:2*h] is the upper half iff D == 2h
            return None
        return x, h
    return None


def _negated(t: tuple) -> tuple | None:
    if t[0] == "neg":
        return t[1]
    if t[0] == "mul" and len(t) == 3 and ("const", -1) in t[1:]:
        return t[2] if t[1] == ("const", -1) else t[1]
    return None


def _rotate_half(t: tuple):
    """(x, split) if t is cat((-x_hi, x_lo), -1), else None."""
    if t[0] != "cat" or t[2] != ("const", -1) or len(t[1]) != 2:
        return None
    first, second = t[1]
    hi = _negated(first)
    if hi is None:
        return None
    return _halves(hi, second)


def _split_product(t: tuple, pred) -> tuple | None:
    """For mul(a, b): (the factor satisfying pred, the other one), else None."""
    if t[0] != "mul" or len(t) != 3:
        return None
    a, b = t[1:]
    if pred(a):
        return a, b
    if pred(b):
        return b, a
    return None


def match(expr) -> tuple[list, dict] | None:
    """x * cos + rotate_half(x) * sin (either order, any operand order), rotate_half spelled with
    slices (x[..., h:], x[..., :h]), x.chunk(2, -1) or x.split(h, -1), inline or in a helper (fx
    inlines it). Returns ([x, cos, sin], {"split": h} or {})."""
    if expr[0] != "add" or len(expr) != 3:
        return None
    for rot_term, lin_term in (expr[1:], expr[2:0:-1]):
        rot = _split_product(rot_term, lambda f: _rotate_half(f) is not None)
        if rot is None:
            continue
        rot_factor, sin = rot
        x, split = _rotate_half(rot_factor)
        lin = _split_product(lin_term, lambda f, x=x: f == x)
        if lin is None:
            continue
        cos = lin[1]
        if sin[0] != "input" or cos[0] != "input" or x in (sin, cos):
            return None
        return [x[1], cos[1], sin[1]], ({} if split is None else {"split": split})
    return None
