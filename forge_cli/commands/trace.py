"""`forge trace`: list the ops of a model or function and whether forge can tune them
(forge.tuner.tracetools: captured with TorchDynamo, one graph per graph break), optionally profiled,
verified with the cached kernels, or written as a manifest. `forge trace DIR/`: every KernelBench
problem file of a directory traced, optionally tuned, verified and scored (forge.tuner.kernelbench)."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from forge.cache import WINNING, CacheError
from forge.errors import ExitCode, ForgeError, UsageError
from forge.tuner import batch, engine, kernelbench, manifest, tracetools
from forge_cli.jsonout import emit
from forge_cli.options import (
    BudgetOpt,
    CacheOpt,
    DeviceOpt,
    DtypeOpt,
    JsonOpt,
    TimeBudgetOpt,
    WorkersOpt,
    check_settings,
    with_help,
)
from forge_cli.render import err, fail, fmt_speedup, fmt_speedup_small, fmt_us, open_cache, out

TargetArg = Annotated[str, typer.Argument(help="FILE.py (KernelBench: Model, get_inputs, get_init_inputs), "
                                               "FILE.py:function or FILE.py:module (an nn.Module the file "
                                               "builds, e.g. a Hugging Face model from a config), or a "
                                               "directory of KernelBench problem files (traced, verified "
                                               "and scored: fast_p).")]
InputOpt = Annotated[list[str] | None, typer.Option("--input", help="For FILE.py:function: one input "
                                                    "SHAPE[:DTYPE] per argument, e.g. 2048x4096:float16.")]
TraceDeviceOpt = with_help(DeviceOpt, "cuda or cpu (default: cuda if available).")
TraceDtypeOpt = with_help(DtypeOpt, "Cast the model and its floating inputs (float16, bfloat16, float32).")
ProfileOpt = Annotated[bool, typer.Option("--profile", help="Rank every op of the captured graphs by run "
                                                            "time (matched or not) and estimate the end-to-end "
                                                            "speedup (Amdahl).")]
WriteManifestOpt = Annotated[Path | None, typer.Option("--write-manifest", help="Write the matched ops "
                                                       "and shapes as a manifest for forge search (with "
                                                       "--profile: each entry's share of the time).")]
VerifyOpt = Annotated[bool, typer.Option("--verify", help="Run with the cached kernels swapped in and "
                                                          "compare with eager end to end.")]
TuneOpt = Annotated[bool, typer.Option("--tune", help="With a directory: tune each problem's tunable ops "
                                                      "(largest share first with --profile) before verifying.")]
TraceBudgetOpt = with_help(BudgetOpt, "With a directory and --tune: candidates per op (default: 50).")
TraceTimeBudgetOpt = with_help(TimeBudgetOpt, "With a directory and --tune: seconds of wall clock for all the "
                                              "problems' tuning together (default: no limit).")
TraceWorkersOpt = with_help(WorkersOpt, "With a directory and --tune: worker processes (default: by backend).")
DIR_SETTINGS = ("budget", "workers", "time_budget")


def trace_cmd(
    target: TargetArg,
    input_: InputOpt = None,
    device: TraceDeviceOpt = None,
    dtype: TraceDtypeOpt = None,
    profile: ProfileOpt = False,
    write_manifest: WriteManifestOpt = None,
    verify: VerifyOpt = False,
    json_out: JsonOpt = False,
    cache: CacheOpt = None,
    tune: TuneOpt = False,
    budget: TraceBudgetOpt = None,
    time_budget: TraceTimeBudgetOpt = None,
    workers: TraceWorkersOpt = None,
) -> None:
    """List every op in a model/function with its shapes and whether forge can tune it (and why not).
    With a directory of KernelBench problem files: trace, (--tune) tune, verify and score each one."""
    settings = {"budget": budget, "time_budget": time_budget, "workers": workers}
    if ":" not in target and Path(target).is_dir():
        _trace_dir(Path(target), input_, device, dtype, profile, write_manifest, tune, settings, json_out, cache)
        return
    # The user's code may print while it runs (a print at a graph break, progress): that goes to stderr,
    # so stdout holds only forge's report (--json stays parseable).
    try:
        if tune or any(v is not None for v in settings.values()):
            raise UsageError("--tune, --budget, --time-budget and --workers are for a directory of problem files; "
                             "for one target, --write-manifest then forge search --manifest tunes it")
        with contextlib.redirect_stdout(sys.stderr):
            if dtype is not None and dtype not in ("float16", "bfloat16", "float32"):
                raise UsageError(f"--dtype {dtype!r}: expected float16, bfloat16 or float32")
            backend = engine.resolve_backend(device)
            dev = "cuda" if backend == "cuda" else "cpu"
            tgt = tracetools.load_target(target, input_ or [], dev, dtype)
            db = open_cache(cache)
            result = tracetools.trace(tgt, dev, db, backend)
            tracetools.annotate_with_cache(result, db, backend)
            prof = tracetools.profile(result) if profile else None
            ver = tracetools.verify(result, db, backend) if verify else None
            if write_manifest is not None:
                entries = tracetools.manifest_entries(result.regions, prof["total_us"] if prof else None)
                if not entries:
                    raise UsageError("no tunable op found: nothing to write")
                write_manifest.write_text(manifest.dumps(entries, {"device": dev}))
    except ForgeError as exc:
        raise fail(exc, exc.exit_code) from None
    doc = {
        "target": tgt.description,
        "graphs": [{"index": i, "calls": sum(n.op.startswith("call_") for n in g.gm.graph.nodes),
                    "inputs": len(g.placeholders), "regions": sum(r.graph == i for r in result.regions),
                    "unmatched": sum(u.graph == i for u in result.unmatched)} for i, g in enumerate(result.graphs)],
        "graph_breaks": {"count": len(result.breaks), "reasons": sorted(set(result.breaks))},
        "regions": [{"index": r.index, "graph": r.graph, "op": r.op, "node": r.root.name, "inputs": r.inputs,
                     "shape": list(r.shape) if r.shape else None, "dtype": r.dtype, "attrs": r.attrs,
                     "tunable": r.unsupported is None, "reason": r.unsupported, "cached": r.decision,
                     "speedup": r.speedup, "us": r.seconds * 1e6 if profile else None} for r in result.regions],
        "unmatched": [{"graph": u.graph, "node": u.node.name, "call": u.call, "shape": list(u.shape),
                       "reason": u.reason, "us": u.seconds * 1e6 if profile else None} for u in result.unmatched],
        "profile": prof, "verify": ver,
        "manifest": str(write_manifest) if write_manifest else None,
    }
    if json_out:
        emit(doc, default=str)
    else:
        print_trace(doc)
    if ver is not None and not ver["ok"]:
        raise typer.Exit(ExitCode.INTERNAL)


def print_trace(doc: dict[str, Any]) -> None:
    graphs, breaks = doc["graphs"], doc["graph_breaks"]
    several = len(graphs) > 1
    out.print(f"captured with TorchDynamo: {len(graphs)} graph(s) "
              f"({', '.join(str(g['calls']) + ' calls' for g in graphs)}), {breaks['count']} graph break(s)"
              + "".join(f"\n  graph break: {escape(reason)}" for reason in breaks["reasons"]))
    t = Table(title=f"forge trace {doc['target']}")
    cols = ("#", *(("graph",) if several else ()), "op", "node", "shape", "dtype", "attrs", "tunable", "cached", "µs")
    for col in cols:
        t.add_column(col, justify="right" if col == "µs" else "left")
    for r in doc["regions"]:
        tun = "[green]yes[/]" if r["tunable"] else f"[yellow]no[/]: {r['reason']}"
        cached = "-" if r["cached"] is None else (
            f"{r['cached']} {r['speedup']:.2f}x" if r["cached"] == "kernel" else r["cached"])
        t.add_row(str(r["index"]), *((str(r["graph"]),) if several else ()), r["op"], r["node"],
                  "x".join(map(str, r["shape"] or [])) or "?",
                  r["dtype"] or "?", json.dumps(r["attrs"]), tun, cached,
                  fmt_us(r["us"]) if r["us"] is not None else "")
    out.print(t)
    if doc["unmatched"]:
        u = Table(title="not matched by any op family")
        for col in (*(("graph",) if several else ()), "node", "call", "shape", "why", "µs"):
            u.add_column(col)
        for x in doc["unmatched"]:
            u.add_row(*((str(x["graph"]),) if several else ()), x["node"], x["call"], "x".join(map(str, x["shape"])),
                      x["reason"][:100], fmt_us(x["us"]) if x["us"] is not None else "")
        out.print(u)
    p = doc["profile"]
    if p and p.get("ranking"):
        out.print(ranking_table(p["ranking"], several))
    if p:
        est = p["amdahl_speedup"]
        out.print(f"profile ({p['clock']}, {p['iters']} runs): {p['total_us']:.1f} µs per run, "
                  f"{p['covered_fraction'] * 100:.1f}% in matched ops; estimated end-to-end speedup "
                  f"with the cached kernels (Amdahl): {est:.2f}x" if est else "no time recorded")
    v = doc["verify"]
    if v:
        verdict = "[green]match[/]" if v["ok"] else "[red]MISMATCH[/]"
        out.print(f"verify: {verdict} — {v['swapped']} region(s) swapped; relative error {v['rel_error']:.3g} "
                  f"(tolerance {v['tolerance']:g} for {v['dtype']}); eager {v['eager_us']:.1f} µs, "
                  f"forge {v['forge_us']:.1f} µs per call ({v['speedup']:.2f}x, {v['clock']})")
        if v.get("device_speedup") is not None:
            out.print(f"device time per forward: eager {v['eager_device_us']:.1f} µs, forge {v['forge_device_us']:.1f} "
                      f"µs ({v['device_speedup']:.2f}x); {v['forge_kernel_share'] * 100:.1f}% of it in forge kernels")
    if doc["manifest"]:
        out.print(f"wrote {doc['manifest']}")


def ranking_table(rows: list[dict[str, Any]], several: bool) -> Table:
    """--profile: every call of the captured graphs, largest time first (each kernel counted once)."""
    t = Table(title="time per op, largest first (every call of the captured graphs)")
    for col in ("rank", *(("graph",) if several else ()), "kind", "op / call", "node", "µs", "share", "cumulative"):
        t.add_column(col, justify="right" if col in ("rank", "µs", "share", "cumulative") else "left")
    for i, r in enumerate(rows, 1):
        kind = r["kind"] if r["kind"] == "region" else f"[yellow]{escape(r['kind'])}[/]"
        t.add_row(str(i), *((str(r["graph"]),) if several else ()), kind, escape(r["what"]), escape(r["node"]),
                  fmt_us(r["us"]), f"{r['share'] * 100:.1f}%", f"{r['cumulative'] * 100:.1f}%")
    return t


# -- a directory of problem files -------------------------------------------------------------------
def _trace_dir(directory: Path, input_, device, dtype, profile: bool, write_manifest, tune: bool,
               settings: dict[str, Any], json_out: bool, cache) -> None:
    try:
        with contextlib.redirect_stdout(sys.stderr):
            if input_:
                raise UsageError("--input is for FILE.py:function; a problem file's inputs come from its get_inputs()")
            if write_manifest is not None:
                raise UsageError("--write-manifest takes one target, not a directory")
            if not tune and any(settings[k] is not None for k in ("budget", "time_budget")):
                raise UsageError("--budget and --time-budget need --tune (without it, a directory is traced and "
                                 "verified with what is cached)")
            if dtype is not None and dtype not in ("float16", "bfloat16", "float32"):
                raise UsageError(f"--dtype {dtype!r}: expected float16, bfloat16 or float32")
            check_settings(settings, DIR_SETTINGS, name_flags=False)
            db = open_cache(cache)

            def on_problem(i: int, n: int, path: Path) -> None:
                if not json_out:
                    err.print(escape(f"[{i + 1}/{n}] {path.name}"))

            def on_job(path: Path, res: batch.JobResult) -> None:
                if json_out:
                    return
                what = (f"skipped: {res.note}" if res.status == "skipped" else
                        f"failed: {res.error}" if res.status == "failed" else
                        f"{res.status}, {res.decision}" + (f" {fmt_speedup(res.speedup)}" if res.decision in WINNING
                                                          else ""))
                err.print(escape(f"    tune {res.op} {res.shape} {res.dtype}: {what}"))

            doc = kernelbench.run(directory, device=device, cache=db, dtype=dtype, tune=tune, profile=profile,
                                  settings=settings, on_problem=on_problem, on_job=on_job)
    except ForgeError as exc:
        raise fail(exc, exc.exit_code) from None
    except CacheError as exc:
        raise fail(exc, ExitCode.CACHE) from None
    doc = {"directory": str(directory), "cache": str(db.path), **doc}
    if json_out:
        emit(doc, default=str)
    else:
        print_dir(doc)
    # A forge kernel that changed a problem's output is a bug in forge (exit 1, as --verify); problems that
    # cannot be imported, traced or verified are part of the score, not a failure of the command.
    if any(p["verify"] is not None and not p["verify"]["ok"] for p in doc["problems"]):
        raise typer.Exit(ExitCode.INTERNAL)


def _not_tunable(p: dict[str, Any]) -> str:
    parts = list(p["not_tunable"])
    if p["unmatched"]:
        parts.append("unmatched: " + ", ".join(f"{call} x{n}" if n > 1 else call for call, n in p["unmatched"].items()))
    return "; ".join(parts) or "-"


def print_dir(doc: dict[str, Any]) -> None:
    t = Table(title=f"forge trace {doc['directory']} ({len(doc['problems'])} problems)")
    for col in ("problem", "correct", "speedup", "eager µs", "forge µs", "regions", "tunable", "swapped", "tuned",
                "not tunable / unmatched", "why not correct"):
        t.add_column(col, justify="right" if col in ("speedup", "eager µs", "forge µs", "regions", "tunable",
                                                       "swapped") else "left")
    for p in doc["problems"]:
        correct = "[green]yes[/]" if p["correct"] else "[red]no[/]"
        tuned = ", ".join(sorted({j["status"] for j in p["jobs"]})) if p["jobs"] else "-"
        t.add_row(escape(p["name"]), correct, fmt_speedup_small(p["speedup"]), fmt_us(p["eager_us"]),
                  fmt_us(p["forge_us"]), str(p["regions"]), str(p["tunable"]), str(p["swapped"]), tuned,
                  escape(_not_tunable(p)[:200]),
                  escape((p["error"] or "")[:200]))
    out.print(t)
    score = doc["score"]
    out.print("fast_p (correct and speedup > p, over all problems): "
              + ", ".join(f"{k} {v:.2f}" for k, v in score.items()))
    if doc["backend"] == "interpreter":
        out.print("[yellow]speedups are host wall time per call with kernels in the Triton interpreter: not GPU "
                  "performance[/]")
    budget = f"; time budget {doc['time_budget_s']:g} s" if doc["time_budget_s"] is not None else ""
    out.print(f"cache: {doc['cache']}; tuning {doc['tuning_s']:.1f} s of {doc['wall_s']:.1f} s{budget}")


def register(app: typer.Typer, cache_app: typer.Typer) -> None:
    app.command("trace")(trace_cmd)
