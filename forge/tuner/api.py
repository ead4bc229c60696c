"""The public Python API for searching: `forge.search(...)` (forge/__init__.py re-exports it lazily).

    import forge
    report = forge.search("rmsnorm", (2048, 4096), "float16", budget=50)
    report.decision, report.winner, report.speedup, report.key

It runs exactly what `forge search` runs (the CLI is a thin layer over the same engine) and loads no
Typer or Rich.
"""

from __future__ import annotations

import os
from typing import Any

from forge import key as keys
from forge import ops
from forge.cache import Cache, default_cache_path
from forge.errors import UsageError
from forge.spec import KernelSpec
from forge.tuner import engine
from forge.tuner import strategy as strategies


def search(op: str | KernelSpec, shape: tuple[int, ...] | None = None, dtype: str = "float16", *,
           device: str | None = None, budget: int | None = None, strategy: str | None = None,
           cache: Cache | str | os.PathLike | None = None, force: bool = False, seed: int = 0, timeout: float = 120.0,
           workers: int | None = None, events: engine.Events | None = None, effort: str = "default",
           **attrs: Any) -> engine.SearchReport:
    """Search (or find in the cache) the kernel decision for one op at one shape.

    op: an op family name ("rmsnorm") with `shape` (and `dtype`, attributes as keywords: eps=1e-5), or
    a `forge.KernelSpec` (then shape, dtype and attributes come from it). device: "cuda", "cpu" (the
    Triton interpreter) or None (CUDA if available; for a KernelSpec, its tensors' device). budget: the
    candidates (default: the effort's, "quick" 12, "default" 50, "full" every valid point). cache: a
    `forge.cache.Cache`, a path, or None for the default cache. Returns the SearchReport: decision
    ("kernel", "eager" or "none"), winner (variant, params, quantiles), baseline, candidates, key.
    Raises forge.errors.ForgeError subclasses (UsageError, EnvironmentProblem) for what the CLI reports
    as exit codes 2 and 3.
    """
    if isinstance(op, KernelSpec):
        if shape is not None or attrs:
            raise UsageError("pass either a KernelSpec or op, shape and attributes, not both")
        op_name, shape, dtype, attrs, device = _from_spec(op, device)
    else:
        if shape is None:
            raise UsageError(f"forge.search({op!r}): give the shape, e.g. (2048, 4096)")
        op_name = op
    from forge.tuner.manifest import EFFORT_BUDGET

    if effort not in EFFORT_BUDGET:
        raise UsageError(f"effort={effort!r}: expected one of {', '.join(EFFORT_BUDGET)}")
    options = engine.SearchOptions(budget=EFFORT_BUDGET[effort] if budget is None else budget,
                                   strategy=strategy or strategies.DEFAULT,
                                   seed=seed, force=force, timeout=timeout, workers=workers)
    db, own = _open(cache)
    try:
        return engine.search(op_name, tuple(shape), dtype, device=device, cache=db, attrs=dict(attrs),
                             options=options, events=events)
    finally:
        if own:
            db.close()


def _from_spec(spec: KernelSpec, device: str | None) -> tuple[str, tuple[int, ...], str, dict, str]:
    """The request a KernelSpec stands for. Only specs forge itself builds for some request are taken
    (anything else would be searched under a key no call ever looks up)."""
    spec_device = "cpu" if spec.device == "cpu" else "cuda"
    if device is not None and device != spec_device:
        raise UsageError(f"device={device!r} but the KernelSpec's tensors are on {spec_device!r}")
    fam = ops.get(spec.op)
    shape = fam.problem_shape(spec)
    backend = "cuda" if spec_device == "cuda" else "interpreter"
    _, canonical = keys.build_spec(spec.op, shape, spec.dtype, backend, dict(spec.attrs))
    if canonical.inputs != spec.inputs:
        want = ", ".join(f"{'x'.join(map(str, t.shape))} {t.dtype} strides {t.strides}" for t in canonical.inputs)
        raise UsageError(f"this KernelSpec is not one {spec.op} builds: for problem shape "
                         f"{'x'.join(map(str, shape))} its inputs are {want}; build it with "
                         f"forge.kernel_spec({spec.op!r}, {tuple(shape)}, {spec.dtype!r})")
    return spec.op, shape, spec.dtype, dict(spec.attrs), spec_device


def _open(cache: Cache | str | os.PathLike | None) -> tuple[Cache, bool]:
    if isinstance(cache, Cache):
        return cache, False
    return Cache(cache or default_cache_path()), True
