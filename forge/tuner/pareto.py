"""Speed against cost (issue 17; the original design's Pareto choice with a lambda trade-off).

Every candidate of a search has a cost: the GPU seconds its worker spent compiling, validating and timing
it, and the tokens an LLM proposer spent proposing it (its round's tokens shared over the candidates the
round gave). The frontier is the candidates no other beats on both speedup and cost; `scalarize` ranks them
with lambda: 0 speed only, 0.1 the default, 1 speed and cost weighted equally, above 1 cost first. Speedup
and each cost component are scaled to [0, 1] by their largest value in the search (components without any
spending are left out), so lambda means the same for every op.

What it is for: seeing what the search bought. The decision itself stays the fastest correct candidate with
the statistical margin (a kernel's search cost is spent once; its speed is paid on every call): the
recommendation says which candidate a cheaper search would have settled for, and how close it comes.
"""

from __future__ import annotations

from typing import Any

DEFAULT_LAMBDA = 0.1


def scalarize(speedup: float, cost: float, lam: float) -> float:
    """The design's scalar: higher is better; speedup and cost already scaled to [0, 1]."""
    return speedup - lam * cost


def _cost(c: dict[str, Any], scale: dict[str, float]) -> float:
    parts = [c["cost"][k] / scale[k] for k in scale if scale[k] > 0]
    return sum(parts) / len(parts) if parts else 0.0


def frontier(candidates: list[dict[str, Any]], lam: float = DEFAULT_LAMBDA) -> dict[str, Any] | None:
    """{"lambda", "frontier": [...], "recommended": {...}} over a search report's candidates that have a
    speedup and a cost; None when there are none."""
    if lam < 0:
        raise ValueError(f"lambda={lam}: expected a number >= 0")
    pts = [c for c in candidates if c.get("speedup") and c.get("cost")]
    if not pts:
        return None
    scale = {k: max(c["cost"].get(k, 0) for c in pts) for k in ("gpu_seconds", "tokens")}
    top = max(c["speedup"] for c in pts)
    rows = []
    for c in pts:
        cost = _cost(c, scale)
        rows.append({"variant": c["variant"], "params": c["params"], "speedup": c["speedup"], "cost": c["cost"],
                     "scaled_cost": round(cost, 6), "score": scalarize(c["speedup"] / top, cost, lam)})
    front = [r for r in rows if not any(o["speedup"] >= r["speedup"] and o["scaled_cost"] <= r["scaled_cost"]
                                        and (o["speedup"] > r["speedup"] or o["scaled_cost"] < r["scaled_cost"])
                                        for o in rows)]
    front.sort(key=lambda r: r["scaled_cost"])
    best = max(rows, key=lambda r: (r["score"], r["speedup"]))
    return {"lambda": lam, "frontier": front, "recommended": best}
