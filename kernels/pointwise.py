"""pointwise: any chain of elementwise ops over n inputs, generated from its expression (code generation,
not one template per op): y = expr(x0, x1, ...), computed in fp32, stored once in the output dtype.

The expression is the spec attribute "expr", a canonical text over numbered inputs, e.g. the swish
"mul(x0,sigmoid(x0))" or MinGPT's tanh-GELU "mul(0.5,x0,add(1.0,tanh(mul(0.7978845608028654,
add(x0,mul(0.044715,x0,x0,x0))))))". Constants are written as repr(float) (exact: repr round-trips), so
the text is part of the cache key. Functions (FUNCS): add, mul (2 or more operands), sub, div, neg, recip,
exp, log, sqrt, rsqrt, tanh, sigmoid, erf, abs, relu, hardswish, leaky_relu(e, slope), clamp(e, lo, hi)
(hardtanh; -inf/inf for a missing bound), pow(e, exponent), where(cond, a, b) with cond one of gt, ge,
eq, ne of two values, and the casts to_float16 / to_bfloat16 / to_float32.

Problem shape: the output's. Inputs: one dtype (float16, bfloat16 or float32), each of the output's shape
or broadcastable to it (a bias (N,), a (B, 1, S, D) table): the attribute "input_shapes" names each input's shape
("c": the output's; else comma-separated sizes, "()" for a 0-d tensor), present only when some input is
broadcast. Inputs may also be strided, in any order of strides (the "strides" attribute, forge/ops.py);
broadcasting by stride 0 (x.expand(...)) is refused there (overlapping addresses). Broadcast and strided
inputs are addressed by index math from the output's flat index (their strides baked in, 0 for broadcast
dims); inputs of the output's shape, contiguous, by the flat index itself. The output is contiguous.

Casts inside the chain are the user's numerics: to_float32 is exact (every value already is fp32 in the
kernel), to_float16 / to_bfloat16 round there (`.to(tl.float16).to(tl.float32)`). The output dtype is
the root's dtype by torch's promotion (a Python constant never promotes; float16 with bfloat16 is float32).

Variants: the elementwise ones (forge/opkit.py), over the output's flat index:
  flat        one BLOCK of contiguous elements per program, cdiv(numel, BLOCK) programs
  persistent  min(cdiv(numel, BLOCK), PROGRAMS_PER_SM x SMs) programs striding over the blocks
"""

from __future__ import annotations

import dataclasses
import math
import re

from forge import opkit
from forge.spec import KernelSpec, TensorSpec

NAME = "pointwise"
SUMMARY = "any chain of elementwise ops (generated from its expression), over broadcast inputs"
TEMPLATES = {"flat": "pointwise_flat.j2", "persistent": "pointwise_persistent.j2"}
# The swish x * sigmoid(x): the spec a request without attributes gets (tests over every family).
DEFAULT_ATTRS: dict = {"expr": "mul(x0,sigmoid(x0))"}
OPTIONAL_ATTRS = ("input_shapes",)  # present only where an input is broadcast (manifests may name it)
# Tried after every specific family, at each cut of a region (forge/ops.py match_order): where gelu,
# silu_mul or rmsnorm match, their kernels win; this family takes the elementwise chains nobody else does.
GENERIC = True
MAX_INPUTS = 8
# Any input may be strided, in any order of strides (the index math takes every stride).
STRIDED_INPUTS = tuple(range(MAX_INPUTS))
STRIDED_ANY_ORDER = True
# Elementwise masking shapes for tests/test_templates.py: one element, odd sizes, leading dims that
# flatten, a power of two, and a long one whose last block holds one element.
TEST_SHAPES = [(1,), (7,), (3, 7), (2, 3, 33), (5, 300), (4096,), (1, 65537)]

# name -> number of operands (None: 2 or more).
FUNCS: dict[str, int | None] = {
    "add": None, "mul": None, "sub": 2, "div": 2, "neg": 1, "recip": 1, "exp": 1, "log": 1, "sqrt": 1,
    "rsqrt": 1, "tanh": 1, "sigmoid": 1, "erf": 1, "abs": 1, "relu": 1, "hardswish": 1, "leaky_relu": 2,
    "clamp": 3, "pow": 2, "where": 3, "gt": 2, "ge": 2, "eq": 2, "ne": 2,
    "to_float16": 1, "to_bfloat16": 1, "to_float32": 1,
}
COMPARISONS = {"gt": ">", "ge": ">=", "eq": "==", "ne": "!="}
CASTS = {"to_float16": "float16", "to_bfloat16": "bfloat16", "to_float32": "float32"}
# Operands that must be constants: (function, operand positions).
CONST_OPERANDS = {"leaky_relu": (1,), "clamp": (1, 2), "pow": (1,)}
# Functions defined only for arguments >= 0 (test inputs must be in their domain: see _positive_inputs).
DOMAIN = {"log", "sqrt", "rsqrt"}
# pow with an integer exponent of at most this magnitude is a chain of multiplications (binary powering).
MAX_INT_POW = 32
_HALF = ("float16", "bfloat16")
_TOKEN = re.compile(r"\s*(?:(?P<num>[-+]?(?:inf|(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?))|(?P<input>x\d+)"
                    r"|(?P<name>[a-z_][a-z0-9_]*)|(?P<punct>[(),]))", re.I)


# -- the expression: parse, print, check -------------------------------------------------------------
# Nodes: ("x", i) an input, ("c", value) a float constant, (function, *operands).
def parse(text) -> tuple:
    """The expression tree of `text`; ValueError naming what is wrong (unknown function, arity, input
    index, a constant where one must be, trailing text)."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"expr={text!r}: expected an expression such as 'mul(x0,sigmoid(x0))'")
    toks = []
    pos = 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        m = _TOKEN.match(text, pos)
        if m is None:
            raise ValueError(f"expr={text!r}: unexpected {text[pos:pos + 10].strip()!r} at offset {pos}")
        toks.append((m.lastgroup, m.group(m.lastgroup)))
        pos = m.end()
    i = 0

    def take() -> tuple:
        nonlocal i
        if i >= len(toks):
            raise ValueError(f"expr={text!r}: ends early")
        kind, val = toks[i]
        i += 1
        if kind == "num":
            return ("c", float(val))
        if kind == "input":
            return ("x", int(val[1:]))
        if kind != "name":
            raise ValueError(f"expr={text!r}: unexpected {val!r}")
        name = val.lower()
        if name not in FUNCS:
            raise ValueError(f"expr={text!r}: unknown function {val!r} (known: {', '.join(sorted(FUNCS))})")
        if i >= len(toks) or toks[i][1] != "(":
            raise ValueError(f"expr={text!r}: {name} needs its operands in parentheses")
        i += 1
        args = [take()]
        while i < len(toks) and toks[i][1] == ",":
            i += 1
            args.append(take())
        if i >= len(toks) or toks[i][1] != ")":
            raise ValueError(f"expr={text!r}: {name}( is not closed")
        i += 1
        arity = FUNCS[name]
        if (arity is None and len(args) < 2) or (arity is not None and len(args) != arity):
            want = "2 or more" if arity is None else str(arity)
            raise ValueError(f"expr={text!r}: {name} takes {want} operand(s), got {len(args)}")
        for k in CONST_OPERANDS.get(name, ()):
            if args[k][0] != "c":
                raise ValueError(f"expr={text!r}: operand {k + 1} of {name} must be a constant")
        return (name, *args)

    tree = take()
    if i != len(toks):
        raise ValueError(f"expr={text!r}: unexpected text after the expression")
    return tree


def _num(v: float) -> str:
    """A constant as the text writes it: repr(float), which round-trips exactly ('inf', '-inf')."""
    return repr(float(v))


def unparse(e: tuple) -> str:
    if e[0] == "x":
        return f"x{e[1]}"
    if e[0] == "c":
        return _num(e[1])
    return f"{e[0]}({','.join(unparse(a) for a in e[1:])})"


def inputs_of(e: tuple) -> set[int]:
    if e[0] == "x":
        return {e[1]}
    if e[0] == "c":
        return set()
    return set().union(*(inputs_of(a) for a in e[1:]))


def _promote(a: str | None, b: str | None) -> str | None:
    """torch's promotion of two floating dtypes; None is a Python constant (never promotes)."""
    if a is None or a == b:
        return b
    if b is None:
        return a
    return "float32"  # float32 with anything, or float16 with bfloat16


def dtype_of(e: tuple, dtype: str) -> str | None:
    """The dtype torch gives `e` over inputs of `dtype`: a float dtype, "bool" (a comparison) or None
    (constants only). ValueError where a comparison is used as a number or a number as a condition."""
    head = e[0]
    if head == "x":
        return dtype
    if head == "c":
        return None
    kids = [dtype_of(a, dtype) for a in e[1:]]
    if head == "where":
        if kids[0] != "bool":
            raise ValueError(f"where's condition must be a comparison (gt, ge, eq, ne), not {unparse(e[1])}")
        kids = kids[1:]
    if "bool" in kids:
        raise ValueError(f"{head} takes numbers, not the comparison in {unparse(e)}")
    if head in CASTS:
        return CASTS[head]
    out = None
    for k in kids:
        out = _promote(out, k)
    return "bool" if head in COMPARISONS else out


def cast_dtypes(e: tuple) -> set[str]:
    """The dtypes the expression rounds to along the way (its casts)."""
    if e[0] in ("x", "c"):
        return set()
    own = {CASTS[e[0]]} if e[0] in CASTS else set()
    return own.union(*(cast_dtypes(a) for a in e[1:]))


def _nonneg(e: tuple, pos: set[int]) -> bool:
    """e >= 0 (or NaN) for every value of the inputs in `pos` >= 0 and the others anything."""
    head, args = e[0], e[1:]
    if head == "x":
        return e[1] in pos
    if head == "c":
        return not e[1] < 0
    if head in ("exp", "sigmoid", "abs", "relu", "sqrt", "rsqrt"):
        return True
    if head in ("add", "div", "where", "recip", "tanh", "erf", "leaky_relu", *CASTS):
        operands = args[1:] if head == "where" else args[:1] if head == "leaky_relu" else args
        return all(_nonneg(a, pos) for a in operands)
    if head == "mul":  # a factor that is not >= 0 must come in pairs (x * x)
        return all(_nonneg(a, pos) or args.count(a) % 2 == 0 for a in args)
    if head == "pow":
        c = args[1][1]
        return _nonneg(args[0], pos) or (float(c).is_integer() and c % 2 == 0)
    if head == "clamp":
        lo, hi = args[1][1], args[2][1]
        return not hi < 0 and (not lo < 0 or _nonneg(args[0], pos))
    return False


def _domain_args(e: tuple) -> list[tuple]:
    """Operands that must be >= 0 for the result to be a number: of log, sqrt, rsqrt, and pow with an
    exponent that is not an integer."""
    if e[0] in ("x", "c"):
        return []
    own = []
    if e[0] in DOMAIN or (e[0] == "pow" and not float(e[2][1]).is_integer()):
        own = [e[1]]
    return own + [d for a in e[1:] for d in _domain_args(a)]


def positive_inputs(e: tuple) -> set[int]:
    """The inputs whose test values are drawn >= 0 (|x|), so that every log/sqrt/rsqrt/fractional pow is
    in its domain; ValueError when that cannot make one of them >= 0 (log(x - 1)): forge could not
    validate such a kernel (the float64 oracle would be NaN), so it is refused."""
    pos: set[int] = set()
    for arg in _domain_args(e):
        if not _nonneg(arg, pos):
            pos |= inputs_of(arg)
    for arg in _domain_args(e):
        if not _nonneg(arg, pos):
            raise ValueError(f"the argument {unparse(arg)} of a log/sqrt/rsqrt/fractional pow is not >= 0 "
                             "for inputs >= 0: forge cannot draw test inputs in its domain")
    return pos


def count_ops(e: tuple) -> int:
    """Operations on tensors (a function of constants only, 1/3 of x / 3, is folded: not one)."""
    if e[0] in ("x", "c") or not inputs_of(e):
        return 0
    return 1 + sum(count_ops(a) for a in e[1:])


# -- shapes ---------------------------------------------------------------------------------------------
def broadcast_shapes(shapes) -> tuple[int, ...]:
    """torch's broadcast of `shapes` (aligned from the right; a size 1 stretches); ValueError if none."""
    out: list[int] = []
    for shape in shapes:
        shape = tuple(shape)
        if len(shape) > len(out):
            out = [1] * (len(shape) - len(out)) + out
        for k, n in enumerate(shape):
            d = len(out) - len(shape) + k
            if n != out[d] and n != 1 and out[d] != 1:
                raise ValueError(f"shapes {[tuple(s) for s in shapes]} do not broadcast together")
            out[d] = max(out[d], n) if n != 1 and out[d] != 1 else out[d] * n
    return tuple(out)


def _shapes_text(shapes, out) -> str | None:
    if all(tuple(s) == tuple(out) for s in shapes):
        return None
    return ";".join("c" if tuple(s) == tuple(out) else ("()" if not s else ",".join(map(str, s))) for s in shapes)


def _parse_shapes(text, n: int, out: tuple[int, ...]) -> list[tuple[int, ...]]:
    if not isinstance(text, str):
        raise ValueError(f"input_shapes={text!r}: expected a string like 'c;4096' (one entry per input)")
    parts = text.split(";")
    if len(parts) != n:
        raise ValueError(f"input_shapes={text!r} names {len(parts)} input(s); the expression reads {n}")
    shapes = []
    for part in parts:
        part = part.strip()
        if part == "c":
            shapes.append(tuple(out))
        elif part == "()":
            shapes.append(())
        else:
            try:
                shapes.append(tuple(int(s) for s in part.split(",")))
            except ValueError:
                raise ValueError(f"input_shapes={text!r}: {part!r} is neither 'c', '()' nor sizes") from None
    return shapes


def make_spec(shape: tuple[int, ...], dtype: str, device: str, attrs: dict | None = None) -> KernelSpec:
    a = {**DEFAULT_ATTRS, **(attrs or {})}
    unknown = set(a) - {"expr", "input_shapes"}
    if unknown:
        raise ValueError(f"pointwise takes attributes ['expr', 'input_shapes'], not {sorted(unknown)}")
    if dtype not in ("float16", "bfloat16", "float32"):
        raise ValueError(f"inputs of dtype {dtype} are not supported (float16, bfloat16, float32)")
    tree = parse(a["expr"])
    used = inputs_of(tree)
    if not used:
        raise ValueError(f"expr={a['expr']!r} reads no input")
    n = max(used) + 1
    if n > MAX_INPUTS:
        raise ValueError(f"expr reads {n} inputs; the kernels take at most {MAX_INPUTS}")
    if used != set(range(n)):
        raise ValueError(f"expr reads inputs {sorted(used)}; inputs are numbered x0..x{n - 1}, each used")
    out_dtype = dtype_of(tree, dtype)
    if out_dtype in (None, "bool"):
        raise ValueError(f"expr={a['expr']!r}: the result must be a floating-point tensor, not "
                         f"{'a comparison' if out_dtype else 'a constant'}")
    _check_clamps(tree)
    positive_inputs(tree)
    out = tuple(int(s) for s in shape)
    shapes = _parse_shapes(a["input_shapes"], n, out) if a.get("input_shapes") is not None else [out] * n
    if broadcast_shapes(shapes) != out:
        raise ValueError(f"input shapes {shapes} broadcast to {broadcast_shapes(shapes)}, not the problem "
                         f"shape {out}")
    attrs_out = {"expr": unparse(tree)}
    text = _shapes_text(shapes, out)
    if text is not None:
        attrs_out["input_shapes"] = text
    return KernelSpec(NAME, tuple(TensorSpec(s, dtype, device=device) for s in shapes), attrs_out)


def _check_clamps(e: tuple) -> None:
    if e[0] in ("x", "c"):
        return
    if e[0] == "clamp" and e[2][1] > e[3][1]:
        raise ValueError(f"clamp with min {e[2][1]} > max {e[3][1]}")
    if e[0] == "pow" and math.isnan(e[2][1]):
        raise ValueError("pow with a NaN exponent")
    for a in e[1:]:
        _check_clamps(a)


def output_of(spec) -> tuple[tuple[int, ...], str]:
    """(shape, dtype) of the output: the inputs' broadcast, the expression's dtype."""
    return broadcast_shapes([t.shape for t in spec.inputs]), dtype_of(parse(spec.attrs["expr"]), spec.inputs[0].dtype)


def problem_shape(spec) -> tuple[int, ...]:
    return broadcast_shapes([t.shape for t in spec.inputs])


def problem(inputs, attrs) -> tuple[int, ...]:
    """The output's shape for these tensors; records their shapes in attrs["input_shapes"] (in place, as
    rope's cos_batch) when some input is broadcast. ValueError for a dtype mix or shapes that do not
    broadcast."""
    dtypes = {str(t.dtype) for t in inputs}
    if len(dtypes) != 1:
        raise ValueError(f"inputs of one dtype only, got {sorted(dtypes)}")
    shapes = [tuple(t.shape) for t in inputs]
    out = broadcast_shapes(shapes)
    if any(n == 0 for n in out):
        raise ValueError(f"an empty output {out}")
    text = _shapes_text(shapes, out)
    attrs.pop("input_shapes", None)
    if text is not None:
        attrs["input_shapes"] = text
    return out


def make_inputs(spec: KernelSpec, seed: int, distribution: str = "normal"):
    """Each input from `distribution`; the inputs under a log/sqrt/rsqrt/fractional pow as |x|, in its
    domain (positive_inputs), and never 0 (the "tiny" values round to 0 in float16, where log(x) + x**-3
    is -inf + inf: NaN in eager too); there the dtype's smallest normal number."""
    import torch

    gen = opkit.generator(seed, spec.device)
    pos = positive_inputs(parse(spec.attrs["expr"]))
    out = []
    for i, t in enumerate(spec.inputs):
        x = opkit.random_tensor(t.shape, t.dtype, t.device, gen, distribution)
        if i in pos:
            x = x.abs().masked_fill_(x == 0, torch.finfo(x.dtype).tiny)
        out.append(x)
    return tuple(out)


# -- eager evaluation: the reference (the user's ops) and the oracle (float64) ----------------------------
def _round_to(v: float, dtype: str) -> float:
    """v rounded to `dtype` (nearest even), as a Python float."""
    import struct

    if dtype == "float32" or math.isnan(v) or math.isinf(v):
        return struct.unpack("f", struct.pack("f", v))[0] if dtype == "float32" and abs(v) < 3.5e38 else v
    if dtype == "float16":
        try:
            return struct.unpack("e", struct.pack("e", v))[0]
        except OverflowError:
            return math.copysign(math.inf, v)
    bits = struct.unpack("I", struct.pack("f", _round_to(v, "float32")))[0]  # bfloat16: the top 16 bits
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return struct.unpack("f", struct.pack("I", bits))[0]


def _const_value(e: tuple):
    """A function of constants only, evaluated in Python float64 (the kernels fold it to a literal)."""
    if e[0] == "c":
        return e[1]
    v = [_const_value(a) for a in e[1:]]
    head = e[0]
    try:
        if head == "where":
            return v[1] if v[0] else v[2]
        if head in COMPARISONS:
            return {"gt": v[0] > v[1], "ge": v[0] >= v[1], "eq": v[0] == v[1], "ne": v[0] != v[1]}[head]
        if head in CASTS:
            return _round_to(v[0], CASTS[head])
        simple = {
            "add": lambda: math.fsum(v), "mul": lambda: math.prod(v), "sub": lambda: v[0] - v[1],
            "div": lambda: v[0] / v[1], "neg": lambda: -v[0], "recip": lambda: 1.0 / v[0],
            "exp": lambda: math.exp(v[0]), "log": lambda: math.log(v[0]) if v[0] else -math.inf,
            "sqrt": lambda: math.sqrt(v[0]), "rsqrt": lambda: 1.0 / math.sqrt(v[0]) if v[0] else math.inf,
            "tanh": lambda: math.tanh(v[0]), "sigmoid": lambda: 0.5 * (1.0 + math.tanh(0.5 * v[0])),
            "erf": lambda: math.erf(v[0]), "abs": lambda: abs(v[0]), "relu": lambda: max(v[0], 0.0),
            "hardswish": lambda: v[0] * min(max(v[0] + 3.0, 0.0), 6.0) / 6.0,
            "leaky_relu": lambda: v[0] if v[0] > 0 else v[0] * v[1],
            "clamp": lambda: min(max(v[0], v[1]), v[2]), "pow": lambda: math.pow(v[0], v[1]),
        }
        return float(simple[head]())
    except ZeroDivisionError:
        num = v[0] if head == "div" else 1.0
        return math.nan if num == 0 else math.copysign(math.inf, num)
    except OverflowError:
        return math.inf
    except ValueError:  # outside the domain (log(-1), sqrt(-1)): NaN, as torch gives
        return math.nan


def _evaluate(e: tuple, xs, oracle: bool):
    """e over tensors xs, one torch op per node as user code runs it (reference), or in float64 with
    the casts to half rounding there and casts to float32 exact (oracle)."""
    import torch
    import torch.nn.functional as F

    memo: dict = {}

    def ev(n):
        if n in memo:
            return memo[n]
        head = n[0]
        if head == "x":
            return xs[n[1]]
        if head == "c" or not inputs_of(n):
            return _const_value(n)
        a = [ev(k) for k in n[1:]]
        if head in ("add", "mul"):
            # a tensor first (Python constants on the left of torch ops), left to right
            t = next(i for i, v in enumerate(a) if isinstance(v, torch.Tensor))
            r = a[t]
            for k, v in enumerate(a):
                if k != t:
                    r = r + v if head == "add" else r * v
        elif head == "sub":
            r = a[0] - a[1]
        elif head == "div":
            r = a[0] / a[1]
        elif head == "neg":
            r = -a[0]
        elif head == "recip":
            r = torch.reciprocal(a[0])
        elif head in ("exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "erf", "abs", "relu"):
            r = getattr(torch, head)(a[0])
        elif head == "hardswish":
            r = F.hardswish(a[0])
        elif head == "leaky_relu":
            r = F.leaky_relu(a[0], a[1])
        elif head == "clamp":
            r = torch.clamp(a[0], a[1], a[2])
        elif head == "pow":
            r = torch.pow(a[0], a[1])
        elif head in COMPARISONS:
            if isinstance(a[0], torch.Tensor):
                r = getattr(torch, head)(a[0], a[1])
            else:  # a constant on the left: the mirrored comparison (torch's take a tensor first)
                r = getattr(torch, {"gt": "lt", "ge": "le"}.get(head, head))(a[1], a[0])
        elif head == "where":  # a condition of constants only is a Python bool
            r = torch.where(a[0] if isinstance(a[0], torch.Tensor) else torch.tensor(a[0]), a[1], a[2])
        else:  # a cast
            dt = getattr(torch, CASTS[head])
            if not oracle:
                r = a[0].to(dt)
            elif dt == torch.float32:
                r = a[0]  # exact: what the user's float32 value holds, the float64 one holds too
            else:
                r = a[0].to(dt).to(torch.float64)
        memo[n] = r
        return r

    out = ev(e)
    # A root that does not read every input's shape (where(gt(1.0, 0.0), x0, x1) reads x0 alone) still
    # has the broadcast shape: what the kernels write.
    shape = broadcast_shapes([tuple(x.shape) for x in xs])
    return out if tuple(out.shape) == shape else out.expand(shape).contiguous()


def reference(inputs, attrs):
    """The eager baseline: one torch op per node of the expression, in the inputs' dtype (one kernel
    each, every intermediate written and re-read)."""
    return _evaluate(parse(attrs["expr"]), inputs, oracle=False)


def oracle(inputs, attrs):
    """The exact result (float64, the expression's casts rounding where they are) rounded once to the
    output dtype: the best any kernel can return (a tiny fp16 result is off by a large relative amount
    in every kernel unrounded). Evaluated in chunks of the output's leading dim so that its float64
    working set stays bounded (opkit.oracle_budget): broadcast inputs are expanded per chunk."""
    import torch

    tree = parse(attrs["expr"])
    out_dtype = getattr(torch, dtype_of(tree, str(inputs[0].dtype).removeprefix("torch.")))
    shape = broadcast_shapes([tuple(t.shape) for t in inputs])

    def run(parts):
        return _evaluate(tree, tuple(p.double() for p in parts), oracle=True).to(out_dtype)

    numel = math.prod(shape)
    budget = opkit.oracle_budget(opkit.tensors_nbytes(inputs))
    per_row = numel // shape[0] if shape and shape[0] else numel
    rows = max(1, budget // (opkit.ORACLE_LIVE_COPIES * 8 * max(1, per_row) * max(1, len(inputs))))
    if not shape or rows >= shape[0]:
        return run(inputs).expand(shape).contiguous()
    result = torch.empty(shape, dtype=out_dtype, device=inputs[0].device)
    full = [t.expand(shape) for t in inputs]
    for r0 in range(0, shape[0], rows):
        result[r0:r0 + rows] = run([t[r0:r0 + rows] for t in full])
    return result


def _loosest(dtypes) -> str:
    order = ["float32", "float16", "bfloat16"]  # ROW_TOLERANCE's bounds grow along this list
    return max(dtypes, key=order.index)


def tolerance_for(spec) -> opkit.Tolerance:
    """The row ops' bounds (opkit.ROW_TOLERANCE) of the coarsest dtype the expression rounds to: its
    output, or a cast down inside it. Why they hold: every fp32 op of the kernel is within a few ulp
    (2^-24 relative; exp/log/tanh/erf's approximations a few ulp, elementary ops 0.5), so a chain of k
    well-conditioned ops is within ~k x 4 ulp of float64, 1e-6 relative for k ~ 10: two orders under the
    fp32 rtol (1e-4) and far under a half output's rounding (2^-11, 2^-8). A rounding inside the chain
    (to_float16) may land one half ulp apart from the float64 oracle's (its fp32 input differs by those
    few ulp; the interpreter also truncates fp32 -> bf16), which the half bounds cover. Ill-conditioned
    chains (cancellation, x - x * (1 + 1e-7)) exceed them and fail validation: eager runs, correct."""
    _, out = output_of(spec)
    return opkit.ROW_TOLERANCE[_loosest({out, *cast_dtypes(parse(spec.attrs["expr"]))})]


def alloc_output(inputs, spec: KernelSpec):
    import torch

    shape, dtype = output_of(spec)
    return torch.empty(shape, dtype=getattr(torch, dtype), device=inputs[0].device)


def run(module, inputs, out, attrs) -> None:
    # Every input as it is (its strides are baked into the kernel's index math); the output contiguous.
    module.launch(*inputs, out)


# -- search space (the elementwise one, over the output's elements) ---------------------------------------
def _as_elementwise(spec: KernelSpec) -> KernelSpec:
    """A one-input spec of the output's shape, for opkit's elementwise rules (which size the blocks by
    spec.inputs[0]; here an input may be a broadcast bias). Sized by the widest dtype moved (output or
    input): per-thread 16-byte accesses of the widest."""
    shape, out = output_of(spec)
    widest = max((out, spec.inputs[0].dtype), key=lambda d: TensorSpec((), d).itemsize)
    return dataclasses.replace(spec, inputs=(TensorSpec(shape, widest, device=spec.device),))


def space(spec: KernelSpec) -> opkit.Space:
    return opkit.elementwise_space(_as_elementwise(spec))


def default(spec: KernelSpec) -> opkit.Candidate:
    return opkit.elementwise_default(_as_elementwise(spec))


def test_candidates(spec: KernelSpec) -> list[opkit.Candidate]:
    return opkit.elementwise_test_candidates(_as_elementwise(spec))


def bytes_moved(spec: KernelSpec) -> int:
    shape, out = output_of(spec)
    return sum(t.nbytes for t in spec.inputs) + math.prod(shape) * TensorSpec((), out).itemsize


# Arithmetic per element of each function (libdevice-like costs: exp/log ~4, erf ~10, tanh via exp ~8).
FLOPS = {"exp": 4, "log": 4, "sqrt": 2, "rsqrt": 2, "tanh": 8, "sigmoid": 6, "erf": 10, "hardswish": 4,
         "pow": 6, "where": 1, "clamp": 2, "leaky_relu": 2, "div": 2, "recip": 2}


def flops(spec: KernelSpec) -> int:
    def cost(e: tuple) -> int:
        if e[0] in ("x", "c") or not inputs_of(e):
            return 0
        own = (len(e) - 2) if e[0] in ("add", "mul") else 0 if e[0] in CASTS else FLOPS.get(e[0], 1)
        return own + sum(cost(a) for a in e[1:])

    return max(1, cost(parse(spec.attrs["expr"]))) * math.prod(problem_shape(spec))


# -- code generation -------------------------------------------------------------------------------------
def _lit(v: float) -> str:
    """A constant in kernel source: exact (repr), fp32 where it meets a tensor, as torch's scalars do."""
    if math.isinf(v):
        return 'float("inf")' if v > 0 else '-float("inf")'
    if math.isnan(v):
        return 'float("nan")'
    return f"({_num(v)})" if v < 0 else _num(v)


def _index_lines(spec: KernelSpec) -> tuple[list[str], list[str]]:
    """(lines computing each non-flat input's offsets from `offs`, per input the offset expression).
    An input of the output's shape, contiguous, is read at `offs`; any other (broadcast, strided) at
    sum(index_d x stride_d) over the output's dims, its strides aligned from the right, 0 where it
    broadcasts (size 1 or absent)."""
    from forge.spec import contiguous_strides, same_layout

    shape = problem_shape(spec)
    inner = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    lines: list[str] = []
    dims_done: set[int] = set()
    offsets = []
    for i, t in enumerate(spec.inputs):
        if tuple(t.shape) == shape and same_layout(shape, t.strides, contiguous_strides(shape)):
            offsets.append("offs")
            continue
        lead = len(shape) - len(t.shape)
        terms = []
        for d in range(len(shape)):
            k = d - lead
            if k < 0 or t.shape[k] == 1 or shape[d] == 1:
                continue
            if d not in dims_done:
                dims_done.add(d)
                idx = "offs" if inner[d] == 1 else f"(offs // {inner[d]})"
                lines.append(f"i{d} = {idx}" + (f" % {shape[d]}" if d > 0 else "") + f"  # index in dim {d}")
            terms.append(f"i{d}" if t.strides[k] == 1 else f"i{d} * {t.strides[k]}")
        if not terms:  # one element read by every lane
            lines.append(f"o{i} = offs * 0  # input {i}: one element, broadcast")
        else:
            lines.append(f"o{i} = {' + '.join(terms)}  # input {i}: shape {tuple(t.shape)}, strides {t.strides}")
        offsets.append(f"o{i}")
    return lines, offsets


# Functions the kernel calls, defined in its source only where the expression uses them.
HELPER_SOURCES = {
    "sigmoid": '''@triton.jit
def _sigmoid(x):
    # 1 / (1 + e) or e / (1 + e) with e = exp(-|x|) <= 1: never overflows (silu_mul's form).
    e = tl.exp(-tl.abs(x))
    return tl.where(x >= 0.0, 1.0, e) / (1.0 + e)''',
    "tanh": '''@triton.jit
def _tanh(x):
    # Through exp, on every Triton (libdevice's tanh is not reachable alike on 3.6 and the newest, nor in
    # the interpreter): sign(x) (1 - e) / (1 + e) with e = exp(-2|x|) <= 1 never overflows. Below
    # |x| = 0.1, 1 - e cancels (relative error ~eps / |x|): there the odd Taylor series to x^9,
    # whose next term is < 1e-10 relative.
    a = tl.abs(x)
    e = tl.exp(-2.0 * a)
    big = (1.0 - e) / (1.0 + e)
    x2 = x * x
    small = a * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0)))))
    t = tl.where(a < 0.1, small, big)
    return tl.where(x < 0.0, -t, t)''',
    "hardswish": '''@triton.jit
def _hardswish(x):
    # torch's: x * min(max(x + 3, 0), 6) / 6
    return x * tl.minimum(tl.maximum(x + 3.0, 0.0), 6.0) / 6.0''',
}


class _Emitter:
    """The expression as straight-line Triton code: one temporary per distinct subtree (x * x * x reads
    x once; a subtree used twice is computed once), constants folded to literals."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.names: dict[tuple, str] = {}
        self.helpers: set[str] = set()

    def value(self, e: tuple) -> str:
        if e[0] == "x":
            return f"x{e[1]}"
        if e[0] == "c" or not inputs_of(e):
            return _lit(_const_value(e))
        if e in self.names:
            return self.names[e]
        code = self.code(e)
        name = f"t{len(self.names)}"
        self.names[e] = name
        self.lines.append(f"{name} = {code}  # {e[0]}")
        return name

    def code(self, e: tuple) -> str:
        head = e[0]
        a = [self.value(k) for k in e[1:]]
        if head == "add":
            return " + ".join(a)
        if head == "mul":
            return " * ".join(a)
        if head == "sub":
            return f"{a[0]} - {a[1]}"
        if head == "div":
            return f"{a[0]} / {a[1]}"
        if head == "neg":
            return f"-{a[0]}"
        if head == "recip":
            return f"1.0 / {a[0]}"
        if head in ("exp", "log", "rsqrt", "abs", "erf"):
            return f"tl.{head}({a[0]})"
        if head == "sqrt":
            return f"tl.sqrt_rn({a[0]})"  # correctly rounded, as torch's (tl.sqrt may be approximate)
        if head in ("tanh", "sigmoid", "hardswish"):
            self.helpers.add(head)
            return f"_{head}({a[0]})"
        if head == "relu":  # NaN stays NaN (torch.relu); tl.maximum may drop it
            return f"tl.where({a[0]} < 0.0, 0.0, {a[0]})"
        if head == "leaky_relu":
            return f"tl.where({a[0]} > 0.0, {a[0]}, {a[0]} * {a[1]})"
        if head == "clamp":
            lo, hi = e[2][1], e[3][1]
            out = a[0]
            if lo != -math.inf:
                out = f"tl.where({out} < {a[1]}, {a[1]}, {out})"
            if hi != math.inf:
                out = f"tl.where({out} > {a[2]}, {a[2]}, {out})"
            return out
        if head == "pow":
            return self.pow(a[0], e[2][1])
        if head in COMPARISONS:
            return f"{a[0]} {COMPARISONS[head]} {a[1]}"
        if head == "where":
            return f"tl.where({a[0]}, {a[1]}, {a[2]})"
        dt = CASTS[head]
        if dt == "float32":
            return a[0]  # every value in the kernel already is fp32: exact
        return f"{a[0]}.to(tl.{dt}).to(tl.float32)  # rounds to {dt} here, as the user's cast does"

    def pow(self, x: str, c: float) -> str:
        if c == 0:
            return f"tl.zeros_like({x}) + 1.0"  # x ** 0 is 1, NaN included (torch)
        if c == 0.5:
            return f"tl.sqrt_rn({x})"
        if c == -0.5:
            return f"tl.rsqrt({x})"
        if c.is_integer() and abs(c) <= MAX_INT_POW:
            # binary powering: |c| <= 32 takes at most 9 multiplications, each rounding once
            n, base, acc = int(abs(c)), x, None
            while n:
                if n & 1:
                    acc = base if acc is None else self.temp(f"{acc} * {base}")
                n >>= 1
                if n:
                    base = self.temp(f"{base} * {base}")
            return f"1.0 / {acc}" if c < 0 else acc
        if c.is_integer():  # |x|^c through exp2/log2, the sign of x for odd c
            r = self.temp(f"tl.exp2({_lit(c)} * tl.log2(tl.abs({x})))")
            return f"tl.where({x} < 0.0, -{r}, {r})" if c % 2 else r
        # x < 0: log2 is NaN, so is the result (torch: a negative base to a fractional power);
        # x = 0: log2 is -inf and exp2 gives 0 (c > 0) or inf (c < 0), as torch.
        return f"tl.exp2({_lit(c)} * tl.log2({x}))"

    def temp(self, code: str) -> str:
        name = f"t{len(self.names)}"
        self.names[("temp", name)] = name
        self.lines.append(f"{name} = {code}")
        return name


def render_context(spec: KernelSpec, cand: opkit.Candidate) -> dict:
    ctx = opkit.elementwise_render_context(_as_elementwise(spec), cand, NAME)
    tree = parse(spec.attrs["expr"])
    index, offsets = _index_lines(spec)
    em = _Emitter()
    loads = [f"x{i} = tl.load(X{i} + {off}, mask=mask, other=1.0).to(tl.float32)" for i, off in enumerate(offsets)]
    y = em.value(tree)
    ctx.update(EXPR=spec.attrs["expr"], N_INPUTS=len(spec.inputs), BODY=[*index, *loads, *em.lines, f"y = {y}"],
               HELPERS=[HELPER_SOURCES[h] for h in sorted(em.helpers)], OUT_DTYPE=output_of(spec)[1])
    return ctx


# -- recognising elementwise chains in user code (forge/trace.py canonical forms) ------------------------
_UNARY = {"neg", "recip", "exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "erf", "abs", "relu", "hardswish"}


def _number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _from_trace(e, leaves: dict) -> tuple | None:
    """The trace tree `e` as an expression, its inputs renumbered in order of first appearance (leaves:
    trace index -> ours), or None if some node is not elementwise."""
    if not isinstance(e, tuple) or not e or not isinstance(e[0], str):
        return None
    head, args = e[0], e[1:]
    if head == "input":
        return ("x", leaves.setdefault(e[1], len(leaves)))
    if head == "const":
        return ("c", float(e[1])) if _number(e[1]) else None
    if head == "cast":
        dt = args[1][1] if args[1][0] == "const" else None
        if f"to_{dt}" not in CASTS:
            return None
        inner = _from_trace(args[0], leaves)
        return None if inner is None else (f"to_{dt}", inner)
    if (head in _UNARY and len(args) == 1 or head in ("add", "mul") and len(args) >= 2
            or head == "sub" and len(args) == 2):
        kids = [_from_trace(a, leaves) for a in args]
        return None if any(k is None for k in kids) else (head, *kids)
    if head in ("leaky_relu", "pow") and len(args) == 2 and args[1][0] == "const" and _number(args[1][1]):
        x = _from_trace(args[0], leaves)
        return None if x is None else (head, x, ("c", float(args[1][1])))
    if head == "clamp" and len(args) == 3:
        bounds = [a[1] if a[0] == "const" else "?" for a in args[1:]]
        if not all(b is None or _number(b) for b in bounds) or bounds == [None, None]:
            return None
        x = _from_trace(args[0], leaves)
        lo = -math.inf if bounds[0] is None else float(bounds[0])
        hi = math.inf if bounds[1] is None else float(bounds[1])
        return None if x is None else ("clamp", x, ("c", lo), ("c", hi))
    if head in COMPARISONS and len(args) == 2 or head == "where" and len(args) == 3:
        kids = [_from_trace(a, leaves) for a in args]
        return None if any(k is None for k in kids) else (head, *kids)
    return None


def match(expr) -> tuple[list, dict] | None:
    """([trace input per x0, x1, ...], {"expr": text}) for a tree of elementwise ops over inputs and
    constants (FUNCS; the casts to float16/bfloat16/float32) with at least two operations on tensors
    (one op is one eager kernel already: nothing to fuse), the result a floating-point tensor. Specific
    families are tried first (GENERIC), so F.gelu, the gelu formulas, silu(a) * b never come here."""
    leaves: dict = {}
    tree = _from_trace(expr, leaves)
    if tree is None or count_ops(tree) < 2:
        return None
    try:
        if dtype_of(tree, "float32") in (None, "bool"):
            return None
    except ValueError:
        return None
    order = sorted(leaves, key=leaves.get)
    return order, {"expr": unparse(tree)}
