"""`forge` command line: a thin Typer layer over the engine and the cache.

One output path: Rich for people (tables on stdout, progress and diagnostics on stderr), `--json`
for scripts (one JSON document on stdout, nothing else there).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.syntax import Syntax
from rich.table import Table

from forge.cache import AmbiguousKey, Cache, CacheError, KeyNotFound, default_cache_path
from forge.errors import EXIT_CODES_HELP, ExitCode, ForgeError, UsageError
from forge.spec import parse_shape
from forge.tuner import engine
from forge.tuner import manifest as manifest_mod

app = typer.Typer(
    name="forge",
    help="Auto-tune Triton kernels for PyTorch ops: search, validate, time, cache.\n\n" + EXIT_CODES_HELP,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
cache_app = typer.Typer(help="Inspect and edit the kernel cache. " + EXIT_CODES_HELP, no_args_is_help=True)
app.add_typer(cache_app, name="cache")

# Piped output (CI logs, `| less`) gets a wide fixed width instead of Rich's 80-column default,
# which folds the candidate table into unreadable cells.
out = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else 160)

CacheOpt = Annotated[Path | None, typer.Option("--cache", help="Cache DB (default: $FORGE_CACHE_DIR/forge.db "
                                                               "or ~/.cache/forge/forge.db).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout, nothing else.")]


def _fail(exc: Exception, code: int) -> typer.Exit:
    err.print(f"[bold red]error:[/] {escape(str(exc))}")  # messages hold [[op]], forge-kernel[ray] ...
    return typer.Exit(code)


def _open_cache(path: Path | None) -> Cache:
    try:
        return Cache(path or default_cache_path())
    except CacheError as exc:
        raise _fail(exc, ExitCode.CACHE) from None


def _cache_exit(exc: CacheError) -> int:
    """A key the user mistyped is a usage error; anything else about the DB is a cache error."""
    return ExitCode.USAGE if isinstance(exc, KeyNotFound | AmbiguousKey) else ExitCode.CACHE


def _parse_attrs(items: list[str]) -> dict[str, Any]:
    attrs: dict[str, Any] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise UsageError(f"--attr expects NAME=VALUE, got {item!r}")
        try:
            attrs[name] = json.loads(value)
        except json.JSONDecodeError:
            attrs[name] = value
    return attrs


def _fmt_us(x: float | None) -> str:
    return "-" if x is None else f"{x:,.2f}"


def _fmt_speedup(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _fmt_params(params: dict | None) -> str:
    return ", ".join(f"{k}={v}" for k, v in (params or {}).items())


STATUS_STYLE = {"ok": "green", "mismatch": "red", "compile-error": "red", "error": "red",
                "timeout": "yellow", "crashed": "magenta", "cuda-error": "magenta"}


def _candidates_table(report: engine.SearchReport, top: int) -> Table:
    clock = "µs (device)" if report.backend == "cuda" else "µs (host, interpreter)"
    table = Table(title=f"{report.op} {report.spec.shape_str} {report.spec.dtype} — candidates")
    for col in ("#", "variant", "params"):
        table.add_column(col)
    for col in (f"p20 {clock}", "p50", "p80", "speedup"):
        table.add_column(col, justify="right")
    table.add_column("status")
    if report.baseline is not None:
        b = report.baseline
        table.add_row("", "eager", "(baseline)", _fmt_us(b.p20), _fmt_us(b.p50), _fmt_us(b.p80), "1.00x", "ok")
    ok = [c for c in report.candidates if c["status"] == "ok"]
    bad = [c for c in report.candidates if c["status"] != "ok"]
    for i, c in enumerate(ok[:top], 1):
        q = c["final"] or c["screen"] or {}
        table.add_row(str(i), c["variant"], _fmt_params(c["params"]), _fmt_us(q.get("p20")),
                      _fmt_us(q.get("p50")), _fmt_us(q.get("p80")), _fmt_speedup(c["speedup"]),
                      "ok" + (" (final)" if c["final"] else ""))
    if len(ok) > top:
        table.add_row("", f"... {len(ok) - top} more ok", "", "", "", "", "", "")
    for c in bad:
        style = STATUS_STYLE.get(c["status"], "red")
        reason = (c.get("reason") or "").splitlines()[0][:90] if c.get("reason") else ""
        table.add_row("", c["variant"], _fmt_params(c["params"]), "", "", "", "",
                      f"[{style}]{c['status']}[/] {reason}")
    return table


def _print_report(report: engine.SearchReport, top: int) -> None:
    if report.backend == "interpreter":
        out.print("[bold yellow]Triton interpreter on the CPU: timings are host-clock interpreter timings, "
                  "not GPU performance.[/]")
    if report.cache_hit:
        out.print(f"[bold]cache hit[/] — decision stored {_age(report.stored['created_at'])} ago for "
                  f"{report.op} {report.spec.shape_str} {report.spec.dtype} (that search took "
                  f"{report.stored['search_seconds']:.1f} s); no work done.")
    out.print(_candidates_table(report, top))
    sp = report.speedup
    if report.decision == "kernel":
        w = report.winner
        out.print(f"[bold green]decision: kernel[/] {w['variant']}({_fmt_params(w['params'])}) "
                  f"p50 {_fmt_us(w['quantiles']['p50'])} µs vs eager {_fmt_us(report.baseline.p50)} µs "
                  f"({_fmt_speedup(sp)})")
    elif report.decision == "eager":
        out.print("[bold yellow]decision: eager[/] — no candidate beat eager by the required margin "
                  "(p80(candidate) < p20(eager)/1.03); eager is cached as the decision.")
    else:
        out.print("[bold red]decision: none[/] — every candidate failed; nothing was cached.")
    out.print(f"cache key: {report.key}  ({report.cache_path})")
    if not report.cache_hit:
        out.print(f"search wall time: {report.seconds:.1f} s")


class _ProgressEvents:
    """Maps engine events to a Rich progress bar on stderr."""

    def __init__(self, progress: Progress | None):
        self.progress = progress
        self.task = None
        self.total = 0
        self.label = ""

    def reset(self, description: str) -> None:
        """A new search (the next manifest entry): a fresh bar under its label."""
        if self.progress is not None and self.task is not None:
            self.progress.remove_task(self.task)
        self.task, self.total, self.label = None, 0, description

    def __call__(self, kind: str, **data: Any) -> None:
        p = self.progress
        if kind == "waiting-for-lock":
            err.print(f"waiting for another forge process to release {data['path']} ...")
        if p is None:
            return
        if kind == "start":
            self.task = p.add_task(f"{self.label} starting {data['workers']} worker(s) ({data['backend']})".strip(),
                                   total=None)
        elif kind == "batch":
            self.total += 2 * data["size"]
            p.update(self.task, total=self.total, description=f"{self.label} validating + timing".strip())
        elif kind in ("validated", "timed"):
            adv = 2 if kind == "validated" and data["result"].status != "ok" else 1
            p.update(self.task, advance=adv)
        elif kind == "finalists":
            p.update(self.task, description=f"{self.label} re-timing {len(data['results'])} finalists vs eager".strip())


@app.command()
def search(
    op: Annotated[str | None, typer.Argument(help="Op family, e.g. rmsnorm or softmax (or use --manifest).")] = None,
    shape: Annotated[str | None, typer.Option("--shape", help="Input shape, e.g. 2048x4096.")] = None,
    manifest: Annotated[Path | None, typer.Option("--manifest", help="Tune every entry of a TOML manifest "
                                                                     "(see docs/manifest.md).")] = None,
    shard: Annotated[str | None, typer.Option("--shard", help="With --manifest: only shard I of N, "
                                                              "written I/N with 0 <= I < N.")] = None,
    dtype: Annotated[str | None, typer.Option(help="float16, bfloat16 or float32 (default: float16).")] = None,
    budget: Annotated[int | None, typer.Option(help="Maximum number of candidates (default: 50).")] = None,
    strategy: Annotated[str | None, typer.Option(help="grid or random (default: grid).")] = None,
    seed: Annotated[int | None, typer.Option(help="Seed for --strategy random and the test inputs "
                                                  "(default: 0).")] = None,
    device: Annotated[str | None, typer.Option(help="cuda or cpu (Triton interpreter) "
                                                    "(default: cuda if available, else cpu).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Search even if a decision is cached.")] = False,
    json_out: JsonOpt = False,
    cache: CacheOpt = None,
    timeout: Annotated[float | None, typer.Option(help="Seconds per candidate before its worker is killed "
                                                       "(default: 120).")] = None,
    workers: Annotated[int | None, typer.Option(help="Worker processes (default: by backend).")] = None,
    attr: Annotated[list[str] | None, typer.Option("--attr", help="Scalar attribute NAME=VALUE, "
                                                                  "e.g. --attr eps=1e-5.")] = None,
    top: Annotated[int, typer.Option(help="Rows of ok candidates to show.")] = 10,
    devices: Annotated[str | None, typer.Option("--devices", help="With --manifest: GPUs of this host to "
                                                "spread the entries over, e.g. 0,1 (one runner per GPU).")] = None,
    executor: Annotated[str, typer.Option(help="With --manifest: local, or ray (each entry a Ray task; "
                                               "pip install 'forge-kernel[ray]').")] = "local",
    address: Annotated[str | None, typer.Option(help="With --executor ray: the cluster address "
                                                     "(default: start a local Ray).")] = None,
) -> None:
    """Search for the fastest correct kernel for OP at --shape (or for every entry of --manifest),
    against eager PyTorch. Settings: command line > FORGE_* environment > manifest > built-in."""
    cli = {"dtype": dtype, "budget": budget, "strategy": strategy, "seed": seed, "timeout": timeout,
           "device": device, "workers": workers, "cache": cache}
    try:
        for name in ("dtype", "budget", "strategy", "seed", "timeout", "device", "workers"):
            if cli[name] is not None:
                cli[name] = manifest_mod._check(name, cli[name], None)
        if manifest is not None:
            if op is not None or shape is not None or attr:
                raise UsageError("--manifest replaces OP, --shape and --attr; give either a manifest or one op")
            _search_manifest(manifest, shard, cli, force, json_out, devices, executor, address)
            return
        for flag, value in (("--shard", shard), ("--devices", devices), ("--address", address),
                            ("--executor", None if executor == "local" else executor)):
            if value is not None:
                raise UsageError(f"{flag} needs --manifest")
        if op is None or shape is None:
            raise UsageError("give OP and --shape (e.g. forge search rmsnorm --shape 2048x4096), or --manifest FILE")
        try:
            shape_t = parse_shape(shape)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        env = os.environ
        r = {name: manifest_mod.resolve(name, cli, env) for name in
             ("dtype", "budget", "strategy", "seed", "timeout", "device", "workers")}
        options = engine.SearchOptions(budget=r["budget"], strategy=r["strategy"], seed=r["seed"], force=force,
                                       timeout=r["timeout"], workers=r["workers"])
        attrs = _parse_attrs(attr or [])
        db = _open_cache(cache)
        show_progress = not json_out and err.is_terminal
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=err, disable=not show_progress) as progress:
            report = engine.search(op, shape_t, r["dtype"], device=r["device"], cache=db, attrs=attrs,
                                   options=options, events=_ProgressEvents(progress))
    except ForgeError as exc:
        raise _fail(exc, exc.exit_code) from None
    except CacheError as exc:
        raise _fail(exc, ExitCode.CACHE) from None
    if json_out:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        _print_report(report, top)
    if report.decision == "none":
        raise typer.Exit(ExitCode.ALL_FAILED)


def _search_manifest(path: Path, shard: str | None, cli: dict, force: bool, json_out: bool,
                     devices: str | None = None, executor: str = "local", address: str | None = None) -> None:
    from forge.tuner import batch

    if executor not in ("local", "ray"):
        raise UsageError(f"--executor {executor!r}: expected local or ray")
    if address is not None and executor != "ray":
        raise UsageError("--address needs --executor ray")
    if devices is not None and executor == "ray":
        raise UsageError("--devices is for the local executor; Ray places each job on a GPU itself")
    device_list = batch.parse_devices(devices) if devices is not None else None
    m = manifest_mod.load(path, cli=cli)
    jobs = m.jobs
    part = None
    if shard is not None:
        part = manifest_mod.parse_shard(shard)
        jobs = manifest_mod.shard(jobs, *part)
    db = _open_cache(m.cache)
    show_progress = not json_out and err.is_terminal and device_list is None and executor == "local"
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=err, disable=not show_progress) as progress:
        events = _ProgressEvents(progress)

        def on_start(n: int, job) -> None:
            label = f"[{n + 1}/{len(jobs)}] {job.label}"
            if show_progress:
                events.reset(label)
            elif not json_out:
                err.print(label)

        t_run = time.monotonic()
        results = batch.run(jobs, cache=db, device=m.device, workers=m.workers, force=force,
                            on_start=on_start, events=events, devices=device_list, executor=executor,
                            address=address)
        wall = time.monotonic() - t_run
    failed = [r for r in results if r.status == "failed"]
    if json_out:
        print(json.dumps({"manifest": str(path), "shard": list(part) if part else None, "cache": str(db.path),
                          "executor": executor, "devices": device_list, "wall_s": wall,
                          "jobs": len(jobs), "total_jobs": len(m.jobs), "failed": len(failed),
                          "entries": [r.to_dict() for r in results]}, indent=2))
    else:
        title = f"{path}" + (f" — shard {part[0]}/{part[1]}: {len(jobs)} of {len(m.jobs)} jobs" if part else "")
        table = Table(title=title)
        spread = device_list is not None or executor == "ray"
        cols = ["entry", "op", "shape", "dtype", "status", "decision", "winner", "p50 µs", "eager µs", "speedup",
                "s"] + (["device"] if spread else [])
        for col in cols:
            table.add_column(col, justify="right" if col in ("p50 µs", "eager µs", "speedup", "s") else "left")
        for r in results:
            status = {"failed": "[red]failed[/]", "cached": "cached", "searched": "[green]searched[/]"}[r.status]
            table.add_row(str(r.entry), r.op, r.shape, r.dtype, status, r.decision or "-", r.winner or "-",
                          _fmt_us(r.p50_us), _fmt_us(r.eager_p50_us), _fmt_speedup(r.speedup), f"{r.seconds:.1f}",
                          *([escape(str(r.device)) if r.device is not None else "-"] if spread else []))
        out.print(table)
        out.print(f"cache: {db.path}; wall time {wall:.1f} s")
        for r in failed:
            err.print(f"[bold red]failed:[/] {escape(f'[[op]] #{r.entry} {r.op} {r.shape} {r.dtype}: {r.error}')}")
    if failed:
        raise typer.Exit(failed[0].exit_code or ExitCode.ALL_FAILED)


def _age(created: float) -> str:
    s = max(0.0, time.time() - created)
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= n:
            return f"{s / n:.0f}{unit}"
    return f"{s:.0f}s"


def _entry_row(e) -> dict[str, Any]:
    x = e.spec["inputs"][0]
    return {"key": e.key, "op": e.op, "shape": "x".join(map(str, x["shape"])), "dtype": x["dtype"],
            "backend": e.env.get("backend"), "device": e.env.get("gpu") or e.env.get("cpu"),
            "decision": e.decision, "variant": e.variant, "params": e.params, "speedup": e.speedup,
            "p50_us": (e.winner or {}).get("p50"), "eager_p50_us": (e.baseline or {}).get("p50"),
            "created_at": e.created_at}


@cache_app.command("ls")
def cache_ls(op: Annotated[str | None, typer.Option(help="Only this op.")] = None,
             json_out: JsonOpt = False, cache: CacheOpt = None) -> None:
    """List cached decisions."""
    db = _open_cache(cache)
    try:
        rows = [_entry_row(e) for e in db.entries(op)]
    except CacheError as exc:
        raise _fail(exc, ExitCode.CACHE) from None
    if json_out:
        print(json.dumps(rows, indent=2))
        return
    table = Table(title=f"forge cache ({db.path})")
    for col in ("key", "op", "shape", "dtype", "device", "decision", "speedup", "p50 µs", "age"):
        table.add_column(col, justify="right" if col in ("speedup", "p50 µs") else "left")
    for r in rows:
        dev = f"{r['device']} [dim]({r['backend']})[/]"
        p50 = r["p50_us"] if r["decision"] == "kernel" else r["eager_p50_us"]
        table.add_row(r["key"][:12], r["op"], r["shape"], r["dtype"], dev, r["decision"],
                      _fmt_speedup(r["speedup"]), _fmt_us(p50), _age(r["created_at"]))
    out.print(table)
    if not rows:
        out.print("(empty)")


@cache_app.command("show")
def cache_show(key: Annotated[str, typer.Argument(help="Cache key or a unique prefix of it.")],
               json_out: JsonOpt = False, cache: CacheOpt = None) -> None:
    """Show one entry's metadata and its Triton source."""
    db = _open_cache(cache)
    try:
        e = db.find(key)
    except CacheError as exc:
        raise _fail(exc, _cache_exit(exc)) from None
    if json_out:
        from dataclasses import asdict

        print(json.dumps(asdict(e), indent=2))
        return
    meta = Table.grid(padding=(0, 2))
    r = _entry_row(e)
    for name, value in [("key", e.key), ("op", e.op), ("shape", r["shape"]), ("dtype", r["dtype"]),
                        ("attrs", json.dumps(e.spec.get("attrs", {}))), ("decision", e.decision),
                        ("variant", e.variant or "-"), ("params", _fmt_params(e.params) or "-"),
                        ("winner µs", json.dumps(e.winner)), ("eager µs", json.dumps(e.baseline)),
                        ("speedup", _fmt_speedup(e.speedup)), ("env", json.dumps(e.env)),
                        ("template hash", e.template_hash), ("source sha256", e.source_sha256 or "-"),
                        ("candidates", _outcome_counts(e.candidates)),
                        ("search", f"{e.search_seconds:.1f} s, forge {e.forge_version}, {_age(e.created_at)} ago")]:
        meta.add_row(f"[bold]{name}[/]", value)
    out.print(meta)
    if e.source:
        out.print(Syntax(e.source, "python", line_numbers=False, word_wrap=True))


def _outcome_counts(cands: list[dict]) -> str:
    counts: dict[str, int] = {}
    for c in cands:
        counts[c["status"]] = counts.get(c["status"], 0) + 1
    return ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "-"


@cache_app.command("rm")
def cache_rm(key: Annotated[str | None, typer.Argument(help="Cache key or unique prefix.")] = None,
             op: Annotated[str | None, typer.Option(help="Remove every entry of this op.")] = None,
             all_: Annotated[bool, typer.Option("--all", help="Remove every entry.")] = False,
             cache: CacheOpt = None) -> None:
    """Remove entries: one KEY, --op OP, or --all."""
    chosen = sum(x is not None and x is not False for x in (key, op, all_ or None))
    if chosen != 1:
        raise _fail(UsageError("give exactly one of KEY, --op OP, --all"), ExitCode.USAGE)
    db = _open_cache(cache)
    try:
        n = db.delete(key) if key else db.delete_op(op) if op else db.delete_all()
    except CacheError as exc:
        raise _fail(exc, _cache_exit(exc)) from None
    out.print(f"removed {n} entr{'y' if n == 1 else 'ies'}")


@cache_app.command("path")
def cache_path(cache: CacheOpt = None) -> None:
    """Print where the cache DB is."""
    print(cache or default_cache_path())


# Subcommands that live in their own modules (each has register(app, cache_app)); imported last,
# because they use this module's helpers (consoles, _open_cache, _fail, option types).
from forge_cli import cmd_bench, cmd_bundle, cmd_export, cmd_trace  # noqa: E402

for _mod in (cmd_trace, cmd_bench, cmd_export, cmd_bundle):
    _mod.register(app, cache_app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
