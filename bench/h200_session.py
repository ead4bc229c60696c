"""One device call's worth of GPU checks and timings, rerunnable by anyone on a CUDA machine.

Usage (on the GPU machine, from the repo root):
    PYTHONPATH=. python3 bench/h200_session.py --out DIR [--parts tests,latency,suite] [--budget 6]

Parts (each a subprocess with its own time limit; a part that fails or times out is reported, the
next one still runs):
  tests     the GPU test tier, `python3 -m pytest -m gpu tests/` (junit XML to DIR/gpu-tests.xml)
  latency   bench/latency.py (the shim's per-call cost on a cache hit, with its breakdown) -> DIR/latency.json
  suite     `forge search --manifest bench/suite.toml --devices 0 --json` -> DIR/suite.json (+ suite.db)
  big       `forge search --manifest bench/big.toml --json` -> DIR/big.json (+ big.db; issue 15's large
            shapes; --big-time-budget ends it cleanly, --big-cache DB continues it in a later call)
  models    bench/models.py (issue 14's models end to end; --models-list, --models-modes, budget 16, a new cache)
            -> DIR/models.json
  pad       bench/pad_probe.py (issue 16's misaligned GEMM: padding schemes side by side) -> DIR/pad-probe.json
  layouts   issue 14's rows: `forge search --manifest bench/layouts.toml --json` -> DIR/layouts.json, then
            `forge bench --manifest bench/layouts.toml --max-autotune --json` on that cache -> DIR/layouts-bench.json
            (--layouts-cache DB continues an earlier call's search; --layouts-bench-args replaces --max-autotune;
            --layouts-manifest bench/gemm.toml runs that manifest instead: DIR/gemm.json, DIR/gemm-bench.json;
            bench/peers.toml and bench/peers_gemm.toml are issue 16's rows, tabled by bench/peers_table.py)
--tests-marker "" runs what --tests names without `-m gpu` (the op tests then run their kernels on CUDA).
Forge caches live in a temporary directory, never under DIR (the device tool brings back few files).
The last thing printed is one table of every part.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

FORGE = [sys.executable, "-c", "import sys; from forge_cli.cli import main; sys.argv[0] = 'forge'; main()"]


def run(cmd: list[str], limit: float, log) -> tuple[int | str, float]:
    t0 = time.monotonic()
    print("$", " ".join(cmd), flush=True)
    try:
        rc: int | str = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=limit).returncode
    except subprocess.TimeoutExpired:
        rc = f"timeout after {limit:.0f} s"
    return rc, time.monotonic() - t0


def tests(out: Path, work: Path, args) -> list[str]:
    xml = out / "gpu-tests.xml"
    marker = ["-m", args.tests_marker] if args.tests_marker else []
    marker += ["-k", args.tests_k] if args.tests_k else []
    rc, wall = run([sys.executable, "-m", "pytest", "-q", *marker, "-p", "no:cacheprovider",
                    f"--junitxml={xml}", *args.tests.split()], args.tests_limit, sys.stdout)
    lines = [f"tests: rc {rc}, {wall:.0f} s"]
    if xml.exists():
        for case in ET.parse(xml).getroot().iter("testcase"):
            status = "passed"
            for tag in ("failure", "error", "skipped"):
                el = case.find(tag)
                if el is not None:
                    status = f"{tag}: {(el.get('message') or '')[:150]}"
            lines.append(f"  {case.get('classname')}::{case.get('name')} {float(case.get('time', 0)):.1f}s {status}")
    return lines


def latency(out: Path, work: Path, args) -> list[str]:
    rc, wall = run([sys.executable, "bench/latency.py", "--out", str(work / "latency"), "--budget",
                    str(args.budget), "--cache", str(work / "latency-cache")], args.latency_limit, sys.stdout)
    lines = [f"latency: rc {rc}, {wall:.0f} s"]
    src = work / "latency" / "latency.json"
    if src.exists():
        (out / "latency.json").write_text(src.read_text())
        for r in json.loads(src.read_text())["rows"]:
            t = r.get("per_call_us", {})
            lines.append(f"  {r['op']:8} {r['shape']:10} {r['uses']:6} {str(r['launch'])[:34]:34} "
                         f"fast={r.get('fast')} "
                         + " ".join(f"{k} {v}" for k, v in t.items()))
            if "breakdown_us" in r:
                lines.append("    breakdown: " + ", ".join(f"{k} {v}" for k, v in r["breakdown_us"].items()))
    return lines


def _manifest_part(name: str, out: Path, cmd: list[str], limit: float, db: Path) -> list[str]:
    """Run one `forge search --manifest ... --json` command; DIR/<name>.json gets its report with the machine
    header, DIR/<name>.db a copy of its cache (SQLite backup API: a file copy can miss the WAL), so a later
    call can continue the same manifest from it."""
    dst = out / f"{name}.json"
    with open(dst, "w") as fh:
        t0 = time.monotonic()
        print("$", " ".join(cmd), flush=True)
        try:
            rc: int | str = subprocess.run(cmd, stdout=fh, timeout=limit).returncode
        except subprocess.TimeoutExpired:
            rc = f"timeout after {limit:.0f} s"
        wall = time.monotonic() - t0
    lines = [f"{name}: rc {rc}, {wall:.0f} s"]
    if db.exists():
        import sqlite3

        src, copy = sqlite3.connect(db), sqlite3.connect(out / f"{name}.db")
        with copy:
            src.backup(copy)
        src.close()
        copy.close()
    try:
        doc = json.loads(dst.read_text())
    except json.JSONDecodeError:
        return [*lines, "  (no JSON summary)"]
    lines[0] += f" (forge wall {doc.get('wall_s')} s, {doc.get('failed')} failed)"
    # `forge search --json` reports jobs, not the machine: add what a results file must carry.
    import torch

    from forge.env import collect_env

    env = collect_env("cuda" if torch.cuda.is_available() else "interpreter")
    header = {k: env.get(k) for k in ("gpu", "driver", "cuda", "torch", "triton", "forge")}
    header.update(date=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), python=sys.version.split()[0],
                  command="forge " + " ".join(cmd[3:]).replace(str(db.parent), "DIR"), exit_code=rc)
    # The header's command is the whole command line; the document's own "command" is only the subcommand
    # ("search", docs/json.md) and must not overwrite it.
    dst.write_text(json.dumps({**header, **{k: v for k, v in doc.items() if k != "command"}}, indent=2))
    for e in doc.get("entries", []):
        peak = e.get("peak_worker_bytes")
        lines.append(f"  {e['op']:13} {e['shape']:20} {e['dtype']:9} {e['status']:9} {str(e['decision']):6} "
                     f"{e.get('p50_us') or 0:9.2f} us vs eager {e.get('eager_p50_us') or 0:9.2f} us "
                     f"({e.get('speedup') or 0:.2f}x) {e.get('seconds', 0):6.1f} s "
                     f"peak/worker {peak / 2**30 if peak else 0:5.1f} GiB exit {e.get('exit_code')} "
                     f"{e.get('winner')} {(e.get('error') or '')[:300]}")
    return lines


def pad(out: Path, work: Path, args) -> list[str]:
    """Issue 16: bench/pad_probe.py, the misaligned GEMM's padding schemes timed side by side in one process."""
    cmd = [sys.executable, "bench/pad_probe.py", "--out", str(work / "pad")]
    rc, wall = run(cmd, args.pad_limit, sys.stdout)
    lines = [f"pad: rc {rc}, {wall:.0f} s"]
    src = work / "pad" / "pad-probe.json"
    if not src.exists():
        return [*lines, "  (no pad-probe.json)"]
    (out / "pad-probe.json").write_text(src.read_text())
    for dtype, rows in json.loads(src.read_text()).get("results", {}).items():
        comp = rows.get("compile", {}).get("p50")
        lines += [f"  {dtype:9} {name:10} {q['p50']:8.1f} us" + (f" ({q['p50'] / comp:.3f}x compile)" if comp else "")
                  for name, q in rows.items()]
    return lines


def suite(out: Path, work: Path, args) -> list[str]:
    db = work / "suite.db"
    cmd = [*FORGE, "search", "--manifest", "bench/suite.toml", "--devices", "0", "--budget",
           str(args.budget), "--json", "--cache", str(db)]
    return _manifest_part("suite", out, cmd, args.suite_limit, db)


def big(out: Path, work: Path, args) -> list[str]:
    """Issue 15: bench/big.toml (prefill-sized and larger shapes after matmul 8192^3 entries) at its own
    budget; --big-cache continues a run an earlier call cut at --big-time-budget (its cached entries are
    not searched again)."""
    db = work / "big.db"
    if args.big_cache:
        import shutil

        shutil.copyfile(args.big_cache, db)  # not copy(): a read-only source would make a read-only cache
    cmd = [*FORGE, "search", "--manifest", "bench/big.toml", "--json", "--cache", str(db)]
    if args.big_time_budget:
        cmd += ["--time-budget", str(args.big_time_budget)]
    return _manifest_part("big", out, cmd, args.big_limit, db)


def models(out: Path, work: Path, args) -> list[str]:
    """Issue 14: bench/models.py over --models-list with --models-modes (each model tuned at --models-budget in
    its own process, at most --models-limit seconds per model), then every contestant's ms per forward."""
    names = [m for m in args.models_list.split(",") if m]
    cmd = [sys.executable, "bench/models.py", "--out", str(work / "models"), "--models", ",".join(names),
           "--modes", args.models_modes, "--budget", str(args.models_budget), "--cache", str(work / "models.db"),
           "--model-limit", str(args.models_limit)]
    rc, wall = run(cmd, args.models_limit * len(names) + 60, sys.stdout)
    lines = [f"models: rc {rc}, {wall:.0f} s"]
    src = work / "models" / "models.json"
    if not src.exists():
        return [*lines, "  (no models.json)"]
    (out / "models.json").write_text(src.read_text())
    for r in json.loads(src.read_text()).get("rows", []):
        for mode, c in r.get("contestants", {}).items():
            got = (f"{c['ms_per_forward']:.3f} ms ({c.get('speedup_vs_eager') or 0:.2f}x eager)"
                   if "ms_per_forward" in c else f"error: {c.get('error', '?')[:120]}")
            lines.append(f"  {r['model']:7} {mode:18} {got} {' | '.join(c.get('cudagraphs', []))[:160]}")
        dev = r.get("device") or {}
        if dev.get("forge_ms"):
            lines.append(f"  {r['model']:7} device: eager {dev['eager_ms']:.3f} ms, forge {dev['forge_ms']:.3f} ms"
                         + (f", compile {dev['compile_ms']:.3f} ms" if dev.get("compile_ms") else ""))
    return lines


def layouts(out: Path, work: Path, args) -> list[str]:
    """Issue 14: bench/layouts.toml (or --layouts-manifest M[,M2...]: each in turn, its files named after its
    stem; one machine start for several manifests) searched (its own budget), then every row benched
    interleaved against eager, the fused torch op, torch.compile (default and max-autotune-no-cudagraphs) and
    Liger."""
    manifests = [m for m in args.layouts_manifest.split(",") if m]
    if args.layouts_cache and len(manifests) > 1:
        raise SystemExit("--layouts-cache continues one manifest's search: give one --layouts-manifest")
    return [line for m in manifests for line in _layouts_one(out, work, args, m)]


def _layouts_one(out: Path, work: Path, args, manifest: str) -> list[str]:
    name = Path(manifest).stem
    db = work / f"{name}.db"
    if args.layouts_cache:  # an earlier call's DIR/layouts.db: its entries are not searched again
        import shutil

        shutil.copyfile(args.layouts_cache, db)
    cmd = [*FORGE, "search", "--manifest", manifest, "--json", "--cache", str(db)]
    if args.layouts_time_budget:
        cmd += ["--time-budget", str(args.layouts_time_budget)]
    lines = _manifest_part(name, out, cmd, args.layouts_limit, db)
    if not args.layouts_bench_limit:  # search only: DIR/layouts.db continues it (forge bench --cache) later
        return lines
    dst = out / f"{name}-bench.json"
    cmd = [*FORGE, "bench", "--manifest", manifest, *args.layouts_bench_args.split(), "--json",
           "--cache", str(db)]
    with open(dst, "w") as fh:
        t0 = time.monotonic()
        print("$", " ".join(cmd), flush=True)
        try:
            rc: int | str = subprocess.run(cmd, stdout=fh, timeout=args.layouts_bench_limit).returncode
        except subprocess.TimeoutExpired:
            rc = f"timeout after {args.layouts_bench_limit:.0f} s"
    lines.append(f"{name} bench: rc {rc}, {time.monotonic() - t0:.0f} s")
    try:
        doc = json.loads(dst.read_text())
    except json.JSONDecodeError:
        return [*lines, "  (no JSON from forge bench)"]
    # the whole command line in place of the document's subcommand ("bench"), as the search files carry it
    doc.update(command="forge " + " ".join(cmd[3:]).replace(str(work), "DIR"), exit_code=rc,
               date=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), python=sys.version.split()[0])
    dst.write_text(json.dumps(doc, indent=2))
    for t in doc.get("targets", []):
        cells = []
        for c in t["contestants"]:
            q = c.get("quantiles") or {}
            cells.append(f"{c['name']} {q.get('p50', 0):.1f}" if c["status"] == "ok" else f"{c['name']} {c['status']}")
        lines.append(f"  {t['op']:10} {t['shape']:16} {json.dumps(t['attrs'], sort_keys=True)[:60]:60} "
                     f"fastest {t.get('fastest')}: " + ", ".join(cells))
    return lines


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--parts", default="tests,latency,suite")
    ap.add_argument("--tests", default="tests/", help="what the tests part hands pytest (with -m gpu)")
    ap.add_argument("--budget", type=int, default=6)
    ap.add_argument("--tests-marker", default="gpu", help="pytest -m for the tests part ('' for none)")
    ap.add_argument("--tests-limit", type=float, default=420)
    ap.add_argument("--latency-limit", type=float, default=240)
    ap.add_argument("--suite-limit", type=float, default=420)
    ap.add_argument("--big-limit", type=float, default=560)
    ap.add_argument("--big-time-budget", type=float, default=None, help="forge search --time-budget for big")
    ap.add_argument("--big-cache", type=Path, default=None, help="a big.db from an earlier call to continue")
    ap.add_argument("--tests-k", default="", help="pytest -k for the tests part")
    ap.add_argument("--models-list", default="gpt2,decode,block,llama", help="the models part's --models")
    ap.add_argument("--models-modes", default="eager,forge,forge-auto,compile,compile-cudagraphs",
                    help="the models part's --modes")
    ap.add_argument("--models-budget", type=int, default=16)
    ap.add_argument("--models-limit", type=float, default=170, help="seconds per model")
    ap.add_argument("--pad-limit", type=float, default=150)
    ap.add_argument("--layouts-manifest", default="bench/layouts.toml",
                    help="the manifest(s) the layouts part runs, comma-separated")
    ap.add_argument("--layouts-limit", type=float, default=330)
    ap.add_argument("--layouts-time-budget", type=float, default=None, help="forge search --time-budget for layouts")
    ap.add_argument("--layouts-bench-limit", type=float, default=300, help="0: search only, no bench")
    ap.add_argument("--layouts-bench-args", default="--max-autotune", help="more forge bench options")
    ap.add_argument("--layouts-cache", type=Path, default=None, help="a layouts.db from an earlier call to continue")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ["PYTHONUNBUFFERED"] = "1"
    work = Path(tempfile.mkdtemp(prefix="forge-h200-"))
    os.environ.setdefault("FORGE_CACHE_DIR", str(work / "cache"))
    parts = {"tests": tests, "latency": latency, "suite": suite, "big": big, "models": models, "pad": pad,
             "layouts": layouts}
    summary: list[str] = []
    for name in args.parts.split(","):
        summary += parts[name](args.out, work, args)
    print("\n".join(["", "=" * 30 + " summary " + "=" * 30, *summary]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
