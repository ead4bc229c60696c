"""Markdown tables of bench/models.py results (README's "Whole models on the H200"), from the JSON files.

    python3 bench/models_table.py bench/results/h200-models-*.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _c(c: dict | None) -> str:
    if not c:
        return "—"
    if "error" in c:
        return "n/a"
    if "invalid" in c:  # measured, but not what it claims to be (the JSON's note says why)
        return f"invalid ({c['ms_per_forward']:.2f})"
    return f"{c['ms_per_forward']:.2f} ({c['speedup_vs_eager']:.2f}x)"


def _liger(r: dict) -> str:
    """Liger's column: timed in its own process (it patches transformers for the whole process), against
    that process's own eager run, where the JSON has it (liger_sequential); else the in-process contestant."""
    seq = r.get("liger_sequential") or {}
    if "liger" in seq and "error" not in seq["liger"]:
        c = seq["liger"]
        return f"{c['ms_per_forward']:.2f} ({c['speedup_vs_eager']:.2f}x, own process)"
    return _c(r.get("contestants", {}).get("liger"))


def table(path: Path) -> str:
    d = json.loads(path.read_text())
    # runs with the CUDA-graph contestants (forge's cudagraphs=True, torch.compile's reduce-overhead) get two
    # more columns
    graphs = any(m in r.get("contestants", {}) for r in d["rows"] for m in ("forge-cudagraphs", "compile-cudagraphs"))
    # and runs with Backend(cudagraphs="auto") (forge-auto) one more
    auto = any("forge-auto" in r.get("contestants", {}) for r in d["rows"])
    # and runs with Backend(rest="inductor") (forge-inductor) one more
    ind = any("forge-inductor" in r.get("contestants", {}) for r in d["rows"])
    lines = [f"`{path.name}` — {d['gpu']}, driver {d['driver']}, torch {d['torch']}, triton {d['triton']}, "
             f"transformers {d['transformers']}, {d['date']}; `{d['command']}`; {d['timing']}.", "",
             "| model | eager ms | forge ms (x eager) | torch.compile ms (x) | max-autotune ms (x) | Liger ms (x) "
             + ("| forge + CUDA graphs ms (x) | compile reduce-overhead ms (x) " if graphs else "")
             + ("| forge, cudagraphs=\"auto\" ms (x) " if auto else "")
             + ("| forge, rest=\"inductor\" ms (x) " if ind else "")
             +
             "| forge device time vs eager "
             "| device time in forge kernels (in regions forge decided kernel or torch op; in every region forge "
             "decided, eager included) "
             "| forge kernels / regions | first call s: forge / compile / max-autotune |",
             "|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if graphs else "") + ("---|" if auto else "")
             + ("---|" if ind else "")]
    for r in d["rows"]:
        cs = r.get("contestants", {})
        if not cs:
            lines.append(f"| {r['model']} | failed: {r.get('error')} ||||||||")
            continue
        e, f = cs.get("eager", {}), cs.get("forge", {})
        dev = r.get("device")
        dv = f"{dev['eager_ms']:.2f} → {dev['forge_ms']:.2f} ms ({dev['speedup']:.2f}x)" if dev else "—"
        for mode in ("compile", "max-autotune"):  # runs since run e: the peers' device time as well
            if dev and dev.get(f"{mode}_ms") and "invalid" not in cs.get(mode, {}):
                dv += f"; {mode} {dev[f'{mode}_ms']:.2f} ms ({dev['eager_ms'] / dev[f'{mode}_ms']:.2f}x)"
        share = f"{dev['forge_kernel_share']:.1%}" if dev and dev.get("forge_kernel_share") is not None else "—"
        if dev and dev.get("shares_invalid"):
            share = "invalid (see note)"
        elif dev and dev.get("forge_region_share") is not None:  # kernel + torch-op regions (issue 14's target)
            share += f" ({dev['forge_region_share']:.1%}"
            if dev.get("decided_share") is not None:  # runs since f: every region forge decided, eager included
                share += f"; {dev['decided_share']:.1%}"
            share += ")"
        kr = f"{f.get('kernels')} / {f.get('regions')}" if "kernels" in f else "—"
        fc = " / ".join(str(cs.get(m, {}).get("first_call_s", "—")) for m in ("forge", "compile", "max-autotune"))
        peers = " | ".join(_c(cs.get(m)) for m in ("compile", "max-autotune"))
        extra = ""
        if graphs:
            extra = " | ".join(_c(cs.get(m)) for m in ("forge-cudagraphs", "compile-cudagraphs")) + " | "
        if auto:
            extra += _c(cs.get("forge-auto")) + " | "
        if ind:
            extra += _c(cs.get("forge-inductor")) + " | "
        lines.append(f"| {r.get('label', r['model'])} | {e.get('ms_per_forward', 0):.2f} | {_c(f)} | {peers} "
                     f"| {_liger(r)} | {extra}{dv} | {share} | {kr} | {fc} |")
    if d.get("note"):
        lines += ["", d["note"]]
    return "\n".join(lines)


if __name__ == "__main__":
    print("\n\n".join(table(Path(p)) for p in sys.argv[1:]))
