"""Building blocks shared by the op families in kernels/ (search-space types, input distributions,
tolerances). torch is imported inside the functions that need it, so the parent process can build
search spaces and render candidates without paying for torch tensors.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from forge import hardware

DISTRIBUTIONS = ("normal", "large", "tiny", "outliers")


@dataclass(frozen=True)
class Candidate:
    """One point of a search space: a structural variant (a template) and its parameters."""

    variant: str
    params: tuple[tuple[str, Any], ...]

    @classmethod
    def make(cls, variant: str, **params: Any) -> Candidate:
        return cls(variant, tuple(sorted(params.items())))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Candidate:
        return cls.make(d["variant"], **d["params"])

    @property
    def p(self) -> dict[str, Any]:
        return dict(self.params)

    def to_dict(self) -> dict[str, Any]:
        return {"variant": self.variant, "params": self.p}

    @property
    def label(self) -> str:
        return f"{self.variant}({', '.join(f'{k}={v}' for k, v in self.params)})"

    @property
    def key(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


@dataclass
class Space:
    """variants: variant -> {param: [choices]}; valid: the ONE rule saying which points are allowed."""

    variants: dict[str, dict[str, list[Any]]]
    valid: Callable[[Candidate], bool]

    def points(self, variant: str) -> list[Candidate]:
        grid = self.variants[variant]
        names = sorted(grid)
        out = []
        for values in itertools.product(*(grid[n] for n in names)):
            cand = Candidate(variant, tuple(zip(names, values, strict=True)))
            if self.valid(cand):
                out.append(cand)
        return out

    def all_points(self) -> Iterator[Candidate]:
        for variant in self.variants:
            yield from self.points(variant)

    def __contains__(self, cand: Candidate) -> bool:
        grid = self.variants.get(cand.variant)
        if grid is None or set(grid) != {k for k, _ in cand.params}:
            return False
        return all(v in grid[k] for k, v in cand.params) and self.valid(cand)


@dataclass(frozen=True)
class Tolerance:
    """Pass iff ‖out−ref‖/‖ref‖ <= rel_norm AND |out−ref| <= atol + rtol·|ref| element-wise."""

    rel_norm: float
    atol: float
    rtol: float


# Output rounding alone is 2^-11 (fp16), 2^-8 (bf16), 2^-24 (fp32) relative; the bounds below leave
# room for fp32 accumulation-order differences and Triton's approximate rsqrt/exp (a few ulp).
ROW_TOLERANCE = {
    "float32": Tolerance(rel_norm=1e-5, atol=1e-6, rtol=1e-4),
    "float16": Tolerance(rel_norm=2e-3, atol=1e-5, rtol=2e-3),
    "bfloat16": Tolerance(rel_norm=1e-2, atol=1e-5, rtol=1.6e-2),
}


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def torch_dtype(name: str):
    import torch

    return {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
            "int64": torch.int64, "int32": torch.int32}[name]


def torch_device(spec_device: str) -> str:
    return "cuda" if spec_device == "cuda" else "cpu"


def random_tensor(shape, dtype: str, device: str, gen, distribution: str, *, base: float = 0.0):
    """Seeded test data, generated on the target device (on the GPU, generating 134M values on the
    host took seconds per call; on the device it takes milliseconds). Never zeros: they hide
    unwritten outputs and bad indexing.

    normal: N(base, 1); large: ×1e3 (fp16, whose max is 65504) or ×1e5; tiny: ×1e-4;
    outliers: N(0,1) with ~0.1% of elements set to ±1e3 (fp16) or ±1e4.
    """
    import torch

    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"unknown distribution {distribution!r}")
    dev = torch_device(device)
    shape = tuple(shape)
    x = torch.randn(shape, generator=gen, dtype=torch.float32, device=dev)
    if distribution == "large":
        x *= 1e3 if dtype == "float16" else 1e5
    elif distribution == "tiny":
        x *= 1e-4
    elif distribution == "outliers":
        u = torch.rand(shape, generator=gen, dtype=torch.float32, device=dev)
        big = 1e3 if dtype == "float16" else 1e4
        # In place (torch.where would hold two more float32 copies at once): x, u and one mask at a time.
        x.masked_fill_(u > 1 - 1e-3, -big)
        x.masked_fill_(u < 1e-3, big)
        del u
    if base:
        x += base
    return x.to(torch_dtype(dtype))


# -- strided inputs ----------------------------------------------------------------------------------
# A spec's inputs are contiguous unless its attribute "strides" names their layout: one entry per input,
# separated by ";", each "c" (contiguous) or the strides, comma-separated ("4096,1;c": x with a row stride
# of 4096, the weight contiguous). A plain string, so it travels like any attribute: in the cache key, a
# manifest, `--attr strides=...`. Only the inputs an op family lists in STRIDED_INPUTS may be strided, and
# only with the last dimension contiguous and no two elements at one address.
STRIDES = "strides"


def strides_text(layouts: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> str | None:
    """The "strides" attribute for inputs given as (shape, strides), or None when all are contiguous."""
    from forge.spec import contiguous_strides, same_layout

    parts, strided = [], False
    for shape, strides in layouts:
        if same_layout(shape, strides, contiguous_strides(shape)):
            parts.append("c")
        else:
            strided = True
            parts.append(",".join(str(int(s)) for s in strides))
    return ";".join(parts) if strided else None


def parse_strides(text: Any, shapes: list[tuple[int, ...]], strided_inputs: tuple[int, ...],
                  any_order: bool = False) -> list[tuple | None]:
    """The per-input strides a "strides" attribute names (None: contiguous); ValueError with the reason."""
    if not isinstance(text, str):
        raise ValueError(f"strides={text!r}: expected a string like '4096,1;c' (one entry per input)")
    parts = text.split(";")
    if len(parts) != len(shapes):
        raise ValueError(f"strides={text!r} names {len(parts)} input(s); the op takes {len(shapes)}")
    out: list[tuple | None] = []
    for i, (part, shape) in enumerate(zip(parts, shapes, strict=True)):
        part = part.strip()
        if part == "c":
            out.append(None)
            continue
        try:
            strides = tuple(int(x) for x in part.split(","))
        except ValueError:
            raise ValueError(f"strides={text!r}: input {i}: {part!r} is neither 'c' nor integers") from None
        if i not in strided_inputs:
            raise ValueError(f"input {i} must be contiguous (this op takes strided layouts for input(s) "
                             f"{list(strided_inputs) or 'none'})")
        check_layout(shape, strides, f"input {i}", any_order)
        out.append(strides)
    return out


def check_layout(shape: tuple[int, ...], strides: tuple[int, ...], what: str, any_order: bool = False) -> None:
    """A layout a strided kernel takes: one stride per dim, the last dim contiguous (unless any_order: the
    family's kernels take any order, e.g. matmul's w.t()), every stride positive, and no two elements at
    one address (each dim, by stride, steps over all the smaller ones)."""
    if len(strides) != len(shape):
        raise ValueError(f"{what}: {len(strides)} strides for {len(shape)} dims")
    if not any_order and shape[-1] > 1 and strides[-1] != 1:
        raise ValueError(f"{what}: the last dimension must be contiguous (stride 1), got strides {strides}")
    dims = sorted((st, n) for n, st in zip(shape, strides, strict=True) if n > 1)
    span = 1
    for st, n in dims:
        if st < span:
            raise ValueError(f"{what}: strides {strides} for shape {shape} overlap or are not positive")
        span = st * n


def empty_like_strides(shape: tuple[int, ...], strides: tuple[int, ...]) -> tuple[int, ...]:
    """The strides torch.empty_like gives a tensor of this layout (preserve_format: the same strides where it
    is a dense permutation, else dense strides in its dimension order), on a meta tensor: nothing allocated."""
    import torch

    meta = torch.empty_strided(tuple(shape), tuple(strides), device="meta")
    return tuple(torch.empty_like(meta, memory_format=torch.preserve_format).stride())


def restride(t, strides: tuple[int, ...]):
    """t's values in a tensor with these strides, in a fresh allocation whose gaps hold NaN (floats) or -1:
    a kernel that reads a gap poisons its output, and validation sees it."""
    import torch

    from forge.spec import storage_elements

    fill = float("nan") if t.is_floating_point() else -1
    buf = torch.full((storage_elements(tuple(t.shape), strides),), fill, dtype=t.dtype, device=t.device)
    out = buf.as_strided(tuple(t.shape), strides)
    out.copy_(t)
    return out


def generator(seed: int, device: str = "cpu"):
    import torch

    g = torch.Generator(device=torch_device(device))
    g.manual_seed(seed)
    return g


# ---------------------------------------------------------------------------------------------
# Row-wise ops over the last dimension (norms, softmax, row reductions) share one structure:
# a [M, N] view, and three structural variants:
#   row      - one row per program, the whole row in registers (BLOCK_N = next_pow2(N))
#   looped   - one row per program, loops over column blocks (long rows that would spill)
#   multirow - ROWS rows per program, whole rows in registers (short rows, many of them)
# (and, for rmsnorm, persistent: with_persistent_rows below)

ROW_VARIANTS = ("row", "looped", "multirow")
# fp32 values per thread above which the whole-row variants spill registers on Hopper
# (x and w both live in registers; 64 fp32 each ≈ 128 of 255 registers).
MAX_ELEMS_PER_THREAD = 64
MAX_LOOP_ELEMS_PER_THREAD = 32


def rows_cols(spec) -> tuple[int, int]:
    """(rows, columns) of the [M, N] view a row kernel runs on. A spec normalizing over several trailing
    dims (attribute "dims" = k, e.g. nn.LayerNorm((C, H, W))) is a row op over their product: its rows
    are contiguous, so the kernels are the last-dim ones on x.reshape(-1, prod(shape[-k:]))."""
    shape = spec.inputs[0].shape
    k = int(getattr(spec, "attrs", {}).get("dims", 1))
    n = 1
    for s in shape[len(shape) - k:]:
        n *= s
    m = 1
    for s in shape[:len(shape) - k]:
        m *= s
    return m, n


def trailing_shape(shape: tuple[int, ...], attrs: dict) -> tuple[int, ...]:
    """The shape of a row op's weight: the normalized trailing dims (attribute "dims", default 1), or for
    a reduction over one non-last dim (attribute "dim" = d < -1) that dim's size followed by ones, so it
    broadcasts against x exactly as the user's w.view(1, C, 1, 1) does (C at dim d)."""
    dim = int(attrs.get("dim", -1))
    if dim != -1:
        return (shape[dim], *(1,) * (-dim - 1))
    k = int(attrs.get("dims", 1))
    return tuple(shape[len(shape) - k:])


def outer_r_inner(shape: tuple[int, ...], dim: int) -> tuple[int, int, int]:
    """(outer, R, inner) of a reduction over dim `dim` (negative) of a contiguous tensor: R values at
    stride `inner`, for each of outer x inner positions."""
    outer = inner = 1
    for s in shape[:len(shape) + dim]:
        outer *= s
    for s in shape[len(shape) + dim + 1:]:
        inner *= s
    return outer, shape[dim], inner


def normalize_dim(dim: Any, ndim: int, what: str) -> int:
    """One dim as a negative index (the spec's form, so dim=1 and dim=-3 of a 4-D tensor are one key)."""
    if isinstance(dim, list | tuple) and len(dim) == 1:
        dim = dim[0]
    if isinstance(dim, bool) or not isinstance(dim, int) or not -ndim <= dim < ndim:
        raise ValueError(f"{what}: dim={dim!r} is not one dimension of a {ndim}-d tensor")
    return dim - ndim if dim >= 0 else dim


def row_space(spec) -> Space:
    m, n = rows_cols(spec)
    block = next_pow2(n)
    on_gpu = spec.device == "cuda"

    def valid(c: Candidate) -> bool:
        p = c.p
        warps = p["num_warps"]
        if c.variant == "looped":
            if not p["BLOCK_N"] < block:  # a single block is the `row` variant
                return False
            if not on_gpu and p["num_stages"] != 1:  # pipelining does not exist in the interpreter
                return False
            per_thread = p["BLOCK_N"] / (32 * warps)
            return per_thread <= MAX_LOOP_ELEMS_PER_THREAD and (warps == 1 or per_thread >= 1)
        rows = p.get("ROWS", 1)
        if c.variant == "multirow" and rows > next_pow2(m):
            return False
        per_thread = rows * block / (32 * warps)
        return per_thread <= MAX_ELEMS_PER_THREAD and (warps == 1 or per_thread >= 1)

    return Space(
        variants={
            "row": {"num_warps": [1, 2, 4, 8, 16, 32]},
            "looped": {"BLOCK_N": [256, 512, 1024, 2048, 4096, 8192], "num_warps": [2, 4, 8, 16],
                       "num_stages": [1, 2, 3]},
            "multirow": {"ROWS": [2, 4, 8, 16, 32], "num_warps": [1, 2, 4, 8, 16]},
        },
        valid=valid,
    )


def capped_row_space(spec, max_elems_per_thread: int) -> Space:
    """row_space with the whole-row variants (row, multirow) capped at `max_elems_per_thread` elements per
    thread, for row ops that hold several arrays of the row in registers (layer_norm: x, w, b; add_norm);
    looped holds one block of each and keeps row_space's own bound."""
    base = row_space(spec)
    block = next_pow2(rows_cols(spec)[1])

    def valid(c: Candidate) -> bool:
        if not base.valid(c):
            return False
        if c.variant == "looped":
            return True
        return c.p.get("ROWS", 1) * block / (32 * c.p["num_warps"]) <= max_elems_per_thread

    return Space(base.variants, valid)


# Helion-style knobs for the row ops (issue 16; Helion's rmsnorm winner at 8192^2 used 2 rows per program,
# eviction policy "last" and 32 warps): a "persistent" variant, at most PROGRAMS_PER_SM x SMs programs striding
# over blocks of ROWS whole rows (block pid, pid + grid, ...), the weight loaded once per program, the next
# block's loads pipelined (tl.range num_stages). Knobs are numbers (forge/key.py refuses anything else in params).
# Measured on an H100 (budget-50 search, 2026-12-06, bench/results/h100-knobs-search-2026-12-06.json; screen
# p50, best point of each variant; docs/notes.md, stop 30): only rmsnorm keeps it, and only up to max_numel
# elements (kernels/rmsnorm.py PERSISTENT_MAX_NUMEL). softmax and layer_norm had it too and it never competed
# there (softmax 8192x8192: row 90.77 us vs persistent 98.36; layer_norm 8192x8192: 92.41 vs 104.42). Its
# eviction knob (EVICT=1: x loaded "evict_first") was removed: pairs differing only in EVICT timed 0.97-1.07x
# at 2048x4096 and 0.99-1.03x elsewhere (noise).
PERSISTENT_ROWS = {"ROWS": [1, 2, 4], "num_warps": [4, 8, 16], "PROGRAMS_PER_SM": [2, 4], "num_stages": [1, 2]}


def with_persistent_rows(spec, base: Space, *, max_numel: int) -> Space:
    """`base` (a row space) and the "persistent" variant, valid where its programs loop over row blocks (more
    blocks than programs: with one block per program it is multirow with extra work), its rows fit in
    registers as multirow's do (MAX_ELEMS_PER_THREAD), and the tensor holds at most `max_numel` elements
    (rows x columns: where the caller measured it competitive)."""
    m, n = rows_cols(spec)
    block = next_pow2(n)
    on_gpu = spec.device == "cuda"
    sms = hardware.GPU_SMS if on_gpu else hardware.CPU_SMS

    def valid(c: Candidate) -> bool:
        if c.variant != "persistent":
            return base.valid(c)
        if m * n > max_numel:
            return False
        p = c.p
        if not on_gpu and p["num_stages"] != 1:  # pipelining does not exist in the interpreter
            return False
        per_thread = p["ROWS"] * block / (32 * p["num_warps"])
        if per_thread > MAX_ELEMS_PER_THREAD or per_thread < 1 or p["ROWS"] > next_pow2(m):
            return False
        return -(-m // p["ROWS"]) > p["PROGRAMS_PER_SM"] * sms

    return Space({**base.variants, "persistent": dict(PERSISTENT_ROWS)}, valid)


def row_default(spec) -> Candidate:
    """An untuned but sensible choice: whole row with ~8 fp32 values per thread, else looped."""
    _, n = rows_cols(spec)
    block = next_pow2(n)
    if block <= 16384:
        warps = min(32, max(1, block // 256))
        return Candidate.make("row", num_warps=warps)
    return Candidate.make("looped", BLOCK_N=4096, num_warps=8, num_stages=2 if spec.device == "cuda" else 1)


def last_dim_unary_spec(name: str, shape: tuple[int, ...], dtype: str, device: str, attrs: dict | None):
    """The spec of a one-input op over the last dimension whose only attribute is dim (softmax,
    log_softmax): dim normalised to -1, anything else refused with a reason."""
    from forge.spec import KernelSpec, TensorSpec

    a = {"dim": -1, **(attrs or {})}
    unknown = set(a) - {"dim"}
    if unknown:
        raise ValueError(f"{name} takes attributes ['dim'], not {sorted(unknown)}")
    if int(a["dim"]) not in (-1, len(shape) - 1):
        raise ValueError(f"{name} kernels reduce over the last dimension only, not dim={a['dim']}")
    a["dim"] = -1
    return KernelSpec(name, (TensorSpec(shape, dtype, device=device),), a)


def unary_inputs(spec, seed: int, distribution: str = "normal") -> tuple:
    x = spec.inputs[0]
    return (random_tensor(x.shape, x.dtype, x.device, generator(seed, x.device), distribution),)


def row_render_context(spec, cand: Candidate, op: str) -> dict[str, Any]:
    _, n = rows_cols(spec)
    ctx = dict(cand.p)
    ctx.setdefault("ROWS", 1)
    ctx.setdefault("num_stages", 1)
    if cand.variant != "looped":
        ctx["BLOCK_N"] = next_pow2(n)
    # Triton <= 3.6's interpreter converts a runtime loop bound with int(1-element array), which
    # numpy >= 2.4 rejects ("only 0-dimensional arrays can be converted to Python scalars"), so
    # `range(0, N, BLOCK_N)` fails there. On the interpreter N is passed as a constexpr (a Python
    # int) instead; CUDA sources are unaffected (byte-identical to the ones measured on the H200).
    ctx["N_CONSTEXPR"] = spec.device != "cuda"
    # the persistent variant's (with_persistent_rows, rmsnorm's): the interpreter's SM count
    ctx["CPU_SMS"] = hardware.CPU_SMS
    ctx["kernel_name"] = f"forge_{op}_{cand.variant}"
    ctx["variant"] = cand.variant
    return ctx


# ---------------------------------------------------------------------------------------------
# Elementwise ops over the flattened tensor (gelu, silu_mul) share one space:
#   flat        one block of BLOCK contiguous elements per program
#   persistent  at most PROGRAMS_PER_SM x SMs programs looping over blocks (grid-stride)
# Measured on the H200 (bf16, do_bench medians, 2026-12-02): `flat` is the faster variant on large
# tensors (gelu 8192x14336: 141 us flat vs 148 us best persistent vs 153 us eager; silu_mul: 167 vs
# 174 vs 286 us) and `persistent` ties or wins narrowly around 1M elements (gelu 1024x1024: 5.7 vs
# 6.1 us), where cdiv(numel, BLOCK) blocks leave a partial last wave. On large tensors the unpipelined
# persistent grid was fastest with the most programs (8 per SM x 16 warps, more than the 64 resident
# warps an SM holds): memory parallelism matters more there than the programs' lifetime, so that end
# stays in the grid. Its loop pipelined over 3 stages (tl.range num_stages) was 7% faster than unpipelined
# for gelu at 8192x14336 over grids of at most 64 warps per SM (148 vs 159 us).
ELEMENTWISE_VARIANTS = ("flat", "persistent")
# Streaming sm_90 kernels want each thread to issue at least one 16-byte (LDG.128) access per input:
# narrower accesses need more instructions for the same bytes. 32 fp32 values per thread and input
# (two inputs for silu_mul: 64 registers of data) stays well clear of spilling at num_warps <= 16.
EW_MIN_BYTES_PER_THREAD = 16
EW_MAX_ELEMS_PER_THREAD = 32
EW_MIN_BLOCK = 256
# The validity rule below needs an SM count before any GPU is touched: forge/hardware.py's nominal
# GPU_SMS / CPU_SMS. The persistent launcher reads the real count at run time.


def numel(spec) -> int:
    return spec.inputs[0].numel


def elementwise_space(spec: Any) -> Space:
    n = numel(spec)
    itemsize = spec.inputs[0].itemsize
    on_gpu = spec.device == "cuda"
    sms = hardware.GPU_SMS if on_gpu else hardware.CPU_SMS
    largest = max(EW_MIN_BLOCK, next_pow2(n))

    def valid(c: Candidate) -> bool:
        p = c.p
        per_thread = p["BLOCK"] / (32 * p["num_warps"])
        if per_thread * itemsize < EW_MIN_BYTES_PER_THREAD or per_thread > EW_MAX_ELEMS_PER_THREAD:
            return False
        if p["BLOCK"] > largest:  # one program either way; a bigger block only masks more lanes
            return False
        if c.variant == "persistent":
            if not on_gpu and p["num_stages"] != 1:  # pipelining does not exist in the interpreter
                return False
            # Only where some program loops: with one block per program it is `flat` with extra work.
            return -(-n // p["BLOCK"]) > p["PROGRAMS_PER_SM"] * sms
        return True

    blocks = [256, 512, 1024, 2048, 4096, 8192, 16384]
    return Space(
        variants={
            "flat": {"BLOCK": blocks, "num_warps": [1, 2, 4, 8, 16]},
            "persistent": {"BLOCK": blocks[:-1], "num_warps": [1, 2, 4, 8, 16],
                           "PROGRAMS_PER_SM": [1, 2, 4, 8], "num_stages": [1, 3]},
        },
        valid=valid,
    )


def elementwise_default(spec: Any) -> Candidate:
    """Untuned but sensible: flat, two 16-byte vectors per thread (8 fp32 / 16 half values), 4 warps,
    the block shrunk (never below EW_MIN_BLOCK) for small tensors."""
    itemsize = spec.inputs[0].itemsize
    per_thread = 2 * EW_MIN_BYTES_PER_THREAD // itemsize
    block = min(32 * 4 * per_thread, max(EW_MIN_BLOCK, next_pow2(numel(spec))))
    warps = max(1, min(4, block // (32 * per_thread)))
    return Candidate.make("flat", BLOCK=block, num_warps=warps)


def elementwise_render_context(spec: Any, cand: Candidate, op: str) -> dict:
    ctx = dict(cand.p)
    ctx.setdefault("PROGRAMS_PER_SM", 1)
    ctx.setdefault("num_stages", 1)
    # Triton <= 3.6's interpreter cannot take a runtime loop bound (row_render_context says
    # why): on the interpreter the persistent loop's trip count is passed as a constexpr.
    ctx["N_CONSTEXPR"] = spec.device != "cuda"
    ctx["CPU_SMS"] = hardware.CPU_SMS
    ctx["kernel_name"] = f"forge_{op}_{cand.variant}"
    ctx["variant"] = cand.variant
    return ctx


def elementwise_test_candidates(spec: Any) -> list[Candidate]:
    """For tests/test_templates.py: power-of-two blocks (a partial last block at every size that is not
    a multiple), one far larger than small tensors, and persistent grids that on the interpreter (4
    "SMs") loop over 2-4 rounds, the last one partly or wholly masked. Blocks grow with the tensor so the
    long shapes stay at ~20 programs (the interpreter's cost is per program).
    Chosen directly, not from space(): the persistent rule excludes the tiny shapes, but the template
    must still be right there (one program, one round)."""
    n2 = next_pow2(numel(spec))
    return [
        Candidate.make("flat", BLOCK=max(256, n2 // 8), num_warps=1),
        Candidate.make("flat", BLOCK=4096, num_warps=8),
        Candidate.make("persistent", BLOCK=max(256, n2 // 16), num_warps=2, PROGRAMS_PER_SM=1, num_stages=1),
        Candidate.make("persistent", BLOCK=max(256, n2 // 32), num_warps=4, PROGRAMS_PER_SM=2, num_stages=1),
    ]


# ---------------------------------------------------------------------------------------------
# Bounded float64 oracles. A float64 copy is 2x (fp32) to 4x (fp16, bf16) the bytes of its input, and a
# reference formula holds a few such tensors at once, so an oracle evaluated on whole inputs needs
# several times their size (sdpa's (B, H, Sq, Skv) scores far more). Oracles of ops whose reference
# separates along some dims are evaluated chunk by chunk instead: a chunk's float64 working set (its
# copies of the inputs plus the formula's temporaries) stays within oracle_budget(inputs' bytes), and
# only the float64 result, one output-sized tensor, is whole. A chunk is never smaller than one unit
# (a row, an element, one row of A x one column of B), so a single row larger than the budget is one
# chunk. When everything fits in one chunk the reference runs on the whole inputs, exactly as before.
ORACLE_MIN_CHUNK_BYTES = 64 << 20
ORACLE_MAX_CHUNK_BYTES = 1 << 30
# Chunk-sized float64 tensors a reference holds at once: its copies of the chunked inputs and ~3
# temporaries (x * x, the row statistics broadcast back, the result) for the formulas in kernels/.
ORACLE_LIVE_COPIES = 4
ORACLE_CHUNKS = ("rows", "elements", "matmul")


def oracle_budget(input_bytes: int) -> int:
    """Bytes of float64 working set one oracle chunk may take: the inputs' own size, at least
    ORACLE_MIN_CHUNK_BYTES (small problems are one chunk) and at most ORACLE_MAX_CHUNK_BYTES."""
    return min(ORACLE_MAX_CHUNK_BYTES, max(ORACLE_MIN_CHUNK_BYTES, int(input_bytes)))


def tensors_nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def float64_oracle(reference, inputs, attrs, chunk: str | None = None):
    """The contract's default oracle (forge/ops.py): `reference` on float64 copies of the floating-point
    inputs (the others, e.g. int64 class indices, are passed as they are). chunk (the op's ORACLE_CHUNK):
    evaluated chunk by chunk (oracle_in_chunks), so that only the float64 result is whole. In the kit so
    that an op's own oracle can use it on a reshaped view (rmsnorm, layer_norm over several dims)."""
    def in_float64(part):
        return reference(tuple(t.double() if t.is_floating_point() else t for t in part), attrs)

    if chunk is None:
        return in_float64(inputs)
    return oracle_in_chunks(in_float64, inputs, chunk)


def oracle_in_chunks(fn: Callable, inputs, how: str, budget: int | None = None):
    """fn(inputs) (a reference in float64), evaluated chunk by chunk as `how` says and assembled into one
    tensor; equal to fn(inputs) up to float64 rounding (exactly fn(inputs) when one chunk holds it all).

    how:
      "rows"      the inputs shaped like inputs[0] are cut along their leading dims, flattened (all
                  but the trailing dims the other inputs broadcast over: the last one for a weight of
                  shape (N,), the last two for rope's (S, D) cos/sin); the others are passed whole to
                  every chunk. For row ops (norms, softmax, row reductions) and broadcasts over rows.
      "elements"  every input has inputs[0]'s shape; cut the flattened tensors (elementwise ops).
      "matmul"    (A, B) of shapes (..., M, K) and (..., K, N): blocks of A's rows x B's columns, one
                  batch at a time; the K reduction is never split.
    budget: bytes of float64 working set per chunk (default oracle_budget of the inputs' bytes)."""
    if how not in ORACLE_CHUNKS:
        raise ValueError(f"unknown oracle chunking {how!r}; expected one of {', '.join(ORACLE_CHUNKS)}")
    inputs = tuple(inputs)
    budget = oracle_budget(tensors_nbytes(inputs)) if budget is None else budget
    if how == "matmul":
        return _matmul_chunks(fn, inputs, budget)
    x = inputs[0]
    shape = tuple(x.shape)
    cut = [t is not None and tuple(t.shape) == shape for t in inputs]
    if how == "elements":
        if not all(cut):
            raise ValueError("oracle chunking 'elements' needs inputs of one shape")
        lead = len(shape)
    else:
        trailing = max([1] + [t.dim() for t, c in zip(inputs, cut, strict=True) if t is not None and not c])
        lead = max(0, len(shape) - trailing)
    rows = 1
    for s in shape[:lead]:
        rows *= s
    row_elems = sum(t.numel() for t, c in zip(inputs, cut, strict=True) if c) // max(rows, 1)
    per_chunk = max(1, budget // (ORACLE_LIVE_COPIES * 8 * max(row_elems, 1)))
    if rows <= per_chunk:
        return fn(inputs)
    flat = [t.reshape(rows, *t.shape[lead:]) if c else t for t, c in zip(inputs, cut, strict=True)]
    result = None
    for r0 in range(0, rows, per_chunk):
        r1 = min(rows, r0 + per_chunk)
        part = fn(tuple(t[r0:r1] if c else t for t, c in zip(flat, cut, strict=True)))
        if result is None:
            result = part.new_empty((rows, *part.shape[1:]))
        result[r0:r1] = part
        del part
    return result.reshape(*shape[:lead], *result.shape[1:])


def _matmul_chunks(fn: Callable, inputs, budget: int):
    a, b = inputs
    m, k = a.shape[-2:]
    n = b.shape[-1]
    batch = tuple(a.shape[:-2])
    nb_total = 1
    for s in batch:
        nb_total *= s
    elems = max(1, budget // 8)
    # One block: float64 A rows (mb x K), B columns (K x nb) and their product (mb x nb).
    if nb_total * (m * k + k * n + m * n) <= elems:
        return fn(inputs)
    nb = n if k * n <= elems // 2 else max(1, (elems // 2) // k)
    mb = max(1, min(m, (elems - k * nb) // (k + nb)))
    a3, b3 = a.reshape(nb_total, m, k), b.reshape(nb_total, k, n)
    result = None
    for i in range(nb_total):
        for n0 in range(0, n, nb):
            for m0 in range(0, m, mb):
                part = fn((a3[i, m0:m0 + mb], b3[i, :, n0:n0 + nb]))
                if result is None:
                    result = part.new_empty((nb_total, m, n))
                result[i, m0:m0 + mb, n0:n0 + nb] = part
                del part
    return result.reshape(*batch, m, n)


# ---------------------------------------------------------------------------------------------
# Tiled GEMMs (matmul, linear, swiglu) share one search space: BLOCK_M x BLOCK_N output tiles looping
# over K in BLOCK_K steps ("tiled", programs in groups of GROUP_M tile rows) and split-K ("splitk",
# SPLIT_K programs per tile reducing slices of K into an fp32 workspace). The GPU grids and the rules
# were chosen on the H200 for matmul (kernels/matmul.py says why); linear and swiglu run the same main
# loop with an epilogue, so they take the same points.
GEMM_GPU_GRID = {
    "tiled": {"BLOCK_M": [16, 32, 64, 128, 256], "BLOCK_N": [32, 64, 128, 256], "BLOCK_K": [32, 64, 128],
              "GROUP_M": [1, 8], "num_warps": [4, 8], "num_stages": [2, 3, 4, 5]},
    "splitk": {"BLOCK_M": [16, 32, 64], "BLOCK_N": [32, 64, 128], "BLOCK_K": [32, 64, 128, 256],
               "SPLIT_K": [2, 4, 8, 16, 32], "num_warps": [2, 4, 8], "num_stages": [2, 3, 4]},
    # matmul's "persistent" (TMA descriptor loads, one program per SM looping over tiles; kernels/matmul.py):
    # the large tiles of the tiled grid only (BLOCK_M >= 64: one Hopper warpgroup MMA is 64 rows; smaller
    # tiles are what `tiled` is for), always grouped (concurrent programs walk neighbouring tiles, the
    # point of GROUP_M), and the loop flattened or not (tl.range(flatten=): the compiler pipelines the
    # flattened tile x K loop across tile boundaries, as triton's persistent tutorial does on Hopper; not
    # yet measured here). 196 points at 4096^3 bf16 (84 in fp32), next to tiled's 748: affordable in a
    # budget-50 search. Not here: warp specialisation (tl.range(warp_specialize=True), unflattened loops):
    # on the H200 with triton 3.6 (bench/results/h200-gemm-2026-12-06-a.json) its 4-warp points failed to
    # compile ("PassManager::run failed"), hung (a 120 s timeout) or wrote NaN (caught by validation), and its
    # 8-warp points timed 0-1% slower than the same tiles without it (156.2 vs 153.8 us, 373.3 vs 370.3).
    "persistent": {"BLOCK_M": [64, 128, 256], "BLOCK_N": [64, 128, 256], "BLOCK_K": [32, 64, 128],
                   "GROUP_M": [8], "num_warps": [4, 8], "num_stages": [3, 4, 5], "FLATTEN": [False, True]},
}
# The interpreter: small blocks (it is slow at tl.dot), and no pipelining (num_stages means nothing).
GEMM_CPU_GRID = {
    "tiled": {"BLOCK_M": [16, 32], "BLOCK_N": [16, 32], "BLOCK_K": [16, 32], "GROUP_M": [1, 2],
              "num_warps": [4], "num_stages": [1]},
    "splitk": {"BLOCK_M": [16], "BLOCK_N": [16, 32], "BLOCK_K": [16, 32], "SPLIT_K": [2, 4],
               "num_warps": [4], "num_stages": [1]},
    # FLATTEN has no meaning on the interpreter (its loop is rendered differently: matmul_persistent.j2).
    "persistent": {"BLOCK_M": [16, 32], "BLOCK_N": [16, 32], "BLOCK_K": [16, 32], "GROUP_M": [2],
                   "num_warps": [4], "num_stages": [1], "FLATTEN": [False]},
}
# matmul's "padded" (misaligned operands copied into 16-element aligned buffers, then the tiled loop:
# kernels/matmul.py) takes tiled's points: after the copy it is the same tile loop.
GEMM_GPU_GRID["padded"] = dict(GEMM_GPU_GRID["tiled"])
GEMM_CPU_GRID["padded"] = dict(GEMM_CPU_GRID["tiled"])
# fp32 accumulator values per thread: above 128 (of 255 registers) the A/B fragments and addresses
# no longer fit and the kernel spills; below 4 a warp covers less than one MMA instruction's tile.
GEMM_MAX_ACC_PER_THREAD = 128
GEMM_MIN_ACC_PER_THREAD = 4
# tl.dot needs every block dimension >= 16.
GEMM_MIN_BLOCK = 16


def gemm_cover(n: int, smallest: int) -> int:
    """The largest block worth trying for a dimension of size n: one block covers it."""
    return max(smallest, next_pow2(n))


def gemm_space(dims: tuple[int, int, int, int], device: str, dtype: str, variants=("tiled", "splitk"),
               b_operands: int = 1) -> Space:
    """The GEMM space of a (Bt, M, N, K) problem. b_operands: weight tiles loaded per K step (and fp32
    accumulators held) per program: 1 for a GEMM, 2 for swiglu's gate and up weights."""
    from forge.spec import ITEMSIZE

    bt, m, n, k = dims
    on_gpu = device == "cuda"
    grid = {v: (GEMM_GPU_GRID if on_gpu else GEMM_CPU_GRID)[v] for v in variants}
    itemsize = ITEMSIZE[dtype]

    def valid(c: Candidate) -> bool:
        p = c.p
        bm, bn, bk, warps, stages = p["BLOCK_M"], p["BLOCK_N"], p["BLOCK_K"], p["num_warps"], p["num_stages"]
        g = grid[c.variant]
        # Blocks larger than one that covers the dimension only add masked work.
        if (bm > gemm_cover(m, g["BLOCK_M"][0]) or bn > gemm_cover(n, g["BLOCK_N"][0])
                or bk > gemm_cover(k, g["BLOCK_K"][0])):
            return False
        if min(bm, bn, bk) < GEMM_MIN_BLOCK:
            return False
        if (bm * bk + b_operands * bk * bn) * itemsize * stages > hardware.SMEM_PER_PROGRAM:
            return False
        if on_gpu:
            acc = b_operands * bm * bn / (32 * warps)
            if not GEMM_MIN_ACC_PER_THREAD <= acc <= GEMM_MAX_ACC_PER_THREAD:
                return False
            # fp32 uses FMA dots ("ieee"), whose operand slices live in registers: keep them small.
            if dtype == "float32" and (bk > 64 or acc > 64):
                return False
        elif stages != 1:
            return False
        k_blocks = -(-k // bk)
        tiles = bt * -(-m // bm) * -(-n // bn)
        if on_gpu and stages > 2 and stages > k_blocks:  # more stages than K steps buffer nothing
            return False
        if c.variant in ("tiled", "padded"):
            # Grouping only reorders programs when there are several tile rows and columns.
            return p["GROUP_M"] == 1 or (-(-m // bm) > 1 and -(-n // bn) > 1)
        if c.variant == "persistent":
            # One program per SM only differs from `tiled` when some program gets more than one tile
            # (the interpreter's nominal SMs are few: there it is always worth rendering).
            return not on_gpu or tiles > hardware.GPU_SMS
        split = p["SPLIT_K"]
        per_split = -(-k_blocks // split)
        if -(-k_blocks // per_split) != split:  # some splits would get no K at all
            return False
        # Splitting pays only when the tiles alone leave SMs idle; more than ~4 waves of split
        # programs only adds workspace traffic (SPLIT_K x the fp32 output, written and read back).
        return not on_gpu or (tiles < hardware.GPU_SMS and tiles * split <= 4 * hardware.GPU_SMS)

    return Space(variants={v: dict(g) for v, g in grid.items()}, valid=valid)


def gemm_default(dims: tuple[int, int, int, int], device: str, dtype: str, sp: Space) -> Candidate:
    """An untuned but sensible GEMM point of `sp`: split-K when the output is a handful of tiles and K
    is long (decode) and sp has it, else 128x128 tiles (smaller for small M/N) with BLOCK_K 64 (32 for
    fp32), 3 stages; on the interpreter one tile of at most 32 in each dim."""
    bt, m, n, k = dims
    if device != "cuda":
        def fit(d: int) -> int:
            return min(32, gemm_cover(d, 16))
        cand = Candidate.make("tiled", BLOCK_M=fit(m), BLOCK_N=fit(n), BLOCK_K=fit(k), GROUP_M=1,
                              num_warps=4, num_stages=1)
        return cand if cand in sp else sp.points("tiled")[0]
    fp32 = dtype == "float32"
    bm = min(128, gemm_cover(m, 16))
    bn = min(128, gemm_cover(n, 32))
    tiles = bt * -(-m // bm) * -(-n // bn)
    if "splitk" in sp.variants and tiles < hardware.GPU_SMS // 2 and k >= 1024:
        bm_s, bn_s, bk_s = min(64, gemm_cover(m, 16)), 64, 64 if fp32 else 128
        split_tiles = bt * -(-m // bm_s) * -(-n // bn_s)
        for split in (32, 16, 8, 4, 2):
            cand = Candidate.make("splitk", BLOCK_M=bm_s, BLOCK_N=bn_s, BLOCK_K=bk_s, SPLIT_K=split,
                                  num_warps=4, num_stages=3)
            if split_tiles * split <= 2 * hardware.GPU_SMS and cand in sp:
                return cand
    # Large half-precision GEMMs start from 128x256x64 tiles, 8 warps, 4 stages, no grouping: the budget-50
    # winner for GPT-2's c_fc + gelu_new (4096x4096x1024) on the H200, 2.97x eager
    # (h200-layouts-search-2026-12-04.json), where the budget-16 search of the same spec, which starts from
    # the 128x128x64 3-stage point, kept that point at 2.32x eager (h200-models-2026-12-04-c.json, each
    # ratio measured side by side with eager): the even grid of a small budget never reaches it.
    if not fp32 and m >= 1024 and n >= 1024 and k >= 256:
        cand = Candidate.make("tiled", BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=1, num_warps=8, num_stages=4)
        if cand in sp:
            return cand
    bk = 32 if fp32 else 64
    for warps in (8, 4):
        for stages in (3, 2):
            cand = Candidate.make("tiled", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=min(bk, gemm_cover(k, 32)),
                                  GROUP_M=8 if -(-m // bm) > 1 and -(-n // bn) > 1 else 1,
                                  num_warps=warps, num_stages=stages)
            if cand in sp:
                return cand
    points = sp.points("tiled")
    return points[0] if points else next(sp.all_points())


# TMA (cuTensorMapEncodeTiled; triton's host-side TensorDescriptor asserts the same): a 16-byte aligned
# base, every stride but the last a multiple of 16 bytes, the last stride 1. The bases are the shim's
# concern (it runs only 16-byte aligned inputs through forge's kernels: forge/shim.py ALIGNMENT) and
# outputs are freshly allocated, so a spec is TMA-loadable when its strides are.
TMA_ALIGN = 16


def tma_available() -> bool:
    """Whether the installed triton has host-side tensor descriptors (triton.tools.tensor_descriptor)."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401 - the API the variants use
    except ImportError:
        return False
    return True


def tma_row_stride(rows: int, cols: int, row_stride: int | None, last_stride: int, itemsize: int) -> int | None:
    """The row stride to give a 2-D TMA descriptor over a (rows, cols) matrix with these strides, or None
    where TMA cannot read it: the last stride must be 1 and the row stride a 16-byte multiple. A single row's
    stride is never stepped, so it gets the row length rounded up to 16 bytes (any multiple would do)."""
    if last_stride != 1 and cols > 1:
        return None
    if rows == 1:
        per = TMA_ALIGN // itemsize
        return -(-cols // per) * per
    if row_stride is None or row_stride * itemsize % TMA_ALIGN:
        return None
    return row_stride


def flat_rows(shape: tuple[int, ...], strides: tuple[int, ...]) -> int | None:
    """The row stride of a 2-D or 3-D tensor's rows seen as one (rows, last dim) matrix, or None where its
    rows are not evenly spaced (a 3-D tensor whose batch stride is not S x its row stride, e.g. a slice of
    a wider sequence). With a single row there is no stride to speak of: the row length is returned."""
    if len(shape) == 2:
        return strides[0] if shape[0] > 1 else shape[1]
    b, s = shape[0], shape[1]
    if b * s == 1:
        return shape[2]
    if s == 1:
        return strides[0]
    if b == 1 or strides[0] == s * strides[1]:
        return strides[1]
    return None


def persistent_gemm_context(cand: Candidate, device: str) -> dict:
    """The render context every persistent GEMM template (linear, swiglu) shares: the interpreter's loop
    bounds as constexprs (triton 3.6's interpreter takes no runtime loop bound, as in matmul's), its nominal
    SM count, and the loop's flag FLATTEN."""
    return {"K_CONSTEXPR": device != "cuda", "CPU_SMS": hardware.CPU_SMS, "FLATTEN": bool(cand.p["FLATTEN"])}


# The K that a GEMM's tolerance(dtype) assumes when it is not told K (forge/tuner/validate.py passes only
# the dtype): the bound then holds for K <= 65536. A larger K can make a correct kernel fail validation,
# which only means eager is used; see the families' tolerance_for(spec).
GEMM_K_ASSUMED = 65536


def gemm_dot_context(dtype: str, device: str) -> dict[str, str]:
    """The tl.dot spelling of a GEMM render (matmul, linear, swiglu): DOT_ARGS and DOT_CAST."""
    return {
        # fp32 inputs: full fp32 products (TF32 would be ~1e-3 off, and eager fp32 matmul does not use TF32
        # unless the user turns it on).
        "DOT_ARGS": ', input_precision="ieee"' if dtype == "float32" else "",
        # The interpreter (triton 3.6 to 3.9) keeps bf16 as raw uint16 bits and its tl.dot multiplies those
        # bits as integers; widening to fp32 first is exact (bf16 products fit fp32's mantissa). CUDA
        # sources keep the native bf16 dot.
        "DOT_CAST": ".to(tl.float32)" if device != "cuda" and dtype == "bfloat16" else "",
    }


def gemm_tolerance(dtype: str, k: int) -> Tolerance:
    """Tolerance for an output of scale ~1 after a K-long fp32 accumulation.

    fp32 accumulation in a different order than the oracle's float64 adds an error of RMS ~
    2^-24 * sqrt(K/2) per output (a random walk over K roundings of partial sums of size <= 1).
    Added to the norm bound (x4) and as an absolute floor (x8, covering the largest of millions of
    elements) for elements that cancel to ~0, where no relative bound can hold."""
    import math

    acc = 2.0 ** -24 * math.sqrt(max(int(k), 1))
    base = ROW_TOLERANCE[dtype]  # the output's rounding and the fp32 ops around it, as for row ops
    return Tolerance(rel_norm=base.rel_norm + 4 * acc, atol=base.atol + 8 * acc, rtol=base.rtol)


def oracle_in_row_col_blocks(fn: Callable, m: int, n: int, k: int, nbytes: int, budget: int | None = None):
    """fn(r0, r1, c0, c1) (a float64 (r1-r0) x (c1-c0) block of an M x N GEMM-shaped result whose
    inputs are sliced by the caller: rows of x, columns of the weights), assembled into one (M, N)
    tensor, blocks sized so that one block's float64 working set (its x rows, weight columns, result,
    a few epilogue temporaries) stays within the budget (oracle_budget of `nbytes`, the inputs' bytes).
    The K reduction is never split. One block when it all fits: exactly fn(0, M, 0, N)."""
    budget = oracle_budget(nbytes) if budget is None else budget
    elems = max(1, budget // 8)
    if m * k + 2 * k * n + ORACLE_LIVE_COPIES * m * n <= elems:
        return fn(0, m, 0, n)
    nb = n if 2 * k * n <= elems // 2 else max(1, (elems // 2) // (2 * k))
    mb = max(1, min(m, (elems - 2 * k * nb) // (k + ORACLE_LIVE_COPIES * nb)))
    result = None
    for c0 in range(0, n, nb):
        for r0 in range(0, m, mb):
            part = fn(r0, min(m, r0 + mb), c0, min(n, c0 + nb))
            if result is None:
                result = part.new_empty((m, n))
            result[r0:r0 + mb, c0:c0 + nb] = part
            del part
    return result


def distribution_rms(distribution: str, dtype: str) -> float:
    """The root mean square of random_tensor's elements under each distribution (its scale factors: large
    x1e3 (fp16) or x1e5; tiny x1e-4; outliers: N(0, 1) with 0.2% of elements set to ±1e3 (fp16) or ±1e4,
    so E[a^2] = 1 + 2e-3 * big^2). GEMM families scale their weights by its reciprocal (matmul's
    make_inputs says why)."""
    import math

    if distribution == "large":
        return 1e3 if dtype == "float16" else 1e5
    if distribution == "tiny":
        return 1e-4
    if distribution == "outliers":
        big = 1e3 if dtype == "float16" else 1e4
        return math.sqrt(1.0 + 2e-3 * big * big)
    return 1.0


# ---------------------------------------------------------------------------------------------
# Row ops over one dim that is not the last (rmsnorm over C of NCHW, x.sum(1)): a contiguous x is an
# (outer, R, inner) problem, the R values to reduce `inner` elements apart. One structural variant:
#   strided  - a program per (outer index, tile of BLOCK_I inner positions), looping over R in blocks
#              of BLOCK_R; a [BLOCK_R, BLOCK_I] tile's rows are BLOCK_I contiguous elements, so loads
#              stay coalesced along inner while the reduction runs down the tile's columns.
STRIDED_VARIANT = "strided"
# fp32 values of one tile per thread: the accumulator plus the loaded tile, as the looped row variants.
MAX_STRIDED_ELEMS_PER_THREAD = 32


def strided_space(spec, dim: int) -> Space:
    _, r, inner = outer_r_inner(spec.inputs[0].shape, dim)
    bi_max, br_max = next_pow2(inner), next_pow2(r)

    def valid(c: Candidate) -> bool:
        p = c.p
        per_thread = p["BLOCK_R"] * p["BLOCK_I"] / (32 * p["num_warps"])
        return per_thread <= MAX_STRIDED_ELEMS_PER_THREAD and (p["num_warps"] == 1 or per_thread >= 1)

    # Blocks wider than the problem only mask lanes: capped at its next power of two (the grid shrinks
    # to those few distinct values on small dims).
    return Space(
        variants={STRIDED_VARIANT: {
            "BLOCK_I": sorted({min(bi_max, b) for b in (16, 32, 64, 128, 256)}),
            "BLOCK_R": sorted({min(br_max, b) for b in (1, 4, 8, 16, 32, 64)}),
            "num_warps": [1, 2, 4, 8],
        }},
        valid=valid,
    )


def strided_default(spec, dim: int) -> Candidate:
    """Untuned but sensible: 64 inner positions (coalesced 128-256 byte rows) x 16 reduced values, 4 warps
    (8 values per thread), shrunk to the problem."""
    _, r, inner = outer_r_inner(spec.inputs[0].shape, dim)
    bi, br = min(64, next_pow2(inner)), min(16, next_pow2(r))
    warps = max(1, min(4, bi * br // 256))
    return Candidate.make(STRIDED_VARIANT, BLOCK_I=bi, BLOCK_R=br, num_warps=warps)


def strided_render_context(spec, cand: Candidate, op: str) -> dict[str, Any]:
    ctx = dict(cand.p)
    # The interpreter cannot take a runtime loop bound (row_render_context says why): R as a constexpr.
    ctx["N_CONSTEXPR"] = spec.device != "cuda"
    ctx["kernel_name"] = f"forge_{op}_{cand.variant}"
    ctx["variant"] = cand.variant
    return ctx
