"""`forge cache export | import | merge | prune`: move cache entries between machines, never trusting
their code (forge.tuner.bundle), and clear out entries this machine can no longer use."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from forge.cache import Cache, CacheError
from forge.errors import ExitCode, ForgeError, UsageError
from forge.tuner import bundle
from forge_cli.jsonout import emit
from forge_cli.options import CacheOpt, JsonOpt
from forge_cli.render import age, entry_row, err, fail, open_cache, out

TrustOpt = Annotated[bool, typer.Option(
    "--trust", help="Also import kernel entries whose source does not re-render from the installed "
                    "templates (with a warning). Key, sha256, parameter and timing checks are never "
                    "skipped, and such entries are never loaded until they re-render.")]


def print_import(report: bundle.ImportReport, json_out: bool, verb: str) -> None:
    """An import or merge: what came in, what was kept and what was rejected (then exit 5)."""
    for t in report.trusted:
        err.print(f"[bold yellow]warning:[/] --trust: imported {t['key'][:12]} ({t['op']}) from "
                  f"{escape(t['from'])} although {escape(t['reason'])}")
    if json_out:
        emit(report.to_dict())
    else:
        n = len(report.added) + len(report.replaced)
        out.print(f"{verb} {escape(report.source)} into {escape(report.cache)}: {len(report.added)} added, "
                  f"{len(report.replaced)} replaced (newer), {len(report.kept)} kept (the cache's was as new "
                  f"or newer), {len(report.rejected)} rejected")
        if report.other_env:
            out.print(f"{len(report.other_env)} of the imported entries were made for another environment: "
                      "kept, but never served here (`forge cache prune --env` removes them)")
        if report.rejected:
            table = Table(title="rejected entries (not imported)")
            for col in ("key", "op", "from", "reason"):
                table.add_column(col, overflow="fold")
            for r in report.rejected:
                table.add_row(r["key"][:12], r["op"], r["from"], r["reason"])
            out.print(table)
        elif n == 0 and not report.kept:
            out.print("(nothing to import)")
    if report.rejected:
        n = len(report.rejected)
        err.print(f"[bold red]error:[/] {n} entr{'y was' if n == 1 else 'ies were'}"
                  " rejected (listed above); the others were imported. `--trust` imports those whose only "
                  "problem is a source the installed templates do not render.")
        raise typer.Exit(ExitCode.CACHE)


def cache_export(file: Annotated[Path, typer.Argument(help="Bundle file to write (JSON).")],
                 op: Annotated[str | None, typer.Option("--op", help="Only this op's entries.")] = None,
                 json_out: JsonOpt = False, cache: CacheOpt = None) -> None:
    """Write the cache's entries (all, or --op's) to one bundle file (JSON), for `forge cache import`."""
    db = open_cache(cache)
    try:
        entries = db.entries(op)
        n = bundle.write_bundle(file, entries)
    except CacheError as exc:
        raise fail(exc, ExitCode.CACHE) from None
    except ForgeError as exc:
        raise fail(exc, exc.exit_code) from None
    if json_out:
        emit({"bundle": str(file), "cache": str(db.path), "count": n, "keys": [e.key for e in entries]})
    else:
        out.print(f"exported {n} entr{'y' if n == 1 else 'ies'} of {escape(str(db.path))} to {escape(str(file))}")


def cache_import(file: Annotated[Path, typer.Argument(help="Bundle file written by `forge cache export`.")],
                 trust: TrustOpt = False, json_out: JsonOpt = False, cache: CacheOpt = None) -> None:
    """Import a bundle written by `forge cache export`, checking every entry.

    Every kernel's source must re-render from the installed templates with its variant and params (same
    sha256); entries that fail are rejected and listed (exit 5). The newer entry wins on a key conflict."""
    try:
        raws = bundle.read_bundle(file)
    except ForgeError as exc:
        raise fail(exc, exc.exit_code) from None
    db = open_cache(cache)
    try:
        report = bundle.import_entries(db, [(str(file), r) for r in raws], trust=trust, source=str(file))
    except CacheError as exc:
        raise fail(exc, ExitCode.CACHE) from None
    print_import(report, json_out, "imported")


def cache_merge(dbs: Annotated[list[Path], typer.Argument(help="Other cache DB files to merge into --cache.")],
                trust: TrustOpt = False, json_out: JsonOpt = False, cache: CacheOpt = None) -> None:
    """Merge other cache DBs into the --cache one, with the checks of `forge cache import`.

    The newer entry (created_at) wins on a key conflict; ties keep --cache's, so a rerun changes nothing.
    The other DBs are opened read-only."""
    raws = []
    for path in dbs:
        if not path.is_file():
            raise fail(UsageError(f"{path}: no such cache DB file"), ExitCode.USAGE)
        try:
            src = Cache.open_read_only(path)
            try:
                raws += [(str(path), e) for e in src.entries()]
            finally:
                src.close()
        except CacheError as exc:
            raise fail(exc, ExitCode.CACHE) from None
    db = open_cache(cache)
    try:
        report = bundle.import_entries(db, raws, trust=trust, source=", ".join(map(str, dbs)))
    except CacheError as exc:
        raise fail(exc, ExitCode.CACHE) from None
    print_import(report, json_out, "merged")


def cache_prune(
    env: Annotated[bool, typer.Option("--env", help="Entries made for another environment than this "
                                                    "machine's (GPU, driver, torch, triton, forge).")] = False,
    stale: Annotated[bool, typer.Option("--stale", help="Entries whose op's templates changed since "
                                                        "(template_hash differs) or whose op is gone.")] = False,
    older_than: Annotated[float | None, typer.Option("--older-than", help="Entries older than DAYS.",
                                                     metavar="DAYS")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="List what would go; delete nothing.")] = False,
    json_out: JsonOpt = False, cache: CacheOpt = None,
) -> None:
    """Remove entries this machine cannot use (--env, --stale) or old ones (--older-than).

    Without a criterion: --env and --stale. An entry goes when any chosen criterion matches it;
    --dry-run lists what would go."""
    if older_than is not None and not older_than >= 0:
        raise fail(UsageError(f"--older-than expects a number of days >= 0, got {older_than}"), ExitCode.USAGE)
    if not (env or stale or older_than is not None):
        env = stale = True
    db = open_cache(cache)
    try:
        doomed = bundle.prune_reasons(db.entries(), env=env, stale=stale, older_than_days=older_than)
        removed = 0 if dry_run else db.delete_keys([e.key for e, _ in doomed])
    except CacheError as exc:
        raise fail(exc, ExitCode.CACHE) from None
    criteria = [c for c, on in (("env", env), ("stale", stale), ("older-than", older_than is not None)) if on]
    if json_out:
        emit({"cache": str(db.path), "dry_run": dry_run, "criteria": criteria, "older_than_days": older_than,
              "removed": removed, "entries": [{**entry_row(e), "reasons": r} for e, r in doomed]})
        return
    verb = "would remove" if dry_run else "removed"
    if doomed:
        table = Table(title=f"{verb} ({', '.join(criteria)})")
        for col in ("key", "op", "shape", "dtype", "device", "decision", "age", "why"):
            table.add_column(col, overflow="fold")
        for e, reasons in doomed:
            r = entry_row(e)
            table.add_row(r["key"][:12], r["op"], r["shape"], r["dtype"], str(r["device"]), r["decision"],
                          age(r["created_at"]), "; ".join(reasons))
        out.print(table)
    n = len(doomed) if dry_run else removed
    out.print(f"{verb} {n} entr{'y' if n == 1 else 'ies'} of {escape(str(db.path))}")


def register(app: typer.Typer, cache_app: typer.Typer) -> None:
    cache_app.command("export")(cache_export)
    cache_app.command("import")(cache_import)
    cache_app.command("merge")(cache_merge)
    cache_app.command("prune")(cache_prune)
