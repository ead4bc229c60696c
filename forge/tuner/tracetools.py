"""`forge trace`: find the ops forge can tune inside a user's model or function.

A target is a KernelBench-style problem file (`Model(nn.Module)`, `get_inputs()`, optional
`get_init_inputs()`) or `FILE.py:function` with `--input 2048x4096:float16 ...`. The whole target is
traced once with torch.fx (forge/trace.py, values from a real run), and its graph is split into
regions, each matched to an op family:

  Walking the graph from the output backwards, at each not-yet-covered call node the largest region
  rooted there is tried first: (1) everything down to the target's arguments and parameters, then
  (2) cut at values used more than once (x in x * rsqrt(mean(x*x))), then (3) only the node itself
  with its direct inputs as leaves (gelu(layer_norm(x)) is two regions). The first match wins and its
  nodes are covered. Calls left uncovered are reported with why nothing matched.

`--profile` attributes run time to regions (each graph node runs inside one profiler range, so a
kernel is counted once, in the range that launched it), `--write-manifest` writes the matched
(op, shape, dtype, attrs) for `forge search --manifest`, and `--verify` runs the target with every
region that has a cached kernel swapped for it and compares with eager end to end.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forge import ops
from forge.errors import UsageError
from forge.spec import DTYPES, dtype_name


@dataclass
class Target:
    fn: Any  # the module or function
    args: tuple
    description: str


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


@dataclass
class TraceResult:
    target: Target
    regions: list[Region]
    unmatched: list[Unmatched]
    graph: Any  # forge.trace.TraceGraph
    profile: dict[str, Any] = field(default_factory=dict)


# -- loading the target ----------------------------------------------------------------------------
def _import_file(path: Path):
    if not path.is_file():
        raise UsageError(f"{path}: no such file")
    name = f"forge_trace_target_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise UsageError(f"{path}: not a Python file")
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent.resolve()))  # the file's own imports of its neighbours
    try:
        spec.loader.exec_module(mod)
    except Exception as exc:  # noqa: BLE001 - the user's file failed to import; say so, no traceback
        raise UsageError(f"{path}: importing it failed: {type(exc).__name__}: {exc}") from None
    finally:
        sys.path.remove(str(path.parent.resolve()))
    return mod


def parse_input(text: str):
    """'2048x4096:float16' (dtype optional, default float32) -> (shape, dtype)."""
    from forge.spec import parse_shape

    shape_s, _, dtype = text.partition(":")
    dtype = dtype or "float32"
    if dtype not in (*DTYPES, "int64"):
        raise UsageError(f"--input {text!r}: dtype must be one of {', '.join((*DTYPES, 'int64'))}")
    try:
        return parse_shape(shape_s), dtype
    except ValueError as exc:
        raise UsageError(f"--input {text!r}: {exc}") from None


def load_target(target: str, inputs: list[str], device: str, dtype: str | None = None, seed: int = 0) -> Target:
    import torch

    path_s, sep, func = target.partition(":")
    path = Path(path_s)
    mod = _import_file(path)
    torch.manual_seed(seed)
    cast = getattr(torch, dtype) if dtype else None

    def to_dev(v):
        if isinstance(v, torch.Tensor):
            v = v.to(device)
            return v.to(cast) if cast is not None and v.is_floating_point() else v
        return v

    if sep:
        fn = getattr(mod, func, None)
        if not callable(fn):
            raise UsageError(f"{path}: no function {func!r}")
        if inputs:
            args = []
            for spec in inputs:
                shape, dt = parse_input(spec)
                if dt == "int64":
                    args.append(torch.randint(0, max(2, shape[-1]), shape, device=device))
                else:
                    args.append(torch.randn(shape, device=device, dtype=getattr(torch, dt)))
            return Target(fn, tuple(args), f"{path}:{func}")
        if hasattr(mod, "get_inputs"):
            return Target(fn, tuple(to_dev(a) for a in mod.get_inputs()), f"{path}:{func}")
        raise UsageError(f"{target}: give the function's inputs with --input SHAPE:DTYPE (e.g. 2048x4096:float16)")
    if inputs:
        raise UsageError("--input is for FILE.py:function; a problem file's inputs come from its get_inputs()")
    for name in ("Model", "get_inputs"):
        if not hasattr(mod, name):
            raise UsageError(f"{path}: a problem file defines Model (an nn.Module) and get_inputs() "
                             f"(KernelBench convention); {name} is missing. For a function, use {path}:NAME")
    init = mod.get_init_inputs() if hasattr(mod, "get_init_inputs") else []
    model = mod.Model(*init)
    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"{path}: Model is not an nn.Module")
    model = model.to(device).eval()
    if cast is not None:
        model = model.to(cast)
    return Target(model, tuple(to_dev(a) for a in mod.get_inputs()), f"{path} (Model)")


# -- matching regions ------------------------------------------------------------------------------
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


def _describe_call(n) -> str:
    t = n.target
    name = t if isinstance(t, str) else getattr(t, "__name__", str(t))
    return f"{n.op.replace('call_', '')} {name}"


def find_regions(graph, device: str) -> tuple[list[Region], list[Unmatched]]:
    import torch

    from forge.trace import describe

    families = [ops.get(name) for name in sorted(ops.available())]
    calls = _call_nodes(graph)
    covered: set = set()
    regions: list[Region] = []
    reasons: dict = {}
    multi = {n for n in calls if len(n.users) > 1}
    for n in reversed(calls):
        if n in covered:
            continue
        direct = {a for a in n.all_input_nodes if a.op.startswith("call_")}
        found = None
        for cut in (frozenset(), frozenset(multi - {n}), frozenset(direct)):
            traced = graph.expr(n, cut=cut, number_args=False)
            for fam in families:
                m = getattr(fam.module, "match", None)
                if m is not None and (res := m(traced.expr)) is not None:
                    found = (fam, traced, *res)
                    break
            if found:
                break
            reasons.setdefault(n, f"no op family matches ({describe(traced.expr)})")
        if not found:
            continue
        fam, traced, indices, attrs = found
        leaf_nodes = {x for x in traced.leaves if not isinstance(x, str)}
        region = Region(index=len(regions), root=n, nodes=_region_nodes(n, leaf_nodes), leaves=traced.leaves,
                        op=fam.name, indices=list(indices), attrs=dict(attrs))
        covered.update(region.nodes)
        picked = [traced.tensors[i] if i is not None else None for i in indices]
        try:
            inputs = fam.module.fill_missing(picked)
            x = inputs[0]
            dtype = dtype_name(x.dtype)
            if dtype not in DTYPES:
                raise ValueError(f"dtype {x.dtype} is not supported")
            problem = getattr(fam.module, "problem", None)
            shape = tuple(problem(inputs, attrs)) if problem else tuple(x.shape)
            spec = fam.module.make_spec(shape, dtype, "cuda" if device == "cuda" else "cpu", attrs)
            actual = [(tuple(t.shape), dtype_name(t.dtype)) for t in inputs]
            if actual != [(s.shape, s.dtype) for s in spec.inputs]:
                raise ValueError(f"input shapes/dtypes {actual} do not fit {fam.name}'s kernel")
            if any(not t.is_contiguous() for t in inputs):
                raise ValueError("non-contiguous input")
            region.shape, region.dtype, region.attrs = shape, dtype, dict(spec.attrs)
        except ValueError as exc:
            region.unsupported = str(exc)
            first = dtype_name(picked[0].dtype) if isinstance(picked[0], torch.Tensor) else None
            region.dtype = first if first in DTYPES else None
        regions.append(region)
    regions.sort(key=lambda r: calls.index(r.root))
    for i, r in enumerate(regions):
        r.index = i
    unmatched = [Unmatched(n, _describe_call(n), tuple(graph.values[n].shape), reasons.get(n, "no op family matches"))
                 for n in calls if n not in covered]
    return regions, unmatched


def trace(target: Target, device: str) -> TraceResult:
    from forge.trace import TraceGraph, Untraceable

    try:
        graph = TraceGraph(target.fn, target.args, {})
    except Untraceable as exc:
        raise UsageError(f"{target.description}: cannot trace: {exc}") from None
    regions, unmatched = find_regions(graph, device)
    return TraceResult(target, regions, unmatched, graph)


def annotate_with_cache(result: TraceResult, cache, backend: str) -> None:
    """Each tunable region's cached decision and speedup on this machine, if any."""
    from forge import key as keys

    for r in result.regions:
        if r.unsupported or r.shape is None:
            continue
        fam = ops.get(r.op)
        spec = fam.module.make_spec(r.shape, r.dtype, keys.spec_device(backend), r.attrs)
        entry = cache.get(keys.locate(fam, spec, backend).key)
        if entry is not None:
            r.decision, r.speedup = entry.decision, (entry.speedup if entry.decision == "kernel" else 1.0)


# -- manifest --------------------------------------------------------------------------------------
def manifest_entries(regions: list[Region]) -> list[dict[str, Any]]:
    """One [[op]] per (op, dtype, attrs), with every distinct shape, in first-seen order."""
    grouped: dict[tuple, dict[str, Any]] = {}
    for r in regions:
        if r.unsupported or r.shape is None:
            continue
        key = (r.op, r.dtype, tuple(sorted(r.attrs.items())))
        e = grouped.setdefault(key, {"op": r.op, "shapes": [], "dtype": r.dtype, **r.attrs})
        s = "x".join(map(str, r.shape))
        if s not in e["shapes"]:
            e["shapes"].append(s)
    return list(grouped.values())


# -- profile ---------------------------------------------------------------------------------------
def _labels(result: TraceResult) -> dict:
    labels = {}
    for r in result.regions:
        for n in r.nodes:
            labels[n] = f"forge_region_{r.index}"
    for u in result.unmatched:
        labels[u.node] = f"forge_other_{u.node.name}"
    return labels


def profile(result: TraceResult, iters: int = 5) -> dict[str, Any]:
    """Time per region with torch.profiler: each node runs inside a range named after its region, so
    every kernel is counted once (in the range that launched it), never as both aten op and kernel.
    CUDA: device time of the kernels in each range; CPU: the ranges' own CPU time."""
    import torch
    from torch.profiler import ProfilerActivity, record_function

    g = result.graph
    labels = _labels(result)
    cuda = any(isinstance(a, torch.Tensor) and a.is_cuda for a in result.target.args)

    class Ranged(g.fx.Interpreter):
        def run_node(self, n):
            label = labels.get(n)
            if label is None:
                return super().run_node(n)
            with record_function(label):
                return super().run_node(n)

    args = [g.values[p] for p in g.placeholders]
    runner = Ranged(g.gm)
    with torch.no_grad():
        for _ in range(2):
            runner.run(*args)
        if cuda:
            torch.cuda.synchronize()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(iters):
                runner.run(*args)
            if cuda:
                torch.cuda.synchronize()
    per: dict[str, float] = {}
    for evt in prof.key_averages():
        if not evt.key.startswith(("forge_region_", "forge_other_")):
            continue
        if cuda:
            us = getattr(evt, "device_time_total", None)
            us = getattr(evt, "cuda_time_total", 0.0) if us is None else us
        else:
            us = evt.cpu_time_total
        per[evt.key] = per.get(evt.key, 0.0) + us / iters
    total = sum(per.values())
    for r in result.regions:
        r.seconds = per.get(f"forge_region_{r.index}", 0.0) / 1e6
    for u in result.unmatched:
        u.seconds = per.get(f"forge_other_{u.node.name}", 0.0) / 1e6
    frac = {r.index: (r.seconds * 1e6 / total if total else 0.0) for r in result.regions}
    sped = sum(frac[r.index] / (r.speedup or 1.0) for r in result.regions)
    covered = sum(frac.values())
    estimate = 1.0 / ((1.0 - covered) + sped) if total else None
    result.profile = {"clock": "device (CUDA kernels)" if cuda else "host CPU", "iters": iters,
                      "total_us": total, "covered_fraction": covered, "amdahl_speedup": estimate}
    return result.profile


# -- verify ----------------------------------------------------------------------------------------
# Relative-norm tolerance of the whole output by dtype: each swapped kernel already passed the per-op
# gate (opkit tolerances); end to end, several ops' rounding differences add up, and bf16 carries
# 8 mantissa bits (2^-8 = 0.4% per rounding).
VERIFY_TOL = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}


def swapped_module(result: TraceResult, cache, backend: str):
    """A copy of the traced graph with each region that has a cached kernel replaced by that kernel.
    Returns (GraphModule, {region index: 'kernel' | reason})."""
    import torch.fx as fx

    from forge.shim import load

    g = result.graph
    gm = fx.GraphModule(g.gm, g.gm.graph.__deepcopy__())
    nodes = {n.name: n for n in gm.graph.nodes}
    status: dict[int, str] = {}
    for r in result.regions:
        if r.unsupported or r.shape is None:
            status[r.index] = f"not tunable: {r.unsupported}"
            continue
        device = "cuda" if backend == "cuda" else "cpu"
        try:
            kernel = load(r.op, r.shape, r.dtype, device=device, cache=str(cache.path), **r.attrs)
        except LookupError as exc:
            status[r.index] = f"eager ({exc})"
            continue
        fam = ops.get(r.op).module

        def call(*leaf_values, _k=kernel, _fam=fam, _idx=tuple(r.indices)):
            picked = [leaf_values[i] if i is not None else None for i in _idx]
            return _k(*_fam.fill_missing(picked))

        root = nodes[r.root.name]
        leaf_args = []
        for leaf in r.leaves:
            if isinstance(leaf, str):  # a module parameter by qualified name
                with gm.graph.inserting_before(root):
                    leaf_args.append(gm.graph.get_attr(leaf))
            else:
                leaf_args.append(nodes[leaf.name])
        with gm.graph.inserting_before(root):
            new = gm.graph.call_function(call, tuple(leaf_args))
        root.replace_all_uses_with(new)
        status[r.index] = "kernel"
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm, status


def verify(result: TraceResult, cache, backend: str, iters: int = 20) -> dict[str, Any]:
    import torch

    g = result.graph
    gm, status = swapped_module(result, cache, backend)
    args = [g.values[p] for p in g.placeholders]
    with torch.no_grad():
        ref = result.target.fn(*result.target.args)
        got = gm(*args)
    if not isinstance(ref, torch.Tensor) or not isinstance(got, torch.Tensor):
        raise UsageError("--verify compares single-tensor outputs only")
    dtype = dtype_name(ref.dtype) if dtype_name(ref.dtype) in DTYPES else "float32"
    rel_tol = VERIFY_TOL[dtype]
    r64, g64 = ref.double(), got.double()
    err = float(torch.linalg.vector_norm(g64 - r64)) / max(float(torch.linalg.vector_norm(r64)), 1e-300)
    max_abs = float((g64 - r64).abs().max()) if ref.numel() else 0.0
    ok = bool(torch.isfinite(g64).all() == torch.isfinite(r64).all()) and err <= rel_tol

    def timed(fn) -> float:
        with torch.no_grad():
            for _ in range(3):
                fn()
            if backend == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            if backend == "cuda":
                torch.cuda.synchronize()
        return (time.perf_counter() - t0) / iters * 1e6

    eager_us = timed(lambda: result.target.fn(*result.target.args))
    forge_us = timed(lambda: gm(*args))
    return {"ok": ok, "rel_error": err, "max_abs_error": max_abs, "tolerance": rel_tol, "dtype": dtype,
            "eager_us": eager_us, "forge_us": forge_us, "speedup": eager_us / forge_us if forge_us else None,
            "regions": {str(k): v for k, v in status.items()},
            "swapped": sum(v == "kernel" for v in status.values()), "clock": "host wall time per call"}
