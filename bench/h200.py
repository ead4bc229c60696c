"""GPU benchmark for issue 2: runs forge searches on the GPU and writes one results JSON.

Usage (on the GPU machine, from the repo root):
    PYTHONPATH=. python3 bench/h200.py --out DIR [--budget 50] [--case rmsnorm:2048x4096:float16 ...]

For each case it runs `forge search ... --json --force` as a subprocess (exactly what a user runs),
measures the device copy bandwidth once (for % of bandwidth), and writes DIR/h200-search.json with
GPU, driver, torch, triton, date and the commands. The last thing printed is a table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_CASES = ["rmsnorm:2048x4096:float16", "softmax:2048x4096:bfloat16", "softmax:32768x4096:bfloat16"]


def copy_bandwidth_tbps() -> float:
    """Device-to-device copy of 2 GiB, bytes read + written over the median of 20 copies."""
    import torch

    n = 1 << 30
    a = torch.randn(n, dtype=torch.float16, device="cuda")  # never time on zeros
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    times = []
    for _ in range(20):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1000)
    times.sort()
    return 2 * a.nbytes / times[len(times) // 2] / 1e12


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget", type=int, default=50)
    ap.add_argument("--case", action="append", help="op:MxN:dtype (repeatable)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    from forge import ops
    from forge.env import collect_env

    env = collect_env("cuda")
    bw = copy_bandwidth_tbps()
    rows, runs = [], []
    for case in args.case or DEFAULT_CASES:
        op, shape, dtype = case.split(":")
        cmd = [sys.executable, "-m", "forge_cli.cli", "search", op, "--shape", shape, "--dtype", dtype,
               "--budget", str(args.budget), "--json", "--force", "--cache", str(args.out / "forge.db")]
        t0 = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.monotonic() - t0
        (args.out / f"{op}-{shape}-{dtype}.stderr.txt").write_text(proc.stderr[-20000:])
        if proc.returncode not in (0,):
            print(f"{case}: exit {proc.returncode}\n{proc.stderr[-3000:]}", flush=True)
            runs.append({"case": case, "command": " ".join(cmd[1:]), "exit_code": proc.returncode})
            continue
        rep = json.loads(proc.stdout)
        opfam = ops.get(op)
        spec = opfam.module.make_spec(tuple(int(s) for s in shape.split("x")), dtype, "cuda")
        nbytes = opfam.module.bytes_moved(spec)
        w = rep["winner"]
        best_us = w["quantiles"]["p50"] if w else None
        eager_us = rep["baseline"]["p50"]
        statuses: dict[str, int] = {}
        for c in rep["candidates"]:
            statuses[c["status"]] = statuses.get(c["status"], 0) + 1
        row = {
            "case": case, "decision": rep["decision"],
            "winner": f"{w['variant']}({', '.join(f'{k}={v}' for k, v in w['params'].items())})" if w else None,
            "forge_p50_us": best_us, "forge_quantiles": w["quantiles"] if w else None,
            "eager_p50_us": eager_us, "eager_quantiles": rep["baseline"],
            "speedup": rep["speedup"], "bytes_moved": nbytes,
            "pct_copy_bw": (nbytes / (best_us * 1e-6) / 1e12 / bw * 100) if best_us else None,
            "search_wall_s": round(wall, 1), "phases": rep.get("phases"), "candidates": statuses,
        }
        rows.append(row)
        runs.append({"case": case, "command": "forge " + " ".join(cmd[3:]), "exit_code": 0, "report": rep})
        print(json.dumps(row), flush=True)
    result = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "gpu": env.get("gpu"), "driver": env.get("driver"), "cuda": env.get("cuda"),
        "torch": torch.__version__, "triton": env.get("triton"), "forge": env.get("forge"),
        "copy_bandwidth_tbps": round(bw, 3),
        "command": "PYTHONPATH=. python3 bench/h200.py " + " ".join(sys.argv[1:]),
        "rows": rows, "runs": runs,
    }
    (args.out / "h200-search.json").write_text(json.dumps(result, indent=2))
    print(f"\n{env.get('gpu')} driver {env.get('driver')} torch {torch.__version__} "
          f"triton {env.get('triton')} copy BW {bw:.2f} TB/s")
    print(f"{'case':34} {'decision':8} {'forge p50':>10} {'eager p50':>10} {'speedup':>8} {'%BW':>6} "
          f"{'wall s':>7}  winner")
    for r in rows:
        f = r["forge_p50_us"]
        print(f"{r['case']:34} {r['decision']:8} {f if f is None else round(f, 2)!s:>10} "
              f"{r['eager_p50_us']:>10.2f} {r['speedup'] or 0:>7.2f}x "
              f"{r['pct_copy_bw'] or 0:>5.1f}% {r['search_wall_s']:>7}  {r['winner']}")
    return 0 if all(r.get("exit_code", 0) == 0 for r in runs) else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
