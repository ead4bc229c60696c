"""`forge trace`: find the ops forge can tune inside a user's model or function.

A target is a KernelBench-style problem file (`Model(nn.Module)`, `get_inputs()`, optional
`get_init_inputs()`), `FILE.py:function` with `--input 2048x4096:float16 ...` (or the file's
get_inputs()), or `FILE.py:name` of an nn.Module instance. The target runs once on its real inputs
under TorchDynamo (`torch.compile` with a recording backend, no grad, static shapes, graph breaks
allowed): each graph Dynamo captures is run through forge/trace.py's recorder as it executes (so every
node's real value, shape, strides and dtype is known), and Dynamo's state is reset before and after.
A graph break (data-dependent control flow, a print, an unsupported call) gives several graphs; each
is listed, and its graph is split into regions, each matched to an op family (forge/regions.py).

`--profile` attributes run time to every call of the captured graphs, matched or not (each graph node
runs inside one profiler range, so a kernel is counted once, in the range that launched it; time
outside the captured graphs is not attributed) and ranks them, `--write-manifest` writes the matched
(op, shape, dtype, attrs) for `forge search --manifest` (with each entry's share of the profiled time
when profiled), and `--verify` runs the target again under TorchDynamo with each captured
graph replaced by a copy in which every region that has a cached kernel calls that kernel, and
compares every tensor of the output with eager end to end (if the second capture does not give the
same graphs, it says it cannot verify rather than compare something else).
"""

from __future__ import annotations

import functools
import importlib.util
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forge import ops
from forge.cache import WINNING
from forge.errors import EnvironmentProblem, UsageError
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


def out_of_memory_is_environment(what: str):
    """Decorator: the user's model running out of memory while `what` (host or GPU) is an environment
    limit, exit 3 naming the free memory and what to do (issue 15), never a crash or 'cannot trace'."""

    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            from forge.tuner import memory

            try:
                return fn(*args, **kwargs)
            except Exception as exc:
                if not memory.is_oom(exc):
                    raise
                import torch

                cuda = type(exc).__name__ == "OutOfMemoryError" and torch.cuda.is_available()
                backend = "cuda" if cuda else "interpreter"  # the GPU's allocator, else the host's memory
                del exc  # its traceback holds the frames' tensors: free them before measuring
                memory.give_back(backend)
                free, total = memory.free_memory(backend)
                where = "the GPU" if backend == "cuda" else "this host"
                have = (f"{memory.gib(free)} of {memory.gib(total)} free on {where} now" if free is not None
                        and total else "free memory unknown")
                raise EnvironmentProblem(
                    f"{what}: the target ran out of memory ({have}). Trace a smaller input (--input, or the "
                    "file's get_inputs()), or free the memory other processes hold; tracing keeps every "
                    "intermediate value of one forward, verifying keeps eager's output beside forge's"
                ) from None

        return inner

    return wrap


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
        from forge.tuner import memory

        if memory.is_oom(exc):
            raise  # trace()'s decorator: exit 3 with the numbers, not "cannot trace"
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


@out_of_memory_is_environment("tracing")
def trace(target: Target, device: str, cache=None, backend: str | None = None) -> TraceResult:
    """The target's regions and unmatched calls. With a cache (and the backend its keys are for), a region
    whose cached decision is eager is split into its parts, as the forge backend splits it
    (forge/regions.py find_regions' split), so the regions listed are the ones the backend would run."""
    graphs, breaks = capture(target)
    names = param_names(target.fn)
    regions: list[Region] = []
    unmatched: list[Unmatched] = []

    def split(r: Region) -> bool:
        entry = _cached(r, cache, backend) if cache is not None and backend is not None else None
        return entry is not None and entry.decision == "eager" and len(r.nodes) > 1

    for i, g in enumerate(graphs):
        r, u = find_regions(g, device, i, names, split=split)
        regions.extend(r)
        unmatched.extend(u)
    for i, r in enumerate(regions):
        r.index = i
    return TraceResult(target, regions, unmatched, graphs, breaks)


def annotate_with_cache(result: TraceResult, cache, backend: str) -> None:
    """Each tunable region's cached decision and speedup on this machine, if any."""
    for r in result.regions:
        entry = _cached(r, cache, backend)
        if entry is not None:
            r.decision, r.speedup = entry.decision, (entry.speedup if entry.decision in WINNING else 1.0)


def _cached(r: Region, cache, backend: str):
    """The region's cache entry on this machine, or None (not tunable, or not tuned)."""
    from forge import key as keys

    if r.unsupported or r.shape is None:
        return None
    fam = ops.get(r.op)
    spec = fam.module.make_spec(r.shape, r.dtype, keys.spec_device(backend), r.attrs)
    return cache.get(keys.locate(fam, spec, backend).key)


# -- manifest --------------------------------------------------------------------------------------
SHARE_DIGITS = 6  # a share is written rounded to 6 decimals (1 ppm of the model's time)


def manifest_entries(regions: list[Region], total_us: float | None = None) -> list[dict[str, Any]]:
    """The tunable regions as [[op]] entries for a manifest.

    Without a profile (total_us None or 0): one [[op]] per (op, dtype, attrs) listing every distinct
    shape, in first-seen order. With one (total_us: profile()'s total, the regions' `seconds` set): one
    [[op]] per (op, shape, dtype, attrs) with `share` = the fraction of the profiled time its regions
    took (summed over every region of that job), largest share first, so each job's share is exact."""
    grouped: dict[tuple, dict[str, Any]] = {}
    for r in regions:
        if r.unsupported or r.shape is None:
            continue
        s = "x".join(map(str, r.shape))
        attrs = tuple(sorted(r.attrs.items()))
        if total_us:
            e = grouped.setdefault((r.op, s, r.dtype, attrs),
                                   {"op": r.op, "shape": s, "dtype": r.dtype, **r.attrs, "share": 0.0})
            e["share"] += r.seconds * 1e6 / total_us
            continue
        e = grouped.setdefault((r.op, r.dtype, attrs), {"op": r.op, "shapes": [], "dtype": r.dtype, **r.attrs})
        if s not in e["shapes"]:
            e["shapes"].append(s)
    entries = list(grouped.values())
    if total_us:
        for e in entries:
            e["share"] = min(1.0, round(e["share"], SHARE_DIGITS))
        entries.sort(key=lambda e: -e["share"])
    return entries


# -- profile ---------------------------------------------------------------------------------------
def _labels(result: TraceResult) -> tuple[dict, list]:
    """({node: profiler range name}, the calls in neither a region nor the unmatched list: (graph, node)).
    Every call node of every captured graph gets a range, so every kernel the graphs run is attributed.
    The third kind are calls whose value is not one tensor (a tuple from split/chunk/max(dim), a scalar):
    regions and the unmatched list hold tensor-valued calls only. A getitem of such a tuple launches nothing
    and is left out."""
    import operator

    labels = {}
    for r in result.regions:
        for n in r.nodes:
            labels[n] = f"forge_region_{r.index}"
    for u in result.unmatched:
        labels[u.node] = _node_label(u.graph, u.node)
    others = []
    for gi, g in enumerate(result.graphs):
        for n in g.gm.graph.nodes:
            if n.op.startswith("call_") and n not in labels and n.target is not operator.getitem:
                labels[n] = _node_label(gi, n)
                others.append((gi, n))
    return labels, others


def _node_label(graph: int, node) -> str:
    return f"forge_other_{graph}_{node.name}"


def _describe(node) -> str:
    t = node.target
    return f"{node.op.replace('call_', '')} {t if isinstance(t, str) else getattr(t, '__name__', str(t))}"


def ranking(result: TraceResult, other_us: dict | None = None) -> list[dict[str, Any]]:
    """Every profiled call of the captured graphs, largest time first: regions (tunable or not), unmatched
    calls and the other calls (other_us: {(graph, node name): µs}); each with its µs per run, its share
    of the profiled time and the running total of the shares."""
    rows = []
    for r in result.regions:
        rows.append({"kind": "region" if r.unsupported is None else "region (not tunable)", "graph": r.graph,
                     "region": r.index, "node": r.root.name, "what": r.label, "reason": r.unsupported,
                     "us": r.seconds * 1e6})
    for u in result.unmatched:
        rows.append({"kind": "unmatched", "graph": u.graph, "region": None, "node": u.node.name,
                     "what": f"{u.call} {'x'.join(map(str, u.shape))}", "reason": u.reason, "us": u.seconds * 1e6})
    for (gi, name), (call, us) in (other_us or {}).items():
        rows.append({"kind": "other", "graph": gi, "region": None, "node": name, "what": call,
                     "reason": "not a single tensor value (a tuple or a scalar): no op family takes it", "us": us})
    total = sum(row["us"] for row in rows)
    rows.sort(key=lambda row: -row["us"])
    running = 0.0
    for row in rows:
        row["share"] = row["us"] / total if total else 0.0
        running += row["share"]
        row["cumulative"] = running
    return rows


@out_of_memory_is_environment("profiling (--profile)")
def profile(result: TraceResult, iters: int = 5) -> dict[str, Any]:
    """Time per region with torch.profiler: each node runs inside a range named after its region, so
    every kernel is counted once (in the range that launched it), never as both aten op and kernel.
    CUDA: device time of the kernels in each range; CPU: the ranges' own CPU time. Each captured graph
    runs on the inputs it was captured with; time between graphs (eager code at graph breaks) is not
    counted."""
    import torch
    from torch.profiler import ProfilerActivity, record_function

    labels, others = _labels(result)
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
        u.seconds = per.get(_node_label(u.graph, u.node), 0.0) / 1e6
    other_us = {(gi, n.name): (_describe(n), per.get(_node_label(gi, n), 0.0)) for gi, n in others}
    frac = {r.index: (r.seconds * 1e6 / total if total else 0.0) for r in result.regions}
    sped = sum(frac[r.index] / (r.speedup or 1.0) for r in result.regions)
    covered = sum(frac.values())
    estimate = 1.0 / ((1.0 - covered) + sped) if total else None
    result.profile = {"clock": "device (CUDA kernels)" if cuda else "host CPU", "iters": iters,
                      "total_us": total, "covered_fraction": covered, "amdahl_speedup": estimate,
                      "graphs": len(result.graphs), "ranking": ranking(result, other_us)}
    return result.profile


# -- verify ----------------------------------------------------------------------------------------
# Relative-norm tolerance of the whole output by dtype: each swapped kernel already passed the per-op
# gate (opkit tolerances); end to end, several ops' rounding differences add up, and bf16 carries
# 8 mantissa bits (2^-8 = 0.4% per rounding).
VERIFY_TOL = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}


def _tensor_leaves(out) -> list:
    import torch
    from torch.utils._pytree import tree_flatten

    return [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]


# Elements per float64 chunk when comparing outputs (issue 15: a model's logits, 4x1024x128256 bf16, are
# 4.2 GiB in float64; whole-tensor copies and their temporaries took several times that). 2**24 elements
# keep each float64 temporary at 128 MiB.
VERIFY_CHUNK = 1 << 24


def _relative_error(r, g) -> tuple[bool, float, float]:
    """(the same elements finite in both, ||g - r|| / ||r|| over the elements finite in both, max |g - r|),
    in float64, chunk by chunk over the flattened tensors: the float64 working set stays bounded."""
    import torch

    rf, gf = r.reshape(-1), g.reshape(-1)
    finite, diff2, ref2, max_abs = True, 0.0, 0.0, 0.0
    for start in range(0, rf.numel(), VERIFY_CHUNK):
        r64 = rf[start:start + VERIFY_CHUNK].double()
        g64 = gf[start:start + VERIFY_CHUNK].double()
        fin_r, fin_g = torch.isfinite(r64), torch.isfinite(g64)
        finite = finite and bool(torch.equal(fin_r, fin_g))
        both = fin_r & fin_g
        diff = torch.where(both, g64 - r64, 0.0)
        diff2 += float(torch.linalg.vector_norm(diff)) ** 2
        ref2 += float(torch.linalg.vector_norm(torch.where(both, r64, 0.0))) ** 2
        max_abs = max(max_abs, float(diff.abs().max()))
        del r64, g64, diff, both, fin_r, fin_g
    return finite, diff2 ** 0.5 / max(ref2 ** 0.5, 1e-300), max_abs


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
        finite, err, max_abs = _relative_error(r, g)
        ok = ok and finite and err <= tol
        score = (err / tol) if finite else float("inf")
        if worst is None or score > worst[0]:
            worst = (score, err, max_abs, tol, dtype)
    if worst is None:
        worst = (0.0, 0.0, 0.0, 0.0, dtype_name(refs[0].dtype))
    _, err, max_abs, tol, dtype = worst
    return {"ok": ok, "rel_error": err, "max_abs_error": max_abs, "tolerance": tol, "dtype": dtype,
            "tensors": len(refs)}


@out_of_memory_is_environment("verifying (--verify)")
def verify(result: TraceResult, cache, backend: str, iters: int = 20) -> dict[str, Any]:
    """Run the target through the forge TorchDynamo backend (forge/backend.py: each region with a cached
    kernel runs it, guarded; nothing is searched) and compare every output tensor with eager end to end.
    Reports the speedup per forward as host wall time and, on CUDA, as device time (the kernels' own
    time, torch.profiler), and the share of the forge run's device time spent in forge kernels."""
    import torch

    from forge.backend import Backend

    target = result.target
    with torch.no_grad():
        ref = target.fn(*target.args)
    be = Backend(miss="eager", cache=cache.path, interpreter=backend == "interpreter")
    torch._dynamo.reset()
    try:
        compiled = torch.compile(target.fn, backend=be, dynamic=False, fullgraph=False)
        with torch.no_grad(), _QuietDynamo():
            compiled(*target.args)  # the first call plans each graph (and returns the recorded run)
            got = compiled(*target.args)
        cmp = compare_outputs(ref, got)
        report = be.explain()
        cuda = backend == "cuda"

        def timed(fn) -> float:
            with torch.no_grad():
                for _ in range(3):
                    fn()
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(iters):
                    fn()
                if cuda:
                    torch.cuda.synchronize()
            return (time.perf_counter() - t0) / iters * 1e6

        eager_us = timed(lambda: target.fn(*target.args))
        forge_us = timed(lambda: compiled(*target.args))
        device = _device_times(lambda: target.fn(*target.args), lambda: compiled(*target.args), iters,
                               be.kernel_names()) if cuda else None
    finally:
        torch._dynamo.reset()
    by_node = {(r.graph, r.node): r for r in report.regions}
    status = {}
    for r in result.regions:
        seen = by_node.get((r.graph, r.root.name))
        if seen is None:
            status[r.index] = "not run (the backend's capture did not reach this region)"
        else:
            status[r.index] = seen.uses if seen.uses in ("kernel", "torch") else f"eager ({seen.reason})"
    doc = {**cmp, "eager_us": eager_us, "forge_us": forge_us, "speedup": eager_us / forge_us if forge_us else None,
           "regions": {str(k): v for k, v in status.items()}, "graphs": report.graphs, "swapped": report.kernels,
           "torch_ops": report.torch_ops,
           "clock": "host wall time per call (the forge run under TorchDynamo)"}
    if device is not None:
        doc.update(device)
    return doc


def _device_times(eager, forged, iters: int, names: frozenset) -> dict[str, Any]:
    """Device time per forward of both runs (every kernel, copy and set once, from torch.profiler's
    device events) and the share of the forge run's device time in forge kernels, told apart by their
    Triton function names (`names`: Triton's C launcher calls cuLaunchKernel directly, and the profiler
    does not tie such launches to a Python range around them)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity

    def kernels(fn) -> tuple[float, float]:
        with torch.no_grad():
            fn()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                for _ in range(iters):
                    fn()
                torch.cuda.synchronize()
        total = forge = 0.0
        for e in prof.events():
            if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False):
                total += e.device_time_total
                if e.name in names:
                    forge += e.device_time_total
        return total / iters, forge / iters

    eager_dev, _ = kernels(eager)
    forge_dev, in_forge = kernels(forged)
    return {"eager_device_us": eager_dev, "forge_device_us": forge_dev,
            "device_speedup": eager_dev / forge_dev if forge_dev else None,
            "forge_kernel_share": in_forge / forge_dev if forge_dev else None}
