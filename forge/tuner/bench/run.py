"""`forge bench`: validate every contestant against the float64 oracle, time them interleaved with the
search's final sampling, and put each against eager and the roofline."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forge import fused as fused_ops
from forge import key as keys
from forge import ops
from forge.cache import Cache
from forge.env import collect_env
from forge.loader import load_module, write_source
from forge.spec import KernelSpec
from forge.tuner import engine, memory, stats
from forge.tuner.bench import contestants as refs
from forge.tuner.bench._common import Events, _fmt_params, _short
from forge.tuner.bench.peaks import Peaks, device_peaks
from forge.tuner.bench.roofline import roofline_model, roofline_pct
from forge.tuner.bench.targets import Target, prepare_backend
from forge.tuner.lock import device_lock
from forge.tuner.status import Status

# Validation inputs of the bench: a seed the search never used for validation (seed + 1000 * i) or timing
# (seed + 77 + i), so the cached kernel is checked on data it was not chosen on.
BENCH_VALIDATION_SEED = 4242


@dataclass
class BenchOptions:
    seed: int = 0
    rounds: int | None = None  # interleaved rounds; None: the search's finals (engine.SAMPLING)
    skip: frozenset[str] = frozenset()
    max_autotune: bool = False
    remeasure_peaks: bool = False
    timeout: float = 120.0  # --recheck: seconds per worker request
    drift_floor: float = stats.DRIFT_FLOOR


@dataclass
class ContestantResult:
    name: str
    label: str
    # ok | mismatch | error | oom | skipped | refused (forge: fails verify_entry)
    status: Status = Status.PENDING
    reason: str | None = None
    clock: str | None = None  # cuda-graph | cuda-events | host
    note: str | None = None
    quantiles: stats.Quantiles | None = None
    inexact: str | None = None  # eager outside the op's tolerance: timed, then status mismatch (_validate)
    speedup: float | None = None  # eager p50 / this p50
    roofline: dict[str, float] | None = None
    # not serialized: how to run it
    call: Callable[[tuple], Any] | None = field(default=None, repr=False)
    timing: Callable[[Any], Callable[[int], None]] | None = field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        r = self.roofline or {}
        return {"name": self.name, "label": self.label, "status": self.status, "reason": self.reason,
                "clock": self.clock, "note": self.note,
                "quantiles": self.quantiles.to_dict() if self.quantiles else None,
                "speedup": self.speedup, "pct_roofline": r.get("pct_roofline"),
                "achieved_tbps": r.get("achieved_tbps"), "achieved_tflops": r.get("achieved_tflops")}


@dataclass
class TargetResult:
    target: Target
    contestants: list[ContestantResult] = field(default_factory=list)
    model: dict[str, Any] | None = None
    seconds: float = 0.0
    # Why nothing could be judged: forge's own validation inputs or float64 oracle ran out of memory
    # (every contestant is then oom). The command exits 3 for it (issue 15: never 1, never silent 0).
    out_of_memory: str | None = None

    @property
    def fastest(self) -> str | None:
        ok = [c for c in self.contestants if c.quantiles is not None and c.status == Status.OK]
        return min(ok, key=lambda c: c.quantiles.p50).name if ok else None

    def contestant(self, name: str) -> ContestantResult | None:
        return next((c for c in self.contestants if c.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        t, e = self.target, self.target.entry
        stored = None
        if e is not None:
            stored = {"decision": e.decision, "variant": e.variant, "params": e.params, "winner": e.winner,
                      "baseline": e.baseline, "speedup": e.speedup}
        return {"op": t.op, "shape": t.shape_str, "dtype": t.dtype, "attrs": t.attrs, "key": t.key,
                "error": t.error, "out_of_memory": self.out_of_memory, "stored": stored, **(self.model or {}),
                "contestants": [c.to_dict() for c in self.contestants], "fastest": self.fastest,
                "seconds": round(self.seconds, 3)}


@dataclass
class BenchReport:
    backend: str
    env: dict[str, Any]
    cache_path: str
    peaks: Peaks | None
    results: list[TargetResult]
    options: BenchOptions
    seconds: float = 0.0

    @property
    def missing(self) -> list[TargetResult]:
        return [r for r in self.results if r.target.error]

    @property
    def bad_kernels(self) -> list[TargetResult]:
        """Targets whose cached kernel failed its sha256 or the oracle check (the cache must not serve it)."""
        return [r for r in self.results
                if (c := r.contestant("forge")) is not None
                and c.status in (Status.REFUSED, Status.MISMATCH, Status.ERROR)]

    @property
    def out_of_memory(self) -> list[TargetResult]:
        """Targets nothing could be judged on: forge's validation inputs or oracle ran out of memory."""
        return [r for r in self.results if r.out_of_memory]

    def to_dict(self) -> dict[str, Any]:
        return {"mode": "bench", "backend": self.backend,
                "timing_clock": ("device: CUDA-graph replays (cuda-events where a contestant cannot be captured)"
                                 if self.backend == "cuda" else "host (Triton interpreter)"),
                "env": self.env, "cache": self.cache_path, "peaks": self.peaks.to_dict() if self.peaks else None,
                "rounds": self.options.rounds or engine.SAMPLING[self.backend].final_rounds, "seed": self.options.seed,
                "targets": [r.to_dict() for r in self.results], "missing": len(self.missing),
                "bad_kernels": len(self.bad_kernels), "out_of_memory": len(self.out_of_memory),
                "seconds": round(self.seconds, 3)}


def _contestants(target: Target, backend: str, src_dir: Path, opts: BenchOptions) -> list[ContestantResult]:
    opmod = ops.get(target.op).module
    spec, entry, attrs = target.spec, target.entry, target.spec.attrs
    out: list[ContestantResult] = []

    def generic(fn: Callable) -> tuple[Callable, Callable]:
        # timed through Bench.call_fn: its results rotate over output buffers as forge's kernels' outputs do
        return (lambda inputs: fn(inputs, attrs)), (lambda bench: bench.call_fn(lambda inputs: fn(inputs, attrs)))

    # forge: the cached winner
    torch_op = fused_ops.candidate(target.op, attrs, spec) if entry.decision == "torch" else None
    label = (f"{entry.variant}({_fmt_params(entry.params)})" if entry.decision == "kernel" else
             f"torch op {torch_op.label}" if torch_op is not None else f"({entry.decision} decision)")
    c = ContestantResult("forge", label)
    if "forge" in opts.skip:
        c.status, c.reason = Status.SKIPPED, "--skip forge"
    elif entry.decision == "torch":  # what forge serves for this spec: torch's fused op (forge/fused.py)
        other = fused_ops.timed_other_call(entry.candidates, torch_op) if torch_op is not None else None
        if torch_op is None:
            c.status, c.reason = Status.REFUSED, (f"the cached decision is a torch op, but this forge knows none for "
                                                  f"{target.op} {attrs}; forge cache rm {entry.key[:12]}")
        elif other is not None:
            c.status, c.reason = Status.REFUSED, f"{other}: search again (--force)"
        else:
            c.call, c.timing = generic(torch_op.fn)
    elif entry.decision != "kernel":
        c.status, c.reason = Status.SKIPPED, "the cached decision is eager: no kernel beat eager by the margin"
    elif not keys.source_intact(entry):
        c.status, c.reason = Status.REFUSED, ("the cached source does not match its sha256 (edited after the search): "
                                              f"not loaded; forge cache rm {entry.key[:12]}, then search again")
    elif (problem := keys.verify_entry(entry)) is not None:  # checked before anything is imported
        c.status, c.reason = Status.REFUSED, (f"not loaded: {problem}; forge cache rm {entry.key[:12]}, "
                                              "then search again")
    else:
        try:
            module = load_module(write_source(entry.source, src_dir))
        except Exception as exc:  # noqa: BLE001 - a cached module that no longer imports
            c.status, c.reason = Status.ERROR, f"the cached source does not import: {_short(exc)}"
        else:
            def run_forge(inputs, module=module):
                from forge.tuner.validate import poison

                res = opmod.alloc_output(inputs, spec)
                poison(res)
                opmod.run(module, inputs, res, attrs)
                return res

            c.call = run_forge
            c.timing = lambda bench, module=module: bench.candidate_fn(module)
    out.append(c)

    # eager: the op's reference, the search's baseline
    c = ContestantResult("eager", f"kernels/{target.op}.py reference")
    c.call = lambda inputs: opmod.reference(inputs, attrs)
    c.timing = lambda bench: bench.baseline_fn()
    out.append(c)

    # fused torch op
    fused = fused_ops.get(target.op, attrs)
    c = ContestantResult("fused", fused.label if isinstance(fused, refs.Fused) else "-")
    if isinstance(fused, str):
        c.status, c.reason = Status.SKIPPED, fused
    elif "fused" in opts.skip:
        c.status, c.reason = Status.SKIPPED, "--skip fused"
    elif fused.is_eager_call(attrs, spec):
        c.status, c.reason = Status.SKIPPED, f"same as eager: the op's eager reference already is {fused.label}"
    else:
        c.call, c.timing = generic(fused.fn)
    out.append(c)

    # torch.compile of the reference
    modes = [("compile", None)]
    if opts.max_autotune:
        modes.append(("compile-max-autotune", "max-autotune-no-cudagraphs"))
    for name, mode in modes:
        c = ContestantResult(name, f"torch.compile(reference{', mode=' + repr(mode) if mode else ''})")
        if name in opts.skip:
            c.status, c.reason = Status.SKIPPED, f"--skip {name}"
        elif backend == "interpreter" and refs._cpp_compiler() is None:
            c.status, c.reason = Status.SKIPPED, ("torch.compile on the CPU needs a C++ compiler (g++, clang++ or "
                                                  "$CXX); none found")
        else:
            try:
                import torch

                kwargs: dict[str, Any] = {"dynamic": False}
                if mode:
                    kwargs["mode"] = mode
                # the op's natural spelling where it has one (add_norm's (y, h) pair; `reference` writes the
                # (2, ...) layout through out= ops, which Inductor functionalizes into copies)
                natural = getattr(opmod, "reference_parts", None) or opmod.reference
                compiled = torch.compile(refs._fresh_function(natural, name.replace("-", "_")), **kwargs)
            except Exception as exc:  # noqa: BLE001 - e.g. an unsupported Python for dynamo
                c.status, c.reason = Status.SKIPPED, f"torch.compile is unavailable: {_short(exc)}"
            else:
                c.call, c.timing = generic(compiled)
        out.append(c)

    # Liger-Kernel
    c = ContestantResult("liger", "-")
    if "liger" in opts.skip:
        c.status, c.reason = Status.SKIPPED, "--skip liger"
    else:
        try:
            c.label, fn = refs._liger(target.op)
        except refs._Unavailable as exc:
            c.status, c.reason = Status.SKIPPED, str(exc)
        else:
            c.call, c.timing = generic(fn)
    out.append(c)
    return out


def _memory_note(opmod, spec: KernelSpec, backend: str) -> str:
    """The numbers an out-of-memory outcome is reported with: forge's estimate and the free memory now."""
    free, total = memory.free_memory(backend)
    where = "the GPU" if backend == "cuda" else "this host"
    have = (f"{memory.gib(free)} of {memory.gib(total)} free on {where}" if free is not None and total
            else "free memory unknown")
    return f"forge estimates {memory.estimate(opmod, spec).describe()}; {have}"


def _out_of_memory(c: ContestantResult, exc: BaseException, opmod, spec: KernelSpec, backend: str,
                   what: str = "out of memory") -> None:
    c.status, c.reason = Status.OOM, f"{what}: {_short(exc)} [{_memory_note(opmod, spec, backend)}]"


def _validate(contestants: list[ContestantResult], opmod, spec: KernelSpec, seed: int, sync: Callable,
              backend: str = "cuda") -> str | None:
    """Run each pending contestant once on fresh inputs (a private clone each, so one that writes into
    its inputs cannot affect the next) and compare with the float64 oracle. Out of memory is an outcome:
    a contestant's own is its status oom; forge's (the inputs, the oracle) leaves every pending contestant
    oom, not validated and not timed, with the numbers, and its reason is returned (None otherwise)."""
    import torch

    from forge.tuner.validate import compare

    pending = [c for c in contestants if c.status == Status.PENDING]
    try:
        inputs = opmod.make_inputs(spec, seed + BENCH_VALIDATION_SEED, "normal")
        with torch.no_grad():
            ref = opmod.oracle(inputs, spec.attrs)
    except Exception as exc:
        if not memory.is_oom(exc):
            raise
        inputs = ref = None
        memory.give_back(backend)
        why = ("forge's validation inputs or float64 oracle ran out of memory (bench a smaller shape, or free "
               f"the memory other processes hold): {_short(exc)} [{_memory_note(opmod, spec, backend)}]")
        for c in pending:
            c.status, c.reason = Status.OOM, f"not validated, not timed: {why}"
        return why
    tol = opmod.tolerance(spec.dtype)
    for c in pending:
        try:
            res = c.call(tuple(t.clone() for t in inputs))
            if isinstance(res, (tuple, list)):  # a contestant's parts (y, h): the op's stacked layout, untimed
                res = torch.stack(res)
            sync()
        except refs._Unavailable as exc:  # a peer without this spec (Liger's norms over another dim)
            c.status, c.reason = Status.SKIPPED, str(exc)
            continue
        except Exception as exc:  # noqa: BLE001 - a contestant may raise anything (compile errors too)
            if memory.is_oom(exc):
                memory.give_back(backend)
                _out_of_memory(c, exc, opmod, spec, backend)
            else:
                c.status, c.reason = Status.ERROR, _short(exc)
            continue
        reason = compare(res, ref, tol)
        del res
        if reason is not None and c.name == "eager":
            # the user's code as written (a bf16 formula rounding at every step, a residual add that cancels):
            # less exact than forge must be, and still what the user runs and every speedup is against. Timed
            # anyway; status "mismatch" after timing, never "fastest" (seen on the H200 for linear + residual).
            c.inexact = f"outside forge's tolerance against the float64 oracle (timed anyway: the baseline): {reason}"
        elif reason is not None:  # forge's kernel (exit 5) or a peer: not timed
            c.status, c.reason = Status.MISMATCH, f"does not match the float64 oracle, not timed: {reason}"
    del inputs, ref
    memory.give_back(backend)
    return None


def _event_sampler(bench, fn: Callable[[int], None]) -> Callable[[], float]:
    """µs per call from CUDA events around K back-to-back launches (K sized like the graph replays)."""
    torch = bench.torch
    k_launches = bench.launches_per_sample(fn)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    counter = [0]

    def sample() -> float:
        start.record()
        for _ in range(k_launches):
            fn(counter[0] % bench.n_sets)
            counter[0] += 1
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1000.0 / k_launches

    sample.launches = k_launches
    return sample


def _time(contestants: list[ContestantResult], opmod, spec: KernelSpec, backend: str, opts: BenchOptions,
          sampling: engine.Sampling) -> None:
    from forge.tuner.timing import Bench
    from forge.tuner.validate import CandidateRaised

    cuda = backend == "cuda"
    samplers: dict[str, tuple[Callable[[], float], Any]] = {}
    for c in contestants:
        if c.status != Status.PENDING:
            continue
        try:
            bench = Bench(opmod, spec, backend, opts.seed)  # private rotating input sets
        except Exception as exc:
            if not memory.is_oom(exc):
                raise
            memory.give_back(backend)
            _out_of_memory(c, exc, opmod, spec, backend, "not timed: its timing sets ran out of memory")
            continue
        fn = c.timing(bench)
        try:
            sampler = bench.prepare(fn)
            c.clock = "cuda-graph" if cuda else "host"
        except CandidateRaised as exc:
            if memory.is_oom(exc):
                del bench, fn
                memory.give_back(backend)
                _out_of_memory(c, exc.__cause__ or exc, opmod, spec, backend, "out of memory while being prepared "
                               "for timing")
                continue
            if not (cuda and str(exc).startswith("CUDA-graph timing failed")):
                c.status, c.reason = Status.ERROR, ("failed while being prepared for timing: "
                                                    f"{_short(exc.__cause__ or exc)}")
                continue
            try:
                bench.torch.cuda.synchronize()
                sampler = _event_sampler(bench, fn)
            except Exception as exc2:  # noqa: BLE001
                c.status, c.reason = Status.ERROR, f"cannot be timed: {_short(exc2)}"
                continue
            c.clock = "cuda-events"
            c.note = (f"not capturable in a CUDA graph ({_short(exc.__cause__ or exc, 160)}): timed with CUDA events "
                      "around back-to-back launches, host launch cost included when it exceeds the kernel's")
        samplers[c.name] = (sampler, bench)
    by_name = {c.name: c for c in contestants}
    samples: dict[str, list[float]] = {name: [] for name in samplers}

    def one_round(keep: bool) -> None:
        for name in list(samplers):
            try:
                value = samplers[name][0]()
            except Exception as exc:  # noqa: BLE001 - a replay that fails part-way
                if memory.is_oom(exc):
                    _out_of_memory(by_name[name], exc, opmod, spec, backend, "out of memory while being timed")
                else:
                    by_name[name].status, by_name[name].reason = (Status.ERROR,
                                                                  f"failed while being timed: {_short(exc)}")
                del samplers[name]
                continue
            if keep:
                samples[name].append(value)

    if sampling.settle_ms and samplers:  # bring the GPU to its steady clock with every contestant running
        end = time.perf_counter() + sampling.settle_ms / 1000
        while samplers and time.perf_counter() < end:
            one_round(keep=False)
    for _ in range(opts.rounds or sampling.final_rounds):
        one_round(keep=True)
    for name in samplers:
        by_name[name].status = Status.OK
        by_name[name].quantiles = stats.Quantiles.of(samples[name])


def bench_target(target: Target, backend: str, cache: Cache, peaks: Peaks, opts: BenchOptions,
                 emit: Events) -> TargetResult:
    import torch

    t0 = time.monotonic()
    opmod = ops.get(target.op).module
    spec = target.spec
    res = TargetResult(target)
    res.model = roofline_model(opmod, spec, peaks)
    res.contestants = _contestants(target, backend, Path(cache.path).parent / "kernels-src", opts)
    sync = torch.cuda.synchronize if backend == "cuda" else (lambda: None)
    emit("validating", target=target, contestants=[c.name for c in res.contestants if c.status == Status.PENDING])
    res.out_of_memory = _validate(res.contestants, opmod, spec, opts.seed, sync, backend)
    emit("timing", target=target, contestants=[c.name for c in res.contestants if c.status == Status.PENDING])
    _time(res.contestants, opmod, spec, backend, opts, engine.SAMPLING[backend])
    eager = res.contestant("eager")
    for c in res.contestants:
        if c.inexact is not None and c.status == Status.OK:
            c.status, c.reason = Status.MISMATCH, c.inexact
        if c.quantiles is None:
            continue
        c.speedup = stats.speedup(c.quantiles, eager.quantiles if eager else None)
        c.roofline = roofline_pct(res.model, c.quantiles.p50, peaks, spec.dtype)
    memory.give_back(backend)  # the timing sets and graphs of this target, before the next one's
    res.seconds = time.monotonic() - t0
    return res


def run_bench(targets: list[Target], *, backend: str, cache: Cache, options: BenchOptions | None = None,
              events: Events | None = None) -> BenchReport:
    """Bench every target that has a cached decision (the others are reported with their error)."""
    opts = options or BenchOptions()
    emit = events or (lambda *a, **k: None)
    prepare_backend(backend)
    t0 = time.monotonic()
    env = collect_env(backend)
    results: list[TargetResult] = []
    peaks = None
    with device_lock(engine.device_id(env), on_wait=lambda p: emit("waiting-for-lock", path=str(p))):
        if any(t.entry is not None for t in targets) or (not targets and opts.remeasure_peaks):
            peaks = device_peaks(backend, Path(cache.path).parent, opts.remeasure_peaks, emit)
        for n, t in enumerate(targets):
            emit("target", index=n, total=len(targets), target=t)
            if t.entry is None:
                results.append(TargetResult(t))
                continue
            results.append(bench_target(t, backend, cache, peaks, opts, emit))
    return BenchReport(backend=backend, env=env, cache_path=str(cache.path), peaks=peaks, results=results,
                       options=opts, seconds=time.monotonic() - t0)

