"""`forge cache ls | show | rm | path`: read and edit the kernel cache (forge.cache)."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Annotated

import typer
from rich.syntax import Syntax
from rich.table import Table

from forge.cache import WINNING, CacheError, default_cache_path
from forge.errors import ExitCode, UsageError
from forge_cli.jsonout import emit
from forge_cli.options import CacheOpt, JsonOpt
from forge_cli.render import age, cache_exit_code, entry_row, fail, fmt_params, fmt_speedup, fmt_us, open_cache, out


def cache_ls(op: Annotated[str | None, typer.Option("--op", help="Only this op.")] = None,
             json_out: JsonOpt = False, cache: CacheOpt = None) -> None:
    """List cached decisions."""
    db = open_cache(cache)
    try:
        rows = [entry_row(e) for e in db.entries(op)]
    except CacheError as exc:
        raise fail(exc, ExitCode.CACHE) from None
    if json_out:
        # An object, not the bare list of rows it was before the schema had a version: every document
        # starts with {"version", "command"} (forge_cli/jsonout.py).
        emit({"cache": str(db.path), "entries": rows})
        return
    table = Table(title=f"forge cache ({db.path})")
    for col in ("key", "op", "shape", "dtype", "device", "decision", "speedup", "p50 µs", "age"):
        table.add_column(col, justify="right" if col in ("speedup", "p50 µs") else "left")
    for r in rows:
        dev = f"{r['device']} [dim]({r['backend']})[/]"
        p50 = r["p50_us"] if r["decision"] in WINNING else r["eager_p50_us"]
        # Timings measured on another machine and imported (forge cache import/merge) are marked.
        speedup = fmt_speedup(r["speedup"]) + (" [dim](imported)[/]" if r["imported"] else "")
        table.add_row(r["key"][:12], r["op"], r["shape"], r["dtype"], dev, r["decision"],
                      speedup, fmt_us(p50), age(r["created_at"]))
    out.print(table)
    if not rows:
        out.print("(empty)")


def cache_show(key: Annotated[str, typer.Argument(help="Cache key or a unique prefix of it.")],
               json_out: JsonOpt = False, cache: CacheOpt = None) -> None:
    """Show one entry's metadata and its Triton source."""
    db = open_cache(cache)
    try:
        e = db.find(key)
    except CacheError as exc:
        raise fail(exc, cache_exit_code(exc)) from None
    if json_out:
        emit(asdict(e))
        return
    meta = Table.grid(padding=(0, 2))
    r = entry_row(e)
    for name, value in [("key", e.key), ("op", e.op), ("shape", r["shape"]), ("dtype", r["dtype"]),
                        ("attrs", json.dumps(e.spec.get("attrs", {}))), ("decision", e.decision),
                        ("variant", e.variant or "-"), ("params", fmt_params(e.params) or "-"),
                        ("winner µs", json.dumps(e.winner)), ("eager µs", json.dumps(e.baseline)),
                        ("speedup", fmt_speedup(e.speedup)), ("env", json.dumps(e.env)),
                        ("template hash", e.template_hash), ("source sha256", e.source_sha256 or "-"),
                        ("candidates", _outcome_counts(e.candidates)),
                        ("search", f"{e.search_seconds:.1f} s, forge {e.forge_version}, {age(e.created_at)} ago")]:
        meta.add_row(f"[bold]{name}[/]", value)
    out.print(meta)
    if e.source:
        out.print(Syntax(e.source, "python", line_numbers=False, word_wrap=True))


def _outcome_counts(cands: list[dict]) -> str:
    counts: dict[str, int] = {}
    for c in cands:
        counts[c["status"]] = counts.get(c["status"], 0) + 1
    return ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "-"


def cache_rm(key: Annotated[str | None, typer.Argument(help="Cache key or unique prefix.")] = None,
             op: Annotated[str | None, typer.Option("--op", help="Remove every entry of this op.")] = None,
             all_: Annotated[bool, typer.Option("--all", help="Remove every entry.")] = False,
             json_out: JsonOpt = False, cache: CacheOpt = None) -> None:
    """Remove entries: one KEY, --op OP, or --all."""
    chosen = sum(x is not None and x is not False for x in (key, op, all_ or None))
    if chosen != 1:
        raise fail(UsageError("give exactly one of KEY, --op OP, --all"), ExitCode.USAGE)
    db = open_cache(cache)
    try:
        n = db.delete(key) if key else db.delete_op(op) if op else db.delete_all()
    except CacheError as exc:
        raise fail(exc, cache_exit_code(exc)) from None
    if json_out:
        emit({"cache": str(db.path), "removed": n})
        return
    out.print(f"removed {n} entr{'y' if n == 1 else 'ies'}")


def cache_path(json_out: JsonOpt = False, cache: CacheOpt = None) -> None:
    """Print where the cache DB is."""
    path = cache or default_cache_path()
    if json_out:
        emit({"path": str(path)})
        return
    print(path)


def register(app: typer.Typer, cache_app: typer.Typer) -> None:
    cache_app.command("ls")(cache_ls)
    cache_app.command("show")(cache_show)
    cache_app.command("rm")(cache_rm)
    cache_app.command("path")(cache_path)
