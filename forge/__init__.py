"""forge runtime package. Import-light: loads no Typer, Rich, Jinja2 or triton (those come only with a
search on a cache miss, or when a cached kernel is loaded).

    import forge, torch

    @forge.optimize(budget=50)
    def rmsnorm(x, weight, eps=1e-6):
        return x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + eps) * weight
"""

from forge._version import __version__
from forge.shim import Explanation, explain, load, optimize

__all__ = ["Explanation", "__version__", "explain", "load", "optimize"]
