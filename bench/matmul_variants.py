"""One GEMM spec (matmul, or --op linear / swiglu with --attr K=V) searched over a chosen set of candidates,
to compare structural variants side by side (issue 16): the op's default, the best recorded point of another
variant (--seed-from TABLE, the H200's exhaustive tables), then --n points of --variant spread as grid spreads
them (--where K=V keeps only points with that parameter value, e.g. WS=True), all screened and the top 3
re-timed interleaved with eager (cuBLAS, with the epilogue as the user's code runs it) in the same process, as
`forge search` does.

Usage (GPU machine, repo root):
    PYTHONPATH=. python3 bench/matmul_variants.py --out DIR [--op matmul] [--shape 4096x4096x4096]
        [--dtype bfloat16] [--attr residual=true] [--variant persistent] [--n 48] [--where WS=True]
        [--seed-from bench/results/h200-tables-2026-12-04/matmul-...json]
Writes DIR/<op>-variants.json (the search report, with the command and environment) and prints a table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import tempfile
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--op", default="matmul")
    ap.add_argument("--attr", action="append", default=[], help="K=V, an attribute of the spec (repeatable)")
    ap.add_argument("--where", action="append", default=[], help="K=V: only --variant points with this value")
    ap.add_argument("--shape", default="4096x4096x4096")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--variant", default="persistent")
    ap.add_argument("--n", type=int, default=48)
    ap.add_argument("--seed-from", type=Path, default=None, help="a replay table: its best point is proposed too")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    from forge import ops
    from forge.cache import Cache
    from forge.env import collect_env
    from forge.opkit import Candidate
    from forge.tuner import engine, replay
    from forge.tuner import strategy as strategies

    shape = tuple(int(x) for x in args.shape.split("x"))

    def value(v: str):
        return {"true": True, "false": False}.get(v.lower(), int(v) if v.lstrip("-").isdigit() else v)

    attrs = {k: value(v) for k, v in (a.split("=", 1) for a in args.attr)}
    where = {k: value(v) for k, v in (a.split("=", 1) for a in args.where)}
    seeds: list[Candidate] = []
    if args.seed_from is not None:
        t = replay.load(args.seed_from)
        seeds.append(min((c for c, v in t.times.items() if v is not None), key=lambda c: t.times[c]))

    class Only:
        """The seeds, then grid's spread of --variant's points (a pure strategy, like the registered ones)."""

        def __init__(self, seed: int = 0, first: Candidate | None = None):
            self.first, self.done = first, False

        def propose(self, space, history, n):
            if self.done:
                return []
            self.done = True
            points = [c for c in space.all_points() if c.variant == args.variant
                      and all(c.p.get(k) == v for k, v in where.items())]
            picked = strategies._spread(points, args.n)
            out = [c for c in [self.first, *seeds] if c is not None and c in space]
            return (out + [c for c in picked if c not in out])[:n]

    strategies.REGISTRY["bench-only"] = Only
    mod = ops.get(args.op).module
    n_space = sum(1 for c in mod.space(mod.make_spec(shape, args.dtype, args.device, dict(attrs))).all_points()
                  if c.variant == args.variant)
    rep = engine.search(args.op, shape, args.dtype, device=args.device, attrs=attrs,
                        cache=Cache(Path(tempfile.mkdtemp()) / "forge.db"),
                        options=engine.SearchOptions(budget=args.n + 1 + len(seeds), strategy="bench-only",
                                                     force=True, torch_op=False))
    env = collect_env(engine.resolve_backend(args.device))
    doc = {**{k: env.get(k) for k in ("gpu", "driver", "cuda", "torch", "triton")},
           "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
           "command": "PYTHONPATH=. python3 bench/matmul_variants.py " + " ".join(sys.argv[1:]),
           "variant_points_in_space": n_space, "report": rep.to_dict()}
    (args.out / f"{args.op}-variants.json").write_text(json.dumps(doc, indent=1, default=str))
    base = rep.baseline.p50 if rep.baseline else None
    rows = sorted((c for c in rep.candidates if c["screen"]), key=lambda c: c["screen"]["p50"])
    by_variant: dict[str, dict] = {}
    for c in rows:
        by_variant.setdefault(c["variant"], c)
    print(f"\n{args.op} {args.shape} {args.dtype} {attrs}: eager (cuBLAS) p50 {base:.1f} us; {args.variant}: "
          f"{n_space} points in the space, {sum(c['variant'] == args.variant for c in rep.candidates)} proposed, "
          f"{sum(c['variant'] == args.variant and c['status'] == 'ok' for c in rep.candidates)} valid")
    def on_final_scale(c):  # the final's p50, else the screening's estimate of it (engine.screen_to_final)
        if c["final"]:
            return c["final"]["p50"]
        return c["screen"]["p50"] * base / c["screen_eager_p50"] if base and c.get("screen_eager_p50") else None

    rows.sort(key=lambda c: on_final_scale(c) or float("inf"))
    print(f"{'variant':12} {'params':90} {'screen':>8} {'final':>8} {'vs eager':>9}  (vs eager: final, else estimate)")
    for c in rows[:8] + [c for v, c in by_variant.items() if c not in rows[:8]]:
        t = on_final_scale(c)
        print(f"{c['variant']:12} {json.dumps(c['params'])[:90]:90} {c['screen']['p50']:8.1f} "
              f"{(c['final'] or {}).get('p50', float('nan')):8.1f} {base / t if base and t else float('nan'):9.3f}")
    fails = {}
    for c in rep.candidates:
        if c["status"] != "ok":
            fails.setdefault(c["status"], (0, c["reason"]))
            fails[c["status"]] = (fails[c["status"]][0] + 1, fails[c["status"]][1])
    for s, (k, why) in fails.items():
        print(f"  {k} x {s}: e.g. {str(why)[:200]}")
    print(f"decision: {rep.decision}; search {rep.seconds:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
