"""Where a model's call latency goes on the host, through the forge backend (diagnosis, not a table).

Usage (on the GPU machine, from the repo root):
    PYTHONPATH=. python3 bench/host_profile.py --out DIR [--model gpt2] [--budget 16] [--cache DB]

Tunes the model as bench/models.py does (or uses --cache as it is with --no-tune), then:
(1) call latency per forward, interleaved (bench/models.py timed_rounds), and the host's dispatch time alone,
for eager, forge, forge without the torch-op regions' C++ check (EagerCall), forge without any C++ fast
call, torch.compile (the fast-call extension is built first, so every variant has it from its first call);
(2) every synchronising CUDA call one forge forward makes (torch.cuda.set_sync_debug_mode, with the Python
stack of the first); (3) cProfile of 20 forge forwards, the top functions by own and by cumulative time.
Writes DIR/host_profile.json and DIR/host_profile.txt.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import models  # noqa: E402  (bench/models.py)
import torch  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--cache", type=Path, default=None)
    ap.add_argument("--no-tune", action="store_true")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--n", type=int, default=10)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="forge-host-"))
    cache = args.cache or work / "cache.db"
    doc: dict = {"model": args.model, "env": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}}
    if not args.no_tune:
        doc["tune"] = {k: v for k, v in models.tune(args.model, cache, work, args.budget).items() if k != "rounds"}

    from forge import fastcall

    fastcall.module(wait=True)  # built before any contestant's first call: every variant gets its fast calls
    _, make_args, step, _ = models.build(args.model)
    runs, backends = {}, {}
    real_make_eager = getattr(fastcall, "make_eager", None)

    def no_eager(*a, **k):
        raise fastcall.Unsupported("turned off for the comparison")

    for mode in ("eager", "forge", "forge-no-eager-check", "forge-no-fastcall", "compile"):
        fn, be = models.contestant("compile" if mode == "compile" else ("eager" if mode == "eager" else "forge"),
                                   args.model, cache)
        kw = make_args()
        # the variants' fast calls are refused while they are offered (the first calls), for good
        if mode == "forge-no-eager-check" and real_make_eager is not None:
            fastcall.make_eager = no_eager
        if mode == "forge-no-fastcall":
            os.environ["FORGE_FASTCALL"] = "0"
        try:
            with torch.no_grad():
                for _ in range(3):
                    step(fn, kw)
            torch.cuda.synchronize()
        finally:
            os.environ.pop("FORGE_FASTCALL", None)
            if real_make_eager is not None:
                fastcall.make_eager = real_make_eager
        if be is not None:
            backends[mode] = be
            doc.setdefault("fast_calls", {})[mode] = sum(k.fast is not None for k in be.kernel_calls)
        runs[mode] = (lambda fn=fn, kw=kw: step(fn, kw))
    doc["ms_per_forward"] = models.timed_rounds(runs, args.n, args.rounds)
    # host dispatch alone: the wall time of n forwards issued back to back, the GPU idle at the start and
    # not waited for at the end (a figure above the device time means the host sets the pace)
    host = {}
    with torch.no_grad():
        for mode, fwd in runs.items():
            walls = []
            for _ in range(5):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(args.n):
                    fwd()
                walls.append((time.perf_counter() - t0) * 1e3 / args.n)
                torch.cuda.synchronize()
            host[mode] = sorted(walls)[2]
    doc["host_dispatch_ms_per_forward"] = host
    doc["kernel_calls"] = [{"op": k.__name__, "launch": k.binding.launch, "fast": k.fast is not None,
                            "fast_eager": getattr(k, "fast_eager", None), "calls": k.calls, "fallbacks": k.fallbacks}
                           for k in backends["forge"].kernel_calls]

    # synchronising calls in one forge forward
    fwd = runs["forge"]
    syncs = []
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.no_grad():
                fwd()
        for w in caught:
            syncs.append(str(w.message)[:300])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # the stacks: again, with the warning raised as an error at the first one
    stacks = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.no_grad():
            fwd()
    except RuntimeError as exc:
        stacks.append({"error": str(exc)[:300], "stack": traceback.format_exc()[-6000:]})
    finally:
        torch.cuda.set_sync_debug_mode("default")
    doc["syncs"], doc["first_sync_stack"] = syncs, stacks

    # cProfile
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    with torch.no_grad():
        prof.enable()
        for _ in range(20):
            fwd()
        torch.cuda.synchronize()
        prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(35)
    s2 = io.StringIO()
    pstats.Stats(prof, stream=s2).sort_stats("cumulative").print_stats(45)
    text = s.getvalue() + "\n\n" + s2.getvalue()
    (args.out / "host_profile.txt").write_text(text)
    (args.out / "host_profile.json").write_text(json.dumps(doc, indent=1))
    print(json.dumps({k: v for k, v in doc.items() if k not in ("kernel_calls", "tune")}, indent=1)[:6000])
    print(text[:5000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
