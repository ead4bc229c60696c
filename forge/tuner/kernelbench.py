"""`forge trace DIR/`: a directory of KernelBench-style problem files, scored as KernelBench scores them.

Each `*.py` of the directory (not recursive; names starting with "_" are skipped) is one problem: a
`Model(nn.Module)`, `get_inputs()` and optional `get_init_inputs()` (tracetools.load_target). For each
problem, in file-name order:

  1. trace it (tracetools.trace: TorchDynamo, regions matched to op families), note what was cached;
  2. with `profile`, time every call of its graphs (tracetools.profile) so its jobs carry shares;
  3. with `tune`, tune its tunable regions (manifest.parse of tracetools.manifest_entries, then
     batch.run: largest share first, one worker pool for the whole directory, and one wall-clock
     `time_budget` for all the problems' tuning together: once it is spent no search starts, and the
     jobs not started are reported "skipped"); a region the search decided eager is traced again split
     into its parts (as the forge backend splits it), which are tuned in the next round (TUNE_ROUNDS);
  4. verify it (tracetools.verify: the captured graphs with the cached kernels swapped in, compared with
     eager end to end and timed against it).

A problem that fails to import, build, trace or verify is not correct, with its reason, and the others
go on. The score is KernelBench's fast_p: the fraction of all problems that are correct and whose
speedup over eager is greater than p (strictly), for p in P_VALUES; fast_0 is the fraction correct.
Tracing and verifying run for every problem whatever the time budget: it bounds tuning only.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from forge.errors import ForgeError, UsageError
from forge.tuner import batch, engine, manifest, tracetools

P_VALUES = (1.0, 1.25, 1.5, 2.0)
# Tuning rounds per problem: a region decided eager is split and its parts tuned in the next round (as
# bench/models.py's tune phase does; a split region splits at most once per cut level, so few are needed).
TUNE_ROUNDS = 3


@dataclass
class Problem:
    """One problem file's outcome: one row of the table and of --json's "problems"."""

    name: str  # the file name
    path: str
    correct: bool = False
    speedup: float | None = None  # eager / forge per call (tracetools.verify), None if not verified
    eager_us: float | None = None
    forge_us: float | None = None
    error: str | None = None  # why it is not correct: import/trace/verify failure or the mismatch
    stage: str | None = None  # where it failed: "load", "trace", "tune", "verify" (None: it ran through)
    regions: int = 0  # regions matched to an op family
    tunable: int = 0  # ...of which forge can tune
    swapped: int = 0  # ...of which a cached kernel ran in the verified run
    not_tunable: list[str] = field(default_factory=list)  # "op (node): reason" per region forge cannot tune
    unmatched: dict[str, int] = field(default_factory=dict)  # call -> how many calls no op family matched
    graph_breaks: int = 0
    jobs: list[dict[str, Any]] = field(default_factory=list)  # batch.JobResult.to_dict() per tuned job
    profile: dict[str, Any] | None = None  # covered_fraction, amdahl_speedup, total_us (no ranking)
    verify: dict[str, Any] | None = None  # tracetools.verify's dict, as it returned it
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def problem_files(directory: str | Path) -> list[Path]:
    d = Path(directory)
    if not d.is_dir():
        raise UsageError(f"{d}: not a directory")
    files = sorted(p for p in d.glob("*.py") if p.is_file() and not p.name.startswith("_"))
    if not files:
        raise UsageError(f"{d}: no problem files (*.py with Model and get_inputs) in it")
    return files


def fast_p(problems: list[Problem], ps: tuple[float, ...] = P_VALUES) -> dict[str, float]:
    """KernelBench's fast_p over all problems (a broken one counts as not correct): the fraction that
    are correct and have speedup > p. Keys "fast_1.0", "fast_1.25", ...; "fast_0" is the fraction correct."""
    n = len(problems)
    score = {"fast_0": sum(p.correct for p in problems) / n if n else 0.0}
    for p in ps:
        hits = sum(1 for x in problems if x.correct and x.speedup is not None and x.speedup > p)
        score[f"fast_{p}"] = hits / n if n else 0.0
    return score


def _summary(result: tracetools.TraceResult, row: Problem) -> None:
    row.regions = len(result.regions)
    row.tunable = sum(r.unsupported is None and r.shape is not None for r in result.regions)
    row.not_tunable = [f"{r.op} ({r.root.name}): {r.unsupported}" for r in result.regions if r.unsupported]
    row.unmatched = dict(Counter(u.call for u in result.unmatched))
    row.graph_breaks = len(result.breaks)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def run(directory: str | Path, *, device: str | None, cache, dtype: str | None = None, tune: bool = False,
        profile: bool = False, settings: dict[str, Any] | None = None, env: dict[str, str] | None = None,
        on_problem: Callable[[int, int, Path], None] | None = None,
        on_job: Callable[[Path, batch.JobResult], None] | None = None) -> dict[str, Any]:
    """Trace, optionally profile and tune, and verify every problem of `directory`; returns
    {"problems": [Problem.to_dict()...], "score": fast_p, "time_budget_s", "tuning_s", "backend"}.

    settings: the search settings from the command line (budget, strategy, seed, timeout, workers,
    time_budget), resolved against the FORGE_* environment (`env`, default os.environ) and the built-in
    defaults as a manifest's are (manifest.resolve). on_problem(i, n, path) before problem i of n;
    on_job(path, result) after each tuning job."""
    import os

    env = os.environ if env is None else env
    settings = {k: v for k, v in (settings or {}).items() if v is not None}
    files = problem_files(directory)
    backend = engine.resolve_backend(device)
    dev = "cuda" if backend == "cuda" else "cpu"
    time_budget = manifest.resolve("time_budget", settings, env)
    workers = manifest.resolve("workers", settings, env)
    t_start = time.monotonic()
    deadline = t_start + time_budget if time_budget is not None else None
    tuning = 0.0
    rows: list[Problem] = []
    with engine.Pools() as pools:
        for i, path in enumerate(files):
            if on_problem is not None:
                on_problem(i, len(files), path)
            row = Problem(name=path.name, path=str(path))
            t0 = time.monotonic()
            result = _guarded(row, _trace, path, row, dev, dtype, cache, backend, profile)
            for _ in range(TUNE_ROUNDS if tune else 0):
                if result is None:
                    break
                # not guarded: batch.run records each job's failure; others are bugs
                t_tune = time.monotonic()
                todo = [r for r in result.regions if r.decision is None]
                row.jobs += _tune(result, todo, path, cache, dev, workers, settings, env, deadline, pools, on_job)
                tuning += time.monotonic() - t_tune
                tracetools.annotate_with_cache(result, cache, backend)
                # A region the search decided eager is split by the next trace, as the backend splits it (its
                # parts: a SwiGLU MLP's gate and up projections and silu(g) * u): traced again, its parts are
                # tuned in the next round, until a trace finds nothing untuned.
                if not any(r.decision == "eager" and len(r.nodes) > 1 for r in todo):
                    break
                result = _guarded(row, _trace, path, row, dev, dtype, cache, backend, profile)
                if result is not None and not any(r.decision is None and _tunable(r) for r in result.regions):
                    break
            if result is not None:
                _guarded(row, _verify, result, row, cache, backend)
            del result  # its graphs hold every value of the problem's run
            row.seconds = time.monotonic() - t0
            rows.append(row)
    return {"problems": [r.to_dict() for r in rows], "score": fast_p(rows), "p_values": list(P_VALUES),
            "backend": backend, "time_budget_s": time_budget, "tuning_s": tuning,
            "wall_s": time.monotonic() - t_start}


def _guarded(row: Problem, step: Callable[..., Any], *args: Any) -> Any:
    """step(*args)'s value; if it raises, the problem is not correct, with the reason (others go on)."""
    try:
        return step(*args)
    except ForgeError as exc:
        row.error = str(exc)
    except Exception as exc:  # noqa: BLE001 - the problem's own code raised (Model(), get_inputs(), forward)
        row.error = f"{row.stage}: {_one_line(exc)}"
    return None


def _trace(path: Path, row: Problem, dev: str, dtype, cache, backend: str, profile: bool):
    row.stage = "load"
    tgt = tracetools.load_target(str(path), [], dev, dtype)
    row.stage = "trace"
    result = tracetools.trace(tgt, dev, cache, backend)
    _summary(result, row)
    tracetools.annotate_with_cache(result, cache, backend)
    if profile:
        row.stage = "profile"
        prof = tracetools.profile(result)
        row.profile = {k: v for k, v in prof.items() if k != "ranking"}
    row.stage = None
    return result


def _verify(result: tracetools.TraceResult, row: Problem, cache, backend: str) -> None:
    row.stage = "verify"
    ver = tracetools.verify(result, cache, backend)
    row.stage = None
    row.verify = ver
    row.correct = bool(ver["ok"])
    row.speedup, row.eager_us, row.forge_us = ver.get("speedup"), ver.get("eager_us"), ver.get("forge_us")
    row.swapped = int(ver.get("swapped") or 0)
    if not row.correct:
        row.error = (f"output differs from eager: relative error {ver.get('rel_error'):.3g} "
                     f"> tolerance {ver.get('tolerance'):g}")


def _tunable(r) -> bool:
    return not r.unsupported and r.shape is not None


def _tune(result: tracetools.TraceResult, regions: list, path: Path, cache, dev: str, workers, settings: dict,
          env, deadline: float | None, pools: engine.Pools, on_job) -> list[dict[str, Any]]:
    """Tune `regions` of one problem (its shares, if profiled, order the jobs); [JobResult dict]."""
    total = (result.profile or {}).get("total_us")
    entries = tracetools.manifest_entries(regions, total)
    if not entries:
        return []
    cli = {k: settings[k] for k in ("budget", "strategy", "seed", "timeout") if k in settings}
    # The regions' dtypes are what the problem computes in (after --dtype's cast): no override applies.
    env = {k: v for k, v in env.items() if k != "FORGE_DTYPE"}
    m = manifest.parse({"defaults": {"device": dev}, "op": entries}, path, cli=cli, env=env)
    jobs = batch.by_share(m.jobs)
    done = batch.run(jobs, cache=cache, device=dev, workers=workers, deadline=deadline, pools=pools,
                     on_done=(lambda n, job, res: on_job(path, res)) if on_job is not None else None)
    return [r.to_dict() for r in done]
