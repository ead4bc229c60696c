"""Pure tests of forge.tuner.strategy: hand-built spaces and the real row-op spaces, no GPU, no I/O."""

from __future__ import annotations

import pytest

from forge.opkit import Candidate, Space, row_default, row_space
from forge.spec import KernelSpec, TensorSpec
from forge.tuner import strategy
from forge.tuner.strategy import Grid, Random, _spread

# --- spaces -----------------------------------------------------------------------------------------


def small_space() -> Space:
    """a: 4 points; b: the 6 of 9 (x, y) pairs with x + y != 6; c: 1 point; d: declared, no valid point."""
    def valid(c: Candidate) -> bool:
        p = c.p
        if c.variant == "b":
            return p["x"] + p["y"] != 6
        return c.variant != "d"

    return Space(
        variants={
            "a": {"x": [1, 2, 3, 4]},
            "b": {"x": [2, 3, 4], "y": [2, 3, 4]},
            "c": {"z": ["only"]},
            "d": {"x": [1, 2]},
        },
        valid=valid,
    )


def wide_space(n: int = 40) -> Space:
    """One variant, n points in order: spread behaviour is easy to read off."""
    return Space(variants={"v": {"i": list(range(n))}}, valid=lambda c: True)


def spec_for(shape, device="cuda") -> KernelSpec:
    return KernelSpec("rmsnorm", (TensorSpec(shape, "float16", device=device),
                                  TensorSpec((shape[-1],), "float16", device=device)), {"eps": 1e-6})


def kernels_space(shape=(4096, 4096), device="cuda") -> Space:
    return row_space(spec_for(shape, device))


ALL_SMALL = list(small_space().all_points())


def drain(strat, space, batch: int) -> list[Candidate]:
    """Ask repeatedly, as the engine does, until the strategy returns nothing."""
    history: dict[Candidate, object] = {}
    order: list[Candidate] = []
    for _ in range(10_000):
        got = strat.propose(space, history, batch)
        if not got:
            return order
        assert len(got) <= batch
        for c in got:
            assert c not in history, f"re-proposed {c.label}"
            history[c] = "ok"
            order.append(c)
    raise AssertionError("strategy never ran dry")


def test_small_space_is_what_the_tests_assume():
    assert len(ALL_SMALL) == 4 + 6 + 1
    assert small_space().points("d") == []
    assert Candidate.make("b", x=3, y=3) not in small_space()
    assert len(set(ALL_SMALL)) == len(ALL_SMALL)


# --- grid -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("budget", [11, 12, 100])
def test_grid_returns_every_valid_point_when_budget_covers_the_space(budget):
    got = Grid().propose(small_space(), {}, budget)
    assert len(got) == len(ALL_SMALL)
    assert set(got) == set(ALL_SMALL)
    assert all(c in small_space() for c in got)


@pytest.mark.parametrize("budget", [0, 1, 2, 3, 4, 5, 7, 10, 11])
def test_grid_respects_budget_exactly_and_has_no_duplicates(budget):
    got = Grid().propose(small_space(), {}, budget)
    assert len(got) == min(budget, len(ALL_SMALL))
    assert len(set(got)) == len(got)
    assert all(c in small_space() for c in got)


@pytest.mark.parametrize("budget", [1, 3, 5, 10, 50, 200])
def test_grid_on_kernels_space_respects_budget(budget):
    space = kernels_space()
    total = len(list(space.all_points()))
    got = Grid().propose(space, {}, budget)
    assert len(got) == min(budget, total)
    assert len(set(got)) == len(got)
    assert all(c in space for c in got)


def test_grid_puts_first_first_and_does_not_repeat_it():
    first = Candidate.make("b", x=4, y=4)
    got = Grid(first).propose(small_space(), {}, 5)
    assert got[0] == first
    assert got.count(first) == 1
    assert len(got) == 5
    everything = Grid(first).propose(small_space(), {}, 100)
    assert everything[0] == first and set(everything) == set(ALL_SMALL) and len(everything) == len(ALL_SMALL)


def test_grid_first_is_skipped_once_in_history():
    first = Candidate.make("a", x=2)
    got = Grid(first).propose(small_space(), {first: "ok"}, 100)
    assert first not in got
    assert set(got) == set(ALL_SMALL) - {first}


@pytest.mark.parametrize("budget", [3, 4, 6])
def test_grid_covers_every_variant_with_a_budget_of_one_per_variant(budget):
    got = Grid().propose(small_space(), {}, budget)
    assert {c.variant for c in got} == {"a", "b", "c"}  # "d" has no valid point


def test_grid_covers_every_variant_of_a_kernels_space():
    space = kernels_space()
    got = Grid().propose(space, {}, 3)
    assert sorted(c.variant for c in got) == ["looped", "multirow", "row"]


def test_grid_covers_every_variant_with_first_and_a_budget_of_one_per_variant():
    space = kernels_space()
    first = row_default(spec_for((4096, 4096)))
    assert first in space and first.variant == "row"
    got = Grid(first).propose(space, {}, 3)
    assert got[0] == first
    assert sorted(c.variant for c in got) == ["looped", "multirow", "row"]


def test_grid_keeps_both_ends_of_a_variants_grid():
    pts = wide_space(40).points("v")
    for k in (2, 3, 5, 17, 39):
        got = Grid().propose(wide_space(40), {}, k)
        assert len(got) == k
        assert got[0] == pts[0] and got[-1] == pts[-1], k
        assert got == sorted(got, key=lambda c: c.p["i"])  # in grid order
    # per variant, on a real space: with two slots each, each variant's first and last point
    space = kernels_space()
    got = Grid().propose(space, {}, 6)
    for variant in ("row", "looped", "multirow"):
        pts = space.points(variant)
        mine = [c for c in got if c.variant == variant]
        assert mine == [pts[0], pts[-1]], variant


def test_grid_spread_is_even():
    got = Grid().propose(wide_space(41), {}, 5)
    assert [c.p["i"] for c in got] == [0, 10, 20, 30, 40]
    one = Grid().propose(wide_space(41), {}, 1)
    assert [c.p["i"] for c in one] == [20]  # a single slot takes the middle


def test_spread_helper():
    pts = list(range(10))
    assert _spread(pts, 0) == []
    assert _spread(pts, -1) == []
    assert _spread(pts, 10) == pts
    assert _spread(pts, 11) == pts
    assert _spread(pts, 2) == [0, 9]
    for k in range(2, 10):
        s = _spread(pts, k)
        assert len(s) == k and len(set(s)) == k and s[0] == 0 and s[-1] == 9 and s == sorted(s)


def test_grid_respects_history():
    space = small_space()
    history = {c: "ok" for c in ALL_SMALL[::2]}
    got = Grid().propose(space, history, 100)
    assert not set(got) & set(history)
    assert set(got) == set(ALL_SMALL) - set(history)
    assert Grid().propose(space, {c: "ok" for c in ALL_SMALL}, 100) == []


@pytest.mark.parametrize("batch", [1, 2, 3, 7])
def test_grid_drained_in_batches_visits_every_point_once(batch):
    first = Candidate.make("c", z="only")
    order = drain(Grid(first), small_space(), batch)
    assert order[0] == first
    assert sorted(order, key=lambda c: c.key) == sorted(ALL_SMALL, key=lambda c: c.key)


def test_grid_drains_a_kernels_space():
    space = kernels_space((64, 1000), "cpu")
    order = drain(Grid(row_default(spec_for((64, 1000), "cpu"))), space, 8)
    assert len(order) == len(set(order)) == len(list(space.all_points()))


# --- random -----------------------------------------------------------------------------------------


def test_random_is_deterministic_for_a_seed():
    space = kernels_space()
    a = Random(seed=7).propose(space, {}, 10)
    b = Random(seed=7).propose(space, {}, 10)
    assert a == b
    # and so is a whole sequence of calls
    assert drain(Random(seed=3), small_space(), 2) == drain(Random(seed=3), small_space(), 2)


def test_random_differs_between_seeds():
    space = kernels_space()
    assert len(list(space.all_points())) > 50
    proposals = {tuple(Random(seed=s).propose(space, {}, 10)) for s in range(5)}
    assert len(proposals) == 5


@pytest.mark.parametrize("budget", [0, 1, 5, 11, 50])
def test_random_respects_budget_only_valid_no_duplicates(budget):
    got = Random(seed=1).propose(small_space(), {}, budget)
    assert len(got) == min(budget, len(ALL_SMALL))
    assert len(set(got)) == len(got)
    assert all(c in small_space() for c in got)
    assert all(c.variant != "d" for c in got)


def test_random_on_kernels_space_only_valid():
    space = kernels_space((8, 300), "cpu")
    got = Random(seed=2).propose(space, {}, 1000)
    assert set(got) == set(space.all_points())
    assert len(got) == len(set(got))
    assert all(c.p["num_stages"] == 1 for c in got if c.variant == "looped")  # cpu: no pipelining


def test_random_respects_history_and_first():
    space = small_space()
    history = {c: "ok" for c in ALL_SMALL[:5]}
    got = Random(seed=4).propose(space, history, 100)
    assert set(got) == set(ALL_SMALL[5:])
    first = Candidate.make("a", x=4)
    got = Random(seed=4, first=first).propose(space, {}, 3)
    assert got[0] == first and len(got) == 3 and got.count(first) == 1
    assert first not in Random(seed=4, first=first).propose(space, {first: "ok"}, 100)


@pytest.mark.parametrize("batch", [1, 4])
def test_random_drained_in_batches_visits_every_point_once(batch):
    order = drain(Random(seed=9, first=Candidate.make("a", x=1)), small_space(), batch)
    assert order[0] == Candidate.make("a", x=1)
    assert len(order) == len(ALL_SMALL) and set(order) == set(ALL_SMALL)


# --- make -------------------------------------------------------------------------------------------


def test_make():
    first = Candidate.make("a", x=1)
    g = strategy.make("grid", first=first)
    assert isinstance(g, Grid) and g.first == first
    r = strategy.make("random", seed=5)
    assert isinstance(r, Random) and r.first is None
    assert r.propose(small_space(), {}, 4) == Random(5).propose(small_space(), {}, 4)
    with pytest.raises(ValueError, match="unknown strategy 'nope'"):
        strategy.make("nope")


# --- the contract every registered strategy keeps -------------------------------------------------------
# Driven the way the engine drives it: asked for at most the remaining budget until it returns nothing,
# with each proposal recorded in the history (the outcome is a stand-in status).


def _drive(name: str, space: Space, budget: int, seed: int, first: Candidate | None, batch: int) -> list[Candidate]:
    strat = strategy.make(name, seed=seed, first=first)
    history: dict[Candidate, str] = {}
    order: list[Candidate] = []
    while len(history) < budget:
        got = strat.propose(space, history, min(batch, budget - len(history)))
        assert len(got) <= min(batch, budget - len(history)), f"{name} proposed more than it was asked for"
        if not got:
            break
        for c in got:
            assert c not in history, f"{name} proposed {c.label} again"
            history[c] = "ok"
            order.append(c)
    return order


CONTRACT_SPACES = {
    "small": lambda: small_space(),
    "rmsnorm-1x4096": lambda: row_space(spec_for((1, 4096))),
    "rmsnorm-2048x4096": lambda: row_space(spec_for((2048, 4096))),
}


def test_the_registry_holds_the_built_in_strategies():
    assert {"grid", "random"} <= set(strategy.names())
    with pytest.raises(ValueError, match="registered twice"):
        strategy.register("grid")(Grid)


@pytest.mark.parametrize("name", strategy.registered())
@pytest.mark.parametrize("space_name", sorted(CONTRACT_SPACES))
@pytest.mark.parametrize("budget", [1, 3, 10, 1000])
@pytest.mark.parametrize("batch", [1, 7, 1000])
def test_every_strategy_keeps_the_contract(name, space_name, budget, batch):
    space = CONTRACT_SPACES[space_name]()
    valid = list(space.all_points())
    first = valid[len(valid) // 2]
    order = _drive(name, space, budget, seed=3, first=first, batch=batch)
    assert len(order) == min(budget, len(valid))  # budget respected, and spent while points remain
    assert len(set(order)) == len(order)  # no repeats
    assert all(c in space for c in order)  # valid points only
    assert order[0] == first  # the op's default goes first
    # deterministic for a seed: the same run twice proposes the same candidates in the same order
    assert order == _drive(name, space, budget, seed=3, first=first, batch=batch)
