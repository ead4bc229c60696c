"""reduce: a row reduction over the last dimension — sum, mean, amax or argmax, with or without keepdim.

Output shape x.shape[:-1] (+ (1,) with keepdim). sum/mean/amax write x's dtype (accumulated in fp32);
argmax writes int64 indices, the first maximal one on ties (torch's rule), a NaN counting as maximal.
"""

from __future__ import annotations

import math

from forge import opkit
from forge.spec import KernelSpec, TensorSpec

NAME = "reduce"
SUMMARY = "x.sum / x.mean / x.amax / x.argmax over dim=-1 [keepdim]"
TEMPLATES = {"row": "reduce_row.j2", "looped": "reduce_looped.j2", "multirow": "reduce_multirow.j2"}
DEFAULT_ATTRS = {"kind": "sum", "keepdim": False, "dim": -1}
KINDS = ("sum", "mean", "amax", "argmax")


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
        raise ValueError("reduce kernels reduce over the last dimension only, not over all dimensions")
    if isinstance(dim, list | tuple) and len(dim) == 1:
        dim = dim[0]
    if isinstance(dim, bool) or not isinstance(dim, int) or dim not in (-1, len(shape) - 1):
        raise ValueError(f"reduce kernels reduce over the last dimension only, not dim={dim!r}")
    attrs_n = {"kind": kind, "keepdim": _as_bool(a["keepdim"], "keepdim"), "dim": -1}
    return KernelSpec(NAME, (TensorSpec(shape, dtype, device=device),), attrs_n)


def output_shape(shape: tuple[int, ...], attrs) -> tuple[int, ...]:
    return (*shape[:-1], 1) if attrs["keepdim"] else tuple(shape[:-1])


def _smallest_subnormal(dtype) -> float:
    import torch

    fi = torch.finfo(dtype)
    return fi.tiny * fi.eps


def _exact_sum_grid(x):
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
    bound = float(d.abs().sum(-1).max())
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
        t = _exact_sum_grid(t)
    # "outliers" already ties: every +outlier is the same value (+1e3 or +1e4), the row's maximum.
    elif kind == "argmax" and distribution != "outliers":
        t = _tie_grid(t)
    return (t,)


def reference(inputs, attrs):
    """The eager baseline, as a user writes it."""
    x = inputs[0]
    keepdim = attrs["keepdim"]
    kind = attrs["kind"]
    if kind == "sum":
        return x.sum(-1, keepdim=keepdim)
    if kind == "mean":
        return x.mean(-1, keepdim=keepdim)
    if kind == "amax":
        return x.amax(-1, keepdim=keepdim)
    return x.argmax(-1, keepdim=keepdim)


def oracle(inputs, attrs):
    """float64 result rounded once to the output dtype (what a correctly rounded kernel writes; it only
    matters where an fp16 sum overflows to inf). argmax: the first index holding the row maximum,
    spelled out rather than trusting torch.argmax's own tie rule; the float64 view of fp16/bf16 values
    is exact, so it has exactly the input's ties. Rows are independent: evaluated on chunks of rows
    (opkit.oracle_in_chunks), so its float64 working set stays bounded."""
    import torch

    dtype = inputs[0].dtype

    def rows(part):
        d = part[0].double()
        if attrs["kind"] == "argmax":
            n = d.shape[-1]
            idx = torch.arange(n, device=d.device).expand(d.shape)
            return torch.where(d == d.amax(-1, keepdim=True), idx, n).amin(-1, keepdim=attrs["keepdim"])
        return reference((d,), attrs).to(dtype)

    return opkit.oracle_in_chunks(rows, inputs, "rows")


def alloc_output(inputs, spec: KernelSpec):
    import torch

    x = inputs[0]
    dtype = torch.int64 if spec.attrs["kind"] == "argmax" else x.dtype
    return torch.empty(output_shape(tuple(x.shape), spec.attrs), dtype=dtype, device=x.device)


def run(module, inputs, out, attrs) -> None:
    x = inputs[0]
    n = x.shape[-1]
    module.launch(x.reshape(-1, n), out.view(-1))


space = opkit.row_space
default = opkit.row_default


def render_context(spec: KernelSpec, cand: opkit.Candidate) -> dict:
    ctx = opkit.row_render_context(spec, cand, NAME)
    ctx["kind"] = spec.attrs["kind"]
    return ctx


def bytes_moved(spec: KernelSpec) -> int:
    x = spec.inputs[0]
    m, _ = opkit.rows_cols(spec)
    return x.nbytes + m * (8 if spec.attrs["kind"] == "argmax" else x.itemsize)


def flops(spec: KernelSpec) -> int:
    return spec.inputs[0].numel


# tolerance: the contract's default, opkit.ROW_TOLERANCE (forge/ops.py). sum/mean are exact up to the
# final rounding on make_inputs' grid; amax and argmax are exact.


# -- recognising reductions in user code (forge/trace.py canonical forms) --------------------------
def match(expr) -> tuple[list, dict] | None:
    """x.sum / torch.sum / x.mean / x.amax / torch.amax / x.argmax / torch.argmax of one input.

    Any dim/keepdim/dtype is returned as attrs: make_spec refuses dims other than the last and a
    dtype= argument with a reason the shim shows, rather than "no op family matches"."""
    head = expr[0]
    if head == "mean_last":  # the tracer folds mean(x, -1, keepdim=True) into this
        if expr[1][0] != "input":
            return None
        return [expr[1][1]], {"kind": "mean", "keepdim": True, "dim": -1}
    if head in ("sum", "mean") and len(expr) == 5:
        _, x, dim, keepdim, dtype = expr
    elif head in ("amax", "argmax") and len(expr) == 4:
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
