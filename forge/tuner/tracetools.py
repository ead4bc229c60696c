"""`forge trace`: find the ops forge can tune inside a user's model or function.

A target is a KernelBench-style problem file (`Model(nn.Module)`, `get_inputs()`, optional
`get_init_inputs()`), `FILE.py:function` with `--input 2048x4096:float16 ...` (or the file's
get_inputs()), or `FILE.py:name` of an nn.Module instance. The target runs once on its real inputs
under TorchDynamo (`torch.compile` with a recording backend, no grad, static shapes, graph breaks
allowed): each graph Dynamo captures is run through forge/trace.py's recorder as it executes (so every
node's real value, shape, strides and dtype is known), and Dynamo's state is reset before and after.
A graph break (data-dependent control flow, a print, an unsupported call) gives several graphs; each
is listed, and its graph is split into regions, each matched to an op family (forge/regions.py).

`--profile` attributes run time to regions (each graph node runs inside one profiler range, so a
kernel is counted once, in the range that launched it; time outside the captured graphs is not
attributed), `--write-manifest` writes the matched (op, shape, dtype, attrs) for
`forge search --manifest`, and `--verify` runs the target again under TorchDynamo with each captured
graph replaced by a copy in which every region that has a cached kernel calls that kernel, and
compares every tensor of the output with eager end to end (if the second capture does not give the
same graphs, it says it cannot verify rather than compare something else).
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
from forge.regions import Region, Unmatched, find_regions, param_names
from forge.spec import DTYPES, dtype_name


@dataclass
class Target:
    fn: Any  # the module or function
    args: tuple
    description: str


@dataclass
class TraceResult:
    target: Target
    regions: list[Region]
    unmatched: list[Unmatched]
    graphs: list  # forge.trace.TraceGraph per graph TorchDynamo captured, in the order they ran
    breaks: list[str] = field(default_factory=list)  # Dynamo's graph-break reasons (first line each)
    profile: dict[str, Any] = field(default_factory=dict)

    @property
    def graph(self):
        """The captured graph, when there is one (graph breaks give several: see `graphs`)."""
        if len(self.graphs) != 1:
            raise ValueError(f"{len(self.graphs)} graphs were captured; use .graphs")
        return self.graphs[0]


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
        if isinstance(fn, torch.nn.Module):  # FILE.py:model, a module the file built
            fn = fn.to(device).eval()
            if cast is not None:
                fn = fn.to(cast)
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


def _first_lines(exc: BaseException) -> str:
    """An exception's first line, plus Dynamo's "Explanation:" line when it has one (no traceback)."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    explained = [ln for ln in lines[1:] if ln.startswith("Explanation:")]
    if explained:
        text += f" ({explained[0][:300]})"
    return text


class _QuietDynamo:
    """Dynamo logs a failing fake-tensor run with its traceback; the usage error says it in one line."""

    NAMES = ("torch._dynamo", "torch._subclasses.fake_tensor", "torch.fx.experimental.symbolic_shapes")

    def __enter__(self):
        import logging

        self.saved = [(logging.getLogger(n), logging.getLogger(n).level) for n in self.NAMES]
        for logger, _ in self.saved:
            logger.setLevel(logging.CRITICAL)

    def __exit__(self, *exc):
        for logger, level in self.saved:
            logger.setLevel(level)


_BREAK_COUNTERS = ("graph_break", "unimplemented")


def _break_counts() -> dict:
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # pragma: no cover - a torch without Dynamo's counters
        return {}
    return {(k, reason): n for k in _BREAK_COUNTERS for reason, n in counters[k].items()}


def _break_reason(text: str) -> str:
    """Dynamo's graph-break message in one line: its title and its explanation."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    if not lines:
        return ""
    why = next((ln.removeprefix("Explanation:").strip() for ln in lines[1:] if ln.startswith("Explanation:")), "")
    return f"{lines[0]}: {why[:200]}" if why else lines[0]


def run_under_dynamo(fn, args: tuple, backend) -> Any:
    """fn(*args) once under TorchDynamo with `backend` (static shapes, graph breaks allowed, no grad),
    Dynamo's caches reset before and after so nothing compiled is left behind."""
    import torch

    torch._dynamo.reset()
    try:
        compiled = torch.compile(fn, backend=backend, dynamic=False, fullgraph=False)
        with torch.no_grad(), _QuietDynamo():
            return compiled(*args)
    finally:
        torch._dynamo.reset()


def capture(target: Target) -> tuple[list, list[str]]:
    """(a TraceGraph per graph TorchDynamo captured, in the order they ran; the graph-break reasons)."""
    from forge.trace import TraceGraph

    graphs: list = []

    def record(gm, example_inputs):
        state = {"recorded": False}

        def run(*args):
            if state["recorded"]:  # a graph called again (a loop around a graph break): run it plainly
                return gm.forward(*args)
            state["recorded"] = True
            g = TraceGraph.from_graph(gm, args)  # the graph's one execution, every value recorded
            graphs.append(g)
            return g.output

        return run

    before = _break_counts()
    try:
        run_under_dynamo(target.fn, target.args, record)
    except UsageError:
        raise
    except Exception as exc:  # noqa: BLE001 - Dynamo or the user's code failed; say why, no traceback
        raise UsageError(f"{target.description}: cannot trace: TorchDynamo could not capture it: "
                         f"{_first_lines(exc)}") from None
    after = _break_counts()
    breaks = []
    for key, n in after.items():
        breaks.extend([_break_reason(key[1]) or key[0]] * (n - before.get(key, 0)))
    if not graphs:
        raise UsageError(f"{target.description}: cannot trace: TorchDynamo captured no graph (no tensor "
                         "operation ran in code it could compile)" + (f"; graph breaks: {'; '.join(breaks)}"
                                                                      if breaks else ""))
    return graphs, breaks


def trace(target: Target, device: str) -> TraceResult:
    graphs, breaks = capture(target)
    names = param_names(target.fn)
    regions: list[Region] = []
    unmatched: list[Unmatched] = []
    for i, g in enumerate(graphs):
        r, u = find_regions(g, device, i, names)
        regions.extend(r)
        unmatched.extend(u)
    for i, r in enumerate(regions):
        r.index = i
    return TraceResult(target, regions, unmatched, graphs, breaks)


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
        labels[u.node] = _other_label(u)
    return labels


def _other_label(u: Unmatched) -> str:
    return f"forge_other_{u.graph}_{u.node.name}"


def profile(result: TraceResult, iters: int = 5) -> dict[str, Any]:
    """Time per region with torch.profiler: each node runs inside a range named after its region, so
    every kernel is counted once (in the range that launched it), never as both aten op and kernel.
    CUDA: device time of the kernels in each range; CPU: the ranges' own CPU time. Each captured graph
    runs on the inputs it was captured with; time between graphs (eager code at graph breaks) is not
    counted."""
    import torch
    from torch.profiler import ProfilerActivity, record_function

    labels = _labels(result)
    cuda = any(isinstance(a, torch.Tensor) and a.is_cuda for a in result.target.args) or any(
        isinstance(v, torch.Tensor) and v.is_cuda for g in result.graphs for v in (g.values.get(p) for p in
                                                                                 g.placeholders))
    runs = []
    for g in result.graphs:
        class Ranged(g.fx.Interpreter):
            def run_node(self, n):
                label = labels.get(n)
                if label is None:
                    return super().run_node(n)
                with record_function(label):
                    return super().run_node(n)

        runs.append((Ranged(g.gm), [g.values[p] for p in g.placeholders]))

    def run_all():
        for runner, args in runs:
            runner.run(*args)

    with torch.no_grad():
        for _ in range(2):
            run_all()
        if cuda:
            torch.cuda.synchronize()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(iters):
                run_all()
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
        u.seconds = per.get(_other_label(u), 0.0) / 1e6
    frac = {r.index: (r.seconds * 1e6 / total if total else 0.0) for r in result.regions}
    sped = sum(frac[r.index] / (r.speedup or 1.0) for r in result.regions)
    covered = sum(frac.values())
    estimate = 1.0 / ((1.0 - covered) + sped) if total else None
    result.profile = {"clock": "device (CUDA kernels)" if cuda else "host CPU", "iters": iters,
                      "total_us": total, "covered_fraction": covered, "amdahl_speedup": estimate,
                      "graphs": len(result.graphs)}
    return result.profile


# -- verify ----------------------------------------------------------------------------------------
# Relative-norm tolerance of the whole output by dtype: each swapped kernel already passed the per-op
# gate (opkit tolerances); end to end, several ops' rounding differences add up, and bf16 carries
# 8 mantissa bits (2^-8 = 0.4% per rounding).
VERIFY_TOL = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}


def swapped_graphs(result: TraceResult, cache, backend: str) -> tuple[list, dict[int, str]]:
    """A copy of each captured graph with each region that has a cached kernel replaced by that kernel.
    Returns ([GraphModule per graph], {region index: 'kernel' | reason})."""
    import torch.fx as fx

    from forge.shim import load

    status: dict[int, str] = {}
    modules = []
    for gi, g in enumerate(result.graphs):
        gm = fx.GraphModule(g.gm, g.gm.graph.__deepcopy__())
        nodes = {n.name: n for n in gm.graph.nodes}
        for r in (r for r in result.regions if r.graph == gi):
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
                if isinstance(leaf, str):  # a module parameter by qualified name (a get_attr of the graph)
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
        modules.append(gm)
    return modules, status


def _graph_key(gm, inputs) -> tuple:
    """What identifies a captured graph across two captures: its code and its inputs' shapes/dtypes."""
    import torch

    metas = tuple((tuple(t.shape), str(t.dtype), t.device.type) if isinstance(t, torch.Tensor) else repr(t)
                  for t in inputs)
    return gm.code, metas


def _tensor_leaves(out) -> list:
    import torch
    from torch.utils._pytree import tree_flatten

    return [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]


def compare_outputs(ref, got) -> dict[str, Any]:
    """Every tensor of the output (pytree leaves: a tensor, tuples, HF ModelOutputs) against eager: the
    relative norm error of each floating tensor against its dtype's tolerance, other tensors exactly.
    The worst tensor (error / tolerance) is reported."""
    import torch

    refs, gots = _tensor_leaves(ref), _tensor_leaves(got)
    if not refs:
        raise UsageError("--verify compares tensor outputs; the target returned none")
    worst = None
    ok = len(refs) == len(gots)
    for r, g in zip(refs, gots, strict=False):
        if r.shape != g.shape or r.dtype != g.dtype:
            ok = False
            continue
        if not r.is_floating_point():
            ok = ok and bool(torch.equal(r, g))
            continue
        dtype = dtype_name(r.dtype) if dtype_name(r.dtype) in DTYPES else "float32"
        tol = VERIFY_TOL[dtype]
        r64, g64 = r.double(), g.double()
        finite = bool((torch.isfinite(g64) == torch.isfinite(r64)).all())
        both = torch.isfinite(r64) & torch.isfinite(g64)
        diff = torch.where(both, g64 - r64, torch.zeros_like(r64))
        err = float(torch.linalg.vector_norm(diff)) / max(float(torch.linalg.vector_norm(
            torch.where(both, r64, torch.zeros_like(r64)))), 1e-300)
        max_abs = float(diff.abs().max()) if r.numel() else 0.0
        ok = ok and finite and err <= tol
        score = (err / tol) if finite else float("inf")
        if worst is None or score > worst[0]:
            worst = (score, err, max_abs, tol, dtype)
    if worst is None:
        worst = (0.0, 0.0, 0.0, 0.0, dtype_name(refs[0].dtype))
    _, err, max_abs, tol, dtype = worst
    return {"ok": ok, "rel_error": err, "max_abs_error": max_abs, "tolerance": tol, "dtype": dtype,
            "tensors": len(refs)}


def verify(result: TraceResult, cache, backend: str, iters: int = 20) -> dict[str, Any]:
    """Run the target under TorchDynamo again, each captured graph swapped for its copy with the cached
    kernels, and compare with eager end to end. The second capture must give the graphs the first did
    (same code, same input shapes); where it does not, this says it cannot verify (a usage error)
    rather than compare a run that did not use the swapped graphs."""
    import torch

    modules, status = swapped_graphs(result, cache, backend)
    table: dict = {}
    for g, gm in zip(result.graphs, modules, strict=True):
        table.setdefault(_graph_key(g.gm, [g.values[p] for p in g.placeholders]), gm)
    used: set = set()
    unknown: list[str] = []

    def swap(gm, example_inputs):
        key = _graph_key(gm, example_inputs)
        if key not in table:
            unknown.append(f"{len(list(gm.graph.nodes))} nodes")
            return gm.forward
        used.add(key)
        return table[key].forward

    target = result.target
    with torch.no_grad():
        ref = target.fn(*target.args)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(target.fn, backend=swap, dynamic=False, fullgraph=False)
        with torch.no_grad(), _QuietDynamo():
            got = compiled(*target.args)
        if unknown or used != set(table):
            raise UsageError(f"--verify: cannot verify: capturing {target.description} again gave other graphs "
                             f"({len(unknown)} not seen before, {len(set(table) - used)} of the first capture "
                             "not run), so the swapped kernels would not be what runs")
        cmp = compare_outputs(ref, got)

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

        eager_us = timed(lambda: target.fn(*target.args))
        forge_us = timed(lambda: compiled(*target.args))
    finally:
        torch._dynamo.reset()
    return {**cmp, "eager_us": eager_us, "forge_us": forge_us, "speedup": eager_us / forge_us if forge_us else None,
            "regions": {str(k): v for k, v in status.items()}, "graphs": len(result.graphs),
            "swapped": sum(v == "kernel" for v in status.values()),
            "clock": "host wall time per call (the forge run under TorchDynamo)"}
