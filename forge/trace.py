"""Trace a user function with torch.fx and reduce it to a canonical expression tree that op-family
matchers (`match()` in kernels/<op>.py) can recognise whatever the spelling.

The trace is made once per call signature with the actual arguments: non-tensor arguments are
bound as constants (so `eps` is a number in the graph), and the graph is run once through
`torch.fx.Interpreter` so every node's real value is known. Values that are not tensors (shapes,
sizes, `x.shape[-1]`) fold into constants; `dim` arguments are normalised with the real ndim.

Canonical forms (every node is a tuple):
  ("input", i)            the i-th tensor argument
  ("const", value)
  ("mul", a, b, ...)      n-ary, operands sorted (so x*r*w == w*(r*x)); x/y becomes mul(x, recip(y))
  ("add", a, b, ...)      n-ary, sorted
  ("recip", a) ("sqrt", a) ("rsqrt", a) ("exp", a) ...   unary ops; recip(sqrt(a)) == rsqrt(a)
  ("mean_last", a)        mean over the last dim with keepdim=True
  ("softmax_last", a) ("log_softmax_last", a)
  ("rms_norm", x, w | ("none",), eps)
  ("opaque", description) anything else; a matcher never matches through it
"""

from __future__ import annotations

import inspect
import operator
from typing import Any

UNARY = {"rsqrt", "sqrt", "exp", "neg", "reciprocal", "tanh", "sigmoid", "erf", "abs", "log"}


class Untraceable(Exception):
    """torch.fx could not trace the function (data-dependent control flow, unsupported calls)."""


def _name(node) -> str:
    t = node.target
    if node.op == "call_method":
        return str(t)
    if t in (operator.mul,):
        return "mul"
    if t in (operator.add,):
        return "add"
    if t in (operator.truediv,):
        return "div"
    if t in (operator.sub,):
        return "sub"
    if t in (operator.pow,):
        return "pow"
    if t in (operator.neg,):
        return "neg"
    return getattr(t, "__name__", str(t))


def _sorted(args: list) -> tuple:
    return tuple(sorted(args, key=repr))


def _flat(kind: str, args: list) -> tuple:
    out = []
    for a in args:
        out.extend(a[1:] if a[0] == kind else [a])
    return (kind, *_sorted(out))


def _recip(a: tuple) -> tuple:
    if a[0] == "sqrt":
        return ("rsqrt", a[1])
    if a[0] == "rsqrt":
        return ("sqrt", a[1])
    if a[0] == "recip":
        return a[1]
    return ("recip", a)


def _last_dim(dim: Any, ndim: int) -> bool:
    if isinstance(dim, list | tuple):
        if len(dim) != 1:
            return False
        dim = dim[0]
    return isinstance(dim, int) and dim in (-1, ndim - 1)


def canonical(fn, args: tuple, kwargs: dict) -> tuple[tuple, list]:
    """Return (expression tree of fn's output, list of tensor arguments in input-index order)."""
    import torch
    import torch.fx as fx

    sig = inspect.signature(fn)
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as exc:
        raise Untraceable(f"arguments do not fit the signature: {exc}") from None
    bound.apply_defaults()
    tensors, concrete = [], {}
    for name, value in bound.arguments.items():
        if isinstance(value, torch.Tensor):
            tensors.append((name, value))
        else:
            concrete[name] = value
    try:
        gm = fx.symbolic_trace(fn, concrete_args=concrete)
    except Exception as exc:  # noqa: BLE001 - fx raises many types for untraceable code
        raise Untraceable(f"torch.fx could not trace it: {type(exc).__name__}: {exc}") from None

    values: dict = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n):
            values[n] = super().run_node(n)
            return values[n]

    # Placeholders come in parameter order; concrete (non-tensor) ones are re-passed their value.
    params = list(sig.parameters)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(params):
        raise Untraceable("functions with *args/**kwargs are not traced")
    try:
        with torch.no_grad():
            Recorder(gm).run(*(bound.arguments[p] for p in params))
    except Exception as exc:  # noqa: BLE001 - the user's code failed on its own arguments
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise Untraceable(f"running the traced graph failed: {type(exc).__name__}: {first_line}") from None

    tensor_index = {name: i for i, (name, _) in enumerate(tensors)}
    index = {ph: tensor_index[p] for ph, p in zip(placeholders, params, strict=True) if p in tensor_index}
    memo: dict = {}

    def conv(a):
        if isinstance(a, fx.Node):
            return node(a)
        if isinstance(a, list | tuple):
            return tuple(conv(x) for x in a)
        return ("const", a)

    def node(n) -> tuple:
        if n in memo:
            return memo[n]
        v = values.get(n)
        if n.op == "placeholder":
            res = ("input", index[n]) if n in index else ("const", v)
        elif not isinstance(v, torch.Tensor):
            res = ("const", v)
        elif n.op in ("call_function", "call_method"):
            res = _call(n, v)
        else:
            res = ("opaque", f"{n.op} {n.target}")
        memo[n] = res
        return res

    def _call(n, v) -> tuple:
        name = _name(n)
        args = [conv(a) for a in n.args]
        kw = {k: conv(x) for k, x in n.kwargs.items()}
        first = n.args[0] if n.args else None
        first_value = values.get(first) if isinstance(first, fx.Node) else None
        ndim = first_value.ndim if isinstance(first_value, torch.Tensor) else None
        if name in ("mul",) and not kw:
            return _flat("mul", args)
        if name in ("add",) and not kw and len(args) == 2:
            return _flat("add", args)
        if name in ("div", "true_divide") and not kw and len(args) == 2:
            return _flat("mul", [args[0], _recip(args[1])])
        if name == "sub" and not kw and len(args) == 2:
            return ("sub", *args)
        if name == "pow" and len(args) == 2 and args[1][0] == "const":
            e = args[1][1]
            if e == 2:
                return _flat("mul", [args[0], args[0]])
            if e == 0.5:
                return ("sqrt", args[0])
            if e == -0.5:
                return ("rsqrt", args[0])
        if name in UNARY and len(args) == 1 and not kw:
            return _recip(args[0]) if name == "reciprocal" else (name, args[0])
        if name == "mean" and ndim is not None:
            dim = n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else None)
            keepdim = n.kwargs.get("keepdim", n.args[2] if len(n.args) > 2 else False)
            if keepdim and _last_dim(dim, ndim) and n.kwargs.get("dtype") is None:
                return ("mean_last", args[0])
        if name in ("softmax", "log_softmax") and ndim is not None:
            dim = n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else None)
            if _last_dim(dim, ndim) and n.kwargs.get("dtype") is None and n.kwargs.get("_stacklevel", 3) == 3:
                return (f"{name}_last", args[0])
        if name == "rms_norm" and ndim is not None:
            x = values[first]
            shape = n.kwargs.get("normalized_shape", n.args[1] if len(n.args) > 1 else None)
            shape = tuple(values.get(s, s) if isinstance(s, fx.Node) else s for s in
                          (values.get(shape, shape) if isinstance(shape, fx.Node) else shape))
            weight = n.kwargs.get("weight", n.args[2] if len(n.args) > 2 else None)
            eps = n.kwargs.get("eps", n.args[3] if len(n.args) > 3 else None)
            if tuple(int(s) for s in shape) == tuple(x.shape[-1:]):
                eps = torch.finfo(x.dtype).eps if eps is None else float(eps)
                return ("rms_norm", args[0], conv(weight) if weight is not None else ("none",), eps)
        heads = [a[0] if a and isinstance(a[0], str) else "tuple" for a in args]
        return ("opaque", f"{name}({', '.join(heads)})")

    out = [n for n in gm.graph.nodes if n.op == "output"][0]
    result = out.args[0]
    if not isinstance(result, fx.Node):
        return ("opaque", "output is not a single tensor"), [t for _, t in tensors]
    return node(result), [t for _, t in tensors]
