"""Trace a user function (or an nn.Module) with torch.fx and reduce it to a canonical expression tree
that op-family matchers (`match()` in kernels/<op>.py) can recognise whatever the spelling.

The trace is made once per call signature with the actual arguments: non-tensor arguments are
bound as constants (so `eps` is a number in the graph), and the graph is run once through
`torch.fx.Interpreter` so every node's real value is known. Values that are not tensors (shapes,
sizes, `x.shape[-1]`) fold into constants; `dim` arguments are normalised to negative indices with
the real ndim (so dim=1 of a 2-D tensor and dim=-1 are the same tree).

Tensor inputs are numbered: the function's tensor arguments first (parameter order), then, in order
of first use, the module parameters and buffers it reads (`Traced.params` says how to fetch them).

Canonical forms (every node is a tuple):
  ("input", i)            the i-th tensor input
  ("const", value)        None, numbers, strings, shapes, index tuples (slices with concrete bounds)
  ("mul", a, b, ...)      n-ary, operands sorted (so x*r*w == w*(r*x)); x/y becomes mul(x, recip(y))
  ("add", a, b, ...)      n-ary, sorted
  ("sub", a, b)
  ("recip", a) ("sqrt", a) ("rsqrt", a) ("exp", a) ("neg", a) ("erf", a) ("tanh", a) ("sigmoid", a)
                          unary ops; recip(sqrt(a)) == rsqrt(a); x**2 == mul(x, x)
  ("mean_last", a)        mean over the last dim with keepdim=True
  ("softmax_last", a) ("log_softmax_last", a)
  ("rms_norm", x, w | ("none",), eps)
  Calls listed in SIGNATURES, as (name, arg, arg, ...) with every parameter in declaration order
  and defaults filled in, whatever was passed positionally or by keyword (aliases fold: mm, bmm and
  @ are "matmul"; concat is "cat"; F.scaled_dot_product_attention is "sdpa"):
  ("layer_norm", x, normalized_shape, weight, bias, eps)   also nn.LayerNorm
  ("gelu", x, approximate)            also nn.GELU
  ("silu", x, inplace)                also nn.SiLU
  ("sdpa", q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
  ("matmul", a, b)
  ("cross_entropy", input, target, weight, size_average, ignore_index, reduce, reduction,
                    label_smoothing)   also nn.CrossEntropyLoss
  ("sum", x, dim, keepdim, dtype) ("mean", ...) ("amax", x, dim, keepdim) ("argmax", x, dim, keepdim)
                                      a one-element dim list becomes an int for sum/mean/amax
  ("cat", (t, t, ...), dim) ("getitem", x, index) ("chunk", x, chunks, dim) ("split", x, size, dim)
  ("opaque", description) anything else; a matcher never matches through it
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

UNARY = {"rsqrt", "sqrt", "exp", "neg", "reciprocal", "tanh", "sigmoid", "erf", "special_erf", "abs", "log"}

_REQ = object()  # a parameter without a default
# Functions (and methods, whose `self` is the first parameter) reduced to (name, *params in order).
# name -> (canonical name, ((param, default), ...)); defaults as in torch 2.4-2.13.
SIGNATURES: dict[str, tuple[str, tuple[tuple[str, Any], ...]]] = {
    "layer_norm": ("layer_norm", (("input", _REQ), ("normalized_shape", _REQ), ("weight", None), ("bias", None),
                                  ("eps", 1e-5))),
    "gelu": ("gelu", (("input", _REQ), ("approximate", "none"))),
    "silu": ("silu", (("input", _REQ), ("inplace", False))),
    "scaled_dot_product_attention": ("sdpa", (("query", _REQ), ("key", _REQ), ("value", _REQ),
                                              ("attn_mask", None), ("dropout_p", 0.0), ("is_causal", False),
                                              ("scale", None), ("enable_gqa", False))),
    "matmul": ("matmul", (("input", _REQ), ("other", _REQ))),
    "mm": ("matmul", (("input", _REQ), ("mat2", _REQ))),
    "bmm": ("matmul", (("input", _REQ), ("mat2", _REQ))),
    "cross_entropy": ("cross_entropy", (("input", _REQ), ("target", _REQ), ("weight", None),
                                        ("size_average", None), ("ignore_index", -100), ("reduce", None),
                                        ("reduction", "mean"), ("label_smoothing", 0.0))),
    "sum": ("sum", (("input", _REQ), ("dim", None), ("keepdim", False), ("dtype", None))),
    "mean": ("mean", (("input", _REQ), ("dim", None), ("keepdim", False), ("dtype", None))),
    "amax": ("amax", (("input", _REQ), ("dim", ()), ("keepdim", False))),
    "argmax": ("argmax", (("input", _REQ), ("dim", None), ("keepdim", False))),
    "cat": ("cat", (("tensors", _REQ), ("dim", 0))),
    "concat": ("cat", (("tensors", _REQ), ("dim", 0))),
    "concatenate": ("cat", (("tensors", _REQ), ("dim", 0))),
    "getitem": ("getitem", (("input", _REQ), ("index", _REQ))),
    "chunk": ("chunk", (("input", _REQ), ("chunks", _REQ), ("dim", 0))),
    "split": ("split", (("input", _REQ), ("split_size", _REQ), ("dim", 0))),
}
# A one-element dim list means the same as the int for these (not for argmax, which takes an int).
_DIM_LIST_FOLDS = {"sum", "mean", "amax"}


class Untraceable(Exception):
    """torch.fx could not trace the function (data-dependent control flow, unsupported calls)."""


@dataclass(frozen=True)
class Traced:
    """A canonical expression and the tensors its ("input", i) leaves refer to.

    `tensors`: the call's tensor arguments, then module parameters/buffers in order of first use.
    `params`: for each of those parameters, a function of the traced root (the module, or None for a
    plain function) that returns the *current* tensor, so a later call sees reassigned weights."""

    expr: tuple
    tensors: list
    params: list[Callable[[Any], Any]] = field(default_factory=list)
    # What each input is: an fx Node (argument, cut) or a parameter's qualified name (TraceGraph.expr).
    leaves: list = field(default_factory=list)


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


def _neg_dim(dim: Any, ndim: int | None) -> Any:
    """dim (int or sequence of ints) as negative indices; unchanged when ndim is unknown or dim is None."""
    if ndim is None or dim is None:
        return dim
    if isinstance(dim, int) and not isinstance(dim, bool):
        return dim - ndim if dim >= 0 else dim
    if isinstance(dim, list | tuple) and all(isinstance(d, int) for d in dim):
        return tuple(d - ndim if d >= 0 else d for d in dim)
    return dim


def _trace_target(fn):
    """(root module or None, callable to trace, signature to bind the call's arguments with)."""
    import torch

    if isinstance(fn, torch.nn.Module):
        return fn, fn, inspect.signature(type(fn).forward).replace(
            parameters=list(inspect.signature(type(fn).forward).parameters.values())[1:])
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, torch.nn.Module) and getattr(fn, "__func__", None) is type(owner).forward:
        # `model.forward = forge.optimize(model.forward)`: trace the class's forward on the module
        # (the instance attribute is now the wrapper itself).
        return owner, owner, inspect.signature(fn)
    return None, fn, inspect.signature(fn)


class TraceGraph:
    """A traced function/module and the real value of every node, from one run on the call's arguments."""

    def __init__(self, fn, args: tuple, kwargs: dict):
        import torch
        import torch.fx as fx


        root, target, sig = _trace_target(fn)
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
            tracer = fx.Tracer()
            graph = tracer.trace(target, concrete_args=concrete)
            # tracer.root: the module, or the one fx made to hold tensors a plain function closes over
            gm = fx.GraphModule(tracer.root, graph)
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

        self.fx, self.torch = fx, torch
        self.root, self.gm, self.values, self.sig = root, gm, values, sig
        self.placeholders, self.params, self.tensors = placeholders, params, tensors

    def output_node(self):
        out = [n for n in self.gm.graph.nodes if n.op == "output"][0]
        return out.args[0]

    def expr(self, at, cut=frozenset(), number_args: bool = True) -> Traced:
        """The canonical tree of node `at`. Nodes in `cut` are leaves (numbered inputs), as are the
        function's tensor arguments and module parameters. number_args: the function's tensor
        arguments are inputs 0..k-1 in parameter order (the shim's numbering); else leaves are
        numbered in order of first use (matching a region of a larger graph)."""
        torch, fx = self.torch, self.fx
        values, gm, root = self.values, self.gm, self.root
        placeholders, params, tensors = self.placeholders, self.params, self.tensors
        leaf_nodes: list = []

        getters: list = []
        param_index: dict[Any, int] = {}
        memo: dict = {}
        if number_args:
            tensor_index = {name: i for i, (name, _) in enumerate(tensors)}
            index = {ph: tensor_index[p] for ph, p in zip(placeholders, params, strict=True) if p in tensor_index}
            inputs = [t for _, t in tensors]
            leaf_nodes.extend(sorted(index, key=index.get))
        else:
            index, inputs = {}, []

        def param_input(qualname: str, value) -> tuple:
            """A module parameter/buffer as one more numbered input, fetched by name on every call."""
            if qualname not in param_index:
                if root is None:  # a constant fx captured from a plain function's closure: fixed object
                    getters.append(lambda _root, v=value: v)
                else:
                    getters.append(operator.attrgetter(qualname))
                param_index[qualname] = len(inputs)
                inputs.append(value)
                leaf_nodes.append(qualname)
            return ("input", param_index[qualname])

        def leaf(n, value) -> tuple:
            """A node taken as an input of the region being matched (a cut, or an argument)."""
            if n not in param_index:
                getters.append(lambda _root, v=value: v)
                param_index[n] = len(inputs)
                inputs.append(value)
                leaf_nodes.append(n)
            return ("input", param_index[n])

        def concrete_value(a):
            """Python value of an argument, with fx nodes inside (slice bounds, shapes) resolved."""
            if isinstance(a, fx.Node):
                return values.get(a)
            if isinstance(a, slice):
                return slice(concrete_value(a.start), concrete_value(a.stop), concrete_value(a.step))
            if isinstance(a, list | tuple):
                return type(a)(concrete_value(x) for x in a)
            return a

        def holds_tensor(a) -> bool:
            if isinstance(a, fx.Node):
                v = values.get(a)
                return isinstance(v, torch.Tensor) or (isinstance(v, list | tuple)
                                                       and any(isinstance(x, torch.Tensor) for x in v))
            return isinstance(a, list | tuple) and any(holds_tensor(x) for x in a)

        def conv(a):
            if isinstance(a, fx.Node):
                return node(a)
            if isinstance(a, list | tuple):
                return tuple(conv(x) for x in a)
            return ("const", concrete_value(a))

        def node(n) -> tuple:
            if n in memo:
                return memo[n]
            v = values.get(n)
            holds_tensors = isinstance(v, list | tuple) and any(isinstance(x, torch.Tensor) for x in v)
            if n in cut and isinstance(v, torch.Tensor):
                res = leaf(n, v)
            elif n.op == "placeholder" and n in index:
                res = ("input", index[n])
            elif n.op == "placeholder":
                res = leaf(n, v) if isinstance(v, torch.Tensor) else ("const", v)
            elif n.op == "get_attr" and isinstance(v, torch.Tensor):
                res = param_input(str(n.target), v)
            elif not isinstance(v, torch.Tensor) and not holds_tensors:
                res = ("const", v)
            elif n.op in ("call_function", "call_method"):
                res = _call(n)
            elif n.op == "call_module":
                res = _module(n)
            else:
                res = ("opaque", f"{n.op} {n.target}")
            memo[n] = res
            return res

        def ndim_of(a) -> int | None:
            v = values.get(a) if isinstance(a, fx.Node) else None
            if isinstance(v, torch.Tensor):
                return v.ndim
            if isinstance(a, list | tuple) and a:
                return ndim_of(a[0])
            return None

        def _generic(name: str, n) -> tuple | None:
            canon, decl = SIGNATURES[name]
            names = [p for p, _ in decl]
            if len(n.args) > len(names) or set(n.kwargs) - set(names):
                return None
            got = dict(zip(names, n.args, strict=False))
            if set(got) & set(n.kwargs):
                return None
            got.update(n.kwargs)
            out = []
            ndim = ndim_of(n.args[0]) if n.args else None
            for p, default in decl:
                if p in got:
                    a = got[p]
                elif default is _REQ:
                    return None
                else:
                    a = default
                if p == "dim":
                    d = _neg_dim(concrete_value(a), ndim)
                    if canon in _DIM_LIST_FOLDS and isinstance(d, tuple) and len(d) == 1:
                        d = d[0]
                    out.append(("const", d))
                elif holds_tensor(a):
                    out.append(conv(a))
                else:  # shapes, flags, index tuples: one spelling whether passed as a tuple or via nodes
                    out.append(("const", concrete_value(a)))
            return (canon, *out)

        def _call(n) -> tuple:
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
                if isinstance(e, int | float) and not isinstance(e, bool) and e in (2, 3, 4):
                    return _flat("mul", [args[0]] * int(e))  # x**3 of the tanh-gelu formula
                if e == 0.5:
                    return ("sqrt", args[0])
                if e == -0.5:
                    return ("rsqrt", args[0])
            if name in UNARY and len(args) == 1 and not kw:
                if name == "reciprocal":
                    return _recip(args[0])
                return ("erf" if name == "special_erf" else name, args[0])
            if name == "mean" and ndim is not None:
                dim = n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else None)
                keepdim = n.kwargs.get("keepdim", n.args[2] if len(n.args) > 2 else False)
                if keepdim and _last_dim(dim, ndim) and n.kwargs.get("dtype") is None:
                    return ("mean_last", args[0])
            if name in ("softmax", "log_softmax") and ndim is not None:
                dim = n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else None)
                # A third positional argument is F.softmax's _stacklevel (an int, only a warning's stack
                # level; nn.Softmax passes 5) or torch.softmax / Tensor.softmax's dtype, which changes the result.
                dtype_given = n.kwargs.get("dtype") is not None or any(
                    a is not None and not isinstance(a, int) for a in n.args[2:])
                if _last_dim(dim, ndim) and not dtype_given:
                    return (f"{name}_last", args[0])
            if name == "rms_norm" and ndim is not None:
                x = values[first]
                shape = n.kwargs.get("normalized_shape", n.args[1] if len(n.args) > 1 else None)
                weight = n.kwargs.get("weight", n.args[2] if len(n.args) > 2 else None)
                eps = n.kwargs.get("eps", n.args[3] if len(n.args) > 3 else None)
                if tuple(int(s) for s in concrete_value(shape)) == tuple(x.shape[-1:]):
                    eps = torch.finfo(x.dtype).eps if eps is None else float(concrete_value(eps))
                    return ("rms_norm", args[0], conv(weight) if weight is not None else ("none",), eps)
            if name in SIGNATURES and (res := _generic(name, n)) is not None:
                return res
            heads = [a[0] if a and isinstance(a[0], str) else "tuple" for a in args]
            return ("opaque", f"{name}({', '.join(heads)})")

        def _module(n) -> tuple:
            """Leaf nn.Modules fx does not trace into, as the functional call they make."""
            mod = gm.get_submodule(str(n.target))
            kind = type(mod).__name__
            args = [conv(a) for a in n.args]
            if n.kwargs or len(args) != (2 if kind == "CrossEntropyLoss" else 1):
                return ("opaque", f"module {kind} called with {len(args)} args, kwargs {sorted(n.kwargs)}")
            x = values.get(n.args[0])

            def p(attr: str) -> tuple:
                t = getattr(mod, attr, None)
                return ("const", None) if t is None else param_input(f"{n.target}.{attr}", t)

            if kind == "LayerNorm":
                return ("layer_norm", args[0], ("const", tuple(mod.normalized_shape)), p("weight"), p("bias"),
                        ("const", mod.eps))
            if kind == "RMSNorm" and tuple(mod.normalized_shape) == tuple(x.shape[-1:]):
                eps = torch.finfo(x.dtype).eps if mod.eps is None else float(mod.eps)
                w = p("weight")
                return ("rms_norm", args[0], ("none",) if w == ("const", None) else w, eps)
            if kind == "GELU":
                return ("gelu", args[0], ("const", mod.approximate))
            if kind == "SiLU":
                return ("silu", args[0], ("const", mod.inplace))
            if kind in ("Softmax", "LogSoftmax") and x is not None and _last_dim(mod.dim, x.ndim):
                return ("softmax_last" if kind == "Softmax" else "log_softmax_last", args[0])
            if kind == "CrossEntropyLoss":
                return ("cross_entropy", args[0], args[1], p("weight"), ("const", None), ("const", mod.ignore_index),
                        ("const", None), ("const", mod.reduction), ("const", mod.label_smoothing))
            return ("opaque", f"module {kind}")

        if at is None or not isinstance(at, fx.Node):
            return Traced(("opaque", "output is not a single tensor"), inputs, getters, leaf_nodes)
        return Traced(node(at), inputs, getters, leaf_nodes)


def canonical(fn, args: tuple, kwargs: dict) -> Traced:
    """Trace `fn(*args, **kwargs)`; return its output's expression tree and the tensors it reads."""
    g = TraceGraph(fn, args, kwargs)
    return g.expr(g.output_node())


def describe(expr, depth: int = 3) -> str:
    """A short reading of a canonical expression, for "no op family matches (...)" reasons."""
    if not isinstance(expr, tuple) or not expr:
        return repr(expr)
    if depth == 0:
        return "..."
    head, *rest = expr
    if head in ("input", "const", "opaque"):
        return f"{head} {rest[0]!r}" if rest else head
    return f"{head}({', '.join(describe(r, depth - 1) for r in rest)})"
