"""Why forge's row kernels trail Inductor's at rmsnorm 2048x4096 fp16 (issue 16: forge's best 13.3-13.6 µs,
max-autotune 11.2, on the H100 of run a): forge's own row/multirow kernels as rendered, the same kernels with the
row length N (and the row stride) baked in as constexprs, as Inductor bakes its shapes (the `cols < N` mask and
the address arithmetic fold away), eager, F.rms_norm, torch.compile and max-autotune-no-cudagraphs, all timed in
one process in interleaved rounds (forge's Bench: CUDA-graph replays over rotating input sets, L2 cold). Each
call contestant twice: as Bench.call_fn times it (its results held, output buffers rotating like the kernels')
and with its result dropped at once (the timing before that change: one output buffer, L2-resident).

Usage (GPU machine, repo root):
    PYTHONPATH=. python3 bench/row_probe.py --out DIR [--op rmsnorm] [--shape 2048x4096] [--dtype float16]
Writes DIR/row-probe-<op>-<shape>-<dtype>.json (every contestant's p50/p20/p80, the environment, the command)
and prints a table, fastest first.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import statistics
import sys
import tempfile
from pathlib import Path


def _constexpr(source: str, names: tuple[str, ...]) -> str | None:
    """The rendered kernel with the runtime ints `names` of its signature turned into constexprs (None if the
    signature does not have them all)."""
    m = re.search(r"def (\w+)\(([^)]*)\):", source)
    if m is None:
        return None
    params = [p.strip() for p in m.group(2).split(",")]
    if not all(n in params for n in names):
        return None
    new = ", ".join(f"{p}: tl.constexpr" if p in names else p for p in params)
    return source[:m.start(2)] + new + source[m.end(2):]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--op", default="rmsnorm")
    ap.add_argument("--shape", default="2048x4096")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--max-autotune", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--device", default="cuda", help="cpu: the Triton interpreter (a check of this script only)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    backend = "cuda" if args.device == "cuda" else "interpreter"
    if backend == "interpreter":
        import os

        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

    import torch

    from forge import codegen, loader, opkit, ops
    from forge.env import collect_env
    from forge.tuner.timing import Bench

    shape = tuple(int(x) for x in args.shape.split("x"))
    op = ops.get(args.op)
    mod = op.module
    spec = mod.make_spec(shape, args.dtype, args.device, {})
    bench = Bench(mod, spec, backend, seed=0)
    src_dir = Path(tempfile.mkdtemp(prefix="row-probe-"))
    contestants: dict[str, object] = {}

    cands = [opkit.Candidate.make("row", num_warps=w) for w in (4, 8, 16, 32)]
    cands += [opkit.Candidate.make("multirow", ROWS=r, num_warps=w) for r in (2, 4) for w in (4, 8, 16)]
    sp = mod.space(spec)
    for cand in cands:
        if cand not in sp:
            continue
        source = codegen.render(op, spec, cand)
        label = f"{cand.variant} " + " ".join(f"{k}={v}" for k, v in sorted(cand.p.items()))
        for tag, src in (("", source), (" constexpr N", _constexpr(source, ("N",))),
                         (" constexpr N+strides", _constexpr(source, ("N", "stride_x", "stride_y")))):
            if src is None:
                continue
            module = loader.load_module(loader.write_source(src, src_dir))
            contestants[label + tag] = bench.candidate_fn(module)

    calls = {"eager": lambda inp: mod.reference(inp, spec.attrs)}
    if args.op == "rmsnorm":
        import torch.nn.functional as F

        eps = spec.attrs["eps"]
        calls["F.rms_norm"] = lambda inp: F.rms_norm(inp[0], (inp[0].shape[-1],), inp[1], eps)
    modes = [("compile", None)] + ([("max-autotune", "max-autotune-no-cudagraphs")] if args.max_autotune else [])
    attrs = dict(spec.attrs)
    for name, mode in modes:
        torch._dynamo.reset()

        def ref(*xs):
            return mod.reference(list(xs), attrs)

        compiled = torch.compile(ref, dynamic=False, **({"mode": mode} if mode else {}))
        calls[name] = lambda inp, c=compiled: c(*inp)
    for name, call in calls.items():
        # as forge search and bench time a call (its results held, so its output buffers rotate), and with
        # each result dropped at once, as they did before: the graph's pool then hands every launch the
        # block the last one freed, an output that stays in L2
        contestants[name] = bench.call_fn(call)
        contestants[name + " (result dropped)"] = (lambda i, c=call: c(bench.inputs[i]))

    # correctness first: every contestant against eager on set 0 (a probe that times a wrong kernel says nothing)
    expect = mod.reference(bench.inputs[0], spec.attrs).float()
    samplers, errors = {}, {}
    for name, fn in contestants.items():
        try:
            samplers[name] = bench.prepare(fn)
        except Exception as exc:  # noqa: BLE001 - a contestant that fails is reported, the rest go on
            errors[name] = str(exc)[:300]
            continue
        if name not in calls and not name.endswith("(result dropped)"):
            bench.outputs[0].zero_()
            fn(0)
            bench.sync()
            diff = (bench.outputs[0].float() - expect).abs().max().item()
            if diff > 0.05:
                errors[name] = f"max abs diff {diff:.3g} against eager"
                del samplers[name]
    for s in samplers.values():
        bench.settle(s, 50)
    times: dict[str, list[float]] = {name: [] for name in samplers}
    for _ in range(args.rounds):
        for name, s in samplers.items():
            times[name].append(s())

    def q(xs, p):
        return statistics.quantiles(xs, n=100)[p - 1]

    rows = sorted(({"name": n, "p50": statistics.median(v), "p20": q(v, 20), "p80": q(v, 80)}
                   for n, v in times.items()), key=lambda r: r["p50"])
    doc = {"env": collect_env(backend),
           "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
           "command": "PYTHONPATH=. python3 bench/row_probe.py " + " ".join(sys.argv[1:]),
           "op": args.op, "shape": args.shape, "dtype": args.dtype, "rounds": args.rounds,
           "timing": "forge Bench: CUDA-graph replays over rotating input sets (L2 cold), µs per call",
           "rows": rows, "errors": errors}
    dst = args.out / f"row-probe-{args.op}-{args.shape}-{args.dtype}.json"
    dst.write_text(json.dumps(doc, indent=2, default=str))
    best = rows[0]["p50"] if rows else 1.0
    print(f"{'contestant':48s} {'p50':>8s} {'p20':>8s} {'p80':>8s}  x best")
    for r in rows:
        print(f"{r['name']:48s} {r['p50']:8.2f} {r['p20']:8.2f} {r['p80']:8.2f}  {r['p50'] / best:.3f}")
    for n, e in errors.items():
        print(f"{n}: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
