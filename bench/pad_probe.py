"""The misaligned GEMM (issue 16: 8205x2949x5921, K and N rows not 16-byte aligned) timed as several padding
schemes side by side in one process, interleaved, L2 cold (forge's Bench: private rotating input sets, CUDA
graph replays), against cuBLAS on the unpadded operands and torch.compile. Each scheme is a plain call that
allocates its result, timed as forge bench times a torch-op contestant (Bench.call_fn); every scheme's result
is checked against eager's before it is timed.

Schemes (K and N padded with zeros; the extra output columns are never kept):
  forge      forge/fused.py _matmul_aligned as committed (the torch-op candidate the search times; at 75fc458
             K and N padded to 16 B with F.pad, the copies' storage rows to 128 B)
  pad128     K and N padded to 128 B (5952, 3008; stop 32's first version)
  pad16m     K, N and M padded to 16 B (8208 rows; Inductor's pad_mm shape mm(8208x5928, 5928x2952))
  pad16view  K and N padded to 16 B, the output's first N columns returned as a strided view (the copy's cost;
             NOT a valid forge result, eager's layout is contiguous)
  gemm       torch.matmul on operands padded once before timing (the GEMM alone: a lower bound)
  strided    no padded GEMM: A and B copied (one copy kernel each, nothing filled) into storage whose rows are
             16-byte multiples, viewed at their own K and N; cuBLAS writes C into rows of 16-byte multiples too
             (mm's out=), its first N columns copied out contiguous. cuBLAS needs aligned leading dimensions
             and pointers, not aligned sizes, and never reads past the logical K
  stridedc   strided with cuBLAS writing the contiguous (misaligned) output directly: no copy out

Usage (GPU machine, repo root):
    PYTHONPATH=. python3 bench/pad_probe.py --out DIR [--shape 8205x2949x5921] [--dtypes bfloat16,float16]
Writes DIR/pad-probe.json (p20/p50/p80 µs per scheme and dtype, with the environment and the command) and
prints a table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path


def schemes(torch, fused):
    pad = torch.nn.functional.pad

    def up(n: int, elems: int) -> int:
        return -(-n // elems) * elems

    def padded(a, b, kb: int, nb: int, mb: int | None):
        """A and B padded with zeros: K to kb bytes, N to nb bytes, M to mb bytes (None: M as is)."""
        e = a.element_size()
        m, k, n = a.shape[0], a.shape[1], b.shape[1]
        kp, np_ = up(k, max(1, kb // e)), up(n, max(1, nb // e))
        mp = up(m, max(1, mb // e)) if mb else m
        a2 = pad(a, (0, kp - k, 0, mp - m)) if (kp, mp) != (k, m) else a
        b2 = pad(b, (0, np_ - n, 0, kp - k)) if (kp, np_) != (k, n) else b
        return a2, b2

    def pad128(inputs):
        a, b = inputs
        n = b.shape[1]
        a2, b2 = padded(a, b, 128, 128, None)
        return torch.matmul(a2, b2)[:, :n].contiguous()

    def pad16m(inputs):
        a, b = inputs
        m, n = a.shape[0], b.shape[1]
        a2, b2 = padded(a, b, 16, 16, 16)
        out = torch.matmul(a2, b2)[:m, :n]
        return out.contiguous()

    def pad16view(inputs):
        a, b = inputs
        n = b.shape[1]
        a2, b2 = padded(a, b, 16, 16, None)
        return torch.matmul(a2, b2)[:, :n]

    def aligned_view(t, eb: int = 16):
        """t copied into storage whose rows are eb-byte multiples (the pad never written), viewed at t's shape."""
        rows = up(t.shape[1], max(1, eb // t.element_size()))
        buf = torch.empty(t.shape[0], rows, dtype=t.dtype, device=t.device)
        v = buf[:, : t.shape[1]]
        v.copy_(t)
        return v

    def strided(inputs):
        a, b = inputs
        a2, b2 = aligned_view(a), aligned_view(b)
        out = torch.empty(a.shape[0], up(b.shape[1], max(1, 16 // a.element_size())), dtype=a.dtype,
                          device=a.device)[:, : b.shape[1]]
        torch.mm(a2, b2, out=out)
        return out.contiguous()

    def stridedc(inputs):
        a, b = inputs
        return torch.mm(aligned_view(a), aligned_view(b))

    return {
        "strided": strided,
        "stridedc": stridedc,
        "forge": lambda inputs: fused._matmul_aligned(inputs, {}),
        "pad128": pad128,
        "pad16m": pad16m,
        "pad16view": pad16view,
    }, padded


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shape", default="8205x2949x5921", help="M x N x K, as forge's matmul specs")
    ap.add_argument("--dtypes", default="bfloat16,float16")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    import torch

    from forge import fused, ops
    from forge.env import collect_env
    from forge.tuner.stats import Quantiles
    from forge.tuner.timing import Bench

    opmod = ops.get("matmul").module
    shape = tuple(int(x) for x in args.shape.split("x"))
    calls, padded = schemes(torch, fused)
    results: dict = {}
    for dtype in args.dtypes.split(","):
        spec = opmod.make_spec(shape, dtype, "cuda", {})
        contestants = {"eager": lambda inputs: torch.matmul(*inputs), **calls}
        if not args.no_compile:
            torch._dynamo.reset()
            contestants["compile"] = torch.compile(lambda inputs: torch.matmul(*inputs), dynamic=False)
        samplers, benches = {}, []
        for name, call in contestants.items():
            bench = Bench(opmod, spec, "cuda", 0)
            want = torch.matmul(*[t.double() for t in bench.inputs[0]])
            got = call(bench.inputs[0]).double()
            err = ((got - want).abs().max() / want.abs().max()).item()
            if got.shape != want.shape or not err < 1e-2:
                raise SystemExit(f"{name} {dtype}: wrong result (shape {tuple(got.shape)}, rel err {err:.3g})")
            del want, got
            samplers[name] = bench.prepare(bench.call_fn(call))
            benches.append(bench)
        # the GEMM alone: each timing set's operands padded once (K and N to 16 B), only torch.matmul timed
        bench = Bench(opmod, spec, "cuda", 0)
        pre = {id(inp): padded(*inp, 16, 16, None) for inp in bench.inputs}
        samplers["gemm"] = bench.prepare(bench.call_fn(lambda inputs, pre=pre: torch.matmul(*pre[id(inputs)])))
        benches.append(bench)
        samples: dict[str, list[float]] = {n: [] for n in samplers}
        for r in range(args.rounds + 5):
            for name, s in samplers.items():
                v = s()
                if r >= 5:  # the first rounds settle the clocks
                    samples[name].append(v)
        results[dtype] = {n: Quantiles.of(v).to_dict() for n, v in samples.items()}
        samplers = benches = bench = pre = None  # the timing sets' memory, before the next dtype's
        torch.cuda.empty_cache()

    env = collect_env("cuda")
    doc = {**{k: env.get(k) for k in ("gpu", "driver", "cuda", "torch", "triton")},
           "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
           "command": "PYTHONPATH=. python3 bench/pad_probe.py " + " ".join(sys.argv[1:]),
           "shape": args.shape, "clock": "device: CUDA-graph replays, L2 cold (forge's Bench), interleaved",
           "results": results}
    (args.out / "pad-probe.json").write_text(json.dumps(doc, indent=1))
    for dtype, rows in results.items():
        base = rows["eager"]["p50"]
        comp = rows.get("compile", {}).get("p50")
        print(f"\nmatmul {args.shape} {dtype} ({doc['gpu']}): p50 µs, x eager, x compile")
        for name, q in rows.items():
            print(f"  {name:10} {q['p50']:8.1f} {q['p50'] / base:7.3f} "
                  f"{q['p50'] / comp if comp else float('nan'):7.3f}   p20 {q['p20']:.1f} p80 {q['p80']:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
