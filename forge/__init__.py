"""forge: auto-tuned Triton kernels for PyTorch ops. Import-light: loads no Typer, Rich, Jinja2 or
triton (those come only with a search, or when a cached kernel is loaded).

    import forge, torch

    @forge.optimize(budget=50)
    def rmsnorm(x, weight, eps=1e-6):
        return x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + eps) * weight

    report = forge.search("rmsnorm", (2048, 4096), "float16", budget=50)   # the tuner as a library

This module is the package's facade, above every layer (docs/architecture.md): the runtime (shim,
cache, key) never imports the tuner; the facade hands the shim the function that searches on a miss
and imports the tuner only when a search runs.
"""

from __future__ import annotations

from typing import Any

from forge import log as _log
from forge import shim as _shim
from forge._version import __version__
from forge.shim import Explanation, explain, load, optimize
from forge.spec import KernelSpec, TensorSpec

__all__ = ["Explanation", "KernelSpec", "TensorSpec", "__version__", "explain", "kernel_spec", "load", "optimize",
           "search"]


def search(op, shape=None, dtype: str = "float16", **kwargs: Any):
    """Search (or find in the cache) the kernel decision for one op at one shape; see
    forge.tuner.api.search for the options. Returns a forge.tuner.engine.SearchReport."""
    from forge.tuner import api

    return api.search(op, shape, dtype, **kwargs)


def kernel_spec(op: str, shape, dtype: str = "float16", device: str = "cuda", **attrs: Any) -> KernelSpec:
    """The KernelSpec forge builds for a request (attributes normalised, defaults filled in)."""
    from forge import key

    backend = "interpreter" if device == "cpu" else "cuda"
    return key.build_spec(op, tuple(shape), dtype, backend, attrs)[1]


def _search_on_miss(op_name: str, shape, dtype: str, *, device: str, cache, attrs: dict, budget: int,
                    gpu: int | None):
    """The shim's search on a cache miss, said on stderr before and after (a first call that searches
    blocks for its duration: the user should know why, for how long at most, and what came of it). The wall
    clock is capped at FORGE_SEARCH_TIME_BUDGET seconds (default SHIM_TIME_BUDGET_S)."""
    import sys
    import time

    from forge.tuner import engine

    cap = _time_budget()
    what = f"{op_name} {'x'.join(map(str, shape))} {dtype}"
    print(f"forge: {what} is not tuned on this device: searching (at most {budget} candidates and {cap:.0f} s; "
          "FORGE_SEARCH=0 turns searching off)", file=sys.stderr)
    report = engine.search(op_name, shape, dtype, device=device, cache=cache, attrs=attrs,
                           options=engine.SearchOptions(budget=budget, deadline=time.monotonic() + cap), gpu=gpu)
    if report is None:  # a searcher stand-in (tests) that reports nothing
        return None
    if report.decision in ("kernel", "torch"):
        result = f"{report.decision}, {report.speedup:.2f}x faster than eager" if report.speedup else report.decision
    else:
        result = {"eager": "eager (no candidate beat it)", "none": "eager (no candidate was correct)"}.get(
            report.decision, report.decision)
    print(f"forge: {what}: {result} after {report.seconds:.1f} s"
          + (f" ({report.cut_short})" if report.cut_short else "") + f"; cached in {report.cache_path}",
          file=sys.stderr)
    return report


# A cache miss inside @forge.optimize blocks the user's call: a search there stops validating and timing new
# candidates after this many seconds of wall clock (FORGE_SEARCH_TIME_BUDGET overrides; forge search has
# no cap unless --time-budget). 300 s covers a budget-50 search of every suite row on the H200 (the
# longest, matmul 8192^3, took 45 s; issue 15's 16384^3 took 202 s).
SHIM_TIME_BUDGET_S = 300.0


def _time_budget() -> float:
    import os

    raw = os.environ.get("FORGE_SEARCH_TIME_BUDGET")
    if raw:
        try:
            value = float(raw)
        except ValueError:
            value = -1.0
        if value > 0:
            return value
        from forge.errors import UsageError

        raise UsageError(f"FORGE_SEARCH_TIME_BUDGET={raw!r}: expected a number of seconds above 0")
    return SHIM_TIME_BUDGET_S


_shim.set_searcher(_search_on_miss)
_log.configure()  # FORGE_LOG=info|debug: forge's log on stderr (forge/log.py)
