"""rmsnorm: y = x * rsqrt(mean(x², -1) + eps) * w over the last dimension."""

from __future__ import annotations

from forge import opkit
from forge.spec import KernelSpec, TensorSpec

NAME = "rmsnorm"
SUMMARY = "x * rsqrt(mean(x^2, -1) + eps) * w"
TEMPLATES = {"row": "rmsnorm_row.j2", "looped": "rmsnorm_looped.j2", "multirow": "rmsnorm_multirow.j2"}
DEFAULT_ATTRS = {"eps": 1e-6}
# x may have any outer strides with its rows contiguous: the kernels take a row stride; run() views x
# as rows (a copy where no view exists). The weight stays contiguous.
STRIDED_INPUTS = (0,)
# The default oracle (float64 reference) runs on chunks of rows, its memory bounded (forge/ops.py).
ORACLE_CHUNK = "rows"


def make_spec(shape: tuple[int, ...], dtype: str, device: str, attrs: dict | None = None) -> KernelSpec:
    a = {**DEFAULT_ATTRS, **(attrs or {})}
    unknown = set(a) - set(DEFAULT_ATTRS)
    if unknown:
        raise ValueError(f"rmsnorm takes attributes {sorted(DEFAULT_ATTRS)}, not {sorted(unknown)}")
    a["eps"] = float(a["eps"])
    return KernelSpec(NAME, (TensorSpec(shape, dtype, device=device), TensorSpec((shape[-1],), dtype,
                                                                                 device=device)), a)


def make_inputs(spec: KernelSpec, seed: int, distribution: str = "normal"):
    gen = opkit.generator(seed, spec.device)
    x, w = spec.inputs
    # The weight is drawn around 1 but not equal to it, so a kernel that ignores w fails validation.
    return (opkit.random_tensor(x.shape, x.dtype, x.device, gen, distribution),
            opkit.random_tensor(w.shape, w.dtype, w.device, gen, "normal", base=0.0) * 0.5 + 1.0)


def reference(inputs, attrs):
    """The eager baseline, as a user writes it (computes in the input dtype)."""
    import torch

    x, w = inputs
    return x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + attrs["eps"]) * w


def alloc_output(inputs, spec: KernelSpec):
    import torch

    x = inputs[0]  # contiguous whatever x's layout (run() views it as rows)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def run(module, inputs, out, attrs) -> None:
    x, w = inputs
    n = x.shape[-1]
    module.launch(x.reshape(-1, n), w, out.view(-1, n), attrs["eps"])


space = opkit.row_space
default = opkit.row_default


def render_context(spec: KernelSpec, cand: opkit.Candidate) -> dict:
    return opkit.row_render_context(spec, cand, NAME)


def bytes_moved(spec: KernelSpec) -> int:
    x, w = spec.inputs
    return 2 * x.nbytes + w.nbytes


def flops(spec: KernelSpec) -> int:
    return 4 * spec.inputs[0].numel


# -- recognising rmsnorm in user code (forge/trace.py canonical forms) ----------------------------
def match(expr) -> tuple[list, dict] | None:
    """(input indices [x, w or None], attrs) if `expr` computes rmsnorm over the last dim.

    Recognised: F.rms_norm(x, (N,), w, eps); x * rsqrt(mean(x*x or x**2, -1, keepdim) + eps) [* w]
    in any order; x / sqrt(...) is the same tree after canonicalisation."""
    if expr[0] == "rms_norm":
        _, x, w, eps = expr
        if x[0] != "input" or w[0] not in ("input", "none"):
            return None
        return [x[1], w[1] if w[0] == "input" else None], {"eps": float(eps)}
    if expr[0] != "mul":
        return None
    factors = list(expr[1:])
    rsqrts = [f for f in factors if f[0] == "rsqrt"]
    if len(rsqrts) != 1 or rsqrts[0][1][0] != "add" or len(rsqrts[0][1]) != 3:
        return None
    terms = rsqrts[0][1][1:]
    consts = [t for t in terms if t[0] == "const" and isinstance(t[1], int | float)]
    means = [t for t in terms if t[0] == "mean_last"]
    if len(consts) != 1 or len(means) != 1:
        return None
    square = means[0][1]
    if square[0] != "mul" or len(square) != 3 or square[1] != square[2] or square[1][0] != "input":
        return None
    x = square[1]
    rest = list(factors)
    rest.remove(rsqrts[0])
    if x not in rest:
        return None
    rest.remove(x)
    if not rest:
        return [x[1], None], {"eps": float(consts[0][1])}
    if len(rest) == 1 and rest[0][0] == "input" and rest[0] != x:
        return [x[1], rest[0][1]], {"eps": float(consts[0][1])}
    return None


def fill_missing(inputs: list):
    """rmsnorm without a weight is rmsnorm with w = 1 (same kernel, exact: x * r * 1.0 == x * r)."""
    import torch

    x, w = inputs
    if w is None:
        w = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
    return (x, w)
