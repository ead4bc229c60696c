"""Markdown table of issue 15's large-shape manifest (bench/big.toml) from one or more `forge search
--manifest --json` results of the same manifest, a later run continuing an earlier one's cache (one device
call is at most 10 minutes): each entry as the run that searched it reported it.

    python3 bench/big_table.py bench/results/h200-big-2026-12-03-{b,c}.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def table(paths: list[Path]) -> str:
    runs = [(p, json.loads(p.read_text())) for p in paths]
    rows: dict = {}
    for p, d in runs:
        for e in d["entries"]:
            k = (e["op"], e["shape"], e["dtype"], json.dumps(e.get("attrs"), sort_keys=True))
            if e["status"] == "searched" or k not in rows:
                rows[k] = (p, e)
    lines = ["| op, shape, dtype | decision | forge µs | eager µs | speedup | search s | peak per worker GiB "
             "| exit | run |", "|---|---|---|---|---|---|---|---|---|"]
    for (op, shape, dtype, _), (p, e) in rows.items():
        shown = {k: v for k, v in sorted((e.get("attrs") or {}).items())
                 if k not in ("eps", "scale", "keepdim") and v not in (None, "none", False)}
        shape = shape + "".join(f" {k}={v}" for k, v in shown.items())
        peak = e.get("peak_worker_bytes")
        run = p.stem.rsplit("-", 1)[-1] if len(runs) > 1 else "—"
        fmt = (lambda v: f"{v:.1f}" if v else "—")
        speed = f"{e['speedup']:.2f}x" if e.get("speedup") else "—"
        lines.append(f"| {op} {shape} {dtype} | {e.get('decision') or e['status']} | {fmt(e.get('p50_us'))} "
                     f"| {fmt(e.get('eager_p50_us'))} | {speed} | {e.get('seconds') or 0:.1f} "
                     f"| {peak / 2**30:.1f} | {e.get('exit_code')} | {run} |" if peak else
                     f"| {op} {shape} {dtype} | {e.get('decision') or e['status']} | {fmt(e.get('p50_us'))} "
                     f"| {fmt(e.get('eager_p50_us'))} | {speed} | {e.get('seconds') or 0:.1f} | — "
                     f"| {e.get('exit_code')} | {run} |")
    heads = [f"`{p.name}`: {d['gpu']}, driver {d['driver']}, torch {d['torch']}, triton {d['triton']}, "
             f"{d['date']}, commit {d.get('commit', '?')}; `{d['command']}`; forge wall {d['wall_s']:.0f} s, "
             f"exit {d['exit_code']}, {d['failed']} failed" for p, d in runs]
    return "\n".join(["\n".join(f"- {h}" for h in heads), "", *lines])


if __name__ == "__main__":
    print(table([Path(p) for p in sys.argv[1:]]))
