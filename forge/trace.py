"""Reduce a traced function, module or captured graph to canonical expression trees that op-family
matchers (`match()` in kernels/<op>.py) can recognise whatever the spelling.

Two ways in, one representation (`TraceGraph`: an fx GraphModule and the real value of every node):
  TraceGraph(fn, args, kwargs)         the shim (`@forge.optimize`): torch.fx symbolic trace of one call;
                                       non-tensor arguments are bound as constants (`eps` is a number)
  TraceGraph.from_graph(gm, inputs)    `forge trace`: a graph TorchDynamo captured, with its real inputs
                                       (module parameters arrive as inputs)
Either way the graph is run once through `torch.fx.Interpreter` so every node's real value is known:
values that are not tensors (shapes, sizes, `x.shape[-1]`) fold into constants; `dim` arguments are
normalised to negative indices with the real ndim (so dim=1 of a 2-D tensor and dim=-1 are the same
tree); layout and casts are read from the real input and output (shape, strides, dtype).

Tensor inputs are numbered: the function's tensor arguments first (parameter order), then, in order
of first use, the module parameters and buffers it reads (`Traced.params` says how to fetch them).

Canonical forms (every node is a tuple):
  ("input", i)            the i-th tensor input
  ("const", value)        None, numbers, strings, shapes, index tuples (slices with concrete bounds);
                          ("empty_tensor", dtype) for a literal empty 1-D tensor (torch.tensor([]))
  ("mul", a, b, ...)      n-ary, operands sorted (so x*r*w == w*(r*x)); x/y becomes mul(x, recip(y))
  ("add", a, b, ...)      n-ary, sorted
  ("sub", a, b)
  ("recip", a) ("sqrt", a) ("rsqrt", a) ("exp", a) ("neg", a) ("erf", a) ("tanh", a) ("sigmoid", a)
                          unary ops; recip(sqrt(a)) == rsqrt(a); x**2 == mul(x, x), also torch.pow(x, 3.0)
  ("relu", a)             F.relu / torch.relu / x.relu() / nn.ReLU, not in place
  Elementwise calls (ELEMENTWISE_HEADS: only the generic pointwise family reads them; for the other
  families a region is still cut there, as when they were opaque). Bounds, slopes and exponents are
  numbers (a tensor bound is opaque); in-place calls are opaque:
  ("leaky_relu", a, ("const", slope))     F.leaky_relu, nn.LeakyReLU
  ("hardswish", a)                        F.hardswish, nn.Hardswish
  ("clamp", a, ("const", lo | None), ("const", hi | None))   torch.clamp / clip / x.clamp_min / clamp_max;
                          F.hardtanh / nn.Hardtanh (lo, hi), F.relu6 / nn.ReLU6 (0, 6)
  ("pow", a, ("const", e))  x ** e / torch.pow(x, e) for an exponent other than 2, 3, 4, 0.5, -0.5 (above)
  ("gt", a, b) ("ge", a, b) ("eq", a, b) ("ne", a, b)   comparisons (also torch.greater ...); a < b is
                          gt(b, a), a <= b is ge(b, a); eq and ne sort their operands
  ("where", cond, a, b)   torch.where(cond, a, b); a, b tensors or constants
  ("mean_last", a)        mean over the last dim with keepdim=True
  ("softmax_last", a) ("log_softmax_last", a)
  ("rms_norm", x, w | ("none",), eps)        over the last dim (F.rms_norm, nn.RMSNorm)
  ("rms_norm", x, w | ("none",), eps, k)     over the last k > 1 dims (normalized_shape of k dims)
  Calls listed in SIGNATURES, as (name, arg, arg, ...) with every parameter in declaration order
  and defaults filled in, whatever was passed positionally or by keyword (aliases fold: mm, bmm and
  @ are "matmul"; concat is "cat"; F.scaled_dot_product_attention is "sdpa"):
  ("layer_norm", x, normalized_shape, weight, bias, eps)   also nn.LayerNorm
  ("gelu", x, approximate)            also nn.GELU, torch._C._nn.gelu
  ("silu", x, inplace)                also nn.SiLU
  ("sdpa", q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)   Hugging Face's sdpa calls
                                      (is_causal, scale, enable_gqa by keyword) included
  ("matmul", a, b)
  ("linear", x, weight, bias)         F.linear, torch._C._nn.linear, nn.Linear (weight stored (out, in))
  ("addmm", bias, mat1, mat2, beta, alpha)   torch.addmm (GPT-2's Conv1D: weight stored (in, out))
  ("cross_entropy", input, target, weight, size_average, ignore_index, reduce, reduction,
                    label_smoothing)   also nn.CrossEntropyLoss
  ("sum", x, dim, keepdim, dtype) ("mean", ...) ("amax", x, dim, keepdim) ("amin", ...)
  ("argmax", x, dim, keepdim) ("argmin", ...)
                                      a one-element dim list becomes an int for sum/mean/amax/amin; dims
                                      are negative (dim=1 of NCHW is -3, (2, 3) is (-2, -1)); a mean over
                                      the last dim with keepdim is mean_last, over any other dim(s) this
  ("cat", (t, t, ...), dim) ("getitem", x, index) ("chunk", x, chunks, dim) ("split", x, size, dim)
  Layout (read from the real tensors; a matcher never looks through them, so a region is cut there; one
  exception: rmsnorm takes a weight input's view, w.view(1, C, 1, 1), checking its shape):
  ("view", x, shape)      view, reshape, view_as, reshape_as, flatten, unflatten, unsqueeze, squeeze, and
                          indexing with only full slices / None / ...; a view of a view is one view;
                          a view to x's own shape is x
  ("permute", x, perm)    permute, transpose, swapaxes/swapdims, t; composed; the identity is x
  ("expand", x, shape)    expand, expand_as, broadcast_to; to x's own shape it is x
  ("contiguous", x)       x.contiguous() of a non-contiguous x (of a contiguous one: x itself)
  split and chunk are the calls above; F.dropout / nn.Dropout in eval (training=False) is x
  Casts (exact numerics):
  ("cast", x, dtype)      .to(dtype), .float(), .half(), .bfloat16(), .double(), .type(dtype),
                          .type_as(t): the dtype is the result's; a cast to x's own dtype (or a device
                          move) is x; a widening round trip (fp16 -> fp32 -> fp16) is x
                          At the root of an expression only, a cast down to float16/bfloat16 of a value
                          computed entirely in float32 from inputs of that dtype (every intermediate
                          float32, the inputs entering through exact widening casts or type promotion;
                          no sdpa inside) is that computation on the inputs: it is what forge's kernels
                          compute (load, fp32 arithmetic, one rounding at the store). Anywhere else a
                          cast stays: HF LlamaRMSNorm in half precision, weight * (x.float() * r).to(dtype),
                          rounds twice, so rmsnorm does not match it (its inner (x.float() * r).to(dtype)
                          is rmsnorm without a weight, exactly); in float32 every cast is a no-op.
  ("opaque", description, node)  anything else; a matcher never matches through it. `node` is the fx
                          node's name, so two different opaque values differ and one used twice is equal;
                          an expression over MAX_EXPR_NODES nodes (deep residual chains) is opaque too
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

UNARY = {"rsqrt", "sqrt", "exp", "neg", "reciprocal", "tanh", "sigmoid", "erf", "special_erf", "abs", "log"}
# Layout calls (by name; function or method) and casts, canonicalised from the real tensors.
VIEWS = {"view", "reshape", "view_as", "reshape_as", "flatten", "unflatten", "unsqueeze", "squeeze"}
PERMUTES = {"permute", "transpose", "swapaxes", "swapdims", "t"}
EXPANDS = {"expand", "expand_as", "broadcast_to"}
CASTS = {"to", "float", "half", "bfloat16", "double", "type", "type_as"}
# Heads no matcher looks into: a region is cut at nodes of these kinds (forge trace).
BOUNDARY_HEADS = frozenset({"linear", "addmm", "matmul", "sdpa", "opaque", "view", "permute", "expand",
                            "contiguous", "cast"})
# Heads only the generic pointwise family (kernels/pointwise.py) looks into. They were opaque before it
# existed, so forge/regions.py still cuts every other family's regions there (what those families match
# is unchanged); the pointwise family's regions run through them.
# Ops whose value depends on their arguments alone (no randomness, no state, no graph input): a node built
# only from these over literals has the same value on every call of its graph (TraceGraph.constant).
# transformers 5.17 builds its causal mask so under torch.compile: le/ge of aranges, viewed and expanded.
CONSTANT_OPS = frozenset({
    "arange", "add", "sub", "mul", "neg", "le", "lt", "ge", "gt", "eq", "ne", "and_", "or_", "__and__", "__or__",
    "invert", "logical_and", "logical_or", "logical_not", "bitwise_and", "bitwise_or", "getitem", "view",
    "reshape", "unsqueeze", "expand", "expand_as", "to", "contiguous", "ones", "zeros", "full", "tril", "triu",
    "where", "transpose", "permute", "clone", "bool", "long", "int", "float"})
ELEMENTWISE_HEADS = frozenset({"leaky_relu", "hardswish", "clamp", "pow", "gt", "ge", "eq", "ne", "where"})
# Expressions larger (expanded) or deeper than this become opaque: a deep model's residual stream
# expands exponentially, and op patterns are small and shallow.
MAX_EXPR_NODES = 256
MAX_EXPR_DEPTH = 64
_HALF = ("float16", "bfloat16")

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
    "linear": ("linear", (("input", _REQ), ("weight", _REQ), ("bias", None))),
    "addmm": ("addmm", (("input", _REQ), ("mat1", _REQ), ("mat2", _REQ), ("beta", 1), ("alpha", 1))),
    "cross_entropy": ("cross_entropy", (("input", _REQ), ("target", _REQ), ("weight", None),
                                        ("size_average", None), ("ignore_index", -100), ("reduce", None),
                                        ("reduction", "mean"), ("label_smoothing", 0.0))),
    "sum": ("sum", (("input", _REQ), ("dim", None), ("keepdim", False), ("dtype", None))),
    "mean": ("mean", (("input", _REQ), ("dim", None), ("keepdim", False), ("dtype", None))),
    "amax": ("amax", (("input", _REQ), ("dim", ()), ("keepdim", False))),
    "argmax": ("argmax", (("input", _REQ), ("dim", None), ("keepdim", False))),
    "amin": ("amin", (("input", _REQ), ("dim", ()), ("keepdim", False))),
    "argmin": ("argmin", (("input", _REQ), ("dim", None), ("keepdim", False))),
    "cat": ("cat", (("tensors", _REQ), ("dim", 0))),
    "concat": ("cat", (("tensors", _REQ), ("dim", 0))),
    "concatenate": ("cat", (("tensors", _REQ), ("dim", 0))),
    "getitem": ("getitem", (("input", _REQ), ("index", _REQ))),
    "chunk": ("chunk", (("input", _REQ), ("chunks", _REQ), ("dim", 0))),
    "split": ("split", (("input", _REQ), ("split_size", _REQ), ("dim", 0))),
}
# A one-element dim list means the same as the int for these (not for argmax, which takes an int).
_DIM_LIST_FOLDS = {"sum", "mean", "amax", "amin"}


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
        if a[0] == kind:
            out.extend(a[1:])
        else:
            out.append(a)
    return (kind, *_sorted(out))


def _recip(a: tuple) -> tuple:
    if a[0] == "sqrt":
        return ("rsqrt", a[1])
    if a[0] == "rsqrt":
        return ("sqrt", a[1])
    if a[0] == "recip":
        return a[1]
    return ("recip", a)


# The ELEMENTWISE_HEADS calls: name -> ((param, default), ...), bound like SIGNATURES from canonical args.
_EW_PARAMS: dict[str, tuple[tuple[str, Any], ...]] = {
    "leaky_relu": (("input", _REQ), ("negative_slope", 0.01), ("inplace", False)),
    "hardswish": (("input", _REQ), ("inplace", False)),
    "hardtanh": (("input", _REQ), ("min_val", -1.0), ("max_val", 1.0), ("inplace", False)),
    "relu6": (("input", _REQ), ("inplace", False)),
    "clamp": (("input", _REQ), ("min", None), ("max", None)),
    "clip": (("input", _REQ), ("min", None), ("max", None)),
    "clamp_min": (("input", _REQ), ("min", _REQ)),
    "clamp_max": (("input", _REQ), ("max", _REQ)),
    "where": (("condition", _REQ), ("input", _REQ), ("other", _REQ)),
}
_COMPARE = {"gt": ("gt", False), "lt": ("gt", True), "ge": ("ge", False), "le": ("ge", True), "eq": ("eq", False),
            "ne": ("ne", False), "greater": ("gt", False), "less": ("gt", True), "greater_equal": ("ge", False),
            "less_equal": ("ge", True), "not_equal": ("ne", False)}


def _elementwise(name: str, args: list, kw: dict) -> tuple | None:
    """The canonical form of an ELEMENTWISE_HEADS call (args, kw: canonical trees), or None."""
    def number(t) -> bool:
        return t[0] == "const" and isinstance(t[1], int | float) and not isinstance(t[1], bool)

    if name == "pow" and len(args) == 2 and not kw and number(args[1]) and args[0][0] != "const":
        return ("pow", args[0], args[1])
    if name in _COMPARE and len(args) == 2 and not kw:
        head, swap = _COMPARE[name]
        a, b = (args[1], args[0]) if swap else (args[0], args[1])
        return (head, *_sorted([a, b])) if head in ("eq", "ne") else (head, a, b)
    decl = _EW_PARAMS.get(name)
    if decl is None or len(args) > len(decl) or set(kw) - {p for p, _ in decl}:
        return None
    got = dict(zip([p for p, _ in decl], args, strict=False))
    if set(got) & set(kw):
        return None
    got.update(kw)
    for p, default in decl:
        if p not in got:
            if default is _REQ:
                return None
            got[p] = ("const", default)
    if got.get("inplace", ("const", False)) != ("const", False):
        return None  # in place: the user's tensor changes too; the kernel would not change it
    x = got["input"]
    if name == "where":
        return ("where", got["condition"], x, got["other"])
    if name == "hardswish":
        return ("hardswish", x)
    if name == "leaky_relu":
        return ("leaky_relu", x, got["negative_slope"]) if number(got["negative_slope"]) else None
    if name == "relu6":
        return ("clamp", x, ("const", 0.0), ("const", 6.0))
    lo = got.get("min_val", got.get("min", ("const", None)))
    hi = got.get("max_val", got.get("max", ("const", None)))
    if not all(number(b) or b == ("const", None) for b in (lo, hi)) or lo == hi == ("const", None):
        return None
    return ("clamp", x, lo, hi)


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


def _dtype(dtype) -> str:
    from forge.spec import dtype_name

    return dtype_name(dtype)


def _widens_exactly(src, dst) -> bool:
    """Every value of dtype `src` is exactly representable in `dst` (a cast up that loses nothing)."""
    return (_dtype(src), _dtype(dst)) in {("float16", "float32"), ("bfloat16", "float32"), ("float16", "float64"),
                                          ("bfloat16", "float64"), ("float32", "float64")}


def _is_node(t) -> bool:
    return isinstance(t, tuple) and bool(t) and isinstance(t[0], str)


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


def _record(gm, args: list) -> tuple[dict, Any]:
    """Run `gm` once through fx.Interpreter on `args`: (every node's value, the graph's output)."""
    import torch
    import torch.fx as fx

    values: dict = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n):
            values[n] = super().run_node(n)
            return values[n]

    with torch.no_grad():
        out = Recorder(gm).run(*args)
    return values, out


class TraceGraph:
    """A traced function/module (or a captured graph) and the real value of every node, from one run."""

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

        # Placeholders come in parameter order; concrete (non-tensor) ones are re-passed their value.
        params = list(sig.parameters)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(params):
            raise Untraceable("functions with *args/**kwargs are not traced")
        try:
            values, _ = _record(gm, [bound.arguments[p] for p in params])
        except Exception as exc:  # noqa: BLE001 - the user's code failed on its own arguments
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise Untraceable(f"running the traced graph failed: {type(exc).__name__}: {first_line}") from None
        self._setup(root, gm, values, sig, placeholders, params, tensors)

    @classmethod
    def from_graph(cls, gm, example_inputs) -> TraceGraph:
        """A graph captured elsewhere (TorchDynamo hands a backend the GraphModule and its real inputs,
        module parameters among them), run once on those inputs to record every node's value; the
        graph's output is `.output`. Its placeholders are its arguments, in order."""
        import torch

        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        args = list(example_inputs)
        if len(args) != len(placeholders):
            raise Untraceable(f"the graph takes {len(placeholders)} inputs, {len(args)} were given")
        values, out = _record(gm, args)
        self = cls.__new__(cls)
        params = [p.name for p in placeholders]
        tensors = [(p, v) for p, v in zip(params, args, strict=True) if isinstance(v, torch.Tensor)]
        self._setup(gm, gm, values, None, placeholders, params, tensors)
        self.output = out
        return self

    def _setup(self, root, gm, values, sig, placeholders, params, tensors) -> None:
        import torch
        import torch.fx as fx

        self.fx, self.torch = fx, torch
        self.root, self.gm, self.values, self.sig = root, gm, values, sig
        self.placeholders, self.params, self.tensors = placeholders, params, tensors
        self.output = None

    def output_node(self):
        out = [n for n in self.gm.graph.nodes if n.op == "output"][0]
        return out.args[0]

    def upcast_source(self, n):
        """The node `n` casts up from exactly (x in x.float() of a half x), else None."""
        torch = self.torch
        if not isinstance(n, self.fx.Node) or n.op not in ("call_method", "call_function") or _name(n) not in CASTS:
            return None
        src = n.args[0] if n.args else None
        v, s = self.values.get(n), self.values.get(src) if isinstance(src, self.fx.Node) else None
        if isinstance(v, torch.Tensor) and isinstance(s, torch.Tensor) and _widens_exactly(s.dtype, v.dtype):
            return src
        return None

    def constant(self, n) -> bool:
        """True where node n has the same value on every call of the graph: it and every node it is computed
        from are CONSTANT_OPS calls, down to literals (no placeholder, no parameter or buffer: only the
        tensors torch.fx's tracer baked in)."""
        seen, todo = set(), [n]
        while todo:
            m = todo.pop()
            if m in seen:
                continue
            seen.add(m)
            if not isinstance(m, self.fx.Node):
                return False
            if m.op == "get_attr" and str(m.target).startswith("_tensor_constant"):
                continue  # a tensor torch.fx's tracer computed while tracing (no proxy in it): a literal
            if m.op not in ("call_function", "call_method") or _name(m) not in CONSTANT_OPS:
                return False
            todo.extend(m.all_input_nodes)
        return True

    def heads(self) -> dict:
        """Each call node's own kind: its canonical head with every other call as a leaf ("input" for a
        node that passes its input through: a no-op cast, an identity view, dropout in eval)."""
        calls = frozenset(n for n in self.gm.graph.nodes if n.op.startswith("call_"))
        return {n: self.expr(n, cut=calls, number_args=False).expr[0] for n in calls}

    def bounded(self) -> set:
        """The call nodes whose whole tree, down to the graph's inputs, is within MAX_EXPR_NODES (so
        matching it with no cut can succeed): one pass in graph order, every tree built once."""
        calls = [n for n in self.gm.graph.nodes if n.op.startswith("call_")]
        return {n for n, t in zip(calls, self.exprs(calls), strict=True) if not _capped(t.expr)}

    def expr(self, at, cut=frozenset(), number_args: bool = True) -> Traced:
        """The canonical tree of node `at`. Nodes in `cut` (other than `at`) are leaves (numbered
        inputs), as are the function's tensor arguments and module parameters. number_args: the
        function's tensor arguments are inputs 0..k-1 in parameter order (the shim's numbering); else
        leaves are numbered in order of first use (matching a region of a larger graph)."""
        return self.exprs([at], cut, number_args)[0]

    def exprs(self, ats: list, cut=frozenset(), number_args: bool = True) -> list[Traced]:
        """expr() of several nodes, sharing one numbering of the leaves and every subtree (in graph
        order, each node's inputs are already built: no deep recursion)."""
        at = None  # the root being built (never a leaf of its own tree)
        torch, fx = self.torch, self.fx
        values, gm, root = self.values, self.gm, self.root
        placeholders, params, tensors = self.placeholders, self.params, self.tensors
        leaf_nodes: list = []

        getters: list = []
        param_index: dict[Any, int] = {}
        memo: dict = {}
        sizes: dict = {}
        stack: list = []  # the nodes being expanded (depth)
        view_base: dict = {}  # a view node -> the node its ("view", x, shape) tree views
        if number_args:
            tensor_index = {name: i for i, (name, _) in enumerate(tensors)}
            index = {ph: tensor_index[p] for ph, p in zip(placeholders, params, strict=True) if p in tensor_index}
            inputs = [t for _, t in tensors]
            leaf_nodes.extend(sorted(index, key=index.get))
        else:
            index, inputs = {}, []

        def is_leaf(n) -> bool:
            return n in cut and n is not at and isinstance(values.get(n), torch.Tensor)

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

        def size(t) -> int:
            """Nodes in the expanded tree t (shared subtrees counted at every use)."""
            if not isinstance(t, tuple) or not t:
                return 0
            k = id(t)
            if k not in sizes:
                if isinstance(t[0], str):
                    s = 1 if t[0] in ("input", "const", "opaque", "none") else 1 + sum(size(c) for c in t[1:])
                else:
                    s = sum(size(c) for c in t)
                sizes[k] = (t, s)  # the tuple is kept alive with its id
            return sizes[k][1]

        def node(n) -> tuple:
            if n in memo:
                return memo[n]
            if len(stack) >= MAX_EXPR_DEPTH:  # not memoised: reached from nearer, it may still expand
                return ("opaque", f"an expression deeper than {MAX_EXPR_DEPTH} nodes", n.name)
            stack.append(n)
            try:
                res = _node(n)
            finally:
                stack.pop()
            if size(res) > MAX_EXPR_NODES:
                res = ("opaque", f"an expression of more than {MAX_EXPR_NODES} nodes", n.name)
            memo[n] = res
            return res

        def _node(n) -> tuple:
            v = values.get(n)
            holds_tensors = isinstance(v, list | tuple) and any(isinstance(x, torch.Tensor) for x in v)
            if (n.op in ("call_function", "call_method") and not n.all_input_nodes and isinstance(v, torch.Tensor)
                    and v.dim() == 1 and v.numel() == 0):
                # a literal empty 1-D tensor (transformers' KV cache starts as torch.tensor([])): a constant at
                # every cut, so the cat that reads it is a region over the other tensors (kernels/cat.py)
                res = ("const", ("empty_tensor", _dtype(v.dtype)))
            elif is_leaf(n):
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
                res = ("opaque", f"{n.op} {n.target}", n.name)
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

        def _perm(name: str, n, ndim: int) -> tuple | None:
            """The full permutation a transpose/permute/t call applies, or None."""
            rest = [concrete_value(a) for a in n.args[1:]]
            try:
                if name == "t":
                    return tuple(range(ndim))[::-1] if ndim == 2 else tuple(range(ndim))
                if name == "permute":
                    dims = rest[0] if len(rest) == 1 and isinstance(rest[0], list | tuple) else rest
                    dims = n.kwargs.get("dims", dims)
                    perm = tuple(int(d) % ndim for d in dims)
                    return perm if sorted(perm) == list(range(ndim)) else None
                d0 = n.kwargs.get("dim0", rest[0] if rest else None)
                d1 = n.kwargs.get("dim1", rest[1] if len(rest) > 1 else None)
                perm = list(range(ndim))
                a, b = int(d0) % ndim, int(d1) % ndim
                perm[a], perm[b] = perm[b], perm[a]
                return tuple(perm)
            except (TypeError, ValueError, IndexError, ZeroDivisionError):
                return None

        def _layout(name: str, n, x_node, xv, v) -> tuple | None:
            """Layout calls and casts, from the real input `xv` and output `v`; None if not one."""
            if name in CASTS:
                x = conv(x_node)
                if v.dtype == xv.dtype:  # a no-op (or a device move): the same values
                    return x
                src = self.upcast_source(x_node)
                if x[0] == "cast" and src is not None and values[src].dtype == v.dtype:
                    return x[1]  # fp16 -> fp32 -> fp16: exact round trip
                return ("cast", x, ("const", _dtype(v.dtype)))
            if name == "contiguous":
                x = conv(x_node)
                return x if xv.is_contiguous() else ("contiguous", x)
            if name == "dropout":  # F.dropout(x, p, training, inplace) / torch.dropout(x, p, train)
                training = n.kwargs.get("training", n.kwargs.get("train", n.args[2] if len(n.args) > 2 else True))
                return conv(x_node) if concrete_value(training) is False else None
            if name == "getitem":  # x[..., None, :]: only full slices, None and ...: a view
                index = concrete_value(n.args[1]) if len(n.args) > 1 else None
                index = index if isinstance(index, tuple) else (index,)
                if not all(i is None or i is Ellipsis or isinstance(i, slice) for i in index):
                    return None
                if v.numel() != xv.numel():
                    return None
                name = "view"
            if name in VIEWS:
                x = conv(x_node)
                if tuple(v.shape) == tuple(xv.shape):
                    return x
                base = x_node
                if x[0] == "view" and x_node in view_base:  # a view of a view: one view of the base
                    base, x = view_base[x_node], x[1]
                    if tuple(values[base].shape) == tuple(v.shape):
                        return x
                view_base[n] = base
                return ("view", x, ("const", tuple(v.shape)))
            if name in EXPANDS:
                x = conv(x_node)
                return x if tuple(v.shape) == tuple(xv.shape) else ("expand", x, ("const", tuple(v.shape)))
            if name in PERMUTES:
                perm = _perm(name, n, xv.ndim)
                if perm is None:
                    return None
                x = conv(x_node)
                if x[0] == "permute":
                    inner = x[2][1]
                    x, perm = x[1], tuple(inner[p] for p in perm)
                return x if perm == tuple(range(len(perm))) else ("permute", x, ("const", perm))
            return None

        def _call(n) -> tuple:
            name = _name(n)
            first = n.args[0] if n.args else None
            first_value = values.get(first) if isinstance(first, fx.Node) else None
            v = values.get(n)
            if isinstance(first_value, torch.Tensor) and isinstance(v, torch.Tensor):
                if (res := _layout(name, n, first, first_value, v)) is not None:
                    return res
            args = [conv(a) for a in n.args]
            kw = {k: conv(x) for k, x in n.kwargs.items()}
            if size(tuple(args)) + size(tuple(kw.values())) > MAX_EXPR_NODES:  # before sorting huge operands
                return ("opaque", f"an expression of more than {MAX_EXPR_NODES} nodes", n.name)
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
                    # x**3 of the tanh-gelu formula (GPT-2's gelu_new: torch.pow(x, 3.0))
                    return _flat("mul", [args[0]] * int(e))
                if e == 0.5:
                    return ("sqrt", args[0])
                if e == -0.5:
                    return ("rsqrt", args[0])
            if name == "relu" and args and all(a == ("const", False) for a in (*args[1:], *kw.values())) \
                    and len(args) <= 2 and set(kw) <= {"inplace"}:
                # F.relu(x[, inplace=False]) (F.relu passes inplace on), torch.relu, x.relu(); in place is opaque
                return ("relu", args[0])
            if (res := _elementwise(name, args, kw)) is not None:
                return res
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
                ns = concrete_value(shape)
                ns = (ns,) if isinstance(ns, int) else tuple(int(s) for s in ns)
                if 1 <= len(ns) <= x.ndim and ns == tuple(x.shape[x.ndim - len(ns):]):
                    eps = torch.finfo(x.dtype).eps if eps is None else float(concrete_value(eps))
                    res = ("rms_norm", args[0], conv(weight) if weight is not None else ("none",), eps)
                    return res if len(ns) == 1 else (*res, len(ns))  # k trailing dims
            if name in SIGNATURES and (res := _generic(name, n)) is not None:
                return res
            heads = [a[0] if a and isinstance(a[0], str) else "tuple" for a in args]
            return ("opaque", f"{name}({', '.join(heads)})", n.name)

        def _module(n) -> tuple:
            """Leaf nn.Modules fx does not trace into, as the functional call they make."""
            mod = gm.get_submodule(str(n.target))
            kind = type(mod).__name__
            args = [conv(a) for a in n.args]
            if n.kwargs or len(args) != (2 if kind == "CrossEntropyLoss" else 1):
                return ("opaque", f"module {kind} called with {len(args)} args, kwargs {sorted(n.kwargs)}", n.name)
            x = values.get(n.args[0])

            def p(attr: str) -> tuple:
                t = getattr(mod, attr, None)
                return ("const", None) if t is None else param_input(f"{n.target}.{attr}", t)

            if kind == "LayerNorm":
                return ("layer_norm", args[0], ("const", tuple(mod.normalized_shape)), p("weight"), p("bias"),
                        ("const", mod.eps))
            k = len(getattr(mod, "normalized_shape", ()))
            if kind == "RMSNorm" and 1 <= k <= x.ndim and tuple(mod.normalized_shape) == tuple(x.shape[x.ndim - k:]):
                eps = torch.finfo(x.dtype).eps if mod.eps is None else float(mod.eps)
                w = p("weight")
                res = ("rms_norm", args[0], ("none",) if w == ("const", None) else w, eps)
                return res if k == 1 else (*res, k)  # k trailing dims
            if kind == "GELU":
                return ("gelu", args[0], ("const", mod.approximate))
            if kind == "SiLU":
                return ("silu", args[0], ("const", mod.inplace))
            if kind == "ReLU" and not mod.inplace:
                return ("relu", args[0])
            if kind in ("LeakyReLU", "Hardswish", "Hardtanh", "ReLU6") and not getattr(mod, "inplace", False):
                if kind == "LeakyReLU":
                    return ("leaky_relu", args[0], ("const", mod.negative_slope))
                if kind == "Hardswish":
                    return ("hardswish", args[0])
                return ("clamp", args[0], ("const", mod.min_val), ("const", mod.max_val))  # ReLU6: 0, 6
            if kind == "Linear":
                return ("linear", args[0], p("weight"), p("bias"))
            if kind in ("Dropout", "Identity") and not mod.training:
                return args[0]
            if kind in ("Softmax", "LogSoftmax") and x is not None and _last_dim(mod.dim, x.ndim):
                return ("softmax_last" if kind == "Softmax" else "log_softmax_last", args[0])
            if kind == "CrossEntropyLoss":
                return ("cross_entropy", args[0], args[1], p("weight"), ("const", None), ("const", mod.ignore_index),
                        ("const", None), ("const", mod.reduction), ("const", mod.label_smoothing))
            return ("opaque", f"module {kind}", n.name)

        def computed_in_fp32(src, half: str) -> bool:
            """Every value from the region's leaves up to `src` is float32, and every floating leaf
            has dtype `half` (it enters through an exact widening cast or type promotion)."""
            seen, stack = set(), [src]
            while stack:
                m = stack.pop()
                if m in seen:
                    continue
                seen.add(m)
                mv = values.get(m)
                leafy = is_leaf(m) or m.op in ("placeholder", "get_attr")
                if leafy:
                    if isinstance(mv, torch.Tensor) and mv.is_floating_point() and _dtype(mv.dtype) != half:
                        return False
                    continue
                items = mv if isinstance(mv, list | tuple) else [mv]
                if not any(isinstance(t, torch.Tensor) for t in items):
                    continue  # a constant (a shape, a size)
                if m.op == "call_module" or any(isinstance(t, torch.Tensor) and t.dtype != torch.float32
                                                for t in items):
                    return False
                stack.extend(m.all_input_nodes)
            return True

        def strip_upcasts(t, half: str):
            """t with ("cast", input of dtype `half`, float32) replaced by the input, re-sorted."""
            if not isinstance(t, tuple) or not t:
                return t
            if not _is_node(t):
                return tuple(strip_upcasts(c, half) for c in t)
            if t[0] in ("const", "input", "opaque", "none"):
                return t
            if (t[0] == "cast" and t[2] == ("const", "float32") and t[1][0] == "input"
                    and _dtype(inputs[t[1][1]].dtype) == half):
                return t[1]
            kids = [strip_upcasts(c, half) for c in t[1:]]
            return (t[0], *_sorted(kids)) if t[0] in ("mul", "add") else (t[0], *kids)

        def exact_downcast(res: tuple) -> tuple:
            """At the root: a cast down to half of an all-float32 computation on half inputs, as that
            computation on the inputs (what forge's kernels compute: fp32 arithmetic, one rounding)."""
            half = res[2][1]
            if half not in _HALF or at.op not in ("call_method", "call_function") or _name(at) not in CASTS:
                return res
            src = at.args[0] if at.args else None
            sv = values.get(src) if isinstance(src, fx.Node) else None
            if not isinstance(sv, torch.Tensor) or sv.dtype != torch.float32 or "'sdpa'" in repr(res):
                return res
            if not computed_in_fp32(src, half):
                return res
            return strip_upcasts(res[1], half)

        out = []
        for at in ats:
            if at is None or not isinstance(at, fx.Node):
                out.append(Traced(("opaque", "output is not a single tensor"), list(inputs), list(getters),
                                  list(leaf_nodes)))
                continue
            res = _node(at) if at in cut and at in memo else node(at)  # a root is never its own leaf
            if res[0] == "cast":
                res = exact_downcast(res)
            out.append(Traced(res, list(inputs), list(getters), list(leaf_nodes)))
        return out


def _capped(t) -> bool:
    """t holds an opaque stand-in for an expression too large or too deep to build."""
    if not isinstance(t, tuple) or not t:
        return False
    if t[0] == "opaque":
        return len(t) > 1 and isinstance(t[1], str) and t[1].startswith("an expression ")
    if t[0] in ("const", "input"):
        return False
    return any(_capped(c) for c in (t[1:] if isinstance(t[0], str) else t))


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
    if not isinstance(expr[0], str):  # a tuple of expressions (cat's tensors)
        return f"({', '.join(describe(r, depth - 1) for r in expr)})"
    head, *rest = expr
    if head in ("input", "const", "opaque"):
        return f"{head} {rest[0]!r}" if rest else head
    return f"{head}({', '.join(describe(r, depth - 1) for r in rest)})"
