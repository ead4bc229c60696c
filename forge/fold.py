"""Plan-time simplification of the code the backend runs as captured around forge's regions (rest="eager").

With the regions' kernels launched from C++, what is left of a model's call on the host is the captured
graph's own Python: every view, arange and mask op, one dispatch each, on every call (HF GPT-2's forward
through the backend: 2.5 ms of host dispatch per call against Inductor's 1.4 ms on the H100's host,
2026-12-06, bench/host_profile.py). Two rewrites take calls out of it without changing a value:

- **Constant folding.** A node computed from literals alone through deterministic ops (the causal mask HF
  builds from aranges on every call: arange, add, view, le, expand) has the same value on every call of
  the graph (Dynamo specialises the graph to its shapes; nothing of the inputs reaches it): its value,
  recorded on the planning call, is held as a buffer and read instead (a tensor made from nothing must name
  its device, and its dtype unless it is an arange of integers: torch's defaults may change between calls).
  Never a value that a later node, directly or through a view, changes in place (an in-place method,
  `x[i] = v`, `x += y`, out=) or that the graph returns (the caller may write into it), nor one holding
  more than FOLD_BYTES.
- **Inference dropout.** `F.dropout(x, p, training=False)` returns x itself: its uses read x.
"""

from __future__ import annotations

import operator

# Ops whose value depends on their arguments alone (no random state, no uninitialised memory, no aliasing of
# an input the graph could write), and which never write into an argument.
_FUNCTIONS = ("arange", "ones", "zeros", "full", "eye", "tril", "triu", "where", "le", "lt", "ge", "gt", "eq",
              "ne", "add", "sub", "mul", "logical_and", "logical_or", "logical_not", "bitwise_and", "bitwise_or",
              "bitwise_not", "cat", "stack", "unsqueeze", "reshape", "ones_like", "zeros_like", "full_like")
_OPERATORS = (operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.neg,
              operator.le, operator.lt, operator.ge, operator.gt, operator.eq, operator.ne, operator.and_,
              operator.or_, operator.invert, operator.getitem)
_METHODS = frozenset({"view", "reshape", "unsqueeze", "squeeze", "expand", "to", "__getitem__", "le", "lt", "ge",
                      "gt", "eq", "ne", "add", "sub", "mul", "transpose", "permute", "contiguous", "float", "bool",
                      "long", "int", "half", "bfloat16", "flatten", "masked_fill", "tril", "triu", "type_as",
                      "expand_as", "view_as", "clone", "logical_not", "logical_and", "logical_or"})
# A folded value is held for the graph's life: the bytes one may take (its storage's, an expanded view's
# base counted once). HF's causal masks are a few MB; a larger constant is rare and then better recomputed.
FOLD_BYTES = 64 << 20


def _foldable_functions():
    import torch

    return frozenset(getattr(torch, name) for name in _FUNCTIONS) | frozenset(_OPERATORS)


# Python's in-place operators and item assignment, as Dynamo records `x += y` and `x[i] = v`
_WRITING_OPERATORS = frozenset({operator.setitem, operator.delitem, operator.iadd, operator.isub, operator.imul,
                                operator.itruediv, operator.ifloordiv, operator.imod, operator.ipow, operator.iand,
                                operator.ior, operator.ixor, operator.ilshift, operator.irshift, operator.imatmul})


def mutates(node) -> bool:
    """Whether `node` may write into an argument: an in-place method or function (trailing underscore; and
    __setitem__, __iadd__ ...), an in-place operator or item assignment, or an out=/inplace=True keyword."""
    if node.op == "call_function" and node.target in _WRITING_OPERATORS:
        return True
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    if name.endswith("_") and not name.endswith("__"):
        return True
    if name.startswith("__i") or name in ("__setitem__", "__delitem__"):  # __iadd__, __imul__, ...
        return True
    return "out" in node.kwargs or bool(node.kwargs.get("inplace", False))


# Named with a trailing underscore but writing no tensor's values (autograd's flag): not a data write for
# written_by. Still kept by eliminate_dead_code (mutates), whose erasing it would change autograd's view.
_NOT_DATA_WRITES = frozenset({"requires_grad_"})


def written_by(node) -> list:
    """The arguments (fx Nodes or values) whose tensors `node` writes into in place: its out= argument, else its
    first argument, where `mutates(node)`; empty otherwise and for _NOT_DATA_WRITES. The one rule the region
    finder (a write between a region's nodes) and the CUDA graphs (a write into an input) read."""
    if node.op not in ("call_function", "call_method") or not mutates(node):
        return []
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    if name in _NOT_DATA_WRITES:
        return []
    target = node.kwargs.get("out", node.args[0] if node.args else None)
    if target is None:
        return []
    return list(target) if isinstance(target, (tuple, list)) else [target]


def eliminate_dead_code(graph) -> int:
    """Erase the nodes of `graph` whose value nothing reads, as graph.eliminate_dead_code() does, but never one
    that writes into an argument (mutates) or is impure by fx's own rule (random ops, side effects). fx counts
    every call_method pure, so its own pass erased `t.mul_(1.5)` where the method's return value was unused (as
    it always is in `t.mul_(1.5); y = t + x`): the write was lost and y wrong. Every rewrite of a captured graph
    (fold.simplify, the backend's swaps, cudagraph.split_tail) cleans up through here. Returns how many went."""
    erased = 0
    for n in reversed(list(graph.nodes)):
        if n.users or n.op in ("placeholder", "output") or mutates(n) or n.is_impure():
            continue
        graph.erase_node(n)
        erased += 1
    return erased


def _inputs(node) -> list:
    import torch.fx as fx

    found: list = []
    fx.node.map_arg((node.args, node.kwargs), found.append)
    return found


_CREATION = ("arange", "ones", "zeros", "full", "eye")


def _settled(node, creation: frozenset) -> bool:
    """A tensor-creation call whose dtype and device do not depend on torch's defaults at call time
    (torch.set_default_dtype / set_default_device between calls): an explicit device, and an explicit dtype
    unless it is an arange of integers (int64 whatever the default)."""
    if node.target not in creation:
        return True
    if node.kwargs.get("device") is None:
        return False
    if node.kwargs.get("dtype") is not None:
        return True
    import torch

    return node.target is torch.arange and all(type(a) is int for a in node.args)


def constant_nodes(graph) -> set:
    """The call nodes of `graph` computed from literals alone through the deterministic ops above."""
    import torch

    functions = _foldable_functions()
    creation = frozenset(getattr(torch, name) for name in _CREATION)
    const: set = set()
    for n in graph.nodes:
        if n.op == "call_function":
            ok = n.target in functions and _settled(n, creation)
        elif n.op == "call_method":
            ok = n.target in _METHODS
        else:
            continue
        if ok and "out" not in n.kwargs and all(a in const for a in _inputs(n)):
            const.add(n)
    return const


def _is_inference_dropout(node) -> bool:
    import torch
    import torch.nn.functional as F

    if node.op != "call_function" or node.target not in (F.dropout, torch.dropout):
        return False
    # F.dropout(input, p=0.5, training=True, inplace=False); torch.dropout(input, p, train)
    key = "training" if node.target is F.dropout else "train"
    training = node.args[2] if len(node.args) > 2 else node.kwargs.get(key, node.target is F.dropout)
    inplace = node.args[3] if len(node.args) > 3 else node.kwargs.get("inplace", False)
    return training is False and inplace is False


# Ops whose result may share its argument's storage: a write into their result writes into a folded value.
_ALIASING = frozenset({"view", "reshape", "unsqueeze", "squeeze", "expand", "expand_as", "view_as", "transpose",
                       "permute", "__getitem__", "getitem", "to", "contiguous", "flatten", "float", "bool", "long",
                       "int", "half", "bfloat16", "type_as", "detach", "narrow", "select", "split", "chunk",
                       "unbind", "t", "movedim", "unflatten", "as_strided", "alias"})


def _escapes(node) -> bool:
    """Whether the value of `node`, or a view of it further on, is written in place or returned."""
    seen, todo = {node}, [node]
    while todo:
        m = todo.pop()
        for u in m.users:
            if u.op == "output" or mutates(u):
                return True
            name = u.target if isinstance(u.target, str) else getattr(u.target, "__name__", "")
            if name in _ALIASING and u not in seen:
                seen.add(u)
                todo.append(u)
    return False


def simplify(gm, values: dict) -> tuple[int, int]:
    """Rewrite `gm` (a GraphModule: changed in place, recompiled) as the module docstring says. `values`:
    each node's value on the planning call, by node name. Returns (values folded, dropouts removed)."""
    import torch

    const = constant_nodes(gm.graph)
    folded = dropped = held = 0
    for n in list(gm.graph.nodes):
        if n in const:
            if all(u in const for u in n.users) or _escapes(n):
                continue  # folded with its users (or dead); or written into / returned: recomputed each call
            v = values.get(n.name)
            if not isinstance(v, torch.Tensor) or v.requires_grad:
                continue
            size = v.untyped_storage().nbytes()
            if held + size > FOLD_BYTES:
                continue
            held += size
            name = f"_forge_const_{n.name}"
            gm.register_buffer(name, v, persistent=False)
            with gm.graph.inserting_before(n):
                attr = gm.graph.get_attr(name)
            n.replace_all_uses_with(attr)
            folded += 1
        elif _is_inference_dropout(n):
            n.replace_all_uses_with(n.args[0])
            dropped += 1
    if folded or dropped:
        eliminate_dead_code(gm.graph)
        gm.recompile()
    return folded, dropped
