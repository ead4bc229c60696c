"""layer_norm: y = (x - mean(x)) * rsqrt(var(x) + eps) * w + b over the last dimension."""

from __future__ import annotations

import math

from forge import opkit
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
# Accepted by make_spec but not part of the spec: the only supported value is (N,), which the shape
# already says. The matcher passes it only when it is something else, so the fallback names it.
_CHECKED_ATTRS = ("normalized_shape",)

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
    unknown = set(a) - set(DEFAULT_ATTRS) - set(_CHECKED_ATTRS)
    if unknown:
        raise ValueError(f"layer_norm takes attributes {sorted(DEFAULT_ATTRS)}, not {sorted(unknown)}")
    n = int(shape[-1])
    if "normalized_shape" in a:
        ns = a.pop("normalized_shape")
        ns = (ns,) if isinstance(ns, int) else tuple(ns)
        if ns != (n,):
            raise ValueError(f"normalized_shape={ns} is not supported: layer_norm kernels normalize over the "
                             f"last dimension only, normalized_shape=({n},)")
    eps = a["eps"]
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not math.isfinite(eps):
        raise ValueError(f"eps must be a finite number, not {eps!r}")
    a["eps"] = float(eps)
    vec = TensorSpec((n,), dtype, device=device)
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
    u = torch.rand((*x.shape[:-1], 1), generator=gen, dtype=torch.float32, device=xt.device)
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
    return F.layer_norm(x, x.shape[-1:], w, b, attrs["eps"])


def alloc_output(inputs, spec: KernelSpec):
    import torch

    x = inputs[0]  # contiguous whatever x's layout (run() views it as rows)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def run(module, inputs, out, attrs) -> None:
    x, w, b = inputs
    n = x.shape[-1]
    module.launch(x.reshape(-1, n), w, b, out.view(-1, n), attrs["eps"])


def space(spec: KernelSpec) -> opkit.Space:
    base = opkit.row_space(spec)
    block = opkit.next_pow2(opkit.rows_cols(spec)[1])

    def valid(c: opkit.Candidate) -> bool:
        if not base.valid(c):
            return False
        if c.variant == "looped":  # x, w, b of one block only: opkit's looped bound holds
            return True
        return c.p.get("ROWS", 1) * block / (32 * c.p["num_warps"]) <= MAX_ELEMS_PER_THREAD

    return opkit.Space(base.variants, valid)


default = opkit.row_default  # <= 16 elements per thread: inside space()


def render_context(spec: KernelSpec, cand: opkit.Candidate) -> dict:
    return opkit.row_render_context(spec, cand, NAME)


def bytes_moved(spec: KernelSpec) -> int:
    x, w, b = spec.inputs
    return 2 * x.nbytes + w.nbytes + b.nbytes


def flops(spec: KernelSpec) -> int:
    return 8 * spec.inputs[0].numel


# -- recognising layer_norm in user code (forge/trace.py canonical forms) --------------------------
def _optional_input(e) -> tuple[bool, int | None]:
    """(ok, index) for a weight/bias operand: an input tensor, or absent (None)."""
    if e[0] == "input":
        return True, e[1]
    if e == ("const", None):
        return True, None
    return False, None


def match(expr) -> tuple[list, dict] | None:
    """(input indices [x, w or None, b or None], attrs) for F.layer_norm / nn.LayerNorm.

    The trace ran the call, so a one-element normalized_shape equals x.shape[-1:]; any other is passed
    on as an attribute for make_spec to refuse by name."""
    if expr[0] != "layer_norm" or len(expr) != 6:
        return None
    _, x, ns, w, b, eps = expr
    if x[0] != "input" or ns[0] != "const" or eps[0] != "const":
        return None
    ok_w, wi = _optional_input(w)
    ok_b, bi = _optional_input(b)
    eps = eps[1]
    if not (ok_w and ok_b) or isinstance(eps, bool) or not isinstance(eps, int | float):
        return None
    shape = ns[1]
    if isinstance(shape, int) and not isinstance(shape, bool):
        shape = (shape,)
    if not isinstance(shape, list | tuple) or not all(isinstance(s, int) for s in shape):
        return None
    attrs: dict = {"eps": float(eps)}
    if len(shape) != 1:
        attrs["normalized_shape"] = tuple(int(s) for s in shape)
    return [x[1], wi, bi], attrs


def fill_missing(inputs: list):
    """No weight is w = 1 and no bias is b = 0: the same kernel, exactly (y * 1 + 0 == y; only a
    -0.0 becomes +0.0)."""
    import torch

    x, w, b = inputs
    n = x.shape[-1]
    if w is None:
        w = torch.ones(n, dtype=x.dtype, device=x.device)
    if b is None:
        b = torch.zeros(n, dtype=x.dtype, device=x.device)
    return (x, w, b)
