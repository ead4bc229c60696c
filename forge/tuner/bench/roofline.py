"""The roofline: % of min(peak FLOP/s, intensity x copy bandwidth) against the device's measured peaks."""

from __future__ import annotations

import math
from typing import Any

from forge.spec import KernelSpec
from forge.tuner.bench.peaks import Peaks

# Ops whose flops are matrix products, so the dense matmul rate is their compute ceiling. The others'
# flops (exp, rsqrt, adds) run on the vector units, whose rate the GEMM says nothing about; their
# intensities are 0.25-4 flop/B, two orders of magnitude below the H200's ridge (~700e12 / 4.2e12 = 170
# flop/B), so the copy bandwidth is their roofline. (Without this rule the interpreter's CPU, whose fp16
# GEMM runs at ~1 GFLOP/s, would call rmsnorm compute-bound.)
GEMM_OPS = ("matmul", "sdpa", "linear", "swiglu")


def roofline_model(opmod, spec: KernelSpec, peaks: Peaks) -> dict[str, Any]:
    """bytes, flops, arithmetic intensity and the ridge point (matmul rate / copy bandwidth); bound =
    compute for a GEMM op at or above the ridge, else memory."""
    nbytes, flops = int(opmod.bytes_moved(spec)), int(opmod.flops(spec))
    bw = peaks.copy_tbps * 1e12
    pf = peaks.flops_per_s(spec.dtype)
    intensity = flops / nbytes if nbytes else math.inf
    ridge = pf / bw if pf else None
    gemm = spec.op in GEMM_OPS
    bound = "compute" if gemm and ridge is not None and intensity >= ridge else "memory"
    return {"bytes_moved": nbytes, "flops": flops, "intensity": intensity, "ridge": ridge, "gemm": gemm,
            "bound": bound}


def roofline_pct(model: dict[str, Any], p50_us: float, peaks: Peaks, dtype: str) -> dict[str, float]:
    """Achieved rates and % of the attainable rate min(peak FLOP/s, intensity x copy bandwidth): for a
    memory-bound op that is bytes/time against the copy bandwidth, for a compute-bound one flops/time
    against the matmul rate."""
    t = p50_us * 1e-6
    bw = peaks.copy_tbps * 1e12
    pf = peaks.flops_per_s(dtype)
    achieved_bps, achieved_fps = model["bytes_moved"] / t, model["flops"] / t
    if model["bound"] == "memory" or not pf:
        pct = achieved_bps / bw * 100
    else:
        pct = achieved_fps / min(pf, model["intensity"] * bw) * 100
    return {"achieved_tbps": achieved_bps / 1e12, "achieved_tflops": achieved_fps / 1e12, "pct_roofline": pct}

