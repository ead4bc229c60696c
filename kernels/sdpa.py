"""sdpa: forward scaled-dot-product attention, o = softmax(q @ k^T * scale [+ causal mask]) @ v, as
F.scaled_dot_product_attention(q, k, v, is_causal=..., scale=..., enable_gqa=...) computes it.

Layout: q (B, Hq, Sq, D), k and v (B, Hkv, Skv, D), each contiguous or in any layout with D contiguous
(the "strides" attribute: e.g. Hugging Face's linear(x).view(B, S, H, D).transpose(1, 2)); the output is
contiguous. Hq % Hkv == 0 (grouped-query
attention: q head h reads kv head h // (Hq // Hkv)). Problem shape (B, Hq, Sq, Skv, D); attributes
causal (torch's top-left aligned mask: query i sees keys j <= i, also when Sq != Skv), scale (the
float actually used, 1/sqrt(D) when the caller passed None) and kv_heads (Hkv).

Head dims 1..128 are supported: the kernels work on BLOCK_D = max(16, next_pow2(D)) columns and mask
the padding (D = 80 or 96 cost a 128-wide tile); D > 128 needs tiles that spill on Hopper. Not
supported (ValueError naming it; the shim runs eager with that reason): attn_mask, dropout_p > 0,
scale <= 0, non-4-D inputs, a layout whose D is not contiguous, a value head dim different from the query's,
Hq % Hkv != 0. A rendered kernel is specialised to its spec's Sq, Skv, D and group size (masks only
where a tile is partial); its launch() refuses other shapes.

Variants:
  flash        FlashAttention-2 forward: one program per (BLOCK_M query rows, batch*head), one loop
               over the K/V blocks up to the causal bound, every block masked as needed.
  flash_split  the same, with the K/V loop split in two: blocks left of the diagonal (and inside
               Skv) without any mask, then the diagonal/tail blocks with the causal and tail masks,
               so the bulk of a long causal row skips the per-element compare-and-select.
  split_kv     decode-oriented (flash-decoding): the K/V sequence is cut into NUM_SPLITS chunks that
               run as separate programs, each writing a partial output and its log-sum-exp; a second
               kernel merges them. The GROUP query heads sharing a K/V head are packed as rows of one
               tile, so K/V is read once per group. For small Sq, where the flash grid (Sq/BLOCK_M x
               B x H programs) cannot fill 132 SMs.

A fourth variant, flash_tma (flash_split's loops with q, k, v and o through 4-D tensor descriptors), was
measured on an H100 and removed: its best screening points took 1.24-1.46x torch SDPA's time at the causal
prefill rows, flash_split's 1.05-1.38x (bench/results/h100-peers-tma-search-2026-12-07.json; docs/notes.md
stop 32).
"""

from __future__ import annotations

import math

from forge import hardware, opkit
from forge.spec import KernelSpec, TensorSpec

NAME = "sdpa"
SUMMARY = "F.scaled_dot_product_attention(q, k, v, is_causal, scale, enable_gqa) forward"
TEMPLATES = {"flash": "sdpa_flash.j2", "flash_split": "sdpa_flash_split.j2", "split_kv": "sdpa_split_kv.j2"}
DEFAULT_ATTRS = {"causal": False, "scale": None, "kv_heads": None}
# form="mask": the user's code passes attn_mask, a boolean tensor that forge/regions.py proved to be a graph
# constant equal to the causal rule (or all True) and folded into `causal` (fold_constants). The kernels and
# the oracle are the causal ones; the reference, the search's baseline, is the user's call: F.sdpa with that
# explicit mask (torch then cannot use its flash backend) on k/v repeated per query head, as transformers
# 5.17's repeat_kv does before a masked call; torch's fused op F.sdpa(is_causal=...) is then a real
# candidate (forge/fused.py). Absent: the user called F.sdpa with is_causal.
# form="repeat": the user's code repeats k/v per query head first (transformers' repeat_kv, absorbed by the
# matcher: the spec is grouped-query attention over the unrepeated k/v); the reference repeats as they do,
# and F.sdpa(enable_gqa=True) on the unrepeated tensors is the fused candidate. "mask" implies the repeat.
FORMS = ("mask", "repeat")
OPTIONAL_ATTRS = ("form",)
# What a traced call may carry besides DEFAULT_ATTRS; accepted only at their no-op values, so the
# matcher can pass them through and make_spec names the unsupported one in its error. mask_leaf is the
# matcher's note (which region input the mask is) for fold_constants; it never reaches a spec.
_CALL_ATTRS = {"attn_mask": None, "dropout_p": 0.0, "enable_gqa": None, "mask_leaf": None, "form": None,
               "kv_repeat": None}
# forge/regions.py cuts below single-use nodes of these heads under q, k, v (a cut tried before the direct
# inputs): the matcher then sees k and v as transformers' repeat_kv spells them (kv_repeat below).
LOOK_THROUGH = ("view", "expand")
# q, k and v may each be strided with D contiguous (forge/ops.py: the "strides" attribute).
STRIDED_INPUTS = (0, 1, 2)

MAX_HEAD_DIM = 128
# The split-KV rule is about filling the GPU's multiprocessors (hardware.GPU_SMS); a program's q tile and
# K/V buffers must fit hardware.SMEM_PER_PROGRAM.
# fp32 values per thread (accumulator + score tile + q tile) above which Hopper spills registers.
MAX_REGS_PER_THREAD = 160

# Problem shapes for tests/test_templates.py (B, Hq, Sq, Skv, D): a single row and key, tails in Sq
# and Skv (7, 9, 17, 33, 65 are not multiples of 16 or 32), Sq > Skv and Sq < Skv, several heads
# and batches, and the D in {16, 32, 64} the tiles use (padded D is covered in tests/test_op_sdpa.py).
TEST_SHAPES = [(1, 1, 1, 1, 16), (1, 2, 7, 9, 16), (2, 3, 33, 17, 32), (1, 1, 65, 65, 64)]
# Realistic problem shapes for space/default checks (nothing is run at them): prefill, decode, small and
# padded head dims, a single row.
# For tests/test_templates.py's render check: every variant has points here, on both devices.
MID_SHAPE = (2, 8, 100, 300, 80)
SPACE_SHAPES = [(1, 32, 2048, 2048, 128), (4, 32, 1, 4096, 128), (8, 8, 512, 512, 64), (1, 1, 1, 1, 16),
                (2, 16, 333, 1000, 80), (16, 64, 1, 128, 64), (1, 8, 77, 77, 32), (1, 2, 4096, 4096, 16)]


def _block_d(d: int) -> int:
    return max(16, opkit.next_pow2(d))  # tl.dot needs K >= 16


def _normalise(shape: tuple[int, ...], attrs: dict | None) -> dict:
    """The spec's attributes {causal, scale, kv_heads}; ValueError naming anything unsupported."""
    a = {**DEFAULT_ATTRS, **_CALL_ATTRS, **(attrs or {})}
    unknown = set(a) - set(DEFAULT_ATTRS) - set(_CALL_ATTRS)
    if unknown:
        raise ValueError(f"sdpa takes attributes {sorted(DEFAULT_ATTRS)}, not {sorted(unknown)}")
    if a["attn_mask"] is not None:
        raise ValueError("attn_mask is not supported (only is_causal masking)")
    if float(a["dropout_p"]) != 0.0:
        raise ValueError(f"dropout_p={float(a['dropout_p']):g} is not supported (only dropout_p=0.0)")
    if len(shape) != 5:
        raise ValueError(f"sdpa's problem shape is (B, Hq, Sq, Skv, D), got {shape}")
    _, hq, _, _, d = shape
    kv_heads = hq if a["kv_heads"] is None else int(a["kv_heads"])
    if kv_heads < 1 or hq % kv_heads:
        raise ValueError(f"query heads {hq} are not a multiple of kv_heads {kv_heads}")
    if kv_heads != hq and a["enable_gqa"] is False:
        raise ValueError(f"{hq} query heads with {kv_heads} kv heads needs enable_gqa=True")
    if d > MAX_HEAD_DIM:
        raise ValueError(f"head dim D={d} is not supported (at most {MAX_HEAD_DIM})")
    scale = 1.0 / math.sqrt(d) if a["scale"] is None else float(a["scale"])
    if not scale > 0.0:  # the kernels take the running max of q.k before scaling
        raise ValueError(f"scale={scale:g} is not supported (only scale > 0)")
    if a["form"] is not None and a["form"] not in FORMS:
        raise ValueError(f"form={a['form']!r}: sdpa knows form='mask' (the causal rule or no masking, passed as a "
                         "boolean attn_mask), 'repeat' (k/v repeated per query head first) or no form")
    out = {"causal": bool(a["causal"]), "scale": scale, "kv_heads": kv_heads}
    return {**out, "form": a["form"]} if a["form"] else out  # absent: every other spec's key is unchanged


def make_spec(shape: tuple[int, ...], dtype: str, device: str, attrs: dict | None = None) -> KernelSpec:
    shape = tuple(int(s) for s in shape)
    a = _normalise(shape, attrs)
    b, hq, sq, skv, d = shape
    hkv = a["kv_heads"]
    return KernelSpec(NAME, (TensorSpec((b, hq, sq, d), dtype, device=device),
                             TensorSpec((b, hkv, skv, d), dtype, device=device),
                             TensorSpec((b, hkv, skv, d), dtype, device=device)), a)


def problem_shape(spec: KernelSpec) -> tuple[int, ...]:
    """(B, Hq, Sq, Skv, D): the shape make_spec builds `spec` from."""
    q, k, _ = spec.inputs
    b, hq, sq, d = q.shape
    return (b, hq, sq, k.shape[2], d)


def problem(inputs, attrs: dict) -> tuple[int, ...]:
    """(B, Hq, Sq, Skv, D) of a traced call. Also records kv_heads in `attrs` (in place): the matcher
    sees only the expression, and the shim passes this same dict on to make_spec and the search."""
    q, k, v = inputs
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"sdpa kernels take 4-D (B, H, S, D) tensors, got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})")
    b, hq, sq, d = q.shape
    _, hkv, skv, _ = k.shape
    if tuple(k.shape) != tuple(v.shape) or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must both be (B, Hkv, Skv, D) with "
                         f"q's B={b} and D={d} (a value head dim other than D is not supported)")
    if hq % hkv:
        raise ValueError(f"query heads {hq} are not a multiple of kv heads {hkv}")
    rep = attrs.get("kv_repeat")
    if rep is not None:  # the matcher's note: k, v were k0[:, :, None].expand(...).reshape(...) in the user's code
        unsq, n = rep
        if tuple(k.shape) != (unsq[0], unsq[1], unsq[3], unsq[4]) or hkv * n != hq:
            raise ValueError(f"k/v {tuple(k.shape)} repeated {n} times as {tuple(unsq)} is not grouped-query "
                             f"attention for {hq} query heads")
    attrs["kv_heads"] = int(hkv)
    return (b, hq, sq, skv, d)


def make_inputs(spec: KernelSpec, seed: int, distribution: str = "normal"):
    """Seeded q, k, v, drawn so that attention stays well-conditioned: the fp64 oracle then measures
    the kernel, not which of two nearly tied keys fp32 rounding happens to favour.

    v is non-negative: an output element is a convex combination of positive values and cannot cancel
    to ~0 (with signed v the element-wise check would measure the rounding of P to fp16/bf16 before
    P @ V, which FlashAttention and torch's kernels do, against a near-zero result; no atol bounds that
    across the 1e-4..1e5 scales). v is also at least half its distribution's scale s (|v| + s/2): P in
    fp16 rounds weights below 2^-14 (subnormal) to an absolute 2^-25, not a relative 2^-11, so a row
    whose dominant key has a near-zero v while many large-v keys carry such weights is off by ~2.4e-3
    relative (seen on the H200: 1-2 elements of 4M, fp16 'large', Skv=1024, flash_split 128x64), the
    rounding every fp16 FlashAttention does. With v >= s/2 the dominant key's v is never tiny, and that
    term stays under 2^-25 * Skv * (typical v / (s/2)) relative, ~3e-4 at Skv = 4096 even if every weight
    were subnormal. (A floor of s, v in [s, 2s], made the fp16 bound too loose to catch a 1% scale error.)

    q.k stays within |logit| ~ 1e3: a logit carries an absolute error of
    ~2^-24 |q||k|, and at 1e6..1e10 (q and k both 'large', or outlier meeting outlier, whose equal
    magnitudes tie exactly) that decides between near-tied keys, for eager torch as much as for these
    kernels. So 'large' scales q and v (q by 1e3 in fp16, 1e5 otherwise) and k by 16 / that (logits
    ~N(0, 16^2): sharp softmax, exp2 underflow across blocks), and 'outliers' puts them in q and v only.
    Masking, scaling and head-mapping bugs still move every output element."""
    gen = opkit.generator(seed, spec.device)
    q, k, v = spec.inputs
    q_dist, k_dist = distribution, {"large": "normal", "outliers": "normal"}.get(distribution, distribution)
    qt = opkit.random_tensor(q.shape, q.dtype, q.device, gen, q_dist)
    kt = opkit.random_tensor(k.shape, "float32", k.device, gen, k_dist)
    if distribution == "large":
        kt *= 16.0 / (1e3 if q.dtype == "float16" else 1e5)  # opkit.random_tensor's 'large' factor
    # v >= half its distribution's scale: see the docstring (fp16 weights below 2^-14).
    scale = {"large": 1e3 if v.dtype == "float16" else 1e5, "tiny": 1e-4}.get(distribution, 1.0)
    vt = opkit.random_tensor(v.shape, v.dtype, v.device, gen, distribution).float().abs() + scale / 2
    return qt, kt.to(opkit.torch_dtype(k.dtype)), vt.to(opkit.torch_dtype(v.dtype))


def _sdpa_torch(q, k, v, causal: bool, scale: float):
    import torch.nn.functional as F

    if k.shape[1] == q.shape[1]:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    try:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)
    except TypeError:  # torch < 2.5 has no enable_gqa: the same computation with k/v heads repeated
        group = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                              is_causal=causal, scale=scale)


def reference(inputs, attrs):
    """The eager baseline, the user's call: torch's fused SDPA (flash / memory-efficient / cuDNN backends on
    CUDA) with is_causal; for form="repeat" on k/v repeated per query head first (repeat_kv); for form="mask"
    also with the explicit boolean mask (causal rule or all True): what transformers 5.17 runs under
    torch.compile."""
    import torch
    import torch.nn.functional as F

    q, k, v = inputs
    form = attrs.get("form")
    if form not in ("mask", "repeat"):
        return _sdpa_torch(q, k, v, attrs["causal"], attrs["scale"])
    group = q.shape[1] // k.shape[1]
    if form == "repeat":
        return _sdpa_torch(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), attrs["causal"],
                           attrs["scale"])
    sq, skv = q.shape[2], k.shape[2]
    mask = torch.ones(sq, skv, dtype=torch.bool, device=q.device)
    if attrs["causal"]:
        mask = mask.tril(diagonal=0)
    if group > 1:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.expand(q.shape[0], 1, sq, skv),
                                          scale=attrs["scale"])


def fold_constants(picked, attrs: dict, constants: dict) -> dict:
    """forge/regions.py's hook: `constants` maps region inputs that are graph constants (forge/trace.py
    TraceGraph.constant: the same value on every call) to their value. A boolean attn_mask among them that
    equals the top-left causal rule tril(ones(Sq, Skv)) (transformers 5.17 builds it from aranges under
    torch.compile) becomes causal=True, one that is all True no mask; form="mask" keeps the user's masked
    call as the baseline. Anything else (a padding mask, a float mask, both a mask and is_causal) stays an
    attn_mask, which make_spec refuses."""
    import torch

    mask = constants.get(attrs.get("mask_leaf"))
    q, k = picked[0], picked[1]
    if (mask is None or attrs.get("causal") or mask.dtype != torch.bool or mask.dim() > 4
            or not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k))):
        return attrs
    sq, skv = q.shape[2], k.shape[2]
    try:
        full = mask.expand(q.shape[0], q.shape[1], sq, skv)
    except RuntimeError:  # not broadcastable to the scores: torch would refuse it too
        return attrs
    rule = torch.ones(sq, skv, dtype=torch.bool, device=mask.device).tril(diagonal=0)
    if torch.equal(full, rule.expand_as(full)):
        causal = True
    elif bool(full.all()):
        causal = False
    else:
        return attrs
    rest = {n: x for n, x in attrs.items() if n not in ("attn_mask", "mask_leaf")}
    return {**rest, "causal": causal, "form": "mask"}


def oracle(inputs, attrs):
    """float64, written out (not F.sdpa) so the oracle does not share torch's dispatch: scores, the
    top-left causal mask tril(ones(Sq, Skv)) (query i sees keys j <= i), softmax, @ v; GQA by
    repeating each kv head for its group of query heads.

    Never the whole (B, H, Sq, Skv) score tensor beyond opkit.oracle_budget: past it, one (batch, head) at a
    time and blocks of query rows, each block's exact softmax over its keys (for a causal block, the keys
    up to its last row: the others are masked to 0 weight anyway). The float64 working set of a block is
    its scores and their softmax plus the head's float64 k and v."""
    import torch

    q, k, v = inputs
    b, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    group = hq // hkv
    scale, causal = attrs["scale"], attrs["causal"]
    budget = opkit.oracle_budget(opkit.tensors_nbytes(inputs))
    # float64 elements held at once: q, k, v (k, v repeated per query head) and ~3 score-sized tensors.
    if 8 * (b * hq * (sq * d + 2 * skv * d) + 3 * b * hq * sq * skv) <= budget:
        q, k, v = (t.double() for t in inputs)
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        s = (q @ k.transpose(-2, -1)) * scale
        if causal:
            keep = torch.ones(sq, skv, dtype=torch.bool, device=s.device).tril(diagonal=0)
            s = s.masked_fill(~keep, float("-inf"))
        return torch.softmax(s, dim=-1) @ v
    rows = max(1, (budget // 8 - 2 * skv * d) // (3 * skv + 2 * d))  # query rows per block
    out = torch.empty((b, hq, sq, d), dtype=torch.float64, device=q.device)
    for bi in range(b):
        for h in range(hq):
            kh, vh = k[bi, h // group].double(), v[bi, h // group].double()
            for i0 in range(0, sq, rows):
                i1 = min(sq, i0 + rows)
                n = min(skv, i1) if causal else skv  # the keys this block's rows may see
                s = (q[bi, h, i0:i1].double() @ kh[:n].transpose(0, 1)) * scale
                if causal:  # row i0 + r sees keys j <= i0 + r
                    keep = torch.ones(i1 - i0, n, dtype=torch.bool, device=s.device).tril(diagonal=i0)
                    s = s.masked_fill(~keep, float("-inf"))
                out[bi, h, i0:i1] = torch.softmax(s, dim=-1) @ vh[:n]
                del s
    return out


def alloc_output(inputs, spec: KernelSpec):
    import torch

    q = inputs[0]  # contiguous whatever q's layout (the kernels write (B, Hq, Sq, D) row-major)
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


def run(module, inputs, out, attrs) -> None:
    """`attrs` is the spec's (validation, timing) or the traced call's (the shim), where scale may
    still be None; causal is baked into the rendered kernel."""
    q, k, v = inputs
    scale = attrs.get("scale")
    module.launch(q, k, v, out, 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale))


# -- search space ---------------------------------------------------------------------------------
_BLOCKS = [16, 32, 64, 128]
_GRID = {"BLOCK_M": _BLOCKS, "BLOCK_N": _BLOCKS, "num_warps": [1, 2, 4, 8], "num_stages": [1, 2, 3, 4]}


def _dims(spec: KernelSpec) -> tuple[int, int, int, int, int, int]:
    """(B, Hq, Hkv, Sq, Skv, D)."""
    q, k, _ = spec.inputs
    return q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3]


def space(spec: KernelSpec) -> opkit.Space:
    b, hq, hkv, sq, skv, d = _dims(spec)
    group = hq // hkv
    causal = spec.attrs["causal"]
    block_d = _block_d(d)
    esize = spec.inputs[0].itemsize
    on_gpu = spec.device == "cuda"
    kv_blocks_cap = max(16, opkit.next_pow2(skv))

    def valid(c: opkit.Candidate) -> bool:
        p = c.p
        bm, bn, warps, stages = p["BLOCK_M"], p["BLOCK_N"], p["num_warps"], p["num_stages"]
        rows = group * sq if c.variant == "split_kv" else sq  # split_kv packs a kv head's query heads
        if bm > max(16, opkit.next_pow2(rows)) or bn > kv_blocks_cap:
            return False  # a tile larger than the problem only adds masked work
        if not on_gpu and (bm > 32 or bn > 32 or stages != 1):
            return False  # the interpreter: small tiles, and pipelining does not exist there
        regs = (bm * block_d + bm * bn + bm * block_d * esize / 4) / (32 * warps)
        if regs > MAX_REGS_PER_THREAD:
            return False
        if warps > 1 and bm * bn / (32 * warps) < 4:
            return False  # warps with almost no scores to work on
        if esize * (bm * block_d + stages * 2 * bn * block_d) > hardware.SMEM_PER_PROGRAM:
            return False  # q tile + num_stages buffers of K and V tiles
        if c.variant == "flash_split":
            # Without a causal mask or a partial last block, both loops are the one of `flash`.
            return causal or skv % bn != 0
        if c.variant == "split_kv":
            if causal:
                return False  # top-left causal with small Sq sees only the first keys: nothing to split
            programs = -(-rows // bm) * b * hkv
            splits = p["NUM_SPLITS"]
            launched = _splits(skv, bn, splits)[0]
            # Splitting pays only while the unsplit grid leaves SMs idle. Each split holds whole blocks,
            # so a NUM_SPLITS that launches no more splits than half of it would is the same kernel.
            return (programs < 4 * hardware.GPU_SMS and launched > _splits(skv, bn, max(1, splits // 2))[0]
                    and programs * splits <= 16 * hardware.GPU_SMS)
        return True

    variants = {"flash": dict(_GRID), "flash_split": dict(_GRID),
                "split_kv": {**_GRID, "BLOCK_M": [16, 32, 64], "NUM_SPLITS": [2, 4, 8, 16, 32, 64]}}
    return opkit.Space(variants=variants, valid=valid)


def default(spec: KernelSpec) -> opkit.Candidate:
    """Untuned but sensible: FlashAttention-2's usual tiles (128x64, 8 warps for D=128, 4 below),
    the split loop when causal, split-KV for decode; the first of these the space allows."""
    b, hq, hkv, sq, skv, d = _dims(spec)
    sp = space(spec)
    mk = opkit.Candidate.make
    prefs = []
    if spec.device != "cuda":
        variant = "flash_split" if spec.attrs["causal"] or skv % 32 else "flash"
        prefs += [mk(variant, BLOCK_M=bm, BLOCK_N=bn, num_warps=1, num_stages=1)
                  for bm in (32, 16) for bn in (32, 16)]
    else:
        if not spec.attrs["causal"]:
            programs = -(-(hq // hkv * sq) // 16) * b * hkv
            splits = max(2, min(64, opkit.next_pow2(-(-2 * hardware.GPU_SMS // programs))))
            prefs += [mk("split_kv", BLOCK_M=16, BLOCK_N=bn, NUM_SPLITS=ns, num_warps=4, num_stages=2)
                      for bn in (64, 32, 16) for ns in (splits, splits // 2, 2) if ns >= 2]
        variant = "flash_split" if spec.attrs["causal"] else "flash"
        warps = 8 if d > 64 else 4
        prefs += [mk(variant, BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s)
                  for bm in (128, 64, 32, 16) for bn in (64, 32, 16) for w in (warps, 4, 2, 1) for s in (3, 2, 1)]
    for cand in prefs:
        if cand in sp:
            return cand
    return sp.points("flash")[0]  # BLOCK 16x16, 1 warp is valid for every supported spec


def test_candidates(spec: KernelSpec) -> list[opkit.Candidate]:
    """For tests/test_templates.py: one candidate per variant with masked tails at TEST_SHAPES (some
    outside space(): flash_split also runs without causal, split_kv with a single K/V block), plus
    pipelined GPU-sized tiles on CUDA."""
    mk = opkit.Candidate.make
    out = [mk("flash", BLOCK_M=16, BLOCK_N=32, num_warps=1, num_stages=1),
           mk("flash_split", BLOCK_M=32, BLOCK_N=16, num_warps=1, num_stages=1),
           mk("split_kv", BLOCK_M=16, BLOCK_N=16, NUM_SPLITS=4, num_warps=1, num_stages=1)]
    if spec.device == "cuda":
        out += [mk("flash", BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
                mk("flash_split", BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2),
                mk("split_kv", BLOCK_M=16, BLOCK_N=64, NUM_SPLITS=8, num_warps=4, num_stages=2)]
    return out


def _splits(skv: int, block_n: int, num_splits: int) -> tuple[int, int]:
    """(splits actually launched, K/V blocks per split): whole blocks per split, none of them empty."""
    blocks = -(-skv // block_n)
    per_split = -(-blocks // num_splits)
    return -(-blocks // per_split), per_split


def render_context(spec: KernelSpec, cand: opkit.Candidate) -> dict:
    """The shape is baked in (a rendered kernel serves one spec; its launch() checks the call's shape),
    so the templates emit a mask only along a dimension with a partial tile or padding."""
    b, hq, hkv, sq, skv, d = _dims(spec)
    ctx = dict(cand.p)
    bm, bn = ctx["BLOCK_M"], ctx["BLOCK_N"]
    ctx.update(SQ=sq, SKV=skv, D=d, GROUP=hq // hkv, BLOCK_D=_block_d(d), PAD_D=_block_d(d) != d,
               MASK_N=skv % bn != 0)
    if cand.variant == "split_kv":
        rows = hq // hkv * sq  # a kv head's query heads, packed
        ctx["SPLITS"], ctx["BLOCKS_PER_SPLIT"] = _splits(skv, bn, ctx["NUM_SPLITS"])
        ctx["MASK_M"] = rows % bm != 0
        # the merge kernel's tile of every split's partial row (the splits launched, padded to a power of 2)
        ctx["MERGE_SPLITS"] = opkit.next_pow2(ctx["SPLITS"])
    else:
        ctx["MASK_M"] = sq % bm != 0
    ctx["IS_CAUSAL"] = bool(spec.attrs["causal"])
    # fp32 inputs: full-precision products (Triton's default for fp32 tl.dot is TF32, 10-bit mantissa,
    # which torch's SDPA does not use for fp32).
    ctx["DOT_KW"] = ', input_precision="ieee"' if spec.dtype == "float32" else ""
    # The interpreter's tl.dot multiplies bf16 tensors as their raw uint16 bits (Triton 3.6 and 3.9:
    # np.matmul on the storage array), so there bf16 operands are widened to fp32 first (exact; P is
    # still rounded to bf16 before the widening, as on the GPU). CUDA sources do not contain it.
    ctx["UP"] = ".to(tl.float32)" if spec.device != "cuda" and spec.dtype == "bfloat16" else ""
    # Triton <= 3.6's interpreter cannot take a loop bound computed at run time (see
    # opkit.row_render_context): there Skv is a constexpr and the loops run over all K/V blocks,
    # skipping those outside the program's range with an `if`.
    ctx["N_CONSTEXPR"] = spec.device != "cuda"
    # A strided spec (q, k, v views in any layout with D contiguous, e.g. Hugging Face's
    # linear(x).view(B, S, H, D).transpose(1, 2)): the strides are baked in; contiguous specs render the
    # row-major addressing they always had.
    q_spec, k_spec, v_spec = spec.inputs
    ctx["STRIDED"] = not all(t.contiguous for t in spec.inputs)
    if ctx["STRIDED"]:
        ctx.update(HQ=hq, HKV=hkv, QSB=q_spec.strides[0], QSH=q_spec.strides[1], QSS=q_spec.strides[2],
                   KSB=k_spec.strides[0], KSH=k_spec.strides[1], KSS=k_spec.strides[2],
                   VSB=v_spec.strides[0], VSH=v_spec.strides[1], VSS=v_spec.strides[2])
    ctx["kernel_name"] = f"forge_sdpa_{cand.variant}"
    ctx["variant"] = cand.variant
    return ctx


def bytes_moved(spec: KernelSpec) -> int:
    q, k, v = spec.inputs
    return 2 * q.nbytes + k.nbytes + v.nbytes


def _attended_pairs(sq: int, skv: int, causal: bool) -> int:
    """(query, key) pairs that are not masked: top-left causal row i sees min(i + 1, Skv) keys."""
    if not causal:
        return sq * skv
    full = max(0, sq - skv)  # rows i >= Skv see every key
    tri = min(sq, skv)
    return tri * (tri + 1) // 2 + full * skv


def flops(spec: KernelSpec) -> int:
    b, hq, _, sq, skv, d = _dims(spec)
    return 4 * b * hq * _attended_pairs(sq, skv, spec.attrs["causal"]) * d  # two matmuls, 2 flops per MAC


# fp16/bf16: P is rounded to the input dtype before P @ V (as in FlashAttention and torch's kernels) and
# the output once more; with v >= 0 (make_inputs) the terms cannot cancel, so an element is off by at
# most those two roundings plus fp32 accumulation. One bf16 ulp is 2^-8..2^-7 relative and the Triton
# interpreter rounds fp32 -> bf16 toward zero (a full ulp each time): 2 x 2^-7 = 1.6e-2, hence rtol 2e-2
# (measured: up to 0.87 x 1.6e-2 in the interpreter, 0.44 x for torch's own bf16 SDPA). fp16 (ulp
# 2^-11..2^-10, rounded to nearest): measured <= 0.45 x these bounds. fp32 (IEEE products): a logit
# carries an absolute error of ~2^-24 sum|q_i k_i| * scale, which exp() makes relative; with the
# outliers distribution that reached 5.8e-4 element-wise (torch's fp32 SDPA: 5.3e-4), hence rtol 1e-3
# while the norm-wise bound stays at 1e-5.
TOLERANCE = {
    "float32": opkit.Tolerance(rel_norm=1e-5, atol=1e-6, rtol=1e-3),
    "float16": opkit.Tolerance(rel_norm=2e-3, atol=1e-6, rtol=2e-3),
    "bfloat16": opkit.Tolerance(rel_norm=1e-2, atol=1e-5, rtol=2e-2),
}


def tolerance(dtype: str) -> opkit.Tolerance:
    return TOLERANCE[dtype]


# -- recognising sdpa in user code (forge/trace.py canonical forms) ---------------------------------
def _repeated(t) -> tuple[int, tuple | None] | None:
    """(input index, None) for a plain input; (input index, (unsqueezed shape, n)) for transformers'
    repeat_kv, `x[:, :, None, :, :].expand(B, Hkv, n, S, D).reshape(B, Hkv * n, S, D)` (canonically
    view(expand(view(x)))): the same attention as GQA over x (problem() checks x's shape); else None."""
    if t[0] == "input":
        return t[1], None
    try:
        head, (h2, (h3, x, (c1k, c1)), (c2k, c2)), (c3k, c3) = t
    except (TypeError, ValueError):
        return None
    if (head, h2, h3, c1k, c2k, c3k, x[0]) != ("view", "expand", "view", "const", "const", "const", "input"):
        return None
    if not (len(c1) == len(c2) == 5 and c1[2] == 1 and tuple(c2[:2]) == tuple(c1[:2])
            and tuple(c2[3:]) == tuple(c1[3:]) and tuple(c3) == (c2[0], c2[1] * c2[2], c2[3], c2[4])):
        return None
    return x[1], (tuple(c1), int(c2[2]))


def match(expr) -> tuple[list, dict] | None:
    """("sdpa", q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa) with q a plain input and k, v
    plain inputs or both repeat_kv'd (GQA over the unrepeated tensors). attn_mask / dropout_p are passed on
    when set, so make_spec names them as the reason for eager."""
    if expr[0] != "sdpa" or len(expr) != 9:
        return None
    _, q, k, v, mask, dropout, causal, scale, gqa = expr
    kk, vv = _repeated(k), _repeated(v)
    if q[0] != "input" or kk is None or vv is None or kk[1] != vv[1]:
        return None
    if any(t[0] != "const" for t in (dropout, causal, scale, gqa)):
        return None
    if mask[0] == "expand" and mask[1][0] == "input" and mask[2][0] == "const":
        mask = mask[1]  # a broadcast of the mask input: the same values (fold_constants broadcasts it too)
    if mask[0] not in ("const", "input"):  # the mask's own computation: matched where it is a region input
        return None
    attrs: dict = {"causal": bool(causal[1]), "scale": None if scale[1] is None else float(scale[1]),
                   "enable_gqa": bool(gqa[1])}
    if mask != ("const", None):
        attrs["attn_mask"] = "tensor" if mask[0] == "input" else "constant"
        if mask[0] == "input":  # fold_constants may prove it the causal rule (a region input: which one)
            attrs["mask_leaf"] = mask[1]
    if dropout[1]:
        attrs["dropout_p"] = float(dropout[1])
    if kk[1] is not None:  # fold_constants turns it into form="mask" where the mask is the causal rule
        attrs["kv_repeat"], attrs["enable_gqa"], attrs["form"] = kk[1], True, "repeat"
    return [q[1], kk[0], vv[0]], attrs

