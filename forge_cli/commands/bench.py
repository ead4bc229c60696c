"""`forge bench` and `forge bench --recheck`: the CLI over forge.tuner.bench (tables, --json, --csv, --plot)."""

from __future__ import annotations

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

from forge import ops
from forge.cache import CacheError
from forge.errors import ExitCode, ForgeError, UsageError
from forge.tuner import bench, engine, stats
from forge.tuner import manifest as manifest_mod
from forge.tuner.status import RECHECK_INVALID, Status
from forge_cli.jsonout import emit
from forge_cli.options import (
    AttrOpt,
    CacheOpt,
    DeviceOpt,
    DtypeOpt,
    JsonOpt,
    ManifestOpt,
    SeedOpt,
    ShapeOpt,
    TimeoutOpt,
    check_settings,
    complete_op,
    parse_attrs,
    parse_shape_opt,
    with_help,
)
from forge_cli.render import err, fail, fmt_pct, fmt_speedup_small, fmt_us, lock_wait, open_cache, out, status_cell

BENCH_CSV_FIELDS = ("op", "shape", "dtype", "attrs", "key", "contestant", "label", "status", "clock", "p20_us",
                    "p50_us", "p80_us", "n", "speedup", "pct_roofline", "achieved_tbps", "achieved_tflops", "bound",
                    "reason")
RECHECK_CSV_FIELDS = ("key", "op", "shape", "dtype", "attrs", "status", "stored_speedup", "new_speedup", "ratio",
                      "stored_p50_us", "stored_eager_p50_us", "new_p50_us", "new_eager_p50_us", "reason")
PLOT_HINT = "pip install 'forge-kernel[plot]' (or: pip install matplotlib)"
REASON_LIMIT = 110  # characters of a reason in the status column


# -- rows shared by --csv and --plot ------------------------------------------------------------------
def bench_rows(report: bench.BenchReport) -> list[dict[str, Any]]:
    rows = []
    for r in report.results:
        t = r.target
        base = {"op": t.op, "shape": t.shape_str, "dtype": t.dtype, "attrs": json.dumps(t.attrs, sort_keys=True),
                "key": t.key}
        if t.error:
            rows.append({**base, "status": Status.MISSING.value, "reason": t.error})
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


def recheck_rows(report: bench.RecheckReport) -> list[dict[str, Any]]:
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
        names = [n for n in bench.CONTESTANTS
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
        ax.bar_label(bars, labels=[fmt_speedup_small(v) if v else "" for v in values], fontsize=7, padding=2)
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
def print_bench(report: bench.BenchReport) -> None:
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
            note = f" ({cr.clock})" if cr.clock == "cuda-events" else ""
            pct = (cr.roofline or {}).get("pct_roofline")
            table.add_row(cr.name, escape(cr.label), fmt_us(q.p20 if q else None), fmt_us(q.p50 if q else None),
                          fmt_us(q.p80 if q else None), fmt_speedup_small(cr.speedup), fmt_pct(pct),
                          status_cell(cr.status, cr.reason or cr.note, note=note, limit=REASON_LIMIT))
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


RECHECK_SUMMARY = (Status.OK, Status.DRIFTED, Status.INVALID, Status.SHA256_MISMATCH, Status.SKIPPED, Status.MISSING)


def print_recheck(report: bench.RecheckReport) -> None:
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
        table.add_row((t.key or "-")[:12], t.op, t.shape_str, t.dtype, fmt_speedup_small(r.stored_speedup),
                      fmt_speedup_small(r.new_speedup), change, fmt_us(r.new_kernel.p50 if r.new_kernel else None),
                      fmt_us(r.new_baseline.p50 if r.new_baseline else None),
                      status_cell(r.status, r.reason, limit=REASON_LIMIT))
    out.print(table)
    if not report.results:
        out.print("(no cached entries selected)")
    counts = {s: report.count(s) for s in RECHECK_SUMMARY}
    out.print(", ".join(f"{n} {s}" for s, n in counts.items() if n) or "nothing to recheck")


class ProgressLines:
    """Bench and recheck events as lines on stderr (none with --json or --csv -)."""

    def __init__(self, quiet: bool):
        self.quiet = quiet

    def __call__(self, kind: str, **data: Any) -> None:
        lock_wait(kind, data)
        if self.quiet:
            return
        if kind == "measuring-peaks":
            err.print(f"measuring the device's peaks once (copy bandwidth, matmul rate): {escape(data['device'])}")
        elif kind == "target":
            err.print(f"[{data['index'] + 1}/{data['total']}] {escape(data['target'].label)}")
        elif kind == "validating":
            err.print(f"  checking {', '.join(data['contestants'])} against the float64 oracle"
                      + (" (torch.compile compiles here)" if any(n.startswith("compile")
                                                                 for n in data["contestants"]) else ""))
        elif kind == "timing":
            err.print(f"  timing {', '.join(data['contestants'])} interleaved")
        elif kind == "recheck-validate":
            err.print("  re-validating in a worker (check_candidate)")
        elif kind == "recheck-time":
            err.print("  re-timing against eager")


def print_problems(report, recheck: bool) -> None:
    """The entries that decide a failing exit status, on stderr; then exit 5 (a cached kernel that must not be
    trusted), 2 (a selected spec with no cached decision) or 3 (forge's own validation inputs or oracle ran
    out of memory: nothing judged for that spec)."""
    if recheck:
        bad = [r for r in report.results if r.status in RECHECK_INVALID]
        missing = [r for r in report.results if r.status == Status.MISSING]
        for r in bad:
            err.print(f"[bold red]{r.status}:[/] {escape(r.target.label)} ({(r.target.key or '')[:12]}): "
                      f"{escape(r.reason or '')}")
    else:
        bad = report.bad_kernels
        missing = report.missing
        for r in bad:
            f = r.contestant("forge")
            err.print(f"[bold red]cached kernel {f.status}:[/] {escape(r.target.label)} ({r.target.key[:12]}): "
                      f"{escape(f.reason or '')}")
    for r in missing:
        err.print(f"[bold red]error:[/] {escape(r.target.error or '')}")
    oom = [] if recheck else report.out_of_memory
    for r in oom:
        err.print(f"[bold red]out of memory:[/] {escape(r.target.label)}: {escape(r.out_of_memory or '')}")
    if bad:
        raise typer.Exit(ExitCode.CACHE)
    if missing:
        raise typer.Exit(ExitCode.USAGE)
    if oom:  # nothing could be judged for these (the other targets were benched): an environment limit
        raise typer.Exit(ExitCode.ENVIRONMENT)


# -- the command ----------------------------------------------------------------------------------------
def _targets(*, op, shape, manifest, attr, recheck, remeasure, cli_vals, db_path):
    """(backend, cache, targets) for the selection; UsageError for a bad one."""
    env = os.environ
    if manifest is not None:
        if op is not None or shape is not None or attr:
            raise UsageError("--manifest replaces OP, --shape and --attr; give either a manifest or one op")
        m = manifest_mod.load(manifest, cli=cli_vals)
        backend = engine.resolve_backend(m.device)
        bench.prepare_backend(backend)
        db = open_cache(m.cache)
        return backend, db, [bench.resolve_target(j.op, j.shape, j.dtype, j.attrs, backend, db) for j in m.jobs]
    backend = engine.resolve_backend(manifest_mod.resolve("device", cli_vals, env))
    bench.prepare_backend(backend)
    if shape is not None:
        if op is None:
            raise UsageError("--shape needs OP (e.g. forge bench rmsnorm --shape 2048x4096)")
        shape_t = parse_shape_opt(shape)
        dtype = manifest_mod.resolve("dtype", cli_vals, env)
        db = open_cache(db_path)
        return backend, db, [bench.resolve_target(op, shape_t, dtype, parse_attrs(attr or []), backend, db)]
    if not recheck:
        if remeasure and op is None and not attr:  # `forge bench --remeasure-peaks` alone: just the peaks
            return backend, open_cache(db_path), []
        raise UsageError("give OP and --shape (e.g. forge bench rmsnorm --shape 2048x4096), or --manifest FILE")
    if attr:
        raise UsageError("--attr needs OP and --shape")
    if op is not None:
        ops.get(op)  # unknown op: UsageError naming the known ones
    db = open_cache(db_path)
    return backend, db, [bench.target_of_entry(e) for e in db.entries(op)]


OpArg = Annotated[str | None, typer.Argument(help="Op family (or --manifest). With --recheck: every cached "
                                                  "entry of OP, or of the cache when OP is left out.",
                                             autocompletion=complete_op)]
BenchManifestOpt = with_help(ManifestOpt, "Bench every entry of a TOML manifest (docs/manifest.md).")
BenchDeviceOpt = with_help(DeviceOpt, "cuda or cpu (Triton interpreter; default: cuda if available, else cpu).")
BenchAttrOpt = with_help(AttrOpt, "Scalar attribute NAME=VALUE.")
RecheckOpt = Annotated[bool, typer.Option("--recheck", help="Re-validate and re-time cached winners against "
                                                            "eager; flag drifted and invalid ones.")]
MaxAutotuneOpt = Annotated[bool, typer.Option("--max-autotune", help="Also time torch.compile(mode="
                                              "'max-autotune-no-cudagraphs') (slow to compile).")]
RemeasurePeaksOpt = Annotated[bool, typer.Option("--remeasure-peaks", help="Measure the device's copy "
                                                 "bandwidth and matmul rate again.")]
SkipOpt = Annotated[list[str] | None, typer.Option("--skip", help="Leave a contestant out (repeatable): "
                                                   + ", ".join(bench.CONTESTANTS) + ".")]
RoundsOpt = Annotated[int | None, typer.Option("--rounds", help="Interleaved timing rounds (default: the search's "
                                                                "finals: 40 on CUDA, 5 on the interpreter).")]
BenchSeedOpt = with_help(SeedOpt, "Seed of the inputs (default: 0).")
DriftOpt = Annotated[float, typer.Option("--drift", help="--recheck: the smallest speedup change reported as "
                                                         "drift, as a fraction.")]
BenchTimeoutOpt = with_help(TimeoutOpt, "--recheck: seconds per worker request (default: 120).")
CsvOpt = Annotated[str | None, typer.Option("--csv", metavar="FILE", help="Also write the results as CSV "
                                            "to FILE ('-': stdout, and nothing else there).")]
PlotOpt = Annotated[Path | None, typer.Option("--plot", metavar="FILE.png", help="Bar chart of the speedups "
                                              "(needs matplotlib: " + escape(PLOT_HINT) + ").")]


def bench_cmd(
    op: OpArg = None,
    shape: ShapeOpt = None,
    manifest: BenchManifestOpt = None,
    dtype: DtypeOpt = None,
    device: BenchDeviceOpt = None,
    attr: BenchAttrOpt = None,
    recheck: RecheckOpt = False,
    max_autotune: MaxAutotuneOpt = False,
    remeasure_peaks: RemeasurePeaksOpt = False,
    skip: SkipOpt = None,
    rounds: RoundsOpt = None,
    seed: BenchSeedOpt = None,
    drift: DriftOpt = stats.DRIFT_FLOOR,
    timeout: BenchTimeoutOpt = None,
    json_out: JsonOpt = False,
    csv_out: CsvOpt = None,
    plot: PlotOpt = None,
    cache: CacheOpt = None,
) -> None:
    """Time cached winners against eager, fused torch, torch.compile and Liger; or --recheck them.

    Contestants are checked against the float64 oracle, then timed interleaved (CUDA graphs on the GPU);
    % of roofline is against the device's measured copy bandwidth and matmul rate (docs/bench.md).
    Exit 5 if a cached kernel fails its sha256 or the oracle check, 2 if a selected spec has no cached
    decision, 3 if a spec could not be judged because forge's validation inputs or oracle ran out of memory."""
    if plot is not None and importlib.util.find_spec("matplotlib") is None:
        raise fail(UsageError(f"--plot needs matplotlib, which is not installed: {PLOT_HINT}"), ExitCode.USAGE)
    cli_vals = {"dtype": dtype, "device": device, "seed": seed, "timeout": timeout, "cache": cache}
    try:
        if json_out and csv_out == "-":
            raise UsageError("--json and --csv - both want stdout; write the CSV to a file (--csv FILE)")
        unknown = sorted(set(skip or []) - set(bench.CONTESTANTS))
        if unknown:
            raise UsageError(f"--skip {', '.join(unknown)}: unknown contestant; known: "
                             f"{', '.join(bench.CONTESTANTS)}")
        if rounds is not None and rounds < 1:
            raise UsageError("--rounds must be at least 1")
        if not 0.0 <= drift < 10.0:
            raise UsageError(f"--drift expects a fraction such as 0.1, got {drift}")
        check_settings(cli_vals, ("dtype", "device", "seed", "timeout"), name_flags=True)
        backend, db, targets = _targets(op=op, shape=shape, manifest=manifest, attr=attr, recheck=recheck,
                                        remeasure=remeasure_peaks, cli_vals=cli_vals, db_path=cache)
        opts = bench.BenchOptions(
            seed=manifest_mod.resolve("seed", cli_vals, os.environ), rounds=rounds, skip=frozenset(skip or ()),
            max_autotune=max_autotune, remeasure_peaks=remeasure_peaks,
            timeout=manifest_mod.resolve("timeout", cli_vals, os.environ), drift_floor=drift)
        progress = ProgressLines(quiet=json_out or csv_out == "-")
        run = bench.run_recheck if recheck else bench.run_bench
        report = run(targets, backend=backend, cache=db, options=opts, events=progress)
        rows = recheck_rows(report) if recheck else bench_rows(report)
        if csv_out is not None:
            write_csv(rows, RECHECK_CSV_FIELDS if recheck else BENCH_CSV_FIELDS, csv_out)
        if plot is not None:
            write_plot(plot, report, recheck)
    except ForgeError as exc:
        raise fail(exc, exc.exit_code) from None
    except CacheError as exc:
        raise fail(exc, ExitCode.CACHE) from None
    if json_out:
        emit(report.to_dict())
    elif csv_out != "-":
        (print_recheck if recheck else print_bench)(report)
        if plot is not None:
            out.print(f"plot: {plot}")
        if csv_out is not None:
            out.print(f"csv: {csv_out}")
    print_problems(report, recheck)


def register(app: typer.Typer, cache_app: typer.Typer) -> None:
    app.command("bench")(bench_cmd)
