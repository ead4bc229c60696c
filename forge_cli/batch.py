"""Tuning a manifest's jobs in one run: one worker pool for all of them, one result per job, and a
failure in one job recorded against it while the others go on."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from forge.cache import Cache, CacheError
from forge_cli import engine
from forge_cli.errors import ExitCode, ForgeError
from forge_cli.manifest import Job


@dataclass
class JobResult:
    entry: int
    op: str
    shape: str
    dtype: str
    attrs: dict[str, Any]
    status: str  # "cached" | "searched" | "failed"
    decision: str | None = None  # "kernel" | "eager" | "none"
    key: str | None = None
    winner: str | None = None
    p50_us: float | None = None
    eager_p50_us: float | None = None
    speedup: float | None = None
    seconds: float = 0.0
    error: str | None = None
    exit_code: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def run(jobs: list[Job], *, cache: Cache, device: str | None, workers: int | None, force: bool = False,
        on_start: Callable[[int, Job], None] | None = None, events: engine.Events | None = None) -> list[JobResult]:
    results = []
    with engine.Pools() as pools:
        for n, job in enumerate(jobs):
            if on_start is not None:
                on_start(n, job)
            results.append(_one(job, cache, device, workers, force, events, pools))
    return results


def _one(job: Job, cache: Cache, device, workers, force, events, pools) -> JobResult:
    base = JobResult(entry=job.entry, op=job.op, shape="x".join(map(str, job.shape)), dtype=job.dtype,
                     attrs=job.attrs, status="failed")
    t0 = time.monotonic()
    opts = engine.SearchOptions(budget=job.budget, strategy=job.strategy, seed=job.seed, force=force,
                                timeout=job.timeout, workers=workers)
    try:
        rep = engine.search(job.op, job.shape, job.dtype, device=device, cache=cache, attrs=job.attrs,
                            options=opts, events=events, pools=pools)
    except ForgeError as exc:  # this job cannot be done (no GPU, a worker that cannot start ...)
        base.error, base.exit_code, base.seconds = str(exc), int(exc.exit_code), time.monotonic() - t0
        return base
    except CacheError as exc:
        base.error, base.exit_code, base.seconds = str(exc), int(ExitCode.CACHE), time.monotonic() - t0
        return base
    base.key, base.decision, base.seconds = rep.key, rep.decision, time.monotonic() - t0
    base.status = "cached" if rep.cache_hit else "searched"
    if rep.winner:
        w = rep.winner
        base.winner = f"{w['variant']}({', '.join(f'{k}={v}' for k, v in w['params'].items())})"
        base.p50_us = w["quantiles"]["p50"]
    base.eager_p50_us = rep.baseline.p50 if rep.baseline else None
    base.speedup = rep.speedup
    if rep.decision == "none":
        base.status, base.exit_code = "failed", int(ExitCode.ALL_FAILED)
        base.error = "every candidate failed (nothing cached)"
    return base
