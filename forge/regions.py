"""Regions of a captured graph: which parts of a model's fx graph an op family computes.

Walking the graph from the output backwards, at each not-yet-covered call node the largest region
rooted there is tried first: (1) everything down to the graph's inputs (module parameters are
inputs), then (1b) cut at values used more than once and at the operands of every linear / addmm, but
not at a GEMM's result (a GEMM and its epilogue, gelu_new(x @ W + b) + r, are one region), then (2)
cut at values used more than once (x in x * rsqrt(mean(x*x))), then (3) also cut
at values no matcher looks into (linear / addmm / matmul / sdpa outputs, layout: view, permute,
expand, contiguous; casts; opaque calls), then (4) only the node itself with its direct inputs as
leaves (gelu(layer_norm(x)) is two regions). A cut never stops at an exact widening cast (x.float()
of a half x): the region takes x, so a float32 computation rounded once to x's dtype matches as the
op on x (forge/trace.py, exact numerics). The first match wins and its nodes are covered; the generic
pointwise family is tried after the specific ones (ops.match_order), and at (3) they also cut at the
elementwise calls only it reads (trace.ELEMENTWISE_HEADS: opaque to them, as before it existed). Calls left
uncovered are reported with why nothing matched. A matched region whose inputs the op's kernel
cannot take (a layout, e.g. HF's transposed q/k/v or (B, 1, S, D) cos/sin; a dtype) is listed with
the reason. A match is refused where an in-place write into a tensor it reads stands between its first node
and its root (its kernel, launched at the root, would read that tensor once, after the write).

Runtime layer: `forge trace` (the tuner) and the TorchDynamo backend (forge/backend.py) both read
regions from here, so what trace reports is what the backend swaps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from forge import ops
from forge.spec import DTYPES, dtype_name


@dataclass
class Region:
    index: int
    root: Any  # fx Node
    nodes: list  # every node computed inside the region (root included)
    leaves: list  # the region's inputs: fx Nodes or parameter names, in the matcher's numbering
    op: str
    indices: list  # matcher's picks: input index per op input (None = filled in by the op)
    attrs: dict
    shape: tuple | None = None
    dtype: str | None = None
    unsupported: str | None = None  # why forge cannot tune it (make_spec's reason)
    decision: str | None = None  # from the cache: kernel | eager | None (not tuned)
    speedup: float | None = None
    seconds: float = 0.0  # --profile
    graph: int = 0  # which captured graph (TraceResult.graphs) the region is in
    inputs: list = field(default_factory=list)  # each leaf's name: a parameter's qualified name, else the node's
    # Nodes inside the region whose values are read outside it too, and which the op's one output holds
    # besides the root's (add_norm: h = x + r, read by the next residual add; its output is (2, ...), y
    # in [0] and h in [1]). Only for families that declare KEEP_MULTI_USE; forge/backend.py splits them.
    extra_outputs: list = field(default_factory=list)

    @property
    def label(self) -> str:
        attrs = " ".join(f"{k}={v}" for k, v in sorted(self.attrs.items()))
        shape = "x".join(map(str, self.shape)) if self.shape else "?"
        return f"{self.op} {shape} {self.dtype or '?'}" + (f" {attrs}" if attrs else "")


@dataclass
class Unmatched:
    node: Any
    call: str
    shape: tuple
    reason: str
    seconds: float = 0.0
    graph: int = 0


def _call_nodes(graph) -> list:
    import torch

    return [n for n in graph.gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")
            and isinstance(graph.values.get(n), torch.Tensor)]


def _region_nodes(root, leaves: set) -> list:
    seen, stack = [], [root]
    while stack:
        n = stack.pop()
        if n in seen or n in leaves or n.op in ("placeholder", "get_attr"):
            continue
        seen.append(n)
        stack.extend(n.all_input_nodes)
    return seen


def _writes(graph, order: dict) -> list[tuple[int, list, str]]:
    """(position, the written arguments, a description) of each node of the graph that writes into an argument
    in place (forge/fold.py written_by: x.mul_(k), x[i] = v, x += y, out=, inplace=True)."""
    from forge.fold import written_by

    return [(order[w], targets, _describe_call(w)) for w in graph.gm.graph.nodes if (targets := written_by(w))]


def _written_inside(graph, region: Region, order: dict, writes: list) -> str | None:
    """The first in-place write placed between the region's first node and its root into a tensor whose storage
    the region reads (a leaf or a node of it), or None. A kernel at the root reads every input once, after such
    a write, where the user's code read part of them before it (t's mean of squares, then t.mul_(2), then
    t * rsqrt(mean): not rmsnorm of either t). Storages are the planning call's values."""
    import torch

    lo, hi = min(order[m] for m in region.nodes), order[region.root]
    inside = [(i, t, what) for i, t, what in writes if lo < i < hi]
    if not inside:
        return None

    def storage(v):
        return v.untyped_storage().data_ptr() if isinstance(v, torch.Tensor) and v.numel() else None

    read = {storage(graph.values.get(m)) for m in [*region.nodes, *region.leaves] if not isinstance(m, str)}
    read.discard(None)
    for _, targets, what in inside:
        if any(storage(graph.values.get(x)) in read for x in targets if not isinstance(x, str)):
            return what
    return None


def _describe_call(n) -> str:
    t = n.target
    name = t if isinstance(t, str) else getattr(t, "__name__", str(t))
    return f"{n.op.replace('call_', '')} {name}"


def _through_upcasts(graph, nodes) -> frozenset:
    """The cut `nodes` with each exact widening cast (x.float() of a half x) replaced by what it casts:
    the region then takes x itself, and a float32 computation rounded once to x's dtype is recognised."""
    out = set()
    for n in nodes:
        while (src := graph.upcast_source(n)) is not None:
            n = src
        out.add(n)
    return frozenset(out)


def _gemm_cuts(graph, calls, heads) -> tuple[frozenset, frozenset]:
    """(the operands of every linear / addmm, their results): cut at the first and not at the second, a
    GEMM and the epilogue after it are one region whose leaves are the GEMM's operands, even where an
    operand is computed once for it (gelu(linear(h)), h single-use) or the result is read several times
    by its epilogue (GPT-2's gelu_new reads x three times). Conv1D flattens x for addmm and views the
    result back to x's rows: there the cut is at x itself and the result is the view, so the region's
    input and output keep x's leading dims."""
    gemms = [n for n in calls if heads.get(n) in ("linear", "addmm")]
    ins, outs = set(), set(gemms)
    for g in gemms:
        views_back = [u for u in g.users if heads.get(u) == "view"]
        outs.update(views_back)
        for a in g.all_input_nodes:
            src = a.args[0] if a.args else None
            if (heads.get(a) == "view" and isinstance(src, type(a)) and src in graph.values
                    and len(views_back) == len(g.users) == 1):
                sv, av, ov = graph.values[src], graph.values[a], graph.values[views_back[0]]
                if (getattr(sv, "ndim", 0) > 2 and sv.shape[-1] == av.shape[-1]
                        and tuple(ov.shape[:-1]) == tuple(sv.shape[:-1])):
                    ins.add(src)  # Conv1D: addmm(b, x.view(-1, K), w).view(*x.shape[:-1], N)
                    continue
            ins.add(a)
    return frozenset(ins), frozenset(outs)


def find_regions(graph, device: str, graph_index: int = 0, names: dict | None = None,
                 split: Callable[[Region], bool] | None = None) -> tuple[list[Region], list[Unmatched]]:
    """Regions and unmatched calls of one graph. names: {id(tensor): qualified name} of the target's
    parameters and buffers (Dynamo passes them as graph inputs), for Region.inputs.

    split: regions not to take whole (their cached decision is eager): where split(region) is true, the
    next cut at the same root is tried, so the region's parts become regions of their own (a SwiGLU MLP
    decided eager still fuses its silu(g) * u, a GEMM with a gelu epilogue its gelu). Where no smaller
    region matches at that root, the split region is kept (it runs as captured)."""
    from forge.trace import BOUNDARY_HEADS, ELEMENTWISE_HEADS, describe

    families = ops.match_order()
    generic = [f for f in families if ops.is_generic(f)]
    specific = [f for f in families if not ops.is_generic(f)]
    calls = _call_nodes(graph)
    covered: set = set()
    regions: list[Region] = []
    reasons: dict = {}
    written: dict = {}  # root -> the in-place write that refused a match there (_written_inside)
    multi = frozenset(n for n in calls if len(n.users) > 1)
    heads = graph.heads()
    boundary = frozenset(n for n in calls if heads.get(n) in BOUNDARY_HEADS)
    cut_multi = _through_upcasts(graph, multi)
    cut_bound = _through_upcasts(graph, multi | boundary)
    # Only the generic pointwise family reads ELEMENTWISE_HEADS (clamp, where, ...); they were opaque before
    # it, so every other family's regions are still cut there: what those families match is unchanged.
    elementwise = frozenset(n for n in calls if heads.get(n) in ELEMENTWISE_HEADS)
    cut_bound_specific = _through_upcasts(graph, multi | boundary | elementwise)
    gemm_in, gemm_out = _gemm_cuts(graph, calls, heads)
    cut_gemm = _through_upcasts(graph, (multi - gemm_out) | gemm_in)
    whole = graph.bounded()  # nodes whose whole tree is small enough to match with no cut
    # Families whose region keeps a multi-use node of these heads inside (add_norm: the residual add that
    # feeds a norm and the next residual add), its own inputs cut instead; tried only with those families,
    # before every other cut but the whole tree (cut_gemm would cut the add and give the plain norm).
    # Families that see through single-use views/expands under their inputs (sdpa: transformers' repeat_kv
    # over k and v): a cut below such chains, tried before the cuts at views (cut_bound) and the direct inputs.
    # Their matches, as add_norm's, must fit the kernels (a "repeat" of another layout falls to the next cut)
    # except at the direct inputs, where a match the kernels refuse is a region that says why (attn_mask).
    lookers = [f for f in specific if getattr(f.module, "LOOK_THROUGH", ())]
    look_heads = frozenset(h for f in lookers for h in f.module.LOOK_THROUGH)
    keepers = [f for f in specific if getattr(f.module, "KEEP_MULTI_USE", ())]
    keep_heads = frozenset(h for f in keepers for h in f.module.KEEP_MULTI_USE)
    multi_images = cut_multi - multi
    order = {m: i for i, m in enumerate(graph.gm.graph.nodes)}
    writes = _writes(graph, order)
    for n in reversed(calls):
        if n in covered:
            continue
        direct = _through_upcasts(graph, {a for a in n.all_input_nodes if a.op.startswith("call_")})
        found, tried = None, {}  # cut -> the families tried with it
        inner = []  # for each multi-use node of a kept head at the edge of n's cut_multi tree: cut below it
        if keepers:
            for leaf in graph.expr(n, cut=cut_multi, number_args=False).leaves:
                # a leaf of cut_multi is a multi-use node, or what one casts up from exactly (HF's half
                # precision h.to(float32), the multi-use node, over a single-use add: the model's last norm)
                if isinstance(leaf, str) or leaf in covered or (leaf not in multi and leaf not in multi_images):
                    continue
                # Through what passes the value on unchanged or widens it exactly (HF's LlamaRMSNorm reads
                # h.to(float32): in float32 a no-op, in half precision an exact upcast): the multi-use node
                # may be that cast, the kept add beneath it.
                chain, kept = [leaf], leaf
                while heads.get(kept) == "input" or graph.upcast_source(kept) is not None:
                    ins = [a for a in kept.all_input_nodes if a.op.startswith("call_")]
                    if len(ins) != 1:
                        break
                    kept = ins[0]
                    chain.append(kept)
                if heads.get(kept) in keep_heads and kept not in covered:
                    below = {a for a in kept.all_input_nodes if a.op.startswith("call_")}
                    # every multi-use node that is, or casts up exactly from, a node of the chain stays inside
                    inside = {m for m in multi if m in chain or _through_upcasts(graph, {m}) & set(chain)}
                    inner.append((_through_upcasts(graph, (multi - inside) | below), keepers))
        deep = _below_chains(graph, heads, n, look_heads) if lookers else None
        kept = None  # the first match that split() rejected: the region if nothing smaller matches
        for cut, fams in ((frozenset(), families), *inner, (cut_gemm, families), (cut_multi, families),
                          *(((deep, lookers),) if deep is not None else ()),
                          (cut_bound_specific, specific), (cut_bound, generic), (direct, families)):
            fams = [f for f in fams if f.name not in tried.get(cut, ())]
            if not fams or (not cut and n not in whole):
                continue
            tried.setdefault(cut, set()).update(f.name for f in fams)
            traced = graph.expr(n, cut=cut, number_args=False)
            for fam in fams:
                m = getattr(fam.module, "match", None)
                if m is not None and (res := m(traced.expr)) is not None:
                    res = (res[0], _folded(fam, graph, traced, *res))
                    if ((getattr(fam.module, "KEEP_MULTI_USE", ())
                         or (getattr(fam.module, "LOOK_THROUGH", ()) and cut != direct))
                            and not _fits(fam, traced, *res, device)):
                        # a region that keeps a shared node inside but cannot take these inputs (GPT-2's
                        # wte + wpe broadcast add) would leave its norm eager: the plain norm is tried instead
                        continue
                    region = _region(fam, graph, n, traced, *res, graph_index, names, device)
                    if writes and (w := _written_inside(graph, region, order, writes)) is not None:
                        written[n] = w  # its kernel would read the value after the write in every place
                        continue
                    if split is not None and split(region):
                        kept = kept or region
                        continue  # the next family, then the next cut: the region's parts
                    found = region
                    break
            if found:
                break
            reasons[n] = f"no op family matches ({describe(traced.expr)})"
        found = found or kept
        if not found:
            if n in written:
                reasons[n] = (f"an in-place write ({written[n]}) between the nodes of its {describe(traced.expr)} "
                              "changes a value they read part-way")
            continue
        found.index = len(regions)
        covered.update(found.nodes)
        regions.append(found)
    regions.sort(key=lambda r: calls.index(r.root))
    for i, r in enumerate(regions):
        r.index = i
    for n in calls:
        if heads.get(n) == "input":
            reasons[n] = "a no-op here (returns its input's values: a cast to its own dtype, an identity view)"
    unmatched = [Unmatched(n, _describe_call(n), tuple(graph.values[n].shape), reasons.get(n, "no op family matches"),
                           graph=graph_index) for n in calls if n not in covered]
    return regions, unmatched


def _region(fam, graph, n, traced, indices: list, attrs: dict, graph_index: int, names: dict | None,
            device: str) -> Region:
    """The region a match at root n gives, with its problem shape, dtype and the spec's attrs, or the reason
    its kernels cannot take it (Region.unsupported)."""
    import torch

    leaf_nodes = {x for x in traced.leaves if not isinstance(x, str)}
    region = Region(index=-1, root=n, nodes=_region_nodes(n, leaf_nodes), leaves=traced.leaves,
                    op=fam.name, indices=list(indices), attrs=dict(attrs), graph=graph_index,
                    inputs=[_leaf_name(leaf, t, names) for leaf, t in zip(traced.leaves, traced.tensors,
                                                                          strict=True)])
    if getattr(fam.module, "KEEP_MULTI_USE", ()):
        inside = set(region.nodes)
        region.extra_outputs = [m for m in region.nodes if m is not n and any(u not in inside for u in m.users)]
    picked = [traced.tensors[i] if i is not None else None for i in indices]
    try:
        shape, dtype, region.attrs = _fit(fam, picked, attrs, device)
        region.shape, region.dtype = shape, dtype
    except ValueError as exc:
        region.unsupported = str(exc)
        first = dtype_name(picked[0].dtype) if isinstance(picked[0], torch.Tensor) else None
        region.dtype = first if first in DTYPES else None
    return region


def _folded(fam, graph, traced, indices: list, attrs: dict) -> dict:
    """The matcher's attrs, with the region inputs that are graph constants folded in where the family
    says how (fold_constants: sdpa's causal mask tensor becomes causal=True)."""
    fold = getattr(fam.module, "fold_constants", None)
    if fold is None:
        return attrs
    constants = {i: t for i, (leaf, t) in enumerate(zip(traced.leaves, traced.tensors, strict=True))
                 if not isinstance(leaf, str) and graph.constant(leaf)}
    if not constants:
        return attrs
    return fold([traced.tensors[i] if i is not None else None for i in indices], dict(attrs), constants)


def _below_chains(graph, heads: dict, n, look: frozenset) -> frozenset:
    """The cut under n's direct inputs that passes down through single-use nodes of the `look` heads (views,
    expands): the node each chain starts from is the leaf (none where it is a graph input)."""
    below = set()
    for a in n.all_input_nodes:
        while a is not None and a.op.startswith("call_") and heads.get(a) in look and len(a.users) == 1:
            ins = [x for x in a.all_input_nodes if x.op.startswith("call_")]
            if len(ins) > 1 or (not ins and len(a.all_input_nodes) != 1):
                break
            a = ins[0] if ins else None  # a chain over a graph input: that input is a leaf anyway
        if a is not None and a.op.startswith("call_"):
            below.add(a)
    return _through_upcasts(graph, below)


def _fit(fam, picked: list, attrs: dict, device: str) -> tuple[tuple, str, dict]:
    """(problem shape, dtype, the spec's attrs) of a matched region's inputs, or ValueError with the
    reason its kernels cannot take them (a dtype, a layout, shapes that do not fit the spec)."""
    inputs = ops.fill_inputs(fam.module, picked, attrs)
    x = inputs[0]
    dtype = dtype_name(x.dtype)
    if dtype not in DTYPES:
        raise ValueError(f"dtype {x.dtype} is not supported")
    problem = getattr(fam.module, "problem", None)
    attrs = dict(attrs)
    shape = tuple(problem(inputs, attrs)) if problem else tuple(x.shape)
    attrs, why = ops.strided_attrs(fam, inputs, attrs)
    if why is not None:
        raise ValueError(why)
    spec = fam.module.make_spec(shape, dtype, "cuda" if device == "cuda" else "cpu", attrs)
    actual = [(tuple(t.shape), dtype_name(t.dtype)) for t in inputs]
    if actual != [(s.shape, s.dtype) for s in spec.inputs]:
        raise ValueError(f"input shapes/dtypes {actual} do not fit {fam.name}'s kernel")
    return shape, dtype, dict(spec.attrs)


def _fits(fam, traced, indices: list, attrs: dict, device: str) -> bool:
    try:
        _fit(fam, [traced.tensors[i] if i is not None else None for i in indices], attrs, device)
    except ValueError:
        return False
    return True


def _leaf_name(leaf, tensor, names: dict | None) -> str:
    if isinstance(leaf, str):
        return leaf
    if names and id(tensor) in names:
        return names[id(tensor)]
    return leaf.name


def param_names(fn) -> dict:
    """{id(tensor): qualified name} for the parameters and buffers of the target: an nn.Module's own
    names, or for a function the modules it reads by name (globals, closure) prefixed with that name."""
    import torch

    if isinstance(fn, torch.nn.Module):
        modules = {"": fn}
    else:
        code = getattr(fn, "__code__", None)
        scope = dict(getattr(fn, "__globals__", {}))
        if code is not None and getattr(fn, "__closure__", None):
            scope.update(zip(code.co_freevars, (c.cell_contents for c in fn.__closure__), strict=False))
        used = set(code.co_names) | set(code.co_freevars) if code is not None else set()
        modules = {name: m for name, m in scope.items() if name in used and isinstance(m, torch.nn.Module)}
    names: dict = {}
    for prefix, mod in modules.items():
        named = [*mod.named_parameters(remove_duplicate=False), *mod.named_buffers(remove_duplicate=False)]
        for name, t in named:  # the first name of a shared (tied) tensor
            names.setdefault(id(t), f"{prefix}.{name}" if prefix else name)
    return names
