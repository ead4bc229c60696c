"""Transfer (issue 17): a search first tries the winners cached for the nearest other shapes of its op on the
same device (same dtype, attributes, templates), right after the op's default."""

from __future__ import annotations

from forge import ops
from forge.cache import Cache
from forge.opkit import Candidate
from forge.tuner import engine, stats, strategy
from forge.tuner.engine import transfer_seeds


def _search(db, shape, budget=2, **kw):
    return engine.search("softmax", shape, "float32", device="cpu", cache=db,
                         options=engine.SearchOptions(budget=budget, workers=1, timeout=120, torch_op=False, **kw))


def test_the_nearest_cached_winners_are_tried_right_after_the_default(tmp_path, monkeypatch):
    db = Cache(tmp_path / "f.db")
    monkeypatch.setattr(stats, "accepts", lambda *a, **k: True)  # a kernel decision for the neighbours
    near, far = _search(db, (8, 40)), _search(db, (64, 40))
    assert near.decision == far.decision == "kernel"
    op = ops.get("softmax")
    spec = op.module.make_spec((16, 40), "float32", "cpu")
    env = engine.keys.locate(op, spec, "interpreter").env
    seeds = transfer_seeds(db, op, spec, env)
    w_near = Candidate.make(near.winner["variant"], **near.winner["params"])
    w_far = Candidate.make(far.winner["variant"], **far.winner["params"])
    assert seeds[0] == w_near and set(seeds) == {w_near, w_far}  # one seed where both shapes chose the same
    # another dtype, other attributes or another environment: no seeds
    other = op.module.make_spec((16, 40), "float16", "cpu")
    assert transfer_seeds(db, op, other, engine.keys.locate(op, other, "interpreter").env) == []
    assert transfer_seeds(db, op, spec, {**env, "templates": "x"}) == []
    rep = _search(db, (16, 40), budget=3)
    default = op.module.default(spec)
    order = [c for c in [default, *seeds] if c in op.module.space(spec)]
    order = list(dict.fromkeys(order))  # the default first, then the seeds not already tried
    proposed = strategy.Seeded(strategy.make("grid", 0, default), order).propose(op.module.space(spec), {}, 3)
    assert proposed[:len(order)] == order
    tried = {Candidate.from_dict(c) for c in rep.candidates}
    assert set(order) <= tried
    off = _search(db, (24, 40), budget=3, transfer=False, force=True)
    assert {Candidate.from_dict(c) for c in off.candidates} != set() and off.decision == "kernel"


def test_seeded_proposes_seeds_first_then_the_inner_strategy_without_repeats():
    space_op = ops.get("softmax").module
    sp = space_op.space(space_op.make_spec((4, 40), "float32", "cpu"))
    pts = list(sp.all_points())
    outside = Candidate.make("nope", x=1)
    s = strategy.Seeded(strategy.make("grid"), [pts[3], outside, pts[5]])
    first = s.propose(sp, {}, 2)
    assert first == [pts[3], pts[5]]
    rest = s.propose(sp, dict.fromkeys(first), 100)
    assert pts[3] not in rest and pts[5] not in rest and len(rest) == len(pts) - 2
