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


def score(outcome: Any) -> float | None:
    """An outcome's time (lower is better), or None for a candidate that failed or was not timed: the engine's
    CandidateResult (its final or screening p50 where its status is ok), or replay's float."""
    if outcome is None:
        return None
    if isinstance(outcome, (int, float)):
        return float(outcome)
    if getattr(outcome, "status", "ok") != "ok":  # Status is a StrEnum: Status.OK == "ok"
        return None
    q = getattr(outcome, "best_quantiles", None)
    return q.p50 if q is not None else None


def score_dict(c: dict[str, Any]) -> float | None:
    """score() of a candidate as a search report lists it (its final p50, else its screening p50)."""
    if c.get("status") != "ok":
        return None
    q = c.get("final") or c.get("screen")
    return q["p50"] if q else None


def _neighbours(space: Space, cand: Candidate) -> list[Candidate]:
    """The valid points one step away from `cand`: one parameter moved to the next or previous choice."""
    grid = space.variants[cand.variant]
    out = []
    for name, value in cand.params:
        choices = grid[name]
        if value not in choices:
            continue
        i = choices.index(value)
        for j in (i - 1, i + 1):
            if 0 <= j < len(choices):
                new = Candidate.make(cand.variant, **{**cand.p, name: choices[j]})
                if space.valid(new):
                    out.append(new)
    return out


@register("evolve")
class Evolve:
    """Evolutionary: a first generation spread like grid's (every variant, both ends of each range), then
    generations bred from the fastest so far: each parent's one-step neighbours (one parameter moved to the
    next or previous choice: the landscapes of block sizes and warps are smooth), crossovers of two parents of
    one variant, and a few random valid points so no variant is given up early. Seeded: replayable."""

    FIRST = 16  # first generation (or the budget, if smaller)
    GENERATION = 8
    PARENTS = 4

    def __init__(self, seed: int = 0, first: Candidate | None = None):
        self.rng = _random.Random(seed)
        self.first = first
        self.started = False

    def propose(self, space: Space, history: Mapping[Candidate, Any], n: int) -> list[Candidate]:
        if n <= 0:
            return []
        if not self.started:
            self.started = True
            return Grid(self.first).propose(space, history, min(n, self.FIRST))
        seen = set(history)
        timed = sorted(((t, c) for c, o in history.items() if (t := score(o)) is not None),
                       key=lambda tc: (tc[0], tc[1].key))
        parents = [c for _, c in timed[:self.PARENTS]]
        want = min(n, self.GENERATION)
        out: list[Candidate] = []

        def add(c: Candidate) -> None:
            if c not in seen and c not in out and len(out) < want:
                out.append(c)

        for p in parents:  # the best first: its neighbours before the others'
            nb = _neighbours(space, p)
            self.rng.shuffle(nb)
            for c in nb[:3]:
                add(c)
        for _ in range(4):  # crossovers of two parents of one variant
            pair = [p for p in parents if p.variant == (parents[0].variant if parents else None)]
            if len(pair) < 2:
                break
            a, b = self.rng.sample(pair, 2)
            child = Candidate.make(a.variant, **{k: (a.p if self.rng.random() < 0.5 else b.p)[k] for k in a.p})
            if space.valid(child):
                add(child)
        if len(out) < want:  # explore: random valid points (every variant keeps a chance)
            pool = [c for c in space.all_points() if c not in seen and c not in out]
            self.rng.shuffle(pool)
            for c in pool[:want - len(out)]:
                add(c)
        return out


@register("halving")
class Halving(Grid):
    """Successive halving (issue 17): grid's proposals (the whole budget at once, every variant, the op's default
    first) timed in rungs: every valid candidate is screened with a fraction of the screening's rounds, the best
    fraction of them (ranked against eager's p50 in their own group, as the finalists are) is screened again with
    the full rounds, and the finalists are picked from those. The engine runs the rungs (engine.py, screen_all);
    replay, which has one recorded time per candidate, sees grid's proposals. Deterministic: the seed is not used.

    RUNGS: per rung before the last, (its share of the screening's rounds, the share of its candidates kept for
    the next rung); the last rung takes the full rounds. One cut with eta = 3 (keep a third), the classic choice:
    on the H200 tables (bench/results/h200-tables-2026-12-04, grid's 50 proposals) the fastest candidate a
    one-third cut drops is 11-154% slower than the best, while screening estimates were within 2% of the final
    with 30 rounds; a quarter of them (8) roughly doubles a p50's noise (sqrt(30/8)), still far inside that gap.
    A second cut would screen with 30/9 ~ 3 rounds: the engine's floor, a median that is barely one. The
    engine never keeps fewer than the finalists + 1, so the final still chooses among the cut's survivors."""

    RUNGS = ((0.25, 1 / 3),)

    def __init__(self, first: Candidate | None = None, *, seed: int = 0):
        super().__init__(first, seed=seed)
        self.rungs = self.RUNGS

# The default strategy. Replayed on the H200's exhaustive tables (bench/results/h200-tables-2026-12-04, 9
# op-shapes: norms, softmax, cross-entropy, gelu, rope, matmul, sdpa; `forge replay ... --seeds 5`), mean share
# of the exhaustive best at 10 / 25 / 50% of the space: evolve 0.983 / 0.997 / 0.999, grid 0.967 / 0.976 /
# 0.987, random 0.914 / 0.960 / 0.981. At budgets up to Evolve.FIRST (16) evolve proposes what grid does.
DEFAULT = "evolve"

# Strategies the engine builds itself (they need more than a seed: the op, its spec, a proposer)
ENGINE_BUILT = ("llm",)


def names() -> tuple[str, ...]:
    """Every strategy `--strategy` takes; make() builds the registered ones (replay runs those)."""
    return (*REGISTRY, *ENGINE_BUILT)


def registered() -> tuple[str, ...]:
    """The strategies make() builds from a seed alone (replay and the strategy tests run every one)."""
    return tuple(REGISTRY)


def make(name: str, seed: int = 0, first: Candidate | None = None) -> Strategy:
    factory = REGISTRY.get(name)
    if factory is None:
        raise ValueError(f"unknown strategy {name!r}; expected {' or '.join(REGISTRY)}")
    return factory(seed=seed, first=first)


class Seeded:
    """Another strategy with `seeds` proposed first (those in the space and not tried yet, in order): the
    winners cached for neighbouring shapes of the same op on the same device (engine: transfer)."""

    def __init__(self, inner: Strategy, seeds: list[Candidate]):
        self.inner, self.seeds = inner, list(seeds)

    def propose(self, space: Space, history: Mapping[Candidate, Any], n: int) -> list[Candidate]:
        out = [c for c in self.seeds if c in space and c not in history][:max(0, n)]
        self.seeds = [c for c in self.seeds if c not in out]
        if len(out) < n:
            more = self.inner.propose(space, {**history, **dict.fromkeys(out)}, n - len(out))
            out += [c for c in more if c not in out]
        return out

    def __getattr__(self, name):  # the inner strategy's report (an LLM proposer's usage, tokens)
        return getattr(self.inner, name)
