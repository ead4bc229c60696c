"""cross_entropy: F.cross_entropy(logits, target) forward for logits (M, V) and int64 class indices (M,).

Per row: loss = logsumexp(x) - x[target] = (max - x[target]) + log(sum(exp(x - max))), accumulated in
fp32 and returned in the logits' dtype, as torch does. Rows whose target equals ignore_index have loss 0.
reduction="none" writes the M losses straight to the output; "sum"/"mean" write them to an fp32
scratch buffer of M floats (allocated in the rendered launch(), ~4 bytes/row against 2-4 bytes per
logit read: negligible, and inside a CUDA graph it is allocated once at capture), then a second
one-program kernel sums them in a fixed order. That costs one more launch but is deterministic, which
float atomics are not. "mean" divides by the number of non-ignored rows.

Edge cases, decided to match torch where torch defines a value:
  - every target ignored with reduction="mean": 0 / 0 = NaN, exactly what torch returns. The validator
    rejects NaN, so make_inputs never ignores every row (the kernel is still tested on it, against torch,
    in tests/test_op_cross_entropy.py). The one case where no valid target exists at all, V == 1 with
    ignore_index == 0 and "mean", is refused by make_spec (always NaN: eager runs).
  - a target outside [0, V) that is not ignore_index is a bug in the caller: torch raises on the CPU
    and device-asserts on CUDA. The kernels never dereference it (row/multirow pick x[target] out of
    registers by comparing column indices; looped does a load masked by the range check) and give that
    row a NaN loss, which then propagates into "sum"/"mean", so the bug stays visible without a crash
    or a host sync to check the targets.

Unsupported (make_spec raises ValueError naming it; the shim then runs eager with that reason): class
weights, label_smoothing != 0, the legacy size_average/reduce arguments, soft (probability) targets,
logits that are not 2-D (torch's (N, C, d1, ...) form puts the classes in dim 1), non-int64 targets.
"""

from __future__ import annotations

from forge import opkit
from forge.spec import KernelSpec, TensorSpec

NAME = "cross_entropy"
SUMMARY = "F.cross_entropy(logits (M, V), target (M,)), reduction mean/sum/none, ignore_index"
TEMPLATES = {"row": "cross_entropy_row.j2", "looped": "cross_entropy_looped.j2",
             "multirow": "cross_entropy_multirow.j2"}
DEFAULT_ATTRS = {"reduction": "mean", "ignore_index": -100}
REDUCTIONS = ("mean", "sum", "none")
FLOAT_DTYPES = ("float16", "bfloat16", "float32")
# Fraction of rows whose target make_inputs sets to ignore_index.
IGNORED_FRACTION = 0.25
# Masking shapes for tests/test_templates.py: a single class (loss 0), odd short rows, a partial last
# column block (4097 = 4096 + 1), one very long row (the whole-row variant's BLOCK_N is 131072), and
# row counts that leave a partial last group for multirow. All have >= 1 non-ignored row; those with
# M >= 2 have >= 1 ignored row too (see make_inputs).
TEST_SHAPES = [(1, 1), (1, 7), (7, 33), (3, 300), (2, 4097), (1, 65537)]

_UNSUPPORTED = {
    "weight": "class weights (weight=) are not supported",
    "size_average": "the legacy size_average argument is not supported (use reduction=)",
    "reduce": "the legacy reduce argument is not supported (use reduction=)",
}


def make_spec(shape: tuple[int, ...], dtype: str, device: str, attrs: dict | None = None) -> KernelSpec:
    a = {**DEFAULT_ATTRS, **(attrs or {})}
    for name, why in _UNSUPPORTED.items():
        if a.pop(name, None) is not None:
            raise ValueError(why)
    smoothing = a.pop("label_smoothing", 0.0)
    if smoothing:
        raise ValueError(f"label_smoothing={smoothing} is not supported (only 0.0)")
    unknown = set(a) - set(DEFAULT_ATTRS)
    if unknown:
        raise ValueError(f"cross_entropy takes attributes {sorted(DEFAULT_ATTRS)}, not {sorted(unknown)}")
    reduction = a["reduction"]
    if not isinstance(reduction, str) or reduction.lower() not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r} is not supported; expected one of {', '.join(REDUCTIONS)}")
    ignore_index = a["ignore_index"]
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise ValueError(f"ignore_index must be an int, got {ignore_index!r}")
    if len(shape) != 2:
        raise ValueError(f"logits of shape {tuple(shape)} are not supported: only 2-D (M, V) logits "
                         "(torch reads (N, C, d1, ...) with the classes in dim 1)")
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"logits dtype {dtype!r} is not supported; expected one of {', '.join(FLOAT_DTYPES)}")
    m, v = shape
    if reduction.lower() == "mean" and v == 1 and ignore_index == 0:
        raise ValueError("with V == 1 and ignore_index=0 every target is ignored: reduction='mean' is always NaN")
    return KernelSpec(NAME, (TensorSpec((m, v), dtype, device=device), TensorSpec((m,), "int64", device=device)),
                      {"reduction": reduction.lower(), "ignore_index": int(ignore_index)})


def make_inputs(spec: KernelSpec, seed: int, distribution: str = "normal"):
    """Logits from `distribution`; targets uniform over the classes other than ignore_index, with a
    seeded ~25% of rows set to ignore_index. At least one row is never ignored (so "mean" is not 0/0)
    and, when M >= 2, at least one row is (so every validation run exercises the ignore path)."""
    import torch

    x, t = spec.inputs
    m, v = x.shape
    ii = spec.attrs["ignore_index"]
    gen = opkit.generator(seed, spec.device)
    dev = opkit.torch_device(spec.device)
    logits = opkit.random_tensor(x.shape, x.dtype, x.device, gen, distribution)
    if v == 1 and ii == 0:  # the only class is ignored: every row is (make_spec refuses this for "mean")
        return logits, torch.zeros(m, dtype=torch.int64, device=dev)
    in_range = 0 <= ii < v
    # Uniform over the V (or V - 1) valid classes, skipping ignore_index when it is one of them.
    target = torch.randint(0, v - in_range, (m,), generator=gen, device=dev)
    if in_range:
        target += (target >= ii).to(torch.int64)
    ignored = torch.rand(m, generator=gen, device=dev) < IGNORED_FRACTION
    pick = int(torch.randint(0, m, (1,), generator=gen, device=dev))
    if m >= 2 and not bool(ignored.any()):
        ignored[pick] = True
    if bool(ignored.all()):
        ignored[pick] = False
    return logits, torch.where(ignored, torch.full_like(target, ii), target)


def reference(inputs, attrs):
    """The eager baseline, as a user writes it."""
    import torch.nn.functional as F

    logits, target = inputs
    return F.cross_entropy(logits, target, ignore_index=attrs["ignore_index"], reduction=attrs["reduction"])


def oracle(inputs, attrs):
    """torch's formula in float64. A result beyond the output dtype's range (an fp16 "sum" over many
    rows of large logits) is what the kernel and torch return too: inf, so that is the reference there.
    Its float64 working set is bounded (opkit.oracle_budget): the rows are taken in chunks, each chunk's
    losses summed in float64 ("sum", "mean": divided by the rows not ignored, as torch does) or kept."""
    import torch
    import torch.nn.functional as F

    logits, target = inputs
    m, v = logits.shape
    per_chunk = max(1, opkit.oracle_budget(opkit.tensors_nbytes(inputs)) // (opkit.ORACLE_LIVE_COPIES * 8 * v))
    if m <= per_chunk:
        r = reference((logits.double(), target), attrs)
    else:
        ii, reduction = attrs["ignore_index"], attrs["reduction"]
        parts = [F.cross_entropy(logits[i:i + per_chunk].double(), target[i:i + per_chunk], ignore_index=ii,
                                 reduction="none" if reduction == "none" else "sum")
                 for i in range(0, m, per_chunk)]
        r = torch.cat(parts) if reduction == "none" else torch.stack(parts).sum()
        if reduction == "mean":
            r = r / (target != ii).sum()
    return torch.where(r.abs() > torch.finfo(logits.dtype).max, r.to(logits.dtype).double(), r)


def alloc_output(inputs, spec: KernelSpec):
    import torch

    logits = inputs[0]
    shape = (logits.shape[0],) if spec.attrs["reduction"] == "none" else ()
    return torch.empty(shape, dtype=logits.dtype, device=logits.device)


def run(module, inputs, out, attrs) -> None:
    logits, target = inputs
    module.launch(logits, target, out, attrs["ignore_index"])


space = opkit.row_space
default = opkit.row_default

# The second kernel of "sum"/"mean": one program sums the fp32 per-row losses (and, for "mean",
# counts the non-ignored targets) in a fixed order. Shared by every template through the render
# context; it lives here rather than in an included template file because ops.OpFamily.template_hash
# covers this file and the TEMPLATES files only, and an edit to it must change the cache keys.
REDUCE_BLOCK_MAX = 8192
_REDUCE_SOURCE = '''

@triton.jit
def forge_cross_entropy_reduce(L, T, OUT, M{m_constexpr}, ignore_index, MEAN: tl.constexpr, BLOCK: tl.constexpr):
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    count = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, M, BLOCK):
        rows = start + tl.arange(0, BLOCK)
        mask = rows < M
        acc += tl.load(L + rows, mask=mask, other=0.0)
        if MEAN:
            t = tl.load(T + rows, mask=mask, other=0)
            count += (mask & (t != ignore_index)).to(tl.int32)
    total = tl.sum(acc, axis=0)
    if MEAN:
        # Every target ignored: 0 / 0 = NaN, as torch returns.
        total = total / tl.sum(count, axis=0).to(tl.float32)
    tl.store(OUT, total.to(OUT.dtype.element_ty))


def reduce_losses(losses, t, out, ignore_index):
    forge_cross_entropy_reduce[(1,)](losses, t, out, losses.shape[0], ignore_index, MEAN={mean},
                                     BLOCK={block}, num_warps={warps})
'''


def render_context(spec: KernelSpec, cand: opkit.Candidate) -> dict:
    ctx = opkit.row_render_context(spec, cand, NAME)
    m, _ = spec.inputs[0].shape
    reduction = spec.attrs["reduction"]
    ctx["REDUCTION"] = reduction
    ctx["reduce_source"] = ""
    if reduction != "none":
        # One block of up to 8192 rows (8 per thread at 32 warps): the losses and targets of a batch arrive in one
        # round of loads. Capped at 1024 rows (4 warps) before, an 8192-row batch took 8 loop trips of dependent
        # loads after the row kernel, a few µs of the ~196 that kept 8192x32000 at 89% of the copy bandwidth
        # (issue 16's target 90%; H100 run a, 2026-12-06). Not yet timed on a GPU.
        block = min(REDUCE_BLOCK_MAX, max(16, opkit.next_pow2(m)))
        ctx["reduce_source"] = _REDUCE_SOURCE.format(
            m_constexpr=": tl.constexpr" if ctx["N_CONSTEXPR"] else "",  # interpreter loop bound (see opkit)
            mean=reduction == "mean", block=block, warps=min(32, max(1, block // 256)))
    return ctx


def bytes_moved(spec: KernelSpec) -> int:
    x, t = spec.inputs
    m = x.shape[0]
    if spec.attrs["reduction"] == "none":
        return x.nbytes + t.nbytes + m * x.itemsize
    # fp32 losses written then read back, targets read again for the "mean" count.
    return x.nbytes + t.nbytes + 8 * m + (t.nbytes if spec.attrs["reduction"] == "mean" else 0)


def flops(spec: KernelSpec) -> int:
    return 4 * spec.inputs[0].numel


# -- recognising cross_entropy in user code (forge/trace.py canonical forms) ---------------------
def match(expr) -> tuple[list, dict] | None:
    """F.cross_entropy(logits, target, ...) and nn.CrossEntropyLoss(...)(logits, target), both
    ("cross_entropy", input, target, weight, size_average, ignore_index, reduce, reduction,
    label_smoothing) after tracing. Unsupported arguments are still returned as attributes so that
    make_spec names them in the fallback reason."""
    if expr[0] != "cross_entropy" or len(expr) != 9:
        return None
    _, logits, target, weight, size_average, ignore_index, reduce, reduction, smoothing = expr
    if logits[0] != "input" or target[0] != "input":
        return None
    scalars = (size_average, ignore_index, reduce, reduction, smoothing)
    if any(s[0] != "const" for s in scalars):
        return None
    red = reduction[1].lower() if isinstance(reduction[1], str) else reduction[1]
    ii = ignore_index[1]
    attrs: dict = {"reduction": red, "ignore_index": int(ii) if isinstance(ii, int) else ii}
    if weight != ("const", None):
        attrs["weight"] = "tensor"
    if size_average[1] is not None:
        attrs["size_average"] = bool(size_average[1])
    if reduce[1] is not None:
        attrs["reduce"] = bool(reduce[1])
    if smoothing[1]:
        attrs["label_smoothing"] = float(smoothing[1])
    return [logits[1], target[1]], attrs


def problem(inputs, attrs) -> tuple[int, int]:
    """The problem shape is the logits' (M, V); the target must be M int64 class indices."""
    import torch

    logits, target = inputs
    if target.dtype.is_floating_point:
        raise ValueError("soft (class-probability) targets are not supported, only int64 class indices")
    if target.dtype != torch.int64:
        raise ValueError(f"targets of dtype {target.dtype} are not supported, only int64 class indices")
    if logits.ndim != 2:
        raise ValueError(f"logits with {logits.ndim} dims are not supported, only 2-D (M, V) logits")
    if tuple(target.shape) != (logits.shape[0],):
        raise ValueError(f"target of shape {tuple(target.shape)} does not fit logits of shape {tuple(logits.shape)}")
    return tuple(logits.shape)
