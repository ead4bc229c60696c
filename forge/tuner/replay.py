"""Replay ("simulation mode", as Kernel Tuner has): run a search strategy against a recorded table of
candidate timings, without a GPU, to see how much of the exhaustive best it finds within a budget.

A table is one exhaustive search, recorded: `forge search OP --shape S --budget <the space's size> --json`
(every valid point validated and timed) turned into JSON by `table_from_report`:

    {"op", "shape", "dtype", "attrs", "gpu", "recorded", "source",
     "candidates": [{"variant", "params", "status", "p50_us"}, ...]}

The replayed space is the table's own: the recorded points are the valid ones (the templates may have
changed since the recording; the strategy sees the space as it was). A strategy proposes, the table
answers each proposal with its recorded p50 (None where the candidate failed), until the budget is spent.
Pure: no GPU, no I/O beyond reading the table; every strategy is seeded, so a replay is repeatable.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forge.opkit import Candidate, Space
from forge.tuner import strategy as strategies

FRACTIONS = (0.10, 0.25, 0.50)


@dataclass(frozen=True)
class Table:
    name: str
    times: dict[Candidate, float | None]  # p50 µs, None: the candidate failed (compile, mismatch, ...)
    meta: dict[str, Any]

    @property
    def best(self) -> float:
        ok = [t for t in self.times.values() if t is not None]
        if not ok:
            raise ValueError(f"table {self.name}: no candidate was timed")
        return min(ok)

    def space(self) -> Space:
        grid: dict[str, dict[str, set]] = {}
        for c in self.times:
            for k, v in c.params:
                grid.setdefault(c.variant, {}).setdefault(k, set()).add(v)
        variants = {var: {k: sorted(vs, key=_order) for k, vs in params.items()} for var, params in grid.items()}
        recorded = frozenset(self.times)
        return Space(variants, valid=lambda c: c in recorded)


def _order(v: Any) -> tuple:
    return (0, v, "") if isinstance(v, (int, float)) and not isinstance(v, bool) else (1, 0, str(v))


def load(path: str | Path) -> Table:
    doc = json.loads(Path(path).read_text())
    times = {}
    for c in doc["candidates"]:
        cand = Candidate.make(c["variant"], **c["params"])
        times[cand] = float(c["p50_us"]) if c.get("status") == "ok" and c.get("p50_us") is not None else None
    if not times:
        raise ValueError(f"{path}: the table has no candidates")
    meta = {k: v for k, v in doc.items() if k != "candidates"}
    return Table(Path(path).stem, times, meta)


def table_from_report(report: dict[str, Any], **meta: Any) -> dict[str, Any]:
    """A replay table from `forge search --json`'s report of an exhaustive search: every candidate with its
    status and p50 on one scale: its screening p50 times the final's eager p50 over eager's p50 in its own
    screening group (the engine screens in groups interleaved with eager; this is how it ranks them), or
    the raw screening p50 where the report has no group eager (older reports). The raw screening and final
    p50 are kept beside it. torch's fused op is left out: it is no point of the space."""
    base = (report.get("baseline") or {}).get("p50")
    rows = []
    for c in report["candidates"]:
        if c["variant"] == "torch":
            continue
        screen, final, group_eager = c.get("screen"), c.get("final"), c.get("screen_eager_p50")
        ok = c["status"] == "ok" and screen is not None
        p50 = None
        if ok:
            p50 = screen["p50"] * base / group_eager if base and group_eager else screen["p50"]
        rows.append({"variant": c["variant"], "params": c["params"], "status": c["status"], "p50_us": p50,
                     "screen_p50_us": screen["p50"] if screen else None,
                     "final_p50_us": final["p50"] if final else None})
    spec = report.get("spec") or {}
    first = (spec.get("inputs") or [{}])[0]
    return {"op": report.get("op"), "shape": "x".join(map(str, first.get("shape", ()))), "dtype": first.get("dtype"),
            "attrs": spec.get("attrs"), "key": report.get("key"), **meta, "candidates": rows}


def simulate(table: Table, name: str, budget: int, seed: int = 0, first: Candidate | None = None) -> float:
    """The best p50 a strategy finds within `budget` proposals (inf if none of them was timed)."""
    space = table.space()
    strat = strategies.make(name, seed, first if first in table.times else None)
    history: dict[Candidate, float | None] = {}
    while len(history) < budget:
        batch = strat.propose(space, history, budget - len(history))
        if not batch:
            break
        for c in batch[:budget - len(history)]:
            if c in history or c not in table.times:
                raise AssertionError(f"strategy {name} proposed {c.label}: a repeat or a point outside the space")
            history[c] = table.times[c]
    found = [t for t in history.values() if t is not None]
    return min(found) if found else float("inf")


def quality(table: Table, name: str, fraction: float, seeds: range = range(5)) -> float:
    """Mean over seeds of exhaustive best / found best (1.0: the strategy found the best point) with a budget
    of `fraction` of the table's points (at least 1)."""
    budget = max(1, round(fraction * len(table.times)))
    return statistics.fmean(table.best / simulate(table, name, budget, seed) for seed in seeds)


def evaluate(tables: list[Table], names: tuple[str, ...] | None = None, fractions=FRACTIONS,
             seeds: range = range(5)) -> dict[str, dict[str, Any]]:
    """{strategy: {"per_table": {table: {fraction: quality}}, "mean": {fraction: mean quality}}}."""
    out: dict[str, dict[str, Any]] = {}
    for name in names or strategies.registered():
        per = {t.name: {f: quality(t, name, f, seeds) for f in fractions} for t in tables}
        out[name] = {"per_table": per, "mean": {f: statistics.fmean(p[f] for p in per.values()) for f in fractions}}
    return out
