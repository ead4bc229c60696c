"""`forge bench`: the CLI over forge_cli/benchmark.py. Registered by forge_cli/cli.py (register()).

No `from __future__ import annotations` here: Typer reads the option annotations of the command, which is
defined inside register(), so they must be real objects, not strings naming locals.
"""

import csv
import importlib.util
import io
import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from forge.cache import CacheError
from forge.errors import ExitCode, ForgeError, UsageError
from forge.tuner import benchmark, stats

BENCH_CSV_FIELDS = ("op", "shape", "dtype", "attrs", "key", "contestant", "label", "status", "clock", "p20_us",
                    "p50_us", "p80_us", "n", "speedup", "pct_roofline", "achieved_tbps", "achieved_tflops", "bound",
                    "reason")
RECHECK_CSV_FIELDS = ("key", "op", "shape", "dtype", "attrs", "status", "stored_speedup", "new_speedup", "ratio",
                      "stored_p50_us", "stored_eager_p50_us", "new_p50_us", "new_eager_p50_us", "reason")
PLOT_HINT = "pip install 'forge-kernel[plot]' (or: pip install matplotlib)"
STATUS_STYLE = {"ok": "green", "mismatch": "red", "error": "red", "refused": "red", "skipped": "dim",
                "drifted": "yellow", "invalid": "red", "sha256-mismatch": "red", "missing": "red"}


# -- rows shared by --csv and --plot ------------------------------------------------------------------
def bench_rows(report: benchmark.BenchReport) -> list[dict[str, Any]]:
    rows = []
    for r in report.results:
        t = r.target
        base = {"op": t.op, "shape": t.shape_str, "dtype": t.dtype, "attrs": json.dumps(t.attrs, sort_keys=True),
                "key": t.key}
        if t.error:
            rows.append({**base, "status": "missing", "reason": t.error})
            continue
        for c in r.contestants:
            q = c.quantiles
            roof = c.roofline or {}
            rows.append({**base, "contestant": c.name, "label": c.label, "status": c.status, "clock": c.clock,
                         "p20_us": q.p20 if q else None, "p50_us": q.p50 if q else None,
                         "p80_us": q.p80 if q else None, "n": q.n if q else None, "speedup": c.speedup,
                         "pct_roofline": roof.get("pct_roofline"), "achieved_tbps": roof.get("achieved_tbps"),
                         "achieved_tflops": roof.get("achieved_tflops"), "bound": (r.model or {}).get("bound"),
                         "reason": c.reason or c.note})
    return rows


def recheck_rows(report: benchmark.RecheckReport) -> list[dict[str, Any]]:
    rows = []
    for r in report.results:
        t, e = r.target, r.target.entry
        rows.append({"key": t.key, "op": t.op, "shape": t.shape_str, "dtype": t.dtype,
                     "attrs": json.dumps(t.attrs, sort_keys=True), "status": r.status,
                     "stored_speedup": r.stored_speedup, "new_speedup": r.new_speedup, "ratio": r.ratio,
                     "stored_p50_us": (e.winner or {}).get("p50") if e else None,
                     "stored_eager_p50_us": (e.baseline or {}).get("p50") if e else None,
                     "new_p50_us": r.new_kernel.p50 if r.new_kernel else None,
                     "new_eager_p50_us": r.new_baseline.p50 if r.new_baseline else None, "reason": r.reason})
    return rows


def write_csv(rows: list[dict[str, Any]], fields: tuple[str, ...], dest: str) -> None:
    """Floats at full precision (str(float) round-trips), so the CSV holds the --json numbers exactly."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=fields, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for row in rows:
        w.writerow({k: ("" if row.get(k) is None else row[k]) for k in fields})
    if dest == "-":
        sys.stdout.write(buf.getvalue())
    else:
        try:
            Path(dest).write_text(buf.getvalue())
        except OSError as exc:
            raise UsageError(f"--csv {dest}: cannot write: {exc.strerror or exc}") from None


def write_plot(path: Path, report, recheck: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if recheck:
        done = [r for r in report.results if r.new_speedup is not None]
        labels = [f"{r.target.label}\n{(r.target.key or '')[:8]}" for r in done]
        series = {"stored": [r.stored_speedup or 0.0 for r in done], "now": [r.new_speedup or 0.0 for r in done]}
        title = "forge bench --recheck: cached speedup vs now"
    else:
        done = [r for r in report.results if any(c.speedup is not None for c in r.contestants)]
        labels = [r.target.label for r in done]
        names = [n for n in benchmark.CONTESTANTS
                 if any((c := r.contestant(n)) is not None and c.speedup is not None for r in done)]
        series = {n: [(c.speedup or 0.0) if (c := r.contestant(n)) is not None else 0.0 for r in done]
                  for n in names}
        clock = "device time" if report.backend == "cuda" else "host clock, Triton interpreter"
        title = f"forge bench: speedup over eager (p50, {clock})"
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 + 0.9 * len(labels) * max(1, len(series))), 4.5))
    width = 0.8 / max(1, len(series))
    for k, (name, values) in enumerate(series.items()):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(labels))]
        bars = ax.bar(xs, values, width, label=name)
        ax.bar_label(bars, labels=[_sp(v) if v else "" for v in values], fontsize=7, padding=2)
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylabel("speedup vs eager (eager p50 / p50)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as exc:
        raise UsageError(f"--plot {path}: cannot write: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)


# -- human output -------------------------------------------------------------------------------------
def _sp(x: float | None) -> str:
    """Speedups to 3 significant digits: interpreter speedups are often 0.00x at two decimals."""
    return "-" if x is None else f"{x:.2f}x" if x >= 0.1 else f"{x:.2g}x"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}%"


def _status_cell(status: str, reason: str | None, limit: int = 110) -> str:
    style = STATUS_STYLE.get(status, "red")
    text = f"[{style}]{status}[/]"
    if reason:
        reason = reason if len(reason) <= limit else reason[: limit - 3] + "..."
        text += f" {escape(reason)}"
    return text


def _print_bench(c, report: benchmark.BenchReport) -> None:
    out = c.out
    if report.backend == "interpreter":
        out.print("[bold yellow]Triton interpreter on the CPU: timings are host-clock interpreter timings, "
                  "not GPU performance; the roofline is the CPU's.[/]")
    p = report.peaks
    if p is not None:
        rates = ", ".join(f"{k} {v:,.3g}" for k, v in p.matmul_tflops.items())
        out.print(f"peaks ({'cached' if p.cached else 'measured now'}, {p.measured_at}): copy "
                  f"{p.copy_tbps:.3g} TB/s; matmul TFLOP/s {rates}  [dim]({escape(p.path or '')})[/]")
    for r in report.results:
        t = r.target
        if t.error:
            continue
        clock = "µs (device)" if report.backend == "cuda" else "µs (host, interpreter)"
        table = Table(title=f"{escape(t.label)} — forge bench")
        for col in ("contestant", "what"):
            table.add_column(col)
        for col in (f"p20 {clock}", "p50", "p80", "speedup", "% roofline"):
            table.add_column(col, justify="right")
        table.add_column("status")
        for cr in r.contestants:
            q = cr.quantiles
            status = cr.status + (f" ({cr.clock})" if cr.clock == "cuda-events" else "")
            table.add_row(cr.name, escape(cr.label), c._fmt_us(q.p20 if q else None), c._fmt_us(q.p50 if q else None),
                          c._fmt_us(q.p80 if q else None), _sp(cr.speedup),
                          _pct((cr.roofline or {}).get("pct_roofline")), _status_cell(status, cr.reason or cr.note))
        out.print(table)
        m = r.model or {}
        if m and p is not None:
            if m["bound"] == "compute":
                ref = f"100% = {t.dtype} matmul rate {p.matmul_tflops.get(t.dtype, 0):,.3g} TFLOP/s"
                why = f"{m['intensity']:.3g} flop/B >= ridge {m['ridge']:.3g} flop/B"
            else:
                ref = f"100% = copy bandwidth {p.copy_tbps:.3g} TB/s"
                why = (f"{m['intensity']:.3g} flop/B < ridge {m['ridge']:.3g} flop/B" if m["gemm"] else
                       f"{m['intensity']:.3g} flop/B, not a matrix product")
            out.print(f"roofline: {m['bound']}-bound ({why}); {ref}")
        if r.fastest:
            out.print(f"fastest: [bold]{r.fastest}[/]   (key {t.key[:12]}, {r.seconds:.1f} s)")
    out.print(f"cache: {report.cache_path}")


def _print_recheck(c, report: benchmark.RecheckReport) -> None:
    out = c.out
    if report.backend == "interpreter":
        out.print("[bold yellow]Triton interpreter on the CPU: timings are host-clock interpreter timings.[/]")
    table = Table(title=f"forge bench --recheck ({report.cache_path})")
    for col in ("key", "op", "shape", "dtype"):
        table.add_column(col)
    for col in ("stored", "now", "change", "kernel p50 µs", "eager p50 µs"):
        table.add_column(col, justify="right")
    table.add_column("status")
    for r in report.results:
        t = r.target
        change = "-" if r.ratio is None else f"{(r.ratio - 1) * 100:+.1f}%"
        table.add_row((t.key or "-")[:12], t.op, t.shape_str, t.dtype, _sp(r.stored_speedup),
                      _sp(r.new_speedup), change, c._fmt_us(r.new_kernel.p50 if r.new_kernel else None),
                      c._fmt_us(r.new_baseline.p50 if r.new_baseline else None), _status_cell(r.status, r.reason))
    out.print(table)
    if not report.results:
        out.print("(no cached entries selected)")
    counts = {s: report.count(s) for s in ("ok", "drifted", "invalid", "sha256-mismatch", "skipped", "missing")}
    out.print(", ".join(f"{n} {s}" for s, n in counts.items() if n) or "nothing to recheck")


class _Progress:
    def __init__(self, err, quiet: bool):
        self.err, self.quiet = err, quiet

    def __call__(self, kind: str, **data: Any) -> None:
        if kind == "waiting-for-lock":
            self.err.print(f"waiting for another forge process to release {data['path']} ...")
        if self.quiet:
            return
        if kind == "measuring-peaks":
            self.err.print(f"measuring the device's peaks once (copy bandwidth, matmul rate): {escape(data['device'])}")
        elif kind == "target":
            self.err.print(f"[{data['index'] + 1}/{data['total']}] {escape(data['target'].label)}")
        elif kind == "validating":
            self.err.print(f"  checking {', '.join(data['contestants'])} against the float64 oracle"
                           + (" (torch.compile compiles here)" if any(n.startswith("compile")
                                                                      for n in data["contestants"]) else ""))
        elif kind == "timing":
            self.err.print(f"  timing {', '.join(data['contestants'])} interleaved")
        elif kind == "recheck-validate":
            self.err.print("  re-validating in a worker (check_candidate)")
        elif kind == "recheck-time":
            self.err.print("  re-timing against eager")


# -- the command ----------------------------------------------------------------------------------------
def _targets(c, *, op, shape, manifest, attr, recheck, remeasure, cli_vals, db_path):
    """(backend, cache, targets) for the selection; UsageError for a bad one."""
    from forge import ops
    from forge.spec import parse_shape
    from forge.tuner import engine
    from forge.tuner import manifest as manifest_mod

    env = os.environ
    if manifest is not None:
        if op is not None or shape is not None or attr:
            raise UsageError("--manifest replaces OP, --shape and --attr; give either a manifest or one op")
        m = manifest_mod.load(manifest, cli=cli_vals)
        backend = engine.resolve_backend(m.device)
        benchmark.prepare_backend(backend)
        db = c._open_cache(m.cache)
        return backend, db, [benchmark.resolve_target(j.op, j.shape, j.dtype, j.attrs, backend, db) for j in m.jobs]
    backend = engine.resolve_backend(manifest_mod.resolve("device", cli_vals, env))
    benchmark.prepare_backend(backend)
    if shape is not None:
        if op is None:
            raise UsageError("--shape needs OP (e.g. forge bench rmsnorm --shape 2048x4096)")
        try:
            shape_t = parse_shape(shape)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        dtype = manifest_mod.resolve("dtype", cli_vals, env)
        db = c._open_cache(db_path)
        return backend, db, [benchmark.resolve_target(op, shape_t, dtype, c._parse_attrs(attr or []), backend, db)]
    if not recheck:
        if remeasure and op is None and not attr:  # `forge bench --remeasure-peaks` alone: just the peaks
            return backend, c._open_cache(db_path), []
        raise UsageError("give OP and --shape (e.g. forge bench rmsnorm --shape 2048x4096), or --manifest FILE")
    if attr:
        raise UsageError("--attr needs OP and --shape")
    if op is not None:
        ops.get(op)  # unknown op: UsageError naming the known ones
    db = c._open_cache(db_path)
    return backend, db, [benchmark.target_of_entry(e) for e in db.entries(op)]


def register(app: typer.Typer, cache_app: typer.Typer) -> None:
    from forge.tuner import manifest as manifest_mod
    from forge_cli import cli as c

    @app.command("bench")
    def bench(
        op: Annotated[str | None, typer.Argument(help="Op family (or --manifest). With --recheck: every cached "
                                                      "entry of OP, or of the cache when OP is left out.")] = None,
        shape: Annotated[str | None, typer.Option("--shape", help="Input shape, e.g. 2048x4096.")] = None,
        manifest: Annotated[Path | None, typer.Option("--manifest", help="Bench every entry of a TOML manifest "
                                                                         "(docs/manifest.md).")] = None,
        dtype: Annotated[str | None, typer.Option(help="float16, bfloat16 or float32 (default: float16).")] = None,
        device: Annotated[str | None, typer.Option(help="cuda or cpu (Triton interpreter; "
                                                        "default: cuda if available, else cpu).")] = None,
        attr: Annotated[list[str] | None, typer.Option("--attr", help="Scalar attribute NAME=VALUE.")] = None,
        recheck: Annotated[bool, typer.Option("--recheck", help="Re-validate and re-time cached winners against "
                                                                "eager; flag drifted and invalid ones.")] = False,
        max_autotune: Annotated[bool, typer.Option("--max-autotune", help="Also time torch.compile(mode="
                                                   "'max-autotune-no-cudagraphs') (slow to compile).")] = False,
        remeasure_peaks: Annotated[bool, typer.Option("--remeasure-peaks", help="Measure the device's copy "
                                                      "bandwidth and matmul rate again.")] = False,
        skip: Annotated[list[str] | None, typer.Option("--skip", help="Leave a contestant out (repeatable): "
                                                       + ", ".join(benchmark.CONTESTANTS) + ".")] = None,
        rounds: Annotated[int | None, typer.Option(help="Interleaved timing rounds (default: the search's "
                                                        "finals: 40 on CUDA, 5 on the interpreter).")] = None,
        seed: Annotated[int | None, typer.Option(help="Seed of the inputs (default: 0).")] = None,
        drift: Annotated[float, typer.Option("--drift", help="--recheck: the smallest speedup change reported as "
                                                             "drift, as a fraction.")] = stats.DRIFT_FLOOR,
        timeout: Annotated[float | None, typer.Option(help="--recheck: seconds per worker request "
                                                           "(default: 120).")] = None,
        json_out: c.JsonOpt = False,
        csv_out: Annotated[str | None, typer.Option("--csv", metavar="FILE", help="Also write the results as CSV "
                                                    "to FILE ('-': stdout, and nothing else there).")] = None,
        plot: Annotated[Path | None, typer.Option("--plot", metavar="FILE.png", help="Bar chart of the speedups "
                                                  "(needs matplotlib: " + escape(PLOT_HINT) + ").")] = None,
        cache: c.CacheOpt = None,
    ) -> None:
        """Time cached winners against eager, fused torch, torch.compile and Liger; or --recheck them.

        Contestants are checked against the float64 oracle, then timed interleaved (CUDA graphs on the GPU);
        % of roofline is against the device's measured copy bandwidth and matmul rate (docs/bench.md).
        Exit 5 if a cached kernel fails its sha256 or the oracle check, 2 if a selected spec has no cached
        decision."""
        if plot is not None and importlib.util.find_spec("matplotlib") is None:
            raise _fail(c, UsageError(f"--plot needs matplotlib, which is not installed: {PLOT_HINT}"))
        cli_vals = {"dtype": dtype, "device": device, "seed": seed, "timeout": timeout, "cache": cache}
        try:
            if json_out and csv_out == "-":
                raise UsageError("--json and --csv - both want stdout; write the CSV to a file (--csv FILE)")
            unknown = sorted(set(skip or []) - set(benchmark.CONTESTANTS))
            if unknown:
                raise UsageError(f"--skip {', '.join(unknown)}: unknown contestant; known: "
                                 f"{', '.join(benchmark.CONTESTANTS)}")
            if rounds is not None and rounds < 1:
                raise UsageError("--rounds must be at least 1")
            if not 0.0 <= drift < 10.0:
                raise UsageError(f"--drift expects a fraction such as 0.1, got {drift}")
            for name in ("dtype", "device", "seed", "timeout"):
                if cli_vals[name] is not None:
                    cli_vals[name] = manifest_mod._check(name, cli_vals[name], f"--{name}")
            backend, db, targets = _targets(c, op=op, shape=shape, manifest=manifest, attr=attr, recheck=recheck,
                                            remeasure=remeasure_peaks, cli_vals=cli_vals, db_path=cache)
            opts = benchmark.BenchOptions(
                seed=manifest_mod.resolve("seed", cli_vals, os.environ), rounds=rounds, skip=frozenset(skip or ()),
                max_autotune=max_autotune, remeasure_peaks=remeasure_peaks,
                timeout=manifest_mod.resolve("timeout", cli_vals, os.environ), drift_floor=drift)
            quiet = json_out or csv_out == "-"
            progress = _Progress(c.err, quiet)
            run = benchmark.run_recheck if recheck else benchmark.run_bench
            report = run(targets, backend=backend, cache=db, options=opts, events=progress)
            rows = recheck_rows(report) if recheck else bench_rows(report)
            if csv_out is not None:
                write_csv(rows, RECHECK_CSV_FIELDS if recheck else BENCH_CSV_FIELDS, csv_out)
            if plot is not None:
                write_plot(plot, report, recheck)
        except ForgeError as exc:
            raise _fail(c, exc, exc.exit_code) from None
        except CacheError as exc:
            raise _fail(c, exc, ExitCode.CACHE) from None
        if json_out:
            print(json.dumps(report.to_dict(), indent=2))
        elif csv_out != "-":
            (_print_recheck if recheck else _print_bench)(c, report)
            if plot is not None:
                c.out.print(f"plot: {plot}")
            if csv_out is not None:
                c.out.print(f"csv: {csv_out}")
        _exit(c, report, recheck)


def _fail(c, exc: Exception, code: int = ExitCode.USAGE) -> typer.Exit:
    """cli._fail, with the message escaped: hints like forge-kernel[plot] are not Rich markup."""
    c.err.print(f"[bold red]error:[/] {escape(str(exc))}")
    return typer.Exit(code)


def _exit(c, report, recheck: bool) -> None:
    if recheck:
        bad = [r for r in report.results if r.status in benchmark.INVALID_STATUSES]
        missing = [r for r in report.results if r.status == "missing"]
        for r in bad:
            c.err.print(f"[bold red]{r.status}:[/] {escape(r.target.label)} ({(r.target.key or '')[:12]}): "
                        f"{escape(r.reason or '')}")
    else:
        bad = report.bad_kernels
        missing = report.missing
        for r in bad:
            f = r.contestant("forge")
            c.err.print(f"[bold red]cached kernel {f.status}:[/] {escape(r.target.label)} ({r.target.key[:12]}): "
                        f"{escape(f.reason or '')}")
    for r in missing:
        c.err.print(f"[bold red]error:[/] {escape(r.target.error or '')}")
    if bad:
        raise typer.Exit(ExitCode.CACHE)
    if missing:
        raise typer.Exit(ExitCode.USAGE)
