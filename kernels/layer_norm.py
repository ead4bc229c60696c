"""layer_norm: y = (x - mean(x)) * rsqrt(var(x) + eps) * w + b over the last dimension, or over several
trailing dimensions (attribute dims = k: nn.LayerNorm((C, H, W)), w and b of shape (C, H, W)), which
runs the same kernels on x.reshape(-1, prod(shape[-k:])) (its rows are contiguous)."""

from __future__ import annotations

import math

from forge import formulas, hardware, opkit
from forge.spec import KernelSpec, TensorSpec

NAME = "layer_norm"
SUMMARY = "F.layer_norm(x, (N,), w, b, eps)"
TEMPLATES = {"row": "layer_norm_row.j2", "looped": "layer_norm_looped.j2", "multirow": "layer_norm_multirow.j2"}
DEFAULT_ATTRS = {"eps": 1e-5}
# x may have any outer strides with its rows contiguous: the kernels take a row stride; run() views x
# as rows (a copy where no view exists). The weight and bias stay contiguous.
STRIDED_INPUTS = (0,)
# The default oracle (float64 reference) runs on chunks of rows, its memory bounded (forge/ops.py).
ORACLE_CHUNK = "rows"
# Accepted by make_spec but not part of the spec: it must be the shape's trailing dims, which "dims" (their
# number) then says; the matcher passes "dims".
_CHECKED_ATTRS = ("normalized_shape",)
# In the spec (and the key) only where it is not 1: every spec over the last dim is what it always was.
SHAPE_ATTRS = {"dims": 1}
OPTIONAL_ATTRS = tuple(SHAPE_ATTRS)  # manifests may name it (forge trace --write-manifest writes it)
FILL_MISSING_ATTRS = True  # w and b of the normalized shape, which depends on dims (forge/ops.py)

# Whole-row variants hold x, w and b (three fp32 values per element) in registers: at 64 elements
# per thread that is 192 of 255 registers before addresses and temporaries, where rmsnorm's two
# arrays fit in 128. Capped at 32 per thread (96 registers). An estimate from that count: not yet
# checked against the compiler's spill counts on the H200.
MAX_ELEMS_PER_THREAD = 32

# Per-row mean offsets, in units of each distribution's spread. Removing the mean is what layer_norm
# is for, so test data has one: with a row's mean 100 spreads from zero, E[x^2] - E[x]^2 in fp32
# cancels ~10^4 times more than the variance it should find and fails fp32's tolerance by 10x or
# more (tests/test_op_layer_norm.py), while the kernels' corrected two-pass and shifted Welford
# variances do not depend on the offset. fp16 stays at 30: its "large" rows (spread 1e3) must stay
# below its maximum 65504.
OFFSET_SPREADS = {"float16": 30.0, "bfloat16": 100.0, "float32": 100.0}


def make_spec(shape: tuple[int, ...], dtype: str, device: str, attrs: dict | None = None) -> KernelSpec:
    a = {**DEFAULT_ATTRS, **(attrs or {})}
    unknown = set(a) - set(DEFAULT_ATTRS) - set(_CHECKED_ATTRS) - set(SHAPE_ATTRS)
    if unknown:
        raise ValueError(f"layer_norm takes attributes {sorted(DEFAULT_ATTRS)}, not {sorted(unknown)}")
    shape = tuple(shape)
    dims = a.pop("dims", 1)
    if isinstance(dims, bool) or not isinstance(dims, int) or not 1 <= dims <= len(shape):
        raise ValueError(f"dims={dims!r}: the number of trailing dims normalized, 1 to {len(shape)}")
    if "normalized_shape" in a:
        ns = a.pop("normalized_shape")
        ns = (ns,) if isinstance(ns, int) else tuple(ns)
        if "dims" in (attrs or {}) and len(ns) != dims:
            raise ValueError(f"normalized_shape={ns} and dims={dims} disagree")
        if not 1 <= len(ns) <= len(shape) or ns != shape[len(shape) - len(ns):]:
            raise ValueError(f"normalized_shape={ns} is not supported: layer_norm kernels normalize over "
                             f"trailing dims of the input, shape {shape}")
        dims = len(ns)
    if dims != 1:
        a["dims"] = dims
    eps = a["eps"]
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not math.isfinite(eps):
        raise ValueError(f"eps must be a finite number, not {eps!r}")
    a["eps"] = float(eps)
    vec = TensorSpec(shape[len(shape) - dims:], dtype, device=device)
    return KernelSpec(NAME, (TensorSpec(shape, dtype, device=device), vec, vec), a)


def _spread(distribution: str, dtype: str) -> float:
    """The scale opkit.random_tensor gives `distribution` (its outliers are rare, so 1)."""
    if distribution == "large":
        return 1e3 if dtype == "float16" else 1e5
    if distribution == "tiny":
        return 1e-4
    return 1.0


def make_inputs(spec: KernelSpec, seed: int, distribution: str = "normal"):
    import torch

    gen = opkit.generator(seed, spec.device)
    x, w, b = spec.inputs
    xt = opkit.random_tensor(x.shape, x.dtype, x.device, gen, distribution)
    # A different offset per row, uniform in +-OFFSET_SPREADS spreads: rows near zero and far from it.
    # (A row: the normalized trailing dims, as many as w has.)
    lead = len(x.shape) - len(w.shape)
    u = torch.rand((*x.shape[:lead], *(1,) * len(w.shape)), generator=gen, dtype=torch.float32, device=xt.device)
    offset = (2.0 * u - 1.0) * (OFFSET_SPREADS[x.dtype] * _spread(distribution, x.dtype))
    xt = (xt.float() + offset).to(xt.dtype)
    # w around 1 but not equal to it and b around 0 but not zero, so a kernel that ignores either fails.
    wt = opkit.random_tensor(w.shape, w.dtype, w.device, gen, "normal") * 0.5 + 1.0
    bt = opkit.random_tensor(b.shape, b.dtype, b.device, gen, "normal") * 0.5
    return xt, wt, bt


def reference(inputs, attrs):
    """The eager baseline, as a user writes it."""
    import torch.nn.functional as F

    x, w, b = inputs
    return F.layer_norm(x, x.shape[x.dim() - attrs.get("dims", 1):], w, b, attrs["eps"])


def oracle(inputs, attrs):
    """The float64 reference on chunks of rows (opkit.oracle_in_chunks); over several trailing dims on
    x viewed as rows of prod(trailing) values, w and b flattened: the same values, and chunks that never
    cut a normalized group."""
    if "dims" not in attrs:
        return opkit.float64_oracle(reference, inputs, attrs, ORACLE_CHUNK)
    x, w, b = inputs
    n = w.numel()
    out = opkit.float64_oracle(reference, (x.reshape(-1, n), w.reshape(n), b.reshape(n)), {"eps": attrs["eps"]},
                             "rows")
    return out.reshape(x.shape)


def alloc_output(inputs, spec: KernelSpec):
    import torch

    x = inputs[0]  # contiguous whatever x's layout (run() views it as rows)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def run(module, inputs, out, attrs) -> None:
    x, w, b = inputs
    n = w.numel()  # the normalized trailing dims, flattened (w and b have their shape)
    module.launch(x.reshape(-1, n), w.reshape(-1), b.reshape(-1), out.view(-1, n), attrs["eps"])


# No persistent variant (opkit.with_persistent_rows, rmsnorm's): layer_norm had one, with its eviction knob, and
# it never competed in a budget-50 search on an H100 (2026-12-06, screen p50 of each variant's best point;
# docs/notes.md stop 30): bf16 8192x8192 row 92.41 us vs persistent 104.42, 32768x4096 row 179.07 vs 191.69,
# 4096x1024 row 8.34 vs 10.0.
def space(spec: KernelSpec) -> opkit.Space:
    """The row ops' space, whole rows capped at MAX_ELEMS_PER_THREAD."""
    return opkit.capped_row_space(spec, MAX_ELEMS_PER_THREAD)


default = opkit.row_default  # <= 16 elements per thread: inside space()


# Where the row and multirow kernels load w and b: with x, before the reductions, only where the grid is one
# wave (at most this many programs per SM). Measured on an H100 in two runs on one machine, not side by side
# (budget-50 searches, bench/results/h100-peers-rows-{b,d}-bench-2026-12-07.json, docs/notes.md stop 32): loaded
# early everywhere, the decode rows ran 2.3/2.3/2.7 µs (1/4/16 x 4096 bf16, 0.93-0.96x Liger in that run)
# against 2.4/2.5/3.1 loaded after the reductions (1.02-1.14x Liger in its run; Liger itself moved 10% between
# the runs), but 8192x8192 fell from 93.1 to 108.6 µs (1.17x torch.compile): w and b live through the
# reductions cost registers in a kernel of many waves. The combination is not yet measured.
EARLY_WB_MAX_WAVES = 1


def render_context(spec: KernelSpec, cand: opkit.Candidate) -> dict:
    ctx = opkit.row_render_context(spec, cand, NAME)
    m, _ = opkit.rows_cols(spec)
    sms = hardware.GPU_SMS if spec.device == "cuda" else hardware.CPU_SMS
    programs = -(-m // ctx["ROWS"])
    ctx["EARLY_WB"] = cand.variant in ("row", "multirow") and programs <= EARLY_WB_MAX_WAVES * sms
    return ctx


def bytes_moved(spec: KernelSpec) -> int:
    x, w, b = spec.inputs
    return 2 * x.nbytes + w.nbytes + b.nbytes


def flops(spec: KernelSpec) -> int:
    return 8 * spec.inputs[0].numel


# -- recognising layer_norm in user code (forge/trace.py canonical forms): forge/formulas.py owns the rule ---
def match(expr) -> tuple[list, dict] | None:
    """F.layer_norm / nn.LayerNorm: forge/formulas.py match_layer_norm."""
    return formulas.match_layer_norm(expr)


def fill_missing(inputs: list, attrs: dict | None = None):
    """No weight is w = 1 and no bias is b = 0: the same kernel, exactly (y * 1 + 0 == y; only a
    -0.0 becomes +0.0). Their shape is the normalized trailing shape (attribute dims or normalized_shape,
    the matcher's)."""
    import torch

    x, w, b = inputs
    attrs = attrs or {}
    ns = attrs.get("normalized_shape")
    k = len(ns) if isinstance(ns, list | tuple) else int(attrs.get("dims", 1))
    k = min(max(k, 1), max(x.dim(), 1))
    n = tuple(x.shape[x.dim() - k:]) if x.dim() else (1,)
    if w is None:
        w = torch.ones(n, dtype=x.dtype, device=x.device)
    if b is None:
        b = torch.zeros(n, dtype=x.dtype, device=x.device)
    return (x, w, b)
