"""Per-call latency of the runtime shim on a cache hit (issue 3), on the GPU.

Usage (on the GPU machine, from the repo root):
    PYTHONPATH=. python3 bench/latency.py --out DIR [--calls 5000] [--budget 30]

For each op (rmsnorm, softmax, gelu) at the decode shape 1x4096 and at 2048x4096, it times a host
loop of --calls calls followed by one synchronize, for:
  forge            the @forge.optimize-decorated function after its first call (search or cache hit):
                   the C++ fast path (forge/_fastcall.cpp) when it could be made, else the Python path;
                   for a signature decided eager, the C++ eager call (signature check, then the function)
  forge-python     the same with the C++ fast path switched off (Python key, plan, Triton's C launch)
  forge-jit        the same binding with the compiled launch plan switched off (Triton JIT dispatch)
  triton-jit       the winning kernel's module called directly (`launch()` via the op's run(), JIT)
  eager            the user's function, undecorated (several aten ops for the rmsnorm formula)
  eager-fused      the fused torch op (F.rms_norm, torch.softmax, F.gelu): one aten op
  compile          torch.compile(function) (default mode)
and the device time of the forge kernel (CUDA events around 200 back-to-back launches), so a row can be
read as host-bound (per-call > device time) or device-bound. Writes DIR/latency.json; prints a table last.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def rms_formula(x, weight, eps=1e-6):
    import torch

    return x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + eps) * weight


def softmax_fn(x):
    import torch

    return torch.softmax(x, dim=-1)


def gelu_fn(x):
    import torch.nn.functional as F

    return F.gelu(x)


def per_call_us(fn, args, calls: int, repeats: int = 3) -> float:
    """Median over `repeats` host loops of `calls` calls, each loop closed by one synchronize."""
    import torch

    for _ in range(50):
        fn(*args)
    torch.cuda.synchronize()
    loops = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        torch.cuda.synchronize()
        loops.append((time.perf_counter() - t0) / calls * 1e6)
    return sorted(loops)[len(loops) // 2]


def probes(binding, inputs, tensors, calls: int) -> dict[str, float]:
    """Alternatives to pieces of the hot path, timed the same way (not used by forge unless they win)."""
    import torch

    from forge import launch, shim

    x = inputs[0]
    shape, dtype, device = tuple(x.shape), x.dtype, x.device
    res = {"alloc-empty": per_call_us(lambda: torch.empty(shape, dtype=dtype, device=device), (), calls),
           "alloc-new-empty": per_call_us(lambda: x.new_empty(shape), (), calls),
           "key-one-tensor": per_call_us(lambda: shim._tensor_sig(x), (), calls),
           "stream-query": per_call_us(lambda: torch._C._cuda_getCurrentRawStream(binding.device_index), (), calls)}
    (ln,) = binding.plan.launches if len(binding.plan.launches) == 1 else (None,)
    if ln is None:
        return res
    # Triton's C launch with every argument precomputed: the floor of that path.
    fn, mid, packed = launch._call_form(ln, direct=True)
    ptrs = {pos: tensors[src].data_ptr() for pos, src in ln.slots}
    kargs = tuple(ptrs.get(i, v) for i, v in enumerate(ln.args))
    stream = torch._C._cuda_getCurrentRawStream(binding.device_index)
    if packed:
        res["c-launch-precomputed"] = per_call_us(lambda: fn(*ln.grid, stream, *mid, kargs), (), calls)
    else:
        res["c-launch-precomputed"] = per_call_us(lambda: fn(*ln.grid, stream, *mid, *kargs), (), calls)
    # torch inductor's static CUDA launcher (C++ in torch), on the same cubin.
    try:
        try:
            from torch._inductor.runtime.static_triton_launcher import StaticallyLaunchedCudaKernel as SK
        except ImportError:
            from torch._inductor.runtime.static_cuda_launcher import StaticallyLaunchedCudaKernel as SK
        ck = ln.kernel
        if not hasattr(ck, "_cubin_path"):
            ck._cubin_path = None
        k = SK(ck)
        k.reload_cubin_from_raw(os.path.join(tempfile.mkdtemp(), "k.cubin"))
        k.load_kernel(binding.device_index)
        names, sig = ck.src.fn.arg_names, ck.src.signature
        keep = [i for i, n in enumerate(names)
                if sig.get(n, sig.get(i)) != "constexpr" and i not in k.full_constexprs]
        sargs = [kargs[i] for i in keep]
        out2 = torch.empty_like(tensors[-1])
        sargs2 = [out2.data_ptr() if kargs[i] == tensors[-1].data_ptr() else kargs[i] for i in keep]
        k.run(*ln.grid, stream, *sargs2)
        torch.cuda.synchronize()
        res["torch-static-same-bits"] = float(launch.same_bits(out2, tensors[-1]))
        res["torch-static-launch"] = per_call_us(lambda: k.run(*ln.grid, stream, *sargs), (), calls)
        c_impl, fnh, nw, sh, tys = k.C_impl, k.function, k.num_warps, k.shared, k.arg_tys
        targs = tuple(sargs)
        res["torch-static-c"] = per_call_us(
            lambda: c_impl._launch_kernel(fnh, *ln.grid, nw, sh, tys, targs, stream), (), calls)
    except Exception as exc:  # noqa: BLE001 - a probe of a private torch API: report, do not fail the bench
        print(f"torch static launcher probe failed: {type(exc).__name__}: {exc}", flush=True)
    return res


def breakdown(opt, binding, call_args, calls: int) -> dict[str, float]:
    """Where a cache hit's time goes, piece by piece (µs per call, same loop as per_call_us)."""
    from forge import launch

    inputs = tuple(call_args)
    plan = binding.plan
    out = binding.opmod.alloc_output(inputs, binding.spec)
    tensors = (*inputs, out)
    wrapper = launch.Plan(plan.launches, plan.device_index, direct=False)
    key = next(iter(opt._bound))
    hit = opt._bound[key]
    parts = {"python-call": per_call_us(lambda *a: None, call_args, calls),
             "alloc-output": per_call_us(lambda *a: binding.opmod.alloc_output(a, binding.spec), inputs, calls),
             "plan-usable": per_call_us(lambda *a: plan.usable(), (), calls),
             "fire-c-direct": per_call_us(lambda *a: plan(tensors), (), calls),
             "fire-launcher-object": per_call_us(lambda *a: wrapper(tensors), (), calls)}
    parts.update(probes(binding, inputs, tensors, calls))
    class NoLaunch:  # a binding that does nothing: the loop then costs the key and the lookup
        plan = fast = None

        def __call__(self, tensors, root=None):
            return None

    opt._bound[key] = (NoLaunch(), hit[1])
    try:
        parts["shim-key-lookup"] = per_call_us(opt, call_args, calls)
    finally:
        opt._bound[key] = hit
    binding.plan = wrapper
    try:
        parts["forge-launcher-object"] = per_call_us(opt, call_args, calls)
    finally:
        binding.plan = plan
    return {k: round(v, 2) for k, v in parts.items()}


def device_us(fn, args, n: int = 200) -> float:
    import torch

    fn(*args)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n):
        fn(*args)
    e.record()
    e.synchronize()
    return s.elapsed_time(e) * 1000 / n


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--budget", type=int, default=30)
    ap.add_argument("--ops", default="rmsnorm,softmax,gelu", help="comma-separated subset")
    ap.add_argument("--cache", type=Path, default=None,
                    help="forge cache dir (default: a fresh temporary one, kept out of --out)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ["FORGE_CACHE_DIR"] = str(args.cache or tempfile.mkdtemp(prefix="forge-latency-"))
    import torch
    import torch.nn.functional as F

    import forge
    from forge import ops
    from forge.env import collect_env

    env = collect_env("cuda")
    from forge import fastcall

    t0 = time.monotonic()
    fast_ready = fastcall.module(wait=True) is not None  # built once per machine; calls wait for nothing
    print(f"C++ fast path: {'built' if fast_ready else fastcall.error()} in {time.monotonic() - t0:.1f} s",
          flush=True)
    cases = [("rmsnorm", rms_formula, lambda x, w: F.rms_norm(x, (x.shape[-1],), w, 1e-6), "float16"),
             ("softmax", softmax_fn, lambda x: torch.softmax(x, -1), "bfloat16"),
             ("gelu", gelu_fn, lambda x: F.gelu(x), "float16")]
    rows = []
    for op, fn, fused, dtype in cases:
        if op not in args.ops.split(","):
            continue
        if op not in ops.available():
            print(f"{op}: no such op family in this tree, skipped", flush=True)
            continue
        for shape in ((1, 4096), (2048, 4096)):
            tdt = getattr(torch, dtype)
            x = torch.randn(shape, device="cuda", dtype=tdt)
            call_args = (x, torch.randn(shape[-1], device="cuda", dtype=tdt)) if op == "rmsnorm" else (x,)
            opt = forge.optimize(fn, budget=args.budget)
            t0 = time.monotonic()
            y = opt(*call_args)
            first_s = time.monotonic() - t0
            why = forge.explain(opt, *call_args)
            ref = fn(*call_args)
            max_err = float((y.float() - ref.float()).abs().max())
            row = {"op": op, "shape": "x".join(map(str, shape)), "dtype": dtype, "uses": why.uses,
                   "reason": why.reason, "launch": why.launch, "variant": why.variant, "params": why.params,
                   "first_call_s": round(first_s, 1), "max_abs_err_vs_eager": max_err}
            timings = {"forge": per_call_us(opt, call_args, args.calls),
                       "eager": per_call_us(fn, call_args, args.calls),
                       "eager-fused": per_call_us(fused, call_args, args.calls)}
            compiled = torch.compile(fn)
            timings["compile"] = per_call_us(compiled, call_args, args.calls)
            binding = next(iter(opt._bound.values()))[0]
            if binding is None:  # decided eager: the C++ eager call (signature check, then fn) if made
                row["fast"] = ("eager call" if opt._fast is not None and opt._fast[1]
                               else next(iter(opt._fast_off.values()), "not made"))
                fast, opt._fast = opt._fast, None
                timings["forge-python"] = per_call_us(opt, call_args, args.calls)
                opt._fast = fast
            if binding is not None:
                row["fast"] = binding.fast or "not made"
                fast, opt._fast = opt._fast, None  # every measurement below is of the Python path
                timings["forge-python"] = per_call_us(opt, call_args, args.calls)
                inputs = tuple(call_args) if op != "rmsnorm" else call_args
                out = binding.opmod.alloc_output(inputs, binding.spec)

                def raw(*a, _b=binding, _out=out):
                    _b.opmod.run(_b.module, a, _out, _b.attrs)

                timings["triton-jit"] = per_call_us(raw, inputs, args.calls)
                row["forge_device_us"] = device_us(opt, call_args)
                plan, binding.plan = binding.plan, None
                timings["forge-jit"] = per_call_us(opt, call_args, args.calls)
                binding.plan = plan
                if plan is not None and shape[0] == 1:
                    row["breakdown_us"] = breakdown(opt, binding, call_args, args.calls)
                if fast is not None:
                    # The comparisons that matter, interleaved round by round: the host's speed drifted by
                    # up to 40% between runs minutes apart, so separate loops are compared only loosely.
                    rounds: dict[str, list[float]] = {"forge": [], "forge-python": [], "eager-fused": []}
                    for _ in range(5):
                        opt._fast = fast
                        rounds["forge"].append(per_call_us(opt, call_args, args.calls, repeats=1))
                        opt._fast = None
                        rounds["forge-python"].append(per_call_us(opt, call_args, args.calls, repeats=1))
                        rounds["eager-fused"].append(per_call_us(fused, call_args, args.calls, repeats=1))
                    row["interleaved_us"] = {k: round(sorted(v)[2], 2) for k, v in rounds.items()}
                opt._fast = fast
            row["per_call_us"] = {k: round(v, 2) for k, v in timings.items()}
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "gpu": env.get("gpu"), "driver": env.get("driver"), "cuda": env.get("cuda"),
        "torch": torch.__version__, "triton": env.get("triton"), "forge": env.get("forge"),
        "python": sys.version.split()[0], "calls_per_loop": args.calls,
        "command": "PYTHONPATH=. python3 bench/latency.py " + " ".join(sys.argv[1:]),
        "rows": rows,
    }
    (args.out / "latency.json").write_text(json.dumps(result, indent=2))
    cols = ["forge", "forge-python", "forge-jit", "triton-jit", "eager", "eager-fused", "compile"]
    print(f"\n{env.get('gpu')} driver {env.get('driver')} torch {torch.__version__} triton {env.get('triton')}; "
          f"host loop of {args.calls} calls, µs per call")
    print(f"{'op':8} {'shape':10} {'uses':6} {'launch':9} " + " ".join(f"{c:>11}" for c in cols) + f" {'device':>7}")
    for r in rows:
        t = r["per_call_us"]
        launch = (r["launch"] or "-").split(" ")[0]
        print(f"{r['op']:8} {r['shape']:10} {r['uses']:6} {launch:9} "
              + " ".join(f"{t.get(c, float('nan')):>11.2f}" for c in cols)
              + f" {r.get('forge_device_us', float('nan')):>7.2f}")
    print("interleaved (5 rounds of forge / forge-python / eager-fused loops, median), µs per call:")
    for r in rows:
        if "interleaved_us" in r:
            print(f"{r['op']:8} {r['shape']:10} " + ", ".join(f"{k} {v}" for k, v in r["interleaved_us"].items()))
    for r in rows:
        if "breakdown_us" in r:
            print(f"breakdown {r['op']} {r['shape']}: " + ", ".join(f"{k} {v}" for k, v in r["breakdown_us"].items()))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
