"""`forge bench --recheck`: re-validate and re-time cached winners through the search's worker pool and
flag the ones that drifted."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forge import key as keys
from forge import ops
from forge.cache import Cache, Entry
from forge.env import collect_env
from forge.loader import write_source
from forge.tuner import engine, memory, stats
from forge.tuner.bench._common import Events
from forge.tuner.bench.run import BenchOptions
from forge.tuner.bench.targets import Target, prepare_backend
from forge.tuner.lock import device_lock
from forge.tuner.status import RECHECK_INVALID, Status

# --recheck validates in a worker with the search's check_candidate, at seed + 1 (the search's default is 0).
RECHECK_SEED_OFFSET = 1


@dataclass
class RecheckResult:
    target: Target
    # ok | drifted | invalid (also: refused by verify_entry) | sha256-mismatch | oom (not judged) | ...
    status: Status = Status.PENDING
    reason: str | None = None
    new_kernel: stats.Quantiles | None = None
    new_baseline: stats.Quantiles | None = None

    @property
    def stored_speedup(self) -> float | None:
        e = self.target.entry
        return e.speedup if e is not None else None

    @property
    def new_speedup(self) -> float | None:
        return stats.speedup(self.new_kernel, self.new_baseline)

    @property
    def ratio(self) -> float | None:
        old, new = self.stored_speedup, self.new_speedup
        return new / old if old and new else None

    def to_dict(self) -> dict[str, Any]:
        t, e = self.target, self.target.entry
        return {"key": t.key, "op": t.op, "shape": t.shape_str, "dtype": t.dtype, "attrs": t.attrs,
                "status": self.status, "reason": self.reason,
                "variant": e.variant if e else None, "params": e.params if e else None,
                "stored": {"winner": e.winner if e else None, "baseline": e.baseline if e else None,
                           "speedup": self.stored_speedup},
                "new": {"winner": self.new_kernel.to_dict() if self.new_kernel else None,
                        "baseline": self.new_baseline.to_dict() if self.new_baseline else None,
                        "speedup": self.new_speedup},
                "ratio": self.ratio}


@dataclass
class RecheckReport:
    backend: str
    cache_path: str
    results: list[RecheckResult]
    options: BenchOptions
    seconds: float = 0.0

    def count(self, *statuses: str) -> int:
        return sum(r.status in statuses for r in self.results)

    def to_dict(self) -> dict[str, Any]:
        return {"mode": "recheck", "backend": self.backend, "cache": self.cache_path,
                "timing_clock": "device: CUDA-graph replays" if self.backend == "cuda" else "host (Triton interpreter)",
                "drift_floor": self.options.drift_floor, "seed": self.options.seed + RECHECK_SEED_OFFSET,
                "rounds": self.options.rounds or engine.SAMPLING[self.backend].final_rounds,
                "entries": [r.to_dict() for r in self.results],
                "invalid": self.count(*RECHECK_INVALID), "drifted": self.count(Status.DRIFTED),
                "missing": self.count(Status.MISSING), "seconds": round(self.seconds, 3)}


def _env_mismatch(entry: Entry, here: keys.Located) -> str | None:
    """Why forge would not serve `entry` here (None if it would)."""
    if entry.env.get("backend") != here.env["backend"]:
        return f"made for backend {entry.env.get('backend')!r}; this run is {here.env['backend']!r}"
    if here.key == entry.key:
        return None
    diff = keys.env_diff(entry.env, here.env)
    return f"made for another environment ({', '.join(diff) or 'spec'} differ): forge does not serve it here"


def _oom_reason(what: str, reply: dict, entry: Entry) -> str:
    from forge.spec import KernelSpec

    whose = "the cached kernel" if reply.get("stage", "candidate") == "candidate" else "forge (inputs, oracle or eager)"
    fp = memory.estimate(ops.get(entry.op).module, KernelSpec.from_dict(entry.spec))
    return (f"{what} ran out of memory in {whose}: {reply.get('reason')} [forge estimates {fp.describe()}]; "
            "not judged: recheck with more free memory")


def _recheck_one(r: RecheckResult, backend: str, pools: engine.Pools, src_dir: Path,
                 opts: BenchOptions, emit: Events) -> None:
    t, e = r.target, r.target.entry
    if e.decision != "kernel":
        r.status, r.reason = Status.SKIPPED, (f"the cached decision is {e.decision}: no forge kernel to recheck "
                                              "(forge bench times it)")
        return
    if e.op not in ops.available():
        r.status, r.reason = Status.SKIPPED, f"op {e.op!r} is not known to this forge"
        return
    why = _env_mismatch(e, keys.locate(ops.get(e.op), t.spec, backend))
    if why is not None:
        r.status, r.reason = Status.SKIPPED, why
        return
    if not keys.source_intact(e):
        r.status, r.reason = Status.SHA256_MISMATCH, ("the cached source does not match its sha256 (edited after "
                                                      f"the search): refused, not loaded; forge cache rm {e.key[:12]}, "
                                                      "then search again")
        return
    # Before the source is written out for a worker to import: the entry must be exactly what the search
    # stores (params in the op's space, source re-rendered from the installed templates).
    problem = keys.verify_entry(e)
    if problem is not None:
        r.status, r.reason = Status.INVALID, (f"refused, not loaded: {problem}; forge cache rm {e.key[:12]}, "
                                              "then search again")
        return
    path = str(write_source(e.source, src_dir))
    sampling = engine.SAMPLING[backend]
    setup = {"cmd": "setup", "op": e.op, "spec": e.spec, "seed": opts.seed + RECHECK_SEED_OFFSET}
    pool = pools.get(backend, 1, setup)
    emit("recheck-validate", target=t)
    reply = pool.call({"cmd": "validate", "path": path}, opts.timeout)
    if reply.get("status") == Status.OOM:  # an outcome, not proof that the cached kernel is wrong
        r.status, r.reason = Status.OOM, _oom_reason("validating", reply, e)
        return
    if reply.get("status") != Status.OK:
        r.status, r.reason = Status.INVALID, f"validation now fails ({reply.get('status')}): {reply.get('reason')}"
        return
    emit("recheck-time", target=t)
    rounds = opts.rounds or sampling.final_rounds
    reply = pool.call({"cmd": "time", "paths": [path], "baseline": True, "rounds": rounds, "reps": 1,
                       "settle_ms": sampling.settle_ms}, opts.timeout * 2)
    if reply.get("status") == Status.OOM:
        r.status, r.reason = Status.OOM, _oom_reason("re-timing", reply, e)
        return
    if reply.get("status") != Status.OK:
        r.status, r.reason = Status.INVALID, f"validates but fails while being timed ({reply.get('status')}): " \
                                             f"{reply.get('reason')}"
        return
    r.new_kernel = stats.Quantiles.of(reply["samples"][path])
    r.new_baseline = stats.Quantiles.of(reply["samples"]["eager"])
    if not e.winner or not e.baseline:
        r.status, r.reason = Status.OK, "no stored quantiles to compare with"
        return
    stored_k, stored_b = stats.Quantiles.from_dict(e.winner), stats.Quantiles.from_dict(e.baseline)
    if stats.drifted(stored_k, stored_b, r.new_kernel, r.new_baseline, opts.drift_floor):
        lo, hi = stats.speedup_interval(stored_k, stored_b)
        r.status = Status.DRIFTED
        r.reason = (f"speedup now {r.new_speedup:.3g}x vs {r.stored_speedup:.3g}x stored (stored p20-p80 range "
                    f"{lo:.3g}-{hi:.3g}x; drift floor {opts.drift_floor:.0%}); re-search with --force")
    else:
        r.status = Status.OK


def run_recheck(targets: Iterable[Target], *, backend: str, cache: Cache, options: BenchOptions | None = None,
                events: Events | None = None) -> RecheckReport:
    opts = options or BenchOptions()
    emit = events or (lambda *a, **k: None)
    prepare_backend(backend)
    t0 = time.monotonic()
    env = collect_env(backend)
    results = [RecheckResult(t) for t in targets]
    for r in results:
        if r.target.entry is None:
            r.status, r.reason = Status.MISSING, r.target.error
    src_dir = Path(cache.path).parent / "kernels-src"
    todo = [r for r in results if r.status == Status.PENDING]
    if todo:
        with device_lock(engine.device_id(env), on_wait=lambda p: emit("waiting-for-lock", path=str(p))), \
                engine.Pools() as pools:
            for n, r in enumerate(todo):
                emit("target", index=n, total=len(todo), target=r.target)
                _recheck_one(r, backend, pools, src_dir, opts, emit)
    return RecheckReport(backend=backend, cache_path=str(cache.path), results=results, options=opts,
                         seconds=time.monotonic() - t0)

