"""Search strategies. Pure: (space, history, budget) -> next candidates; no GPU, no I/O.

A strategy is asked repeatedly until it returns nothing or the budget is spent, so adaptive
strategies can use `history` (candidate -> outcome); grid and random ignore outcomes and only
avoid repeats.
"""

from __future__ import annotations

import random as _random
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from forge.opkit import Candidate, Space


class Strategy(Protocol):
    def propose(self, space: Space, history: Mapping[Candidate, Any], n: int) -> list[Candidate]: ...


# name -> factory(seed, first): every strategy is built the same way. `first` is the op's default
# candidate (proposed first when it is in the space); `seed` makes randomised strategies replayable.
REGISTRY: dict[str, Callable[[int, Candidate | None], Strategy]] = {}


def register(name: str):
    """Class decorator: make a strategy available as `--strategy NAME` (its constructor takes
    keyword arguments seed and first; a strategy that needs no seed ignores it)."""

    def add(cls):
        if name in REGISTRY:
            raise ValueError(f"strategy {name!r} is registered twice")
        REGISTRY[name] = cls
        return cls

    return add


def _spread(points: list[Candidate], k: int) -> list[Candidate]:
    """k points evenly spaced over `points` (keeps both ends), in order."""
    if k >= len(points):
        return list(points)
    if k <= 0:
        return []
    if k == 1:
        return [points[len(points) // 2]]
    step = (len(points) - 1) / (k - 1)
    return [points[round(i * step)] for i in range(k)]


@register("grid")
class Grid:
    """Every valid point when it fits the budget; otherwise the budget is shared round-robin across
    structural variants and each variant's share is spread evenly over its grid, so a small budget
    still sees every variant and both ends of each parameter range."""

    def __init__(self, first: Candidate | None = None, *, seed: int = 0):
        self.first = first  # deterministic: the seed is not used

    def propose(self, space: Space, history: Mapping[Candidate, Any], n: int) -> list[Candidate]:
        per_variant = {v: [c for c in space.points(v) if c not in history and c != self.first]
                       for v in space.variants}
        out: list[Candidate] = []
        if self.first is not None and self.first not in history and n > 0:
            out.append(self.first)
        remaining = n - len(out)
        shares = dict.fromkeys(per_variant, 0)
        # `first` already spends one of its variant's slots, so that variant gets one fewer below.
        spent = dict.fromkeys(per_variant, 0)
        if out:
            spent[out[0].variant] = 1
        active = [v for v, pts in per_variant.items() if pts]
        while remaining > 0 and active:
            for v in list(active):
                if remaining == 0:
                    break
                if spent[v]:
                    spent[v] -= 1
                elif shares[v] < len(per_variant[v]):
                    shares[v] += 1
                    remaining -= 1
                else:
                    active.remove(v)
        for v, pts in per_variant.items():
            out.extend(_spread(pts, shares[v]))
        return out


@register("random")
class Random:
    """Uniform over all valid points, seeded, without repeats."""

    def __init__(self, seed: int = 0, first: Candidate | None = None):
        self.rng = _random.Random(seed)
        self.first = first

    def propose(self, space: Space, history: Mapping[Candidate, Any], n: int) -> list[Candidate]:
        out: list[Candidate] = []
        if self.first is not None and self.first not in history and n > 0:
            out.append(self.first)
        pool = [c for c in space.all_points() if c not in history and c not in out]
        k = min(n - len(out), len(pool))
        out.extend(self.rng.sample(pool, k) if k > 0 else [])
        return out


def names() -> tuple[str, ...]:
    return tuple(REGISTRY)


def make(name: str, seed: int = 0, first: Candidate | None = None) -> Strategy:
    factory = REGISTRY.get(name)
    if factory is None:
        raise ValueError(f"unknown strategy {name!r}; expected {' or '.join(REGISTRY)}")
    return factory(seed=seed, first=first)
