"""The TorchDynamo backend: `torch.compile(model, backend="forge")`.

Dynamo hands the backend each graph it captures (a graph break gives several). On the graph's first
call the backend runs it once on the real inputs, recording every node's value (forge/trace.py), finds
its regions (forge/regions.py: the same regions `forge trace` lists) and, for each, asks what the shim
asks for one function (shim.resolve: grad, autocast, devices, layout, alignment, dtypes, the spec, the
cache entry and its integrity check). A region whose kernel is cached is replaced in a copy of the graph
by a call that checks its inputs against what was resolved (shape, strides, dtype, device, requires_grad,
alignment, autocast, grad mode where it matters) and launches the kernel, or runs the region's own nodes when they
differ; every other node runs as captured. Dynamo's own guards recompile the graph for other input
shapes, which resolves again (a miss for an untuned shape).

Options (`torch.compile(model, backend="forge", options={...})` or `forge.backend.Backend(...)`):
  miss     what a region without a cached decision does: "search" (default: tune it in this first call,
           as @forge.optimize does; FORGE_SEARCH=0 turns it off), "record" (append its op/shape/dtype to
           `manifest`, a TOML manifest for `forge search --manifest`, and run eager, as PyTorch
           TunableOp's record-untuned mode), or "eager" (never search: tune offline).
  rest     what runs everything forge does not: "eager" (the captured nodes, as written; default) or
           "inductor" (the graph with forge's kernels as opaque custom ops, compiled by Inductor).
  manifest where "record" writes (default forge-misses.toml in the working directory).
  budget, cache, interpreter: as for @forge.optimize.

Nothing is compiled or searched at start-up on a cache hit: a region's kernel is the cached Triton
source, imported once (Triton's own disk cache holds its binary from the search). No wrong result:
any region forge cannot vouch for runs the captured nodes.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forge import shim
from forge.errors import UsageError

MISS = ("search", "record", "eager")
REST = ("eager", "inductor")
DEFAULT_MANIFEST = "forge-misses.toml"
RECORDED = ("cache miss: recorded", "cache miss: already recorded")  # a miss now in the manifest (misses.record)


@dataclass(frozen=True)
class RegionExplanation:
    """What the backend does for one region of one captured graph."""

    graph: int
    node: str
    op: str
    uses: str  # "kernel" | "torch" (torch's fused op, a cached "torch" decision) | "eager"
    reason: str
    shape: tuple | None = None
    dtype: str | None = None
    attrs: dict = field(default_factory=dict)
    key: str | None = None

    def __str__(self) -> str:
        shape = "x".join(map(str, self.shape)) if self.shape else "?"
        return f"graph {self.graph} {self.node}: {self.op} {shape} {self.dtype or '?'} -> {self.uses}: {self.reason}"


@dataclass(frozen=True)
class ModelExplanation:
    """Every region of every graph captured from a model, and the calls no op family matches."""

    regions: tuple[RegionExplanation, ...]
    unmatched: tuple[tuple[int, str, str, str], ...]  # (graph, node, call, why)
    graphs: int
    cudagraphs: tuple[tuple[int, str], ...] = ()  # (graph, what its CUDA graph did), with cudagraphs on

    @property
    def kernels(self) -> int:
        return sum(r.uses == "kernel" for r in self.regions)

    @property
    def torch_ops(self) -> int:
        """Regions whose cached decision is torch's fused op (run in place of the code as written)."""
        return sum(r.uses == "torch" for r in self.regions)

    @property
    def uses(self) -> str:
        return "regions" if self.kernels or self.torch_ops else "eager"

    def _counts(self) -> str:
        torch_ops = f", {self.torch_ops} torch's fused op" if self.torch_ops else ""
        return (f"{self.kernels} of {len(self.regions)} region(s) in {self.graphs} graph(s) run forge kernels"
                f"{torch_ops}")

    @property
    def reason(self) -> str:
        head = f"{self._counts()}; {len(self.unmatched)} call(s) match no op family"
        if not self.regions:
            return head
        return head + ": " + "; ".join(f"{r.op} {r.node}: {r.uses} ({r.reason})" for r in self.regions)

    def __str__(self) -> str:
        lines = [f"forge backend: {self._counts()}"]
        lines += [f"  {r}" for r in self.regions]
        lines += [f"  graph {g} CUDA graph: {what}" for g, what in self.cudagraphs]
        if self.unmatched:
            lines.append(f"  {len(self.unmatched)} call(s) match no op family: "
                         + ", ".join(f"{node} ({call})" for _, node, call, _ in self.unmatched[:20])
                         + (" ..." if len(self.unmatched) > 20 else ""))
        return "\n".join(lines)


def _check(name: str, value: Any, choices: tuple) -> Any:
    if value not in choices:
        raise UsageError(f"forge backend: {name}={value!r}: expected one of {', '.join(choices)}")
    return value


class Backend:
    """A TorchDynamo backend (a callable gm, example_inputs -> callable) that swaps cached forge kernels
    into each captured graph. `explain()` reports every region it has seen."""

    def __init__(self, *, miss: str = "search", rest: str = "eager", manifest: str | os.PathLike | None = None,
                 budget: int = 50, cache: str | os.PathLike | None = None, interpreter: bool | None = None,
                 cudagraphs: bool | str = False, profile_regions: bool = False):
        self.miss = _check("miss", miss, MISS)
        self.rest = _check("rest", rest, REST)
        if not (isinstance(cudagraphs, bool) or cudagraphs == "auto"):
            raise UsageError(f"forge backend: cudagraphs={cudagraphs!r}: expected True, False or 'auto'")
        # each CUDA graph of the backend replays whole (forge/cudagraph.py): one launch per call; "auto": only
        # where its own replays are measured faster than its calls as captured
        self.cudagraphs = cudagraphs
        self.graphed: list[tuple[int, Any]] = []  # (graph index, its forge.cudagraph.GraphedRun)
        if not isinstance(profile_regions, bool):
            raise UsageError(f"forge backend: profile_regions={profile_regions!r}: expected True or False")
        # For measuring, not for speed: every region with a cached decision runs inside a profiler range
        # named PROFILE_PREFIX + its decision + "::" + op (regions decided eager as their own sub-module), so a
        # torch.profiler trace tells how much device time the regions forge decided hold (bench/models.py).
        # Triton's C launcher is not tied to such ranges: forge's kernels are counted by name (kernel_names).
        self.profile_regions = profile_regions
        self.manifest = Path(manifest or DEFAULT_MANIFEST)
        self.budget = budget
        self.cache = Path(cache) if cache else None
        self.interpreter = (os.environ.get("FORGE_INTERPRETER") == "1") if interpreter is None else interpreter
        self._lock = threading.Lock()
        self._graphs = itertools.count()
        self.regions: list[RegionExplanation] = []
        self.kernel_calls: list[_RegionCall] = []  # every swapped region's guarded call (calls, fallbacks)
        self.unmatched: list[tuple[int, str, str, str]] = []
        self.simplified: list[tuple[int, int, int]] = []  # (graph index, values folded, dropouts removed): fold.py
        self.graphs = 0
        # shim.resolve's miss policy; @forge.optimize sets its own (its wording: "would search", "off")
        self.resolve_miss = {"eager": "skip", "record": "record"}.get(self.miss)

    def explain(self) -> ModelExplanation:
        return ModelExplanation(tuple(self.regions), tuple(self.unmatched), self.graphs,
                                tuple((i, g.describe()) for i, g in self.graphed))

    def kernel_names(self) -> frozenset[str]:
        """The names of the @triton.jit functions of every kernel swapped in: how a profile tells forge's
        kernels apart (Triton's C launcher calls cuLaunchKernel directly, and the profiler does not tie
        such launches to the Python range around them)."""
        names = set()
        for call in self.kernel_calls:
            module = getattr(call.binding, "module", None)  # None: torch's fused op (a "torch" decision)
            for obj in (vars(module).values() if module is not None else ()):
                if type(obj).__name__ == "JITFunction":
                    names.add(obj.fn.__name__)
        return frozenset(names)

    def __call__(self, gm, example_inputs) -> Callable:
        index = next(self._graphs)
        state: dict[str, Any] = {}
        lock = threading.Lock()

        def first_call(*args):
            run = state.get("run")
            if run is not None:
                return run(*args)
            with lock:
                if "run" not in state:
                    state["run"], out = self._plan(gm, args, index)
                    return out
            return state["run"](*args)

        return first_call

    # -- planning one graph, on its first call -----------------------------------------------------
    def _plan(self, gm, args: tuple, index: int) -> tuple[Callable, Any]:
        """(the callable that runs this graph from now on, the output of this first call)."""
        import torch
        import torch.fx as fx

        from forge.regions import find_regions
        from forge.trace import TraceGraph

        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            # Forge kernels are forward-only, and recording runs without autograd: the graph runs as
            # captured (Dynamo guards grad mode: an inference call compiles it again).
            with self._lock:
                self.graphs += 1
                self.unmatched.append((index, "*", "graph", "inputs require grad (forge kernels are forward-only)"))
            return self._rest(gm, args), gm(*args)
        g = TraceGraph.from_graph(gm, args)
        device = "cuda" if any(t.is_cuda for t in tensors) else "cpu"
        # A region whose cached decision is eager (found so, or searched so just now) is split: the graph's
        # regions are found again with it cut into its parts, which resolve on their own (miss: searched,
        # recorded...), until no region of more than one node newly resolves eager. Each round resolves
        # the decided regions from the cache; a region splits at most once per cut, so this ends.
        rejected: set = set()

        def split(r) -> bool:  # by op too: another family matching the same nodes is another spec
            return (r.root, frozenset(r.nodes), r.op) in rejected

        while True:
            regions, unmatched = find_regions(g, device, index, split=split)
            swaps, reports = self._resolve_all(g, regions, index)
            eager = {(r.root, frozenset(r.nodes), r.op) for r, rep in zip(regions, reports, strict=True)
                     if len(r.nodes) > 1 and rep.reason.startswith(EAGER_DECIDED)} - rejected
            if not eager:
                break
            rejected |= eager
        with self._lock:
            self.graphs += 1
            self.regions.extend(reports)
            self.unmatched.extend((index, u.node.name, u.call, u.reason) for u in unmatched)
            self.kernel_calls.extend(call for _, call in swaps)
        if self.profile_regions:  # after resolving: what a region reads is unchanged by the ranges
            swaps = _profiled(g, regions, reports, swaps, eager_too=self.rest == "eager")
        run_gm = _swapped(gm, swaps, inductor=self.rest == "inductor") if swaps else gm
        if self.rest == "eager":  # the host's share of each call outside the regions (Inductor folds its own)
            from forge import fold

            if run_gm is gm:
                run_gm = fx.GraphModule(gm, gm.graph.__deepcopy__())
            done = fold.simplify(run_gm, {n.name: v for n, v in g.values.items()})
            with self._lock:
                self.simplified.append((index, *done))
        run = self._rest(run_gm, args)
        if self.cudagraphs and device == "cuda":
            from forge.cudagraph import GraphedRun, mutated_inputs, split_tail

            index_of = next((t.get_device() for t in tensors if t.is_cuda), 0)
            # a last GEMM or region whose output is large runs after the replay, on the graph's static buffers,
            # instead of its output being copied out of them (forge/cudagraph.py)
            tail = split_tail(run_gm, g.output, lambda t: isinstance(t, (_RegionCall, _Ranged))) \
                if self.rest == "eager" else None
            head, finish, no_clone = (tail[0].forward, tail[1], tail[2]) if tail else (run, None, frozenset())
            after = (f"output(s) {finish.taken} computed after each replay (not copied out)") if tail else ""
            graphed = GraphedRun(head, mutated_inputs(gm), index_of, first_args=args,
                                 auto=self.cudagraphs == "auto", no_clone=no_clone, after=after)
            with self._lock:
                self.graphed.append((index, graphed))
            run = graphed if finish is None else (lambda *a, _g=graphed, _f=finish: _f(_g(*a)))
        return run, g.output

    def _resolve_all(self, g, regions: list, index: int) -> tuple[list, list]:
        """(the swaps, each region's report) of one graph's regions, in graph order."""
        import torch

        from forge import ops

        swaps, reports = [], []
        # A region fed by another region's output sees, once that one is swapped, what its call returns: a
        # forge kernel's output in the layout its family's alloc_output gives (kernel_stride: contiguous in
        # every family but rope), torch's op's in eager's layout. It is resolved for that input, and a region
        # recorded as a miss counts as swapped (it will be, once tuned); if it ends up eager, the guard sees
        # the other layout and the region runs its own nodes.
        produced: dict = {}
        for r in regions:
            report, swap = self._resolve(g, r, index, produced)
            reports.append(report)
            if swap is not None:
                swaps.append((r, swap))
            if swap is not None or report.reason.startswith(RECORDED):
                root = g.values[r.root]
                if isinstance(root, torch.Tensor):
                    if swap is not None and not swap.extra:  # what its call returns (out_meta says which)
                        stride = swap.out_meta[1]
                    else:  # a recorded miss: its kernel's, once tuned; a stacked output's parts: contiguous
                        stride = kernel_stride(ops.get(r.op).module, self._leaves(g, r, produced), r.indices, root)
                    # a copy only where the layout differs (the logits of a 50k vocabulary are 412 MB)
                    produced[r.root] = root if tuple(root.stride()) == tuple(stride) else torch.empty_strided(
                        root.shape, stride, dtype=root.dtype, device=root.device).copy_(root)
                for node in r.extra_outputs:  # stacked in one contiguous output
                    produced[node] = g.values[node].contiguous()
        return swaps, reports

    @staticmethod
    def _leaves(g, r, produced: dict) -> list:
        """The region's inputs as its kernel call sees them (a swapped region's output in its kernel's layout)."""
        return [produced.get(leaf, g.values[leaf]) if not isinstance(leaf, str) else _attr(g.gm, leaf)
                for leaf in r.leaves]

    def _rest(self, gm, args: tuple) -> Callable:
        if self.rest == "inductor":
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(gm, list(args))
        return gm.forward

    def _resolve(self, g, r, index: int, produced: dict):
        """(RegionExplanation, the region's replacement call or None). produced: the values swapped regions'
        kernels give their roots, in place of the recorded ones."""
        import torch

        from forge import ops

        node = r.root.name
        if r.unsupported is not None:
            return RegionExplanation(index, node, r.op, "eager", f"not tunable: {r.unsupported}", r.shape, r.dtype,
                                     dict(r.attrs)), None
        op = ops.get(r.op)
        leaves = self._leaves(g, r, produced)
        if not all(isinstance(t, torch.Tensor) for t in leaves):
            return RegionExplanation(index, node, r.op, "eager", "a region input is not a tensor", r.shape,
                                     r.dtype, dict(r.attrs)), None
        picked = [leaves[i] if i is not None else None for i in r.indices]
        miss = self.resolve_miss or ("search" if shim._search_enabled(True) else "off")
        binding, why = shim.resolve(op, picked, list(r.indices), dict(r.attrs), leaves,
                                    interpreter=self.interpreter, cache_path=self.cache, miss=miss,
                                    budget=self.budget, record=self._record)
        report = RegionExplanation(index, node, r.op, why.uses, why.reason, r.shape, r.dtype, dict(r.attrs), why.key)
        if binding is None:
            return report, None
        out = g.values[r.root]
        if r.extra_outputs:
            # The op's one output holds the root's value and the extra ones' stacked (add_norm: (2, ...), y
            # then h); it is split only where each extra value is exactly that slice of it.
            vals = [out, *(g.values[e] for e in r.extra_outputs)]
            if not (isinstance(binding, shim._Binding) and all(isinstance(v, torch.Tensor) for v in vals)
                    and all(v.shape == out.shape and v.dtype == out.dtype for v in vals)):
                return RegionExplanation(index, node, r.op, "eager", "a region with extra outputs "
                                         f"({', '.join(e.name for e in r.extra_outputs)}) is swapped only for a "
                                         "forge kernel writing them stacked", r.shape, r.dtype, dict(r.attrs),
                                         why.key), None
        fallback = _region_module(g.gm, r)
        if fallback is None:
            return RegionExplanation(index, node, r.op, "eager", "its nodes cannot be run apart from the graph",
                                     r.shape, r.dtype, dict(r.attrs), why.key), None
        # A family whose one output stacks the root's value with a shared node's (add_norm: (2, ...), y then
        # h) writes it stacked whether or not anything outside the region reads h.
        stacked = bool(getattr(op.module, "KEEP_MULTI_USE", ()))
        stride = kernel_stride(op.module, leaves, r.indices, out) if isinstance(binding, shim._Binding) else None
        return report, _RegionCall(binding, leaves, fallback, out, len(r.extra_outputs), stacked, stride)

    def _record(self, op: str, shape: tuple, dtype: str, device: str, attrs: dict) -> str:
        from forge import misses

        done = misses.record(self.manifest, op, shape, dtype, device, attrs)
        if done.startswith("not recorded"):
            return done
        return f"{done} in {self.manifest} for offline tuning (forge search --manifest {self.manifest})"


def kernel_stride(opmod, leaves: list, indices, value) -> tuple[int, ...]:
    """The strides a forge kernel of this family gives a region's root `value`: contiguous (what alloc_output
    gives in every family), or, for a family declaring OUTPUT_LIKE = i (rope: the layout eager's formula has),
    torch.empty_like's layout of its input i (computed on a meta tensor: nothing allocated)."""
    from forge import opkit
    from forge.spec import contiguous_strides

    like = getattr(opmod, "OUTPUT_LIKE", None)
    src = leaves[indices[like]] if like is not None and indices[like] is not None else None
    if src is None or tuple(src.shape) != tuple(value.shape):
        return contiguous_strides(tuple(value.shape))
    return opkit.empty_like_strides(tuple(src.shape), tuple(src.stride()))


def _attr(gm, name: str):
    obj = gm
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


class _RegionCall:
    """A region's kernel, guarded: the leaves' signature (shape, dtype, strides, device, requires_grad,
    alignment), autocast, and grad mode off where a leaf requires grad, as when the kernel was resolved;
    else the region's own nodes run.

    A region with extra outputs (add_norm's h) returns a tuple, the root's value first: views of the
    kernel's stacked output, or the region's own nodes' values (nothing is stacked on that path).
    `stacked` is the same call returning one tensor (the kernel's output as it is, the fallback's values
    stacked): the form the custom op forge::region takes under rest="inductor"."""

    def __init__(self, binding, leaves: list, fallback, out, extra: int = 0, stacked: bool = False,
                 stride: tuple | None = None):
        h = shim._torch_hot()
        self.binding, self.fallback = binding, fallback
        self.sig = tuple(shim._tensor_sig(t) for t in leaves)
        self.autocast = h["autocast"]()
        # Grad mode matters only where a leaf requires grad (resolve() refused grad mode on then); Inductor
        # runs its compiled graphs under no_grad, so the mode itself is not compared.
        self.needs_no_grad = any(t.requires_grad for t in leaves)
        self.extra = extra
        # the kernel's output stacks the root's value with the shared node's even where nothing outside
        # reads the latter (extra == 0): the root's value is then its [0]
        self.kernel_stacked = stacked or bool(extra)
        # out_meta: the layout the custom op forge::region declares (rest="inductor": Inductor compiles the
        # code around it for that layout and asserts it): `stride`, what the forge kernel writes
        # (kernel_stride), which eager's value may not have; stacked:
        # contiguous (1 + extra, *shape); anything else (torch's op): eager's layout. The op brings whatever
        # a call returns to this layout (the fallback path's eager layout gets a copy).
        from forge.spec import contiguous_strides

        if extra:
            shape = (1 + extra, *out.shape)
            self.out_meta = (shape, contiguous_strides(shape), out.dtype)
        else:
            self.out_meta = (tuple(out.shape), tuple(stride) if stride is not None else tuple(out.stride()),
                             out.dtype)
        self.calls = self.fallbacks = 0
        # The C++ fast call (forge/_fastcall.cpp), as @forge.optimize has it: once the binding has its
        # compiled launch plan, one C++ call checks the leaves against the signature the call was made for
        # (sizes, strides, dtype, device, no grad, alignment, grad mode, autocast off), allocates and
        # launches; any other call takes the Python path below. None: not made (yet); fast_reason: why never.
        # A torch op's region (a "torch" decision) gets the C++ check alone (forge/_fastcall.cpp EagerCall: the
        # signature, grad mode and autocast checked in C++, then the op's call; it returns a 1-tuple).
        self.fast = None
        self.fast_eager = isinstance(binding, shim._TorchCall)
        self.fast_reason: str | None = None
        if getattr(binding, "getters", ()):
            self.fast_reason = "the binding fetches module parameters itself"
        self.__name__ = f"forge_{getattr(getattr(binding, 'spec', None), 'op', 'kernel')}"  # fx names nodes so

    def _guarded(self, leaves):
        """(the result, True) from the kernel, or (the region's own nodes' result, False)."""
        fast = self.fast
        if fast is not None:
            out = fast(*leaves)  # None unless the leaves are exactly the signature it was made for
            if out is not None:
                self.calls += 1
                return (out[0] if self.fast_eager else out), True
        h = shim._hot
        self.calls += 1
        if (h["autocast"]() == self.autocast and not (self.needs_no_grad and h["grad"]())
                and tuple(shim._tensor_sig(t) for t in leaves) == self.sig):
            out = self.binding(list(leaves))
            if fast is None and self.fast_reason is None and (
                    self.fast_eager or getattr(self.binding, "plan", None) is not None):
                self._offer_fast(leaves, out)
            return out, True
        self.fallbacks += 1
        return self.fallback(*leaves), False

    def _offer_fast(self, leaves: tuple, out) -> None:
        """After a call through the binding's compiled plan (a kernel) or through torch's op: make the C++ fast
        call for these leaves (None while the extension builds: the next call asks again)."""
        from forge import fastcall

        grad = shim._hot["grad"]()
        try:
            if self.fast_eager:
                binding = self.binding
                self.fast = fastcall.make_eager(lambda *ls: binding(list(ls)), tuple(leaves), grad,
                                                shim._hot["autocast"]())
            else:
                sources = [i if i is not None else d for i, d in self.binding.slots]
                self.fast = fastcall.make(self.binding.plan, tuple(leaves), sources, out, grad)
        except fastcall.Unsupported as exc:
            self.fast_reason = str(exc)

    def __call__(self, *leaves):
        out, kernel = self._guarded(leaves)
        if kernel and self.kernel_stacked:
            parts = out.unbind(0)
            return tuple(parts[:1 + self.extra]) if self.extra else parts[0]
        return out

    def stacked(self, *leaves):
        out, kernel = self._guarded(leaves)
        if self.extra and not kernel:
            import torch

            return torch.stack(out)
        if kernel and self.kernel_stacked and not self.extra:
            return out[0].clone()  # the custom op's output must not be a view (of the stacked buffer)
        return out


PROFILE_PREFIX = "forge_region::"
EAGER_DECIDED = "cached decision is eager"  # shim.resolve's reason for a cached eager decision


class _Ranged:
    """A swapped call run inside a profiler range (Backend(profile_regions=True)); the call's own attributes
    (binding, calls, ...) stay reachable."""

    def __init__(self, call, label: str):
        self.call, self.label = call, label
        self.__name__ = getattr(call, "__name__", "forge_region")

    def __getattr__(self, name):
        return getattr(self.call, name)

    def __call__(self, *leaves):
        from torch.profiler import record_function

        with record_function(self.label):
            return self.call(*leaves)

    def stacked(self, *leaves):
        from torch.profiler import record_function

        with record_function(self.label):
            return self.call.stacked(*leaves)


def _profiled(g, regions: list, reports: list, swaps: list, eager_too: bool) -> list:
    """The swaps with every call inside a profiler range, plus (eager_too: not under rest="inductor", whose
    custom op takes forge's calls only) each region decided eager (cached) as its own sub-module in one: in
    graph order, as _swapped takes them."""
    by_root = {r.root: (r, call) for r, call in swaps}
    out = []
    for r, report in zip(regions, reports, strict=True):
        if r.root in by_root:
            out.append((r, _Ranged(by_root[r.root][1], f"{PROFILE_PREFIX}{report.uses}::{r.op}")))
        elif eager_too and report.reason.startswith(EAGER_DECIDED):
            module = _region_module(g.gm, r)
            if module is not None:
                out.append((r, _Ranged(module, f"{PROFILE_PREFIX}eager::{r.op}")))
    return out


def _region_module(gm, r):
    """The region's nodes as a GraphModule of its leaves (the fallback), or None if a node reads a value
    that is neither a leaf, a region node, nor a module attribute."""
    import torch.fx as fx

    graph = fx.Graph()
    env: dict = {}
    for i, leaf in enumerate(r.leaves):
        p = graph.placeholder(f"leaf_{i}")
        if isinstance(leaf, str):
            env[("attr", leaf)] = p
        else:
            env[leaf] = p
    inside = set(r.nodes)
    missing = []

    def arg(n):
        if n in env:
            return env[n]
        if n.op == "get_attr":
            if ("attr", n.target) in env:
                return env[("attr", n.target)]
            env[n] = graph.get_attr(n.target)
            return env[n]
        missing.append(n)
        return graph.placeholder(f"missing_{len(missing)}")

    for n in gm.graph.nodes:
        if n in inside:
            env[n] = graph.node_copy(n, arg)
    if missing:
        return None
    extra = getattr(r, "extra_outputs", ())
    graph.output((env[r.root], *(env[e] for e in extra)) if extra else env[r.root])
    sub = fx.GraphModule(gm, graph)
    return sub.forward


# Each swapped region under rest="inductor" is the custom op forge::region(handle, leaves): Inductor sees
# an opaque call with a known output (its fake implementation gives the recorded shape, strides, dtype).
_HANDLES: dict[str, _RegionCall] = {}
_handle_ids = itertools.count()
_op_lock = threading.Lock()


def _region_op():
    import torch

    with _op_lock:
        if hasattr(torch.ops.forge, "region"):
            return torch.ops.forge.region

        # The schema is spelled out: this module's annotations are strings (from __future__ import annotations).
        @torch.library.custom_op("forge::region", mutates_args=(), schema="(str handle, Tensor[] leaves) -> Tensor")
        def region(handle, leaves):
            call = _HANDLES[handle]
            out = call.stacked(*leaves) if call.extra else call(*leaves)
            shape, stride, _ = call.out_meta
            if tuple(out.stride()) != stride:  # the layout the fake declared (Inductor asserts it)
                out = torch.empty_strided(shape, stride, dtype=out.dtype, device=out.device).copy_(out)
            # A custom op's output may not alias its inputs (a fallback region could return one of them).
            elif any(out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for t in leaves):
                out = out.clone()
            return out

        @region.register_fake
        def _(handle, leaves):
            shape, stride, dtype = _HANDLES[handle].out_meta
            return torch.empty_strided(shape, stride, dtype=dtype, device=leaves[0].device)

        return torch.ops.forge.region


def _swapped(gm, swaps: list, *, inductor: bool):
    """A copy of `gm` with each region's root replaced by its guarded kernel call (the region's other
    nodes are dropped where nothing else reads them)."""
    import operator

    import torch
    import torch.fx as fx

    from forge import fold

    new = fx.GraphModule(gm, gm.graph.__deepcopy__())
    nodes = {n.name: n for n in new.graph.nodes}
    op = _region_op() if inductor else None
    replaced: dict = {}  # a swapped region's root -> its kernel call: a later region whose leaf it is reads the call
    for r, call in swaps:
        root = nodes[r.root.name]
        with new.graph.inserting_before(root):
            leaf_args = [new.graph.get_attr(leaf) if isinstance(leaf, str)
                         else replaced.get(leaf.name, nodes[leaf.name]) for leaf in r.leaves]
            if op is None:
                repl = new.graph.call_function(call, tuple(leaf_args))
            else:
                handle = f"r{next(_handle_ids)}"
                _HANDLES[handle] = call
                repl = new.graph.call_function(op, (handle, leaf_args))
        inside = {nodes[m.name] for m in r.nodes}
        if r.extra_outputs:  # the call's parts: the root's value, then each extra output's
            with new.graph.inserting_after(repl):
                parts = [new.graph.call_function(operator.getitem, (repl, i)) if op is None
                         else new.graph.call_function(torch.select, (repl, 0, i))
                         for i in range(1 + len(r.extra_outputs))]
            # inserting_after puts each part right after repl, so they are in reverse order: fine (each
            # reads only repl), and every user of theirs is later than the root or the extra node it replaces
            root.replace_all_uses_with(parts[0])
            replaced[r.root.name] = parts[0]
            for e, part in zip(r.extra_outputs, parts[1:], strict=True):
                # only its uses outside the region: the region's own nodes die with the root
                nodes[e.name].replace_all_uses_with(part, delete_user_cb=lambda u, inside=inside: u not in inside)
                replaced[e.name] = part
            continue
        root.replace_all_uses_with(repl)
        replaced[r.root.name] = repl
    fold.eliminate_dead_code(new.graph)  # not fx's own: it drops in-place method calls (forge/fold.py)
    new.recompile()
    return new


def forge_backend(gm, example_inputs, options: dict | None = None, **kwargs):
    """`torch.compile(model, backend="forge", options={...})`: a Backend per compiled model would need
    the options; Dynamo calls this once per captured graph, so a Backend is made per call (its explain()
    is per graph). For a report over the whole model use forge.explain(model, *inputs), or pass a
    Backend instance: torch.compile(model, backend=forge.backend.Backend(miss="record"))."""
    opts = dict(options or {})
    opts.update(kwargs)
    opts.pop("mode", None)
    return Backend(**opts)(gm, example_inputs)


def register() -> None:
    """Register the name "forge" with TorchDynamo when the package's entry point is not installed
    (running from a source tree): torch.compile(model, backend="forge")."""
    from torch._dynamo.backends import registry

    registry._lazy_import()  # entry points first: the installed package's own registration wins
    if "forge" not in registry._BACKENDS:
        registry.register_backend(forge_backend, name="forge")


def compile(model, *, dynamic: bool = False, **options):  # noqa: A001 - mirrors torch.compile
    """torch.compile(model, backend=Backend(**options), dynamic=dynamic); returns (compiled, backend),
    the backend holding the report of every region (backend.explain())."""
    import torch

    backend = Backend(**options)
    return torch.compile(model, backend=backend, dynamic=dynamic), backend
