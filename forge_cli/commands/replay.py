"""`forge replay`: run search strategies against recorded tables of candidate timings (forge.tuner.replay)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table as RichTable

from forge.errors import UsageError
from forge.tuner import replay
from forge.tuner import strategy as strategies
from forge_cli.jsonout import emit
from forge_cli.options import JsonOpt
from forge_cli.render import fail, out

TablesArg = Annotated[list[Path], typer.Argument(help="Recorded tables (JSON; forge.tuner.replay documents the "
                                                      "format).")]
StrategiesOpt = Annotated[list[str] | None, typer.Option("--strategy", help="Strategy to replay (repeatable; "
                                                                            "default: every registered one).")]
SeedsOpt = Annotated[int, typer.Option("--seeds", help="Seeds per strategy and budget (the quality is their mean).")]


def replay_cmd(tables: TablesArg, strategy: StrategiesOpt = None, seeds: SeedsOpt = 5, json_out: JsonOpt = False):
    """Replay search strategies on recorded exhaustive searches, without a GPU: the share of the exhaustive
    best each finds with 10%, 25% and 50% of the space as its budget."""
    try:
        names = tuple(strategy or strategies.registered())
        unknown = [n for n in names if n not in strategies.registered()]
        if unknown:
            raise UsageError(f"unknown strategy {unknown[0]!r}; expected one of {', '.join(strategies.registered())}")
        if seeds < 1:
            raise UsageError("--seeds must be at least 1")
        loaded = []
        for p in tables:
            try:
                loaded.append(replay.load(p))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise UsageError(f"{p}: not a replay table ({type(exc).__name__}: {exc})") from None
        result = replay.evaluate(loaded, names, seeds=range(seeds))
    except UsageError as exc:
        raise fail(exc, exc.exit_code) from None
    if json_out:
        doc = {"fractions": list(replay.FRACTIONS), "seeds": seeds,
               "tables": {t.name: {"points": len(t.times), "best_us": t.best, **t.meta} for t in loaded},
               "strategies": {n: {"mean": {str(f): q for f, q in r["mean"].items()},
                                  "per_table": {tn: {str(f): q for f, q in per.items()}
                                                for tn, per in r["per_table"].items()}}
                              for n, r in result.items()}}
        emit(doc)
        return
    table = RichTable(title=f"share of the exhaustive best found ({len(loaded)} table(s), mean of {seeds} seeds)")
    table.add_column("strategy")
    for f in replay.FRACTIONS:
        table.add_column(f"{f:.0%} of the space", justify="right")
    for n, r in result.items():
        table.add_row(n, *(f"{r['mean'][f]:.3f}" for f in replay.FRACTIONS))
    out.print(table)


def register(app: typer.Typer, cache_app: typer.Typer) -> None:
    app.command("replay")(replay_cmd)
