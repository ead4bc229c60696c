"""`forge trace`: list the ops of a model or function and whether forge can tune them
(forge.tuner.tracetools: captured with TorchDynamo, one graph per graph break), optionally profiled,
verified with the cached kernels, or written as a manifest."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from forge.errors import ExitCode, ForgeError, UsageError
from forge.tuner import engine, manifest, tracetools
from forge_cli.options import CacheOpt, DeviceOpt, DtypeOpt, JsonOpt, with_help
from forge_cli.render import fail, fmt_us, open_cache, out

TargetArg = Annotated[str, typer.Argument(help="FILE.py (KernelBench: Model, get_inputs, get_init_inputs), "
                                               "FILE.py:function or FILE.py:module (an nn.Module the file "
                                               "builds, e.g. a Hugging Face model from a config).")]
InputOpt = Annotated[list[str] | None, typer.Option("--input", help="For FILE.py:function: one input "
                                                    "SHAPE[:DTYPE] per argument, e.g. 2048x4096:float16.")]
TraceDeviceOpt = with_help(DeviceOpt, "cuda or cpu (default: cuda if available).")
TraceDtypeOpt = with_help(DtypeOpt, "Cast the model and its floating inputs (float16, bfloat16, float32).")
ProfileOpt = Annotated[bool, typer.Option("--profile", help="Attribute run time to each op and estimate "
                                                            "the end-to-end speedup (Amdahl).")]
WriteManifestOpt = Annotated[Path | None, typer.Option("--write-manifest", help="Write the matched ops "
                                                       "and shapes as a manifest for forge search.")]
VerifyOpt = Annotated[bool, typer.Option("--verify", help="Run with the cached kernels swapped in and "
                                                          "compare with eager end to end.")]


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
) -> None:
    """List every op in a model/function with its shapes and whether forge can tune it (and why not)."""
    # The user's code may print while it runs (a print at a graph break, progress): that goes to stderr,
    # so stdout holds only forge's report (--json stays parseable).
    try:
        with contextlib.redirect_stdout(sys.stderr):
            if dtype is not None and dtype not in ("float16", "bfloat16", "float32"):
                raise UsageError(f"--dtype {dtype!r}: expected float16, bfloat16 or float32")
            backend = engine.resolve_backend(device)
            dev = "cuda" if backend == "cuda" else "cpu"
            tgt = tracetools.load_target(target, input_ or [], dev, dtype)
            result = tracetools.trace(tgt, dev)
            db = open_cache(cache)
            tracetools.annotate_with_cache(result, db, backend)
            prof = tracetools.profile(result) if profile else None
            ver = tracetools.verify(result, db, backend) if verify else None
            if write_manifest is not None:
                entries = tracetools.manifest_entries(result.regions)
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
        print(json.dumps(doc, indent=2, default=str))
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
    if doc["manifest"]:
        out.print(f"wrote {doc['manifest']}")


def register(app: typer.Typer, cache_app: typer.Typer) -> None:
    app.command("trace")(trace_cmd)
