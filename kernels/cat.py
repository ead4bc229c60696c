"""cat: torch.cat of tensors along one dim, each input in any strided layout, the output contiguous: the
KV-cache update every Hugging Face attention layer runs (transformers' DynamicLayer concatenates the cached
keys with the new ones: `torch.cat([past, k], dim=-2)`, on the first forward of a prefill with an empty
`torch.tensor([])` as the past and k a transposed view of the projection's output).

Measured on the H200 (bench/results/h200-graph-kernels-2026-12-04.json, GPT-2 4x1024 prefill as captured):
each such cat (4x16x1024x64 bf16 out of a (B, S, 3E) addmm output) ran 26-28 µs in torch's
CatArrayBatchedCopy, 8 per forward (0.22 ms): 16.8 MB moved per cat, 0.6 TB/s. A copy at the bandwidth
(about 4 TB/s) takes 4-5 µs.

Problem shape: the output's. Attributes: "dim" (non-negative, the output's dims), "sizes", each input's
size along dim, comma-separated ("1024,1": the cached 1024 positions then the new one), and "empty" (absent
when 0): how many legacy empty 1-D tensors the user's list also holds (shape (0,), which torch.cat skips
whatever the dim: transformers' empty past; forge/trace.py shows a literal one as the constant
("empty_tensor", dtype), so it is no region input). Inputs are the other tensors in the user's order; one
dtype.

Variant "rows": the output viewed as rows (every dim but the last) x the last dim; a program copies a tile of
BLOCK_R rows x BLOCK_C columns (a 2-D grid). The index math (a row's multi-index, each input's offset from its
strides, baked in) is per row, not per element: the divisions are amortised over the row's BLOCK_C elements.
Each element is loaded from the one input whose range along dim holds it (masked loads) and stored once.
"""

from __future__ import annotations

import math

from forge import opkit
from forge.spec import KernelSpec, TensorSpec

NAME = "cat"
SUMMARY = "torch.cat along one dim (the KV-cache update), strided inputs, contiguous output"
TEMPLATES = {"rows": "cat_rows.j2"}
DEFAULT_ATTRS: dict = {"dim": -1, "sizes": None}  # sizes None: one input, the output's shape (a copy)
OPTIONAL_ATTRS = ("empty",)
MAX_INPUTS = 8
STRIDED_INPUTS = tuple(range(MAX_INPUTS))
STRIDED_ANY_ORDER = True
DTYPES = ("float16", "bfloat16", "float32")
# Masking shapes for tests/test_templates.py (sizes None: a copy): one element, odd sizes, a single row,
# a long last dim, leading dims that flatten.
MAX_GRID_Y = 65535  # CUDA's limit on a launch grid's y (and z) dimension
EMPTY_TENSOR = "empty_tensor"  # forge/trace.py's constant for a literal empty 1-D tensor
TEST_SHAPES = [(1,), (7,), (3, 7), (2, 3, 33), (5, 300), (1, 4100), (2, 2, 5, 16)]


def _sizes(text, out: tuple[int, ...], dim: int) -> list[int]:
    """Each input's size along dim from the attribute's text."""
    if text is None:
        return [out[dim]]
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"sizes={text!r}: a comma-separated list of sizes along dim")
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"sizes={text!r}: each input's size along dim, a positive integer")
    sizes = [int(p) for p in parts]
    if sum(sizes) != out[dim]:
        raise ValueError(f"sizes={text!r} add up to {sum(sizes)} along dim {dim}, not the output's {out[dim]}")
    if len(sizes) > MAX_INPUTS:
        raise ValueError(f"{len(sizes)} inputs; the kernel takes at most {MAX_INPUTS}")
    return sizes


def _text(sizes: list[int]) -> str:
    return ",".join(str(s) for s in sizes)


def make_spec(shape: tuple[int, ...], dtype: str, device: str, attrs: dict | None = None) -> KernelSpec:
    a = {**DEFAULT_ATTRS, **(attrs or {})}
    empty_dtype = a.pop("empty_dtype", None)  # the matcher's note: the dtype of the empty tensors
    unknown = set(a) - {"dim", "sizes", "empty"}
    if unknown:
        raise ValueError(f"cat takes attributes ['dim', 'sizes', 'empty'], not {sorted(unknown)}")
    empty = a.get("empty", 0)
    if isinstance(empty, bool) or not isinstance(empty, int) or not 0 <= empty <= MAX_INPUTS:
        raise ValueError(f"empty={empty!r}: the number of empty 1-D tensors in the list, 0 to {MAX_INPUTS}")
    if empty and empty_dtype not in (None, dtype):
        raise ValueError(f"an empty {empty_dtype} tensor with {dtype} ones: torch.cat promotes the result to "
                         "another dtype")
    if dtype not in DTYPES:
        raise ValueError(f"inputs of dtype {dtype} are not supported ({', '.join(DTYPES)})")
    out = tuple(int(s) for s in shape)
    if not out or any(s < 1 for s in out):
        raise ValueError(f"shape {out}: the output has at least one dim and no empty one")
    dim = a["dim"]
    if isinstance(dim, bool) or not isinstance(dim, int) or not -len(out) <= dim < len(out):
        raise ValueError(f"dim={dim!r} is not a dim of a {len(out)}-d output")
    dim %= len(out)
    sizes = _sizes(a["sizes"], out, dim)
    inputs = tuple(TensorSpec(out[:dim] + (s,) + out[dim + 1:], dtype, device=device) for s in sizes)
    return KernelSpec(NAME, inputs, {"dim": dim, "sizes": _text(sizes), **({"empty": empty} if empty else {})})


def problem(inputs, attrs) -> tuple[int, ...]:
    """The output's shape for these tensors, as torch.cat makes it; records "dim" (non-negative) and "sizes"
    in attrs (in place). ValueError for what the kernel does not take (dtypes that mix: torch would promote)."""
    dtypes = {str(t.dtype) for t in inputs}
    if len(dtypes) != 1:
        raise ValueError(f"inputs of one dtype only, got {sorted(dtypes)} (torch.cat promotes them)")
    if any(t.numel() == 0 for t in inputs):
        raise ValueError(f"an empty input among {[tuple(t.shape) for t in inputs]}")
    rank = inputs[0].dim()
    dim = attrs.get("dim", 0)
    if not isinstance(dim, int) or not -rank <= dim < rank:
        raise ValueError(f"dim={dim!r} is not a dim of the {rank}-d inputs")
    dim %= rank
    first = tuple(inputs[0].shape)
    for t in inputs:
        if t.dim() != rank or any(t.shape[d] != first[d] for d in range(rank) if d != dim):
            raise ValueError(f"shapes {[tuple(x.shape) for x in inputs]} do not concatenate along dim {dim}")
    sizes = [int(t.shape[dim]) for t in inputs]
    attrs["dim"], attrs["sizes"] = dim, _text(sizes)
    return first[:dim] + (sum(sizes),) + first[dim + 1:]


def problem_shape(spec) -> tuple[int, ...]:
    dim, shapes = spec.attrs["dim"], [t.shape for t in spec.inputs]
    return shapes[0][:dim] + (sum(s[dim] for s in shapes),) + shapes[0][dim + 1:]


def output_of(spec) -> tuple[tuple[int, ...], str]:
    return problem_shape(spec), spec.inputs[0].dtype


def make_inputs(spec: KernelSpec, seed: int, distribution: str = "normal"):
    gen = opkit.generator(seed, spec.device)
    return tuple(opkit.random_tensor(t.shape, t.dtype, t.device, gen, distribution) for t in spec.inputs)


def reference(inputs, attrs):
    """The user's call: torch.cat of the tensors, after the empty 1-D ones it also had (attribute "empty":
    where they stood does not change the values; torch's kernel is the same generic batched copy)."""
    import torch

    empties = [torch.empty(0, dtype=inputs[0].dtype, device=inputs[0].device)] * attrs.get("empty", 0)
    return torch.cat([*empties, *inputs], dim=attrs["dim"])


def oracle(inputs, attrs):
    """Exact without float64: a copy rounds nothing, so the float64 result rounded back to the inputs' dtype
    is the concatenation itself (and an oracle of a large cat needs no float64 working set: issue 15)."""
    return reference(inputs, attrs)


def alloc_output(inputs, spec: KernelSpec):
    import torch

    shape, dtype = output_of(spec)
    return torch.empty(shape, dtype=getattr(torch, dtype), device=inputs[0].device)


def run(module, inputs, out, attrs) -> None:
    # Every input as it is (its strides are baked into the kernel's index math); the output contiguous.
    module.launch(*inputs, out)


def tolerance_for(spec) -> opkit.Tolerance:
    """A copy: exact, whatever the dtype."""
    return opkit.Tolerance(rel_norm=0.0, atol=0.0, rtol=0.0)


# -- search space -------------------------------------------------------------------------------------
def _rows_cols(spec) -> tuple[int, int]:
    shape = problem_shape(spec)
    return math.prod(shape[:-1]), shape[-1]


def space(spec: KernelSpec) -> opkit.Space:
    rows, cols = _rows_cols(spec)
    itemsize = spec.inputs[-1].itemsize
    widest_c = max(16, opkit.next_pow2(cols))
    widest_r = max(1, opkit.next_pow2(rows))

    def valid(c: opkit.Candidate) -> bool:
        p = c.p
        if p["BLOCK_C"] > widest_c or p["BLOCK_R"] > widest_r:  # only masks more lanes
            return False
        if -(-cols // p["BLOCK_C"]) > MAX_GRID_Y:  # the column tiles are the grid's y dimension
            return False
        tile = p["BLOCK_R"] * p["BLOCK_C"]
        per_thread = tile / (32 * p["num_warps"])
        if per_thread > 64:  # registers: at most 64 elements a thread holds
            return False
        if tile >= widest_r * widest_c:  # one program for the whole (small) tensor: one warp, or enough work
            return p["num_warps"] == 1 or per_thread * itemsize >= 16
        # a 16-byte access per thread at least (smaller tiles only add programs)
        return per_thread * itemsize >= 16

    return opkit.Space(variants={"rows": {"BLOCK_R": [1, 2, 4, 8, 16, 32, 64],
                                          "BLOCK_C": [16, 32, 64, 128, 256, 512, 1024, 2048],
                                          "num_warps": [1, 2, 4, 8]}}, valid=valid)


def default(spec: KernelSpec) -> opkit.Candidate:
    """A row's last dim in one or a few column tiles of up to 256, rows added up to 2048 elements, 4 warps
    (fewer for small tiles): two 16-byte accesses per thread."""
    rows, cols = _rows_cols(spec)
    bc = min(256, max(16, opkit.next_pow2(cols)))
    br = max(1, min(opkit.next_pow2(rows), 2048 // bc, 64))
    itemsize = spec.inputs[-1].itemsize
    warps = max(1, min(4, br * bc * itemsize // (32 * 32)))
    return opkit.Candidate.make("rows", BLOCK_R=br, BLOCK_C=bc, num_warps=warps)


def test_candidates(spec: KernelSpec) -> list[opkit.Candidate]:
    """Partial tiles both ways (rows and columns), one program for everything, and the default."""
    rows, cols = _rows_cols(spec)
    return [opkit.Candidate.make("rows", BLOCK_R=1, BLOCK_C=16, num_warps=1),
            opkit.Candidate.make("rows", BLOCK_R=4, BLOCK_C=64, num_warps=2),
            opkit.Candidate.make("rows", BLOCK_R=max(1, opkit.next_pow2(rows)),
                                 BLOCK_C=max(16, opkit.next_pow2(cols)), num_warps=4),
            default(spec)]


def bytes_moved(spec: KernelSpec) -> int:
    shape, out = output_of(spec)
    return 2 * math.prod(shape) * TensorSpec((), out).itemsize


def flops(spec: KernelSpec) -> int:
    return 0  # a copy


# -- code generation ------------------------------------------------------------------------------------
def render_context(spec: KernelSpec, cand: opkit.Candidate) -> dict:
    """BODY: per program, the rows' multi-index (over every dim but the last), then per non-empty input its
    mask (the rows or columns in its range along dim) and offsets from its own strides; y picks the input
    that holds each element."""
    shape = problem_shape(spec)
    dim, last = spec.attrs["dim"], len(shape) - 1
    lines: list[str] = []
    # the rows' multi-index (int64: row * stride may pass 2^31)
    inner = [math.prod(shape[d + 1:last]) for d in range(last)]
    for d in range(last):
        if shape[d] == 1:
            continue
        idx = "r" if inner[d] == 1 else f"(r // {inner[d]})"
        lines.append(f"i{d} = {idx}" + (f" % {shape[d]}" if d > 0 else "") + f"  # index in dim {d}")
    picks = []
    start = 0
    for j, t in enumerate(spec.inputs):
        size = t.shape[dim]
        lo, hi = start, start + size
        start = hi
        pos = "i" + str(dim) if dim != last else "c"
        conds = []
        if lo > 0:
            conds.append(f"({pos} >= {lo})")
        if hi < shape[dim]:
            conds.append(f"({pos} < {hi})")
        terms = []
        for d in range(last):
            if shape[d] == 1 or t.strides[d] == 0:
                continue
            i = f"(i{d} - {lo})" if (d == dim and lo) else f"i{d}"
            terms.append(i if t.strides[d] == 1 else f"{i} * {t.strides[d]}")
        col = f"(c - {lo})" if (dim == last and lo) else "c"
        terms.append(col if t.strides[last] == 1 else f"{col} * {t.strides[last]}")
        row_mask = "rmask" if dim == last else " & ".join(["rmask", *conds])
        col_mask = "cmask" if dim != last else " & ".join(["cmask", *conds])
        lines.append(f"m{j} = ({row_mask})[:, None] & ({col_mask})[None, :]  # input {j}: {size} along dim "
                     f"{dim}, strides {t.strides}")
        row_off = " + ".join(terms[:-1]) or "r * 0"
        lines.append(f"x{j} = tl.load(X{j} + ({row_off})[:, None] + ({terms[-1]})[None, :], mask=m{j})")
        picks.append(j)
    y = f"x{picks[-1]}"
    for j in reversed(picks[:-1]):
        y = f"tl.where(m{j}, x{j}, {y})"
    lines.append(f"y = {y}")
    return {**cand.p, "kernel_name": f"forge_cat_{cand.variant}", "variant": cand.variant,
            "N_INPUTS": len(spec.inputs), "BODY": lines, "ROWS": math.prod(shape[:-1]), "COLS": shape[-1],
            "DIM": dim, "SIZES": spec.attrs["sizes"]}


# -- recognising it in user code (forge/trace.py canonical forms) ----------------------------------------
def match(expr) -> tuple[list, dict] | None:
    """("cat", (t, t, ...), dim) over region inputs and literal empty 1-D tensors (forge/trace.py's
    ("const", ("empty_tensor", dtype)): a KV cache's empty past), each input once."""
    if expr[0] != "cat" or len(expr) != 3 or not isinstance(expr[1], tuple):
        return None
    parts, dim = expr[1], expr[2]
    if dim[0] != "const" or isinstance(dim[1], bool) or not isinstance(dim[1], int):
        return None
    empties = [p for p in parts if isinstance(p, tuple) and p[0] == "const" and isinstance(p[1], tuple)
               and len(p[1]) == 2 and p[1][0] == EMPTY_TENSOR]
    tensors = [p for p in parts if p not in empties]
    if not 1 <= len(tensors) <= MAX_INPUTS or any(not isinstance(p, tuple) or p[0] != "input" for p in tensors):
        return None
    if len({p[1] for p in tensors}) != len(tensors):
        return None  # cat([x, x]): one tensor read twice (rope's own halves are rope's)
    attrs: dict = {"dim": int(dim[1])}
    if empties:
        if len({p[1][1] for p in empties}) != 1:
            return None
        attrs["empty"], attrs["empty_dtype"] = len(empties), empties[0][1][1]
    return [p[1] for p in tensors], attrs
