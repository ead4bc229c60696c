"""reduce: a reduction over one dimension — sum, mean, amax, amin, argmax or argmin, with or without keepdim.

Output shape x.shape without the reduced dim (a 1 there with keepdim). sum/mean/amax/amin write x's dtype
(accumulated in fp32); argmax/argmin write int64 indices, the first extremal one on ties (torch's rule), a
NaN counting as the extreme (torch propagates it: amax/amin give NaN, argmax/argmin its first index).
The last dim runs the row variants (row, looped, multirow) on x viewed as rows; any other dim (attribute
dim < -1, contiguous x only) the "strided" variant on x viewed as (outer, R, inner).
"""

from __future__ import annotations

import math

from forge import opkit
from forge.spec import KernelSpec, TensorSpec

NAME = "reduce"
SUMMARY = "x.sum / mean / amax / amin / argmax / argmin over one dim [keepdim]"
TEMPLATES = {"row": "reduce_row.j2", "looped": "reduce_looped.j2", "multirow": "reduce_multirow.j2",
             "strided": "reduce_strided.j2"}
DEFAULT_ATTRS = {"kind": "sum", "keepdim": False, "dim": -1}
KINDS = ("sum", "mean", "amax", "amin", "argmax", "argmin")
INDEX_KINDS = ("argmax", "argmin")
# The "strided" variant is only in the space of a spec over a non-last dim: tests render and run it
# under these attributes (tests/test_templates.py, tests/test_golden.py).
VARIANT_ATTRS = {"strided": {"dim": -2}}


def _as_bool(value, name: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ValueError(f"{name} must be true or false, not {value!r}")


def make_spec(shape: tuple[int, ...], dtype: str, device: str, attrs: dict | None = None) -> KernelSpec:
    a = {**DEFAULT_ATTRS, **(attrs or {})}
    # The matcher passes a torch `dtype=` argument through so the fallback reason can name it.
    out_dtype = a.pop("dtype", None)
    unknown = set(a) - set(DEFAULT_ATTRS)
    if unknown:
        raise ValueError(f"reduce takes attributes {sorted(DEFAULT_ATTRS)}, not {sorted(unknown)}")
    kind = str(a["kind"]).lower()
    if kind not in KINDS:
        raise ValueError(f"reduce kind must be one of {', '.join(KINDS)}, not {a['kind']!r}")
    if out_dtype is not None and out_dtype != dtype:  # dtype=x.dtype changes nothing
        raise ValueError(f"dtype={out_dtype} is not supported (the kernels write the input's dtype)")
    dim = a["dim"]
    if dim is None or dim == ():
        raise ValueError("reduce kernels reduce over one dimension, not over all dimensions")
    if isinstance(dim, list | tuple) and len(dim) > 1:
        raise ValueError(f"reduce kernels reduce over one dimension, not dim={tuple(dim)!r}")
    dim = opkit.normalize_dim(dim, len(shape), "reduce")
    attrs_n = {"kind": kind, "keepdim": _as_bool(a["keepdim"], "keepdim"), "dim": dim}
    return KernelSpec(NAME, (TensorSpec(shape, dtype, device=device),), attrs_n)


def output_shape(shape: tuple[int, ...], attrs) -> tuple[int, ...]:
    d = len(shape) + attrs["dim"]
    return (*shape[:d], 1, *shape[d + 1:]) if attrs["keepdim"] else (*shape[:d], *shape[d + 1:])


def _smallest_subnormal(dtype) -> float:
    import torch

    fi = torch.finfo(dtype)
    return fi.tiny * fi.eps


def _exact_sum_grid(x, dim: int = -1):
    """Round x to a power-of-two grid g coarse enough that every fp32 partial sum of a row is exact.

    Why: a sum has no useful relative error bound. A row whose values cancel to ~0 is off by
    ~eps32 * sum|x| in fp32 whatever the order, which no element-wise rtol against the float64
    oracle accepts (measured on the CPU: blockwise fp32 sums of unrounded fp32 "large" 2048x4096
    inputs put 3 rows outside the fp32 tolerance, e.g. 2483 for 2482.52). With every value a
    multiple of g and sum|x| <= 2^22 g, each partial sum is an integer multiple of g below 2^24 g,
    which fp32 holds exactly — so a correct fp32-accumulating kernel returns the exact sum in any
    summation order, and the only error left is the one rounding to the output dtype.
    That also settles overflow: fp16 "large" rows (65537 values x 1e3) sum past 65504; kernel and
    oracle (exact sum, rounded once to fp16) both give the same signed inf, as eager torch does.
    """
    import torch

    d = x.double()
    bound = float(d.abs().sum(dim).max())
    g = 2.0 ** math.ceil(math.log2(bound / 2**22)) if bound > 0 else 1.0
    q = torch.round(d / g) * g
    # Values far below g round to 0; inputs are never zero (a zero hides bad indexing).
    tiny = max(g, _smallest_subnormal(x.dtype))
    q = torch.where(q == 0, torch.where(d < 0, -tiny, tiny), q)
    return q.to(x.dtype)


def _tie_grid(x):
    """Quantise to odd multiples of g/2, g ~ the median |x|: a few dozen distinct values, so rows
    often hold their maximum more than once and the first-index rule is exercised (never zero)."""
    import torch

    med = float(x.float().abs().median())
    g = 2.0 ** math.floor(math.log2(med)) if med > 0 else 1.0
    d = x.double()
    return ((torch.floor(d / g) + 0.5) * g).to(x.dtype)


def make_inputs(spec: KernelSpec, seed: int, distribution: str = "normal"):
    x = spec.inputs[0]
    t = opkit.random_tensor(x.shape, x.dtype, x.device, opkit.generator(seed, x.device), distribution)
    kind = spec.attrs["kind"]
    if kind in ("sum", "mean"):
        t = _exact_sum_grid(t, spec.attrs["dim"])
    # "outliers" already ties: every +outlier is the same value (+1e3 or +1e4), the row's maximum (and
    # every -outlier its minimum).
    elif kind in INDEX_KINDS and distribution != "outliers":
        t = _tie_grid(t)
    return (t,)


def reference(inputs, attrs):
    """The eager baseline, as a user writes it."""
    x = inputs[0]
    keepdim = attrs["keepdim"]
    kind = attrs["kind"]
    dim = attrs.get("dim", -1)
    if kind == "sum":
        return x.sum(dim, keepdim=keepdim)
    if kind == "mean":
        return x.mean(dim, keepdim=keepdim)
    if kind == "amax":
        return x.amax(dim, keepdim=keepdim)
    if kind == "amin":
        return x.amin(dim, keepdim=keepdim)
    if kind == "argmin":
        return x.argmin(dim, keepdim=keepdim)
    return x.argmax(dim, keepdim=keepdim)


def oracle(inputs, attrs):
    """float64 result rounded once to the output dtype (what a correctly rounded kernel writes; it only
    matters where an fp16 sum overflows to inf). argmax/argmin: the first index holding the row
    maximum/minimum, spelled out rather than trusting torch's own tie rule; the float64 view of fp16/bf16
    values is exact, so it has exactly the input's ties. Rows are independent: evaluated on chunks of
    rows (opkit.oracle_in_chunks), so its float64 working set stays bounded; a non-last dim is moved last
    first (the same values, reduced in the same order)."""
    import torch

    dtype = inputs[0].dtype
    dim, keepdim = attrs.get("dim", -1), attrs["keepdim"]
    last = {**attrs, "dim": -1, "keepdim": keepdim and dim == -1}

    def rows(part):
        d = part[0].double()
        if attrs["kind"] in INDEX_KINDS:
            n = d.shape[-1]
            idx = torch.arange(n, device=d.device).expand(d.shape)
            ext = d.amax(-1, keepdim=True) if attrs["kind"] == "argmax" else d.amin(-1, keepdim=True)
            return torch.where(d == ext, idx, n).amin(-1, keepdim=last["keepdim"])
        return reference((d,), last).to(dtype)

    if dim == -1:
        return opkit.oracle_in_chunks(rows, inputs, "rows")
    out = opkit.oracle_in_chunks(rows, (inputs[0].movedim(dim, -1),), "rows")
    return out.unsqueeze(dim) if keepdim else out


def alloc_output(inputs, spec: KernelSpec):
    import torch

    x = inputs[0]
    dtype = torch.int64 if spec.attrs["kind"] in ("argmax", "argmin") else x.dtype
    return torch.empty(output_shape(tuple(x.shape), spec.attrs), dtype=dtype, device=x.device)


def run(module, inputs, out, attrs) -> None:
    x = inputs[0]
    dim = attrs.get("dim", -1)
    if dim == -1:
        n = x.shape[-1]
        module.launch(x.reshape(-1, n), out.view(-1))
        return
    # x is contiguous (reduce lists no STRIDED_INPUTS): (outer, R, inner) is a view; the output (outer, inner)
    outer, r, inner = 1, x.shape[dim], 1
    for s in x.shape[:x.dim() + dim]:
        outer *= s
    for s in x.shape[x.dim() + dim + 1:]:
        inner *= s
    module.launch(x.view(outer, r, inner), out.view(outer, inner))


def space(spec: KernelSpec) -> opkit.Space:
    dim = spec.attrs["dim"]
    return opkit.row_space(spec) if dim == -1 else opkit.strided_space(spec, dim)


def default(spec: KernelSpec) -> opkit.Candidate:
    dim = spec.attrs["dim"]
    return opkit.row_default(spec) if dim == -1 else opkit.strided_default(spec, dim)


def render_context(spec: KernelSpec, cand: opkit.Candidate) -> dict:
    if cand.variant == opkit.STRIDED_VARIANT:
        ctx = opkit.strided_render_context(spec, cand, NAME)
    else:
        ctx = opkit.row_render_context(spec, cand, NAME)
    ctx["kind"] = spec.attrs["kind"]
    ctx["negate"] = spec.attrs["kind"] in ("amin", "argmin")
    return ctx


def bytes_moved(spec: KernelSpec) -> int:
    x = spec.inputs[0]
    outputs = x.numel // max(1, x.shape[spec.attrs["dim"]])
    return x.nbytes + outputs * (8 if spec.attrs["kind"] in INDEX_KINDS else x.itemsize)


def flops(spec: KernelSpec) -> int:
    return spec.inputs[0].numel


# tolerance: the contract's default, opkit.ROW_TOLERANCE (forge/ops.py). sum/mean are exact up to the
# final rounding on make_inputs' grid; amax and argmax are exact.


# -- recognising reductions in user code (forge/trace.py canonical forms) --------------------------
def match(expr) -> tuple[list, dict] | None:
    """x.sum / torch.sum / x.mean / x.amax / x.amin / x.argmax / x.argmin (and torch.*) of one input.

    Any dim/keepdim/dtype is returned as attrs: make_spec refuses several dims or none and a dtype=
    argument with a reason the shim shows, rather than "no op family matches"."""
    head = expr[0]
    if head == "mean_last":  # the tracer folds mean(x, -1, keepdim=True) into this
        if expr[1][0] != "input":
            return None
        return [expr[1][1]], {"kind": "mean", "keepdim": True, "dim": -1}
    if head in ("sum", "mean") and len(expr) == 5:
        _, x, dim, keepdim, dtype = expr
    elif head in ("amax", "amin", "argmax", "argmin") and len(expr) == 4:
        _, x, dim, keepdim = expr
        dtype = ("const", None)
    else:
        return None
    if x[0] != "input" or any(c[0] != "const" for c in (dim, keepdim, dtype)):
        return None
    if not isinstance(keepdim[1], bool):
        return None
    attrs = {"kind": head, "keepdim": keepdim[1], "dim": dim[1]}
    if dtype[1] is not None:
        attrs["dtype"] = str(dtype[1]).removeprefix("torch.")
    return [x[1]], attrs
