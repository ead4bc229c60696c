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
    from forge.tuner import engine

    return engine.search(op_name, shape, dtype, device=device, cache=cache, attrs=attrs,
                         options=engine.SearchOptions(budget=budget), gpu=gpu)


_shim.set_searcher(_search_on_miss)
