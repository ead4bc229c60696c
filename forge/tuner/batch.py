"""Tuning a manifest's jobs in one run: one result per job, a failure in one job recorded against it
while the others go on. Three ways to run them:

  local     one worker pool for all jobs, one after another (the default);
  devices   --devices 0,1,...: one runner per GPU of this host, each taking the next job from a shared
            queue with its own worker pool pinned to its GPU (CUDA_VISIBLE_DEVICES), so every
            candidate of a spec is validated and timed on one GPU, and no two specs share a GPU;
  ray       --executor ray: each job is a Ray task (num_gpus=1 on CUDA) that searches into a
            throw-away cache on whichever node runs it; the driver merges the entries into its cache.

Which failures stop the run: none that forge names. A job that raises a ForgeError (a usage error, exit 2;
an environment problem, exit 3, e.g. forge's own float64 oracle or eager baseline out of memory at that
job's shape; every candidate failed, exit 4) or a cache error (exit 5) is recorded against that job, with
its exit code and message, and the run goes on; the command exits with the first failed job's code. So an
environment that fails every job (no triton, no GPU for device cuda) fails each one alike, quickly (before
any worker starts), rather than stopping at the first. Only an exception that is no ForgeError (a bug in
forge) ends the run. After a job that failed part-way its worker pool is closed (engine.Pools.discard): the
next job starts fresh workers, holding nothing of the failed job's memory.

Order and time: `by_share` puts the jobs with a share of the model's time first, largest first (the rest
after, in manifest order); a `deadline` (time.monotonic(), from --time-budget) starts no job once it has
passed (each is reported "skipped", note "time budget") and is the running searches' deadline too
(engine.SearchOptions.deadline: a search stops timing new candidates and decides from what it timed).
`estimated_speedup` is Amdahl's law over the jobs' shares and their decisions so far.
"""

from __future__ import annotations

import os
import queue
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from forge import key as keys
from forge.cache import WINNING, Cache, CacheError
from forge.errors import ExitCode, ForgeError, UsageError
from forge.tuner import engine
from forge.tuner.manifest import Job


@dataclass
class JobResult:
    entry: int
    op: str
    shape: str
    dtype: str
    attrs: dict[str, Any]
    status: str  # "cached" | "searched" | "failed" | "skipped" (not started: the time budget was spent)
    decision: str | None = None  # "kernel" | "eager" | "none"
    key: str | None = None
    winner: str | None = None
    p50_us: float | None = None
    eager_p50_us: float | None = None
    speedup: float | None = None
    seconds: float = 0.0
    error: str | None = None
    exit_code: int = 0
    device: int | str | None = None  # the GPU index (devices) or Ray node (ray) that ran it
    started: float | None = None  # epoch seconds, for checking that jobs on one device never overlap
    finished: float | None = None
    share: float | None = None  # the job's share of the model's time (manifest `share`), if known
    note: str | None = None  # "time budget" for a skipped job; why a search was cut short
    # The most device memory one worker held for this job (the CUDA caching allocator's reserved peak
    # after the spec's setup); None off CUDA or when nothing was searched.
    peak_worker_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


SKIPPED_NOTE = "time budget"


def run(jobs: list[Job], *, cache: Cache, device: str | None, workers: int | None, force: bool = False,
        on_start: Callable[[int, Job], None] | None = None, events: engine.Events | None = None,
        devices: list[int] | None = None, executor: str = "local", address: str | None = None,
        deadline: float | None = None, on_done: Callable[[int, Job, JobResult], None] | None = None,
        pools: engine.Pools | None = None) -> list[JobResult]:
    """One JobResult per job, in the order of `jobs`. on_start(n, job) before a job starts, on_done(n, job,
    result) after it ends or is skipped; deadline: a time.monotonic() value (see the module's docstring);
    pools: worker pools to reuse (local executor; the caller closes them), else the run's own."""
    if executor == "ray":
        return _run_ray(jobs, cache, device, workers, force, address, on_start, deadline, on_done)
    if executor != "local":
        raise UsageError(f"unknown executor {executor!r}; expected local or ray")
    if devices:
        return _run_devices(jobs, cache, device, workers, force, devices, on_start, deadline, on_done)
    results = []
    with engine.Pools() as own:
        for n, job in enumerate(jobs):
            if _spent(deadline):
                res = skipped(job)
            else:
                if on_start is not None:
                    on_start(n, job)
                res = _one(job, cache, device, workers, force, events, pools or own, deadline=deadline)
            results.append(res)
            if on_done is not None:
                on_done(n, job, res)
    return results


def _spent(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline


def _base(job: Job, status: str) -> JobResult:
    return JobResult(entry=job.entry, op=job.op, shape="x".join(map(str, job.shape)), dtype=job.dtype,
                     attrs=job.attrs, status=status, share=job.share)


def skipped(job: Job) -> JobResult:
    """A job not started because the run's time budget was spent."""
    res = _base(job, "skipped")
    res.note = SKIPPED_NOTE
    return res


def by_share(jobs: list[Job]) -> list[Job]:
    """Jobs with a share first, largest share first; then the others; ties keep their order."""
    return sorted(jobs, key=lambda j: (j.share is None, -(j.share or 0.0)))


def job_speedup(res: JobResult | None) -> float:
    """What a job contributes to the end-to-end estimate: its kernel's speedup; 1 for an eager decision,
    a failed, skipped or not yet run job."""
    if res is None or res.decision not in WINNING or not res.speedup:
        return 1.0
    return res.speedup


def estimated_speedup(pairs) -> float | None:
    """Amdahl over (share, speedup) pairs: 1 / ((1 - covered) + sum(share_i / speedup_i)), covered = the
    sum of the shares; None when no pair has a share (nothing to estimate from)."""
    pairs = [(share, sp) for share, sp in pairs if share is not None]
    if not pairs:
        return None
    covered = min(1.0, sum(share for share, _ in pairs))
    return 1.0 / ((1.0 - covered) + sum(share / sp for share, sp in pairs))


def run_estimate(jobs: list[Job], results: dict[int, JobResult] | list[JobResult]) -> float | None:
    """estimated_speedup of a run: every job's share with its result so far (results: by job index)."""
    done = dict(enumerate(results)) if isinstance(results, list) else results
    return estimated_speedup((j.share, job_speedup(done.get(n))) for n, j in enumerate(jobs))


def parse_devices(text: str) -> list[int]:
    try:
        devs = [int(d) for d in text.split(",") if d.strip()]
    except ValueError:
        raise UsageError(f"--devices expects GPU indices like 0,1,2, got {text!r}") from None
    if not devs or any(d < 0 for d in devs) or len(set(devs)) != len(devs):
        raise UsageError(f"--devices expects distinct GPU indices like 0,1,2, got {text!r}")
    return devs


def _run_devices(jobs, cache: Cache, device, workers, force, devices: list[int], on_start, deadline=None,
                 on_done=None) -> list[JobResult]:
    import torch

    if device != "cpu" and torch.cuda.is_available() and max(devices) >= torch.cuda.device_count():
        raise UsageError(f"--devices {','.join(map(str, devices))}: only {torch.cuda.device_count()} GPU(s) visible")
    todo: queue.Queue = queue.Queue()
    for n, job in enumerate(jobs):
        todo.put((n, job))
    results: dict[int, JobResult] = {}
    lock = threading.Lock()
    errors: list[BaseException] = []

    def runner(dev: int) -> None:
        db = Cache(cache.path)  # one SQLite connection per thread
        try:
            with engine.Pools() as pools:
                while True:
                    try:
                        n, job = todo.get_nowait()
                    except queue.Empty:
                        return
                    if _spent(deadline):
                        res = skipped(job)
                    else:
                        if on_start is not None:
                            with lock:
                                on_start(n, job)
                        res = _one(job, db, device, workers, force, None, pools, gpu=dev, deadline=deadline)
                        res.device = dev
                    with lock:
                        results[n] = res
                        if on_done is not None:
                            on_done(n, job, res)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread below
            errors.append(exc)
        finally:
            db.close()

    threads = [threading.Thread(target=runner, args=(d,), name=f"forge-gpu{d}") for d in devices]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return [results[n] for n in sorted(results)]


def _result_from_entry(job: Job, entry) -> JobResult:
    res = _base(job, "cached")
    res.decision, res.key = entry.decision, entry.key
    if entry.decision in WINNING:
        res.winner = f"{entry.variant}({', '.join(f'{k}={v}' for k, v in (entry.params or {}).items())})"
        res.p50_us = (entry.winner or {}).get("p50")
    res.eager_p50_us = (entry.baseline or {}).get("p50")
    res.speedup = entry.speedup
    return res


def _ray_job(job_d: dict, device, workers, force, known: dict,
             deadline_epoch: float | None = None) -> tuple[dict, dict | None]:
    """Runs inside a Ray worker: search into a throw-away cache, return the result and the entry.
    deadline_epoch: the run's deadline in Unix time (monotonic clocks differ between machines)."""
    from dataclasses import asdict as _asdict

    job = Job(**{**job_d, "shape": tuple(job_d["shape"])})
    deadline = None if deadline_epoch is None else time.monotonic() + (deadline_epoch - time.time())
    if _spent(deadline):
        return skipped(job).to_dict(), None
    backend = engine.resolve_backend(device)
    key = keys.request(job.op, job.shape, job.dtype, backend, job.attrs).key
    if key in known and not force:
        return {"status": "cached", "key": key}, None
    with tempfile.TemporaryDirectory(prefix="forge-ray-") as d:
        db = Cache(os.path.join(d, "forge.db"))
        try:
            with engine.Pools() as pools:
                res = _one(job, db, device, workers, True, None, pools, deadline=deadline)
            entry = db.get(res.key) if res.key else None
        finally:
            db.close()
    import socket

    res.device = socket.gethostname() + (f" CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}"
                                         if backend == "cuda" else "")
    return res.to_dict(), (_asdict(entry) if entry is not None else None)


def _run_ray(jobs, cache: Cache, device, workers, force, address, on_start, deadline=None,
             on_done=None) -> list[JobResult]:
    try:
        import ray
    except ImportError:
        raise UsageError("--executor ray needs Ray: pip install 'forge-kernel[ray]'") from None
    from dataclasses import asdict as _asdict

    from forge.cache import Entry

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    started_here = not ray.is_initialized()
    if started_here:
        # Workers import forge from where this process did (a source tree or an install).
        env = {"PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        for var in ("FORGE_LOCK_DIR", "TRITON_INTERPRET"):
            if os.environ.get(var):
                env[var] = os.environ[var]
        ray.init(address=address, runtime_env={"env_vars": env}, log_to_driver=False,
                 include_dashboard=False, **({"num_cpus": os.cpu_count() or 1} if address is None else {}))
    try:
        known = {e.key: True for e in cache.entries()}
        on_cuda = device != "cpu"
        task = ray.remote(num_gpus=1 if on_cuda else 0, num_cpus=1)(_ray_job)
        refs = {}
        deadline_epoch = None if deadline is None else time.time() + (deadline - time.monotonic())
        for n, job in enumerate(jobs):
            if on_start is not None:
                on_start(n, job)
            refs[task.remote(_asdict(job), device, workers, force, known, deadline_epoch)] = n
        results: dict[int, JobResult] = {}
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            n = refs[done[0]]
            job = jobs[n]
            try:
                res_d, entry_d = ray.get(done[0])
            except ray.exceptions.RayError as exc:
                res = _base(job, "failed")
                res.error = f"Ray task failed: {str(exc).splitlines()[0]}"
                res.exit_code = int(ExitCode.ENVIRONMENT)
            else:
                if res_d.get("status") == "cached" and entry_d is None:
                    res = _result_from_entry(job, cache.get(res_d["key"]))
                else:
                    if entry_d is not None:
                        cache.put(Entry(**entry_d))
                    res = JobResult(**res_d)
            results[n] = res
            if on_done is not None:
                on_done(n, job, res)
        return [results[n] for n in sorted(results)]
    finally:
        if started_here:
            ray.shutdown()


def _one(job: Job, cache: Cache, device, workers, force, events, pools, gpu: int | None = None,
         deadline: float | None = None) -> JobResult:
    base = _base(job, "failed")
    base.started = time.time()
    t0 = time.monotonic()
    opts = engine.SearchOptions(budget=job.budget, strategy=job.strategy, seed=job.seed, force=force,
                                timeout=job.timeout, workers=workers, deadline=deadline)
    try:
        rep = engine.search(job.op, job.shape, job.dtype, device=device, cache=cache, attrs=job.attrs,
                            options=opts, events=events, pools=pools, gpu=gpu)
    except ForgeError as exc:  # this job cannot be done (no GPU, a worker that cannot start ...)
        base.error, base.exit_code, base.seconds = str(exc), int(exc.exit_code), time.monotonic() - t0
        base.finished = time.time()
        return base
    except CacheError as exc:
        base.error, base.exit_code, base.seconds = str(exc), int(ExitCode.CACHE), time.monotonic() - t0
        base.finished = time.time()
        return base
    base.finished = time.time()
    base.key, base.decision, base.seconds = rep.key, rep.decision, time.monotonic() - t0
    base.status = "cached" if rep.cache_hit else "searched"
    if rep.winner:
        w = rep.winner
        base.winner = f"{w['variant']}({', '.join(f'{k}={v}' for k, v in w['params'].items())})"
        base.p50_us = w["quantiles"]["p50"]
    base.eager_p50_us = rep.baseline.p50 if rep.baseline else None
    base.speedup = rep.speedup
    base.peak_worker_bytes = (rep.memory or {}).get("peak_per_worker")
    if rep.cut_short is not None:
        base.note = f"cut short: {rep.cut_short}" + (
            "; eager not cached (a rerun searches again)" if rep.decision == "eager" else "")
    if rep.decision == "none" and rep.cut_short is not None:
        # The budget ran out before a decision: some candidates were never tried, so this is no failure.
        base.status, base.decision = "skipped", None
        base.note = f"{SKIPPED_NOTE}: cut short before a decision ({rep.cut_short})"
    elif rep.decision == "none":
        base.status, base.exit_code = "failed", int(ExitCode.ALL_FAILED)
        base.error = "every candidate failed (nothing cached)"
    return base
