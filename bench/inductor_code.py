"""What Inductor generates for an op's reference at one shape: the Triton source of torch.compile (default and
max-autotune-no-cudagraphs) written to files, plus the launch parameters read from it, so forge's own kernel
for the same spec can be compared line by line (issue 16: rmsnorm 2048x4096 fp16, where max-autotune's kernel
took 11.2 µs and forge's best 13.3-13.6 on the H100 of run a).

Usage (GPU machine, repo root):
    PYTHONPATH=. python3 bench/inductor_code.py --out DIR [--op rmsnorm] [--shape 2048x4096] [--dtype float16]
Writes DIR/<op>-<shape>-<mode>.py (Inductor's output code) and prints, per mode, each generated kernel's name,
its triton_meta/inductor_meta decorator lines and the launch grid.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--op", default="rmsnorm")
    ap.add_argument("--shape", default="2048x4096")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    import torch
    from torch._inductor.utils import run_and_get_code

    from forge import ops

    shape = tuple(int(x) for x in args.shape.split("x"))
    opmod = ops.get(args.op).module
    spec = opmod.make_spec(shape, args.dtype, args.device, {})
    inputs = opmod.make_inputs(spec, 0)
    attrs = dict(spec.attrs)
    natural = getattr(opmod, "reference_parts", None) or opmod.reference

    for mode in (None, "max-autotune-no-cudagraphs"):
        torch._dynamo.reset()

        def fn(*xs):
            return natural(list(xs), attrs)

        kwargs = {"dynamic": False, **({"mode": mode} if mode else {})}
        compiled = torch.compile(fn, **kwargs)
        _, codes = run_and_get_code(compiled, *inputs)
        name = f"{args.op}-{args.shape}-{args.dtype}-{mode or 'default'}"
        text = "\n\n# ---- next module ----\n\n".join(codes)
        (args.out / f"{name}.py").write_text(text)
        print(f"== {name}: {len(codes)} module(s), {len(text)} chars", flush=True)
        for line in text.splitlines():
            s = line.strip()
            if re.match(r"(@triton_heuristics\.|@triton\.jit|def triton_|triton_meta=|inductor_meta=|"
                        r".*\.run\(|.*num_warps|.*XBLOCK|.*R0_BLOCK|.*RBLOCK|.*eviction_policy)", s):
                print("  ", s[:400])
        print("  chosen:", _chosen_configs())
    return 0


def _chosen_configs() -> list[str]:
    """Each loaded Inductor kernel's remaining launchers' configs (after autotuning, the one it picked)."""
    from torch._inductor.codecache import PyCodeCache
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    out = []
    for mod in list(PyCodeCache.modules):
        for attr, obj in vars(mod).items():
            if isinstance(obj, CachingAutotuner):
                cfgs = [str(getattr(launcher, "config", "?")) for launcher in getattr(obj, "launchers", [])]
                out.append(f"{attr}: {cfgs}")
    return out


if __name__ == "__main__":
    sys.exit(main())
