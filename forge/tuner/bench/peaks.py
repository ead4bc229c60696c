"""The device's peaks (copy bandwidth, dense matmul rate per dtype), measured once per device and cached as
JSON next to the cache DB."""

from __future__ import annotations

import datetime as dt
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forge.env import collect_env
from forge.tuner import stats
from forge.tuner.bench._common import Events

PEAKS_FILE = "peaks.json"
PEAKS_VERSION = 1
MATMUL_DTYPES = ("float16", "bfloat16", "float32")


@dataclass
class Peaks:
    device: str  # the key they are cached under: GPU name + uuid + driver + torch (or the CPU)
    copy_tbps: float  # device-to-device copy, bytes read + written per second, 1e12
    matmul_tflops: dict[str, float]  # dense GEMM rate per dtype, 1e12 FLOP/s
    measured_at: str
    method: str
    path: str | None = None
    cached: bool = False

    def flops_per_s(self, dtype: str) -> float | None:
        v = self.matmul_tflops.get(dtype)
        return None if v is None else v * 1e12

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device, "copy_tbps": self.copy_tbps, "matmul_tflops": self.matmul_tflops,
                "measured_at": self.measured_at, "method": self.method, "path": self.path, "cached": self.cached}


def peaks_key(backend: str) -> str:
    """What the peaks are valid for: GPU name, uuid, driver and torch (CPU model and threads on the
    interpreter). A driver or torch upgrade re-measures."""
    import torch

    env = collect_env(backend)
    if backend == "cuda":
        props = torch.cuda.get_device_properties(0)
        return (f"cuda|{env['gpu']}|{getattr(props, 'uuid', 'no-uuid')}|driver {env.get('driver')}|"
                f"torch {torch.__version__}")
    return f"cpu|{env.get('cpu')}|{env.get('machine')}|threads {torch.get_num_threads()}|torch {torch.__version__}"


def _median(xs: list[float]) -> float:
    return stats.quantile(xs, 0.5)


def _measure_peaks(backend: str) -> dict[str, Any]:
    """Measure copy bandwidth and matmul rate on the device (module-level so tests can count calls)."""
    import torch

    if backend == "cuda":
        # As bench/h200.py: a 2 GiB fp16 device-to-device copy, bytes read + written, median of 20 (4.22
        # TB/s on the H200, 2026-12-02). GEMMs: 8192^3, median of 10 after ~200 ms of warm-up.
        def timed(fn, reps: int, warm_ms: float = 200.0) -> float:
            end = time.perf_counter() + warm_ms / 1000
            fn()
            torch.cuda.synchronize()
            while time.perf_counter() < end:  # synchronised, so the host does not queue seconds of work
                fn()
                torch.cuda.synchronize()
            ts = []
            for _ in range(reps):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                fn()
                e.record()
                e.synchronize()
                ts.append(s.elapsed_time(e) / 1000)
            return _median(ts)

        a = torch.randn(1 << 30, dtype=torch.float16, device="cuda")  # never time on zeros
        b = torch.empty_like(a)
        copy_bps = 2 * a.nbytes / timed(lambda: b.copy_(a), 20)
        del a, b
        n = 8192
        rates = {}
        for name in MATMUL_DTYPES:
            dtype = getattr(torch, name)
            x = torch.randn(n, n, device="cuda", dtype=dtype)
            y = torch.randn(n, n, device="cuda", dtype=dtype)
            rates[name] = 2 * n**3 / timed(lambda x=x, y=y: torch.matmul(x, y), 10) / 1e12
            del x, y
        torch.cuda.empty_cache()
        method = ("copy: 2 GiB fp16 device-to-device, median of 20, CUDA events; matmul: 8192^3 torch.matmul "
                  "per dtype (fp32 without TF32, torch's default), median of 10")
    else:
        def host(fn, reps: int) -> float:
            fn()
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            return _median(ts)

        a = torch.randn(8 << 20)
        b = torch.empty_like(a)
        copy_bps = 2 * a.nbytes / host(lambda: b.copy_(a), 10)
        n = 512
        rates = {}
        for name in MATMUL_DTYPES:
            dtype = getattr(torch, name)
            x, y = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
            rates[name] = 2 * n**3 / host(lambda x=x, y=y: torch.matmul(x, y), 3) / 1e12
        method = ("host (CPU) clock: 32 MiB fp32 copy, median of 10; 512^3 torch.matmul per dtype, median of 3 "
                  "(the interpreter's roofline is the CPU's, not a GPU's)")
    return {"copy_tbps": copy_bps / 1e12, "matmul_tflops": rates, "method": method,
            "measured_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")}


def _read_peaks_file(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):  # missing or damaged: it only holds measurements, re-measure
        return {"version": PEAKS_VERSION, "devices": {}}
    if not isinstance(doc, dict) or doc.get("version") != PEAKS_VERSION or not isinstance(doc.get("devices"), dict):
        return {"version": PEAKS_VERSION, "devices": {}}
    return doc


def device_peaks(backend: str, directory: str | os.PathLike, remeasure: bool = False,
                 emit: Events | None = None) -> Peaks:
    """The device's peaks from DIRECTORY/peaks.json, measured (and stored) when missing or asked to."""
    path = Path(directory) / PEAKS_FILE
    key = peaks_key(backend)
    doc = _read_peaks_file(path)
    cached = doc["devices"].get(key)
    if cached is not None and not remeasure:
        try:
            return Peaks(device=key, copy_tbps=float(cached["copy_tbps"]),
                         matmul_tflops={k: float(v) for k, v in cached["matmul_tflops"].items()},
                         measured_at=cached["measured_at"], method=cached["method"], path=str(path), cached=True)
        except (KeyError, TypeError, ValueError, AttributeError):
            pass  # a damaged record: measure again
    if emit is not None:
        emit("measuring-peaks", device=key)
    measured = _measure_peaks(backend)
    doc["devices"][key] = measured
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".peaks-", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f, indent=2, sort_keys=True)
    os.replace(tmp, path)
    return Peaks(device=key, copy_tbps=measured["copy_tbps"], matmul_tflops=dict(measured["matmul_tflops"]),
                 measured_at=measured["measured_at"], method=measured["method"], path=str(path), cached=False)

