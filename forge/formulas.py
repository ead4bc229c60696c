"""Recognising written-out formulas in forge/trace.py's canonical expression trees (kit layer: stdlib only).

One rule, one owner: the gelu family matches gelu with it and the linear family the activation after a
GEMM (GPT-2's gelu_new); rmsnorm and layer_norm match their norms with it and add_norm the norm after a
residual add, without one op file reaching another through the registry (docs/adr/0002-layers.md: op files
import only the kit).
"""

from __future__ import annotations

import math

# -- gelu ----------------------------------------------------------------------------------------------
# A written-out formula matches only if its constants are these within REL_TOL (relative): the
# constant as written in the papers/libraries (0.7978845608, 0.70710678...) or rounded to fp32 passes;
# a different constant is a different function and falls back to eager.
REL_TOL = 1e-6
INV_SQRT2 = 1.0 / math.sqrt(2.0)
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
TANH_CUBIC = 0.044715
# The argument of erf / tanh as a polynomial in x: {power: coefficient}.
ARGUMENT = {"erf": ("none", {1: INV_SQRT2}),
            "tanh": ("tanh", {1: SQRT_2_OVER_PI, 3: SQRT_2_OVER_PI * TANH_CUBIC})}
MAX_DEGREE = 8


def _close(value: float, target: float) -> bool:
    return abs(value - target) <= REL_TOL * abs(target)


def _number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _poly(e: tuple, x: tuple) -> dict[int, float] | None:
    """`e` as a polynomial in the input `x` ({power: coefficient}), or None if it is not one
    (another input, a non-numeric constant, division by a non-constant, a transcendental op)."""
    head = e[0]
    if e == x:
        return {1: 1.0}
    if head == "const":
        return {0: float(e[1])} if _number(e[1]) else None
    if head in ("mul", "add", "sub", "neg", "recip"):
        parts = [_poly(a, x) for a in e[1:]]
        if any(p is None for p in parts):
            return None
        if head == "neg":
            return {k: -c for k, c in parts[0].items()}
        if head == "recip":
            c = parts[0]
            if set(c) != {0} or c[0] == 0.0:
                return None
            return {0: 1.0 / c[0]}
        if head == "sub":
            parts[1] = {k: -c for k, c in parts[1].items()}
        out: dict[int, float] = {0: 1.0} if head == "mul" else {}
        for p in parts:
            if head == "mul":
                prod: dict[int, float] = {}
                for i, a in out.items():
                    for j, b in p.items():
                        prod[i + j] = prod.get(i + j, 0.0) + a * b
                out = prod
            else:
                for k, c in p.items():
                    out[k] = out.get(k, 0.0) + c
        if any(k > MAX_DEGREE for k in out):
            return None
        return {k: c for k, c in out.items() if c != 0.0}
    return None


def _poly_is(p: dict[int, float] | None, target: dict[int, float]) -> bool:
    return p is not None and set(p) == set(target) and all(_close(p[k], target[k]) for k in target)


def _inputs_in(e) -> set:
    if not isinstance(e, tuple) or not e:
        return set()
    if e[0] == "input":
        return {e}
    return set().union(*(_inputs_in(a) for a in e[1:] if isinstance(a, tuple)))


def _special(term: tuple) -> tuple[str, tuple, tuple[tuple, ...]] | None:
    """erf(arg) / tanh(arg), alone or times constant factors: (function, arg, the other factors)."""
    if term[0] in ARGUMENT:
        return term[0], term[1], ()
    if term[0] == "mul":
        found = [f for f in term[1:] if f[0] in ARGUMENT]
        if len(found) == 1:
            rest = list(term[1:])
            rest.remove(found[0])
            return found[0][0], found[0][1], tuple(rest)
    return None


def _match_formula(expr: tuple) -> tuple[list, dict] | None:
    """k * x * (c + c * f(arg)), f = erf or tanh, factors in any order; k * c must be 0.5 and arg
    x / sqrt(2) (erf) or sqrt(2/pi) * (x + 0.044715 x^3) (tanh), checked as polynomials in x."""
    if expr[0] != "mul":
        return None
    sums = [f for f in expr[1:] if f[0] == "add" and sum(_special(t) is not None for t in f[1:]) == 1]
    if len(sums) != 1:
        return None
    terms = list(sums[0][1:])
    term = next(t for t in terms if _special(t) is not None)
    fn, arg, scale_factors = _special(term)
    xs = _inputs_in(arg)
    if len(xs) != 1:
        return None
    x = xs.pop()
    mode, target = ARGUMENT[fn]
    if not _poly_is(_poly(arg, x), target):
        return None
    terms.remove(term)
    scale = _poly(("mul", *scale_factors), x) if scale_factors else {0: 1.0}
    offset = _poly(("add", *terms), x) if len(terms) > 1 else (_poly(terms[0], x) if terms else None)
    rest = list(expr[1:])
    rest.remove(sums[0])
    outer = _poly(("mul", *rest), x) if len(rest) > 1 else (_poly(rest[0], x) if rest else None)
    if scale is None or offset is None or outer is None:
        return None
    if set(scale) != {0} or set(offset) != {0} or set(outer) != {1}:
        return None
    c = offset[0]
    if not (_close(scale[0], c) and _close(outer[1] * c, 0.5)):
        return None
    return [x[1]], {"approximate": mode, "form": "formula"}


def match_gelu(expr) -> tuple[list, dict] | None:
    """F.gelu(x[, approximate]), nn.GELU([approximate]), and the written-out formulas
    0.5 * x * (1 + erf(x / sqrt(2)))  ->  approximate="none"
    0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))  ->  approximate="tanh"
    in any arrangement that canonicalises to the same polynomials (x * 0.7071067811865476,
    x * (0.5 + 0.5 * erf(...)), x * (1 + ...) / 2, x * x * x). An unknown `approximate` string is still
    returned, so make_spec names it as the reason for falling back."""
    if expr[0] == "gelu":
        _, x, mode = expr
        if x[0] != "input" or mode[0] != "const" or not isinstance(mode[1], str):
            return None
        return [x[1]], {"approximate": mode[1].lower()}
    return _match_formula(expr)


# -- rmsnorm (kernels/rmsnorm.py, kernels/add_norm.py) ------------------------------------------------
def _reduced(mean) -> dict | None:
    """The shape attributes of the mean inside rsqrt: {} (last dim), {"dims": k} or {"dim": d}."""
    if mean[0] == "mean_last":
        return {}
    if mean[0] != "mean" or len(mean) != 5 or mean[3] != ("const", True) or mean[4] != ("const", None):
        return None
    dim = mean[2][1] if mean[2][0] == "const" else None
    if isinstance(dim, int) and not isinstance(dim, bool) and dim < 0:
        return {} if dim == -1 else {"dim": dim}
    if isinstance(dim, tuple) and dim and all(isinstance(d, int) and d < 0 for d in dim):
        k = len(dim)
        if sorted(set(dim)) == list(range(-k, 0)) and len(set(dim)) == k:  # the last k dims, any order
            return {} if k == 1 else {"dims": k}
    return None  # several dims that are not the trailing ones, or positive (unnormalised) indices


def _weight(e) -> tuple[int, tuple | None] | None:
    """(input index, the shape a view gives it or None) for a weight operand: an input or a view of one."""
    if e[0] == "input":
        return e[1], None
    if e[0] == "view" and e[1][0] == "input" and e[2][0] == "const" and isinstance(e[2][1], tuple):
        return e[1][1], e[2][1]
    return None


_HALF = ("float16", "bfloat16")


def _strip_upcasts(e):
    """e with every ("cast", input, float32) replaced by the input: the float32 arithmetic on half inputs
    the kernels do anyway (they load, widen exactly, compute in fp32)."""
    if not isinstance(e, tuple) or not e or not isinstance(e[0], str) or e[0] in ("input", "const", "none"):
        return e
    if e[0] == "cast" and e[2] == ("const", "float32") and e[1][0] == "input":
        return e[1]
    return (e[0], *(_strip_upcasts(a) for a in e[1:]))


def _match_hf_half(expr) -> tuple[list, dict] | None:
    """Hugging Face's LlamaRMSNorm in half precision: weight * (x.float() * rsqrt(mean(x.float()**2) + eps))
    .to(x.dtype) rounds twice (the normalised value to x's dtype, then the product with the weight):
    form="hf", which the kernels compute exactly so (rmsnorm's round_before_weight). The cast's dtype is
    passed as a note (hf_dtype) that fill_missing checks against x's: a cast to another dtype is not it."""
    if len(expr) != 3:
        return None
    casts = [t for t in expr[1:] if t[0] == "cast" and t[2][0] == "const" and t[2][1] in _HALF]
    if len(casts) != 1:
        return None
    rest = [t for t in expr[1:] if t is not casts[0]]
    w = _weight(rest[0])
    inner = _strip_upcasts(casts[0][1])
    if w is None or inner == casts[0][1]:  # nothing widened: not the half-precision spelling
        return None
    got = match_rmsnorm(inner)
    if got is None or got[0][1] is not None or "form" in got[1]:  # the normalisation alone, no weight
        return None
    attrs = {**got[1], "form": "hf", "hf_dtype": casts[0][2][1]}
    if w[1] is not None:
        attrs["weight_view"] = w[1]
    return [got[0][0], w[0]], attrs


def match_rmsnorm(expr) -> tuple[list, dict] | None:
    """(input indices [x, w or None], attrs) if `expr` computes rmsnorm.

    Recognised: F.rms_norm(x, normalized_shape, w, eps) and nn.RMSNorm over the trailing dims;
    x * rsqrt(mean(x*x or x**2, dims, keepdim) + eps) [* w] in any order, over the last dim, several
    trailing dims (mean((-2, -1))) or one other dim (mean(1) of NCHW), w an input or a view of one
    (w.view(1, C, 1, 1), w[:, None, None]); x / sqrt(...) is the same tree after canonicalisation.
    fill_missing checks that the weight's shape broadcasts over the normalized dims."""
    if expr[0] == "rms_norm":
        if len(expr) not in (4, 5):
            return None
        _, x, w, eps = expr[:4]
        if x[0] != "input" or w[0] not in ("input", "none"):
            return None
        attrs = {"eps": float(eps), "form": "fused"}
        if len(expr) == 5:
            attrs["dims"] = int(expr[4])
        return [x[1], w[1] if w[0] == "input" else None], attrs
    if expr[0] != "mul":
        return None
    hf = _match_hf_half(expr)
    if hf is not None:
        return hf
    factors = list(expr[1:])
    rsqrts = [f for f in factors if f[0] == "rsqrt"]
    if len(rsqrts) != 1 or rsqrts[0][1][0] != "add" or len(rsqrts[0][1]) != 3:
        return None
    terms = rsqrts[0][1][1:]
    consts = [t for t in terms if t[0] == "const" and isinstance(t[1], int | float)]
    means = [t for t in terms if t[0] in ("mean_last", "mean")]
    if len(consts) != 1 or len(means) != 1:
        return None
    shape_attrs = _reduced(means[0])
    if shape_attrs is None:
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
    attrs = {"eps": float(consts[0][1]), **shape_attrs}
    if not rest:
        return [x[1], None], attrs
    w = _weight(rest[0]) if len(rest) == 1 and rest[0] != x else None
    if w is None:
        return None
    if w[1] is not None:
        attrs["weight_view"] = w[1]
    return [x[1], w[0]], attrs


# -- layer_norm (kernels/layer_norm.py, kernels/add_norm.py) ------------------------------------------
def _optional_input(e) -> tuple[bool, int | None]:
    """(ok, index) for a weight/bias operand: an input tensor, or absent (None)."""
    if e[0] == "input":
        return True, e[1]
    if e == ("const", None):
        return True, None
    return False, None


def match_layer_norm(expr) -> tuple[list, dict] | None:
    """(input indices [x, w or None, b or None], attrs) for F.layer_norm / nn.LayerNorm.

    The trace ran the call, so normalized_shape is x's trailing shape (torch checks it, and w and b
    have it): its length is the attribute dims (passed only when it is not 1)."""
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
