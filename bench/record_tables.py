"""Record exhaustive searches as replay tables (issue 17): every valid point of each op-shape's space
validated and timed, written as DIR/<op>-<shape>-<dtype>.json for `forge replay` (forge/tuner/replay.py).

Usage (on the GPU machine, from the repo root):
    PYTHONPATH=. python3 bench/record_tables.py --out DIR [--case op:shape:dtype[:attr=value,...]] [--limit S]

Default cases: the norms, softmax, cross-entropy, gelu, sdpa and matmul rows of the performance suite. Each
case is `forge search ... --budget <space size> --force --json` in a subprocess with its own cache (what a user
runs), cut at --limit seconds per case; each row's p50 is on the final eager's scale (replay.table_from_report),
and the table keeps the search's decision and its screening-to-final errors (engine.screen_to_final). The device
tool brings back at most 8 files a call: at most 7 cases per call with a log.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FORGE = [sys.executable, "-c", "import sys; from forge_cli.cli import main; sys.argv[0] = 'forge'; main()"]
DEFAULT_CASES = ["rmsnorm:8192x8192:bfloat16", "layer_norm:8192x8192:bfloat16", "softmax:8192x8192:bfloat16",
                 "cross_entropy:8192x32000:bfloat16", "gelu:32768x4096:bfloat16", "rmsnorm:2048x4096:float16",
                 "sdpa:4x32x2048x2048x128:bfloat16:causal=true,kv_heads=8", "matmul:4096x4096x4096:bfloat16"]


def space_size(op: str, shape: tuple[int, ...], dtype: str, attrs: dict) -> int:
    from forge import ops

    mod = ops.get(op).module
    return sum(1 for _ in mod.space(mod.make_spec(shape, dtype, "cuda", attrs)).all_points())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--case", action="append", help="op:shape:dtype[:attr=value,...] (repeatable)")
    ap.add_argument("--limit", type=float, default=300, help="seconds per case")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from forge.env import collect_env
    from forge.tuner import replay

    env = collect_env("cuda")
    lines = []
    for case in args.case or DEFAULT_CASES:
        op, shape_s, dtype, *rest = case.split(":")
        attrs = {}
        for kv in (rest[0].split(",") if rest else []):
            k, v = kv.split("=", 1)
            attrs[k] = {"true": True, "false": False}.get(v, int(v) if v.isdigit() else v)
        shape = tuple(int(x) for x in shape_s.split("x"))
        n = space_size(op, shape, dtype, attrs)
        flags = [x for k, v in attrs.items() for x in ("--attr", f"{k}={str(v).lower() if isinstance(v, bool) else v}")]
        cmd = [*FORGE, "search", op, "--shape", shape_s, "--dtype", dtype, "--budget", str(n), "--force", "--json",
               "--cache", str(Path(tempfile.mkdtemp()) / "forge.db"), *flags]
        t0 = time.monotonic()
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=args.limit)
            report = json.loads(res.stdout)
        except (subprocess.TimeoutExpired, json.JSONDecodeError) as exc:
            lines.append(f"{case}: {n} points, no table ({type(exc).__name__})")
            continue
        doc = replay.table_from_report(report, gpu=env.get("gpu"), driver=env.get("driver"),
                                       torch=env.get("torch"), triton=env.get("triton"),
                                       recorded=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                                       source="PYTHONPATH=. python3 bench/record_tables.py --case " + case,
                                       seconds=round(time.monotonic() - t0, 1))
        # issue 17: how far each finalist's screening p50 was from its final p50 (engine.screen_to_final)
        doc["screening"] = report.get("screening")
        doc["decision"], doc["speedup"] = report.get("decision"), report.get("speedup")
        name = f"{op}-{shape_s}-{dtype}.json"
        (args.out / name).write_text(json.dumps(doc, indent=1))
        ok = sum(c["status"] == "ok" for c in doc["candidates"])
        err = (doc["screening"] or {}).get("max_abs_error")
        lines.append(f"{case}: {n} points, {ok} timed, {time.monotonic() - t0:.0f} s, decision {doc['decision']}, "
                     f"screen-to-final max |error| {'-' if err is None else f'{100 * err:.1f}%'} -> {name}")
    print("\n".join(["", "=" * 30 + " tables " + "=" * 30, *lines]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
