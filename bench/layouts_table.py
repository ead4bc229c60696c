"""Markdown table of `forge bench --manifest bench/layouts.toml --json` results (README, issue 14's rows):
p50 µs of every contestant, forge's ratio to the best other correct one.

    python3 bench/layouts_table.py bench/results/h200-layouts-bench-2026-12-03-b.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

NAMES = ("forge", "eager", "fused", "compile", "compile-max-autotune", "liger")


def _attrs(a: dict) -> str:
    skip = {"eps", "keepdim", "scale"}
    return ", ".join(f"{k}={v}" for k, v in sorted(a.items()) if k not in skip and v not in (None, "none", False))


def _cell(c: dict | None) -> str:
    if c is None:
        return "—"
    q = c.get("quantiles")
    if c["status"] == "ok" and q:
        return f"{q['p50']:.1f}"
    if q:  # timed, outside the tolerance (eager: the user's code, the baseline)
        return f"{q['p50']:.1f} (inexact)"
    return c["status"]


def table(path: Path) -> str:
    d = json.loads(path.read_text())
    head = (f"`{path.name}` — {d['gpu']}, driver {d['driver']}, torch {d['torch']}, triton {d['triton']}, "
            f"{d['date']}, commit {d.get('commit', '?')}; `{d['command']}`; p50 µs of CUDA-graph replays, "
            f"{d['rounds']} interleaved rounds, L2 cold.")
    lines = [head, "", "| op, shape (bf16 unless said) | " + " | ".join(NAMES) + " | forge vs best other |",
             "|---|" + "---|" * (len(NAMES) + 1)]
    for t in d["targets"]:
        cs = {c["name"]: c for c in t["contestants"]}
        ok = {n: c["quantiles"]["p50"] for n, c in cs.items() if c["status"] == "ok" and c.get("quantiles")}
        others = {n: v for n, v in ok.items() if n != "forge"}
        ratio = "—"
        if "forge" in ok and others:
            best = min(others, key=others.get)
            ratio = f"{ok['forge'] / others[best]:.2f} ({best})"
        elif "forge" not in ok:
            ratio = f"forge: {cs['forge']['status']} ({(cs['forge'].get('reason') or '')[:40]})"
        dtype = "" if t["dtype"] == "bfloat16" else f" {t['dtype']}"
        what = f"{t['op']} {t['shape']}{dtype} {_attrs(t['attrs'])}".strip()
        lines.append(f"| {what} | " + " | ".join(_cell(cs.get(n)) for n in NAMES) + f" | {ratio} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print("\n\n".join(table(Path(p)) for p in sys.argv[1:]))
