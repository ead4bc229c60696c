"""`forge bench` (engine side): re-time cached winners against the other ways to run the op, with the
roofline against the device's measured peaks; and `--recheck`, which re-validates and re-times cached
winners and flags the ones that drifted.

Bench, for each target (op, shape, dtype, attrs) that has a cached decision, in this process:

  forge      the cached winner's source (sha256 checked first), launched exactly as the search timed it
  eager      the op's reference (kernels/<op>.py: what a user writes; the search's baseline)
  fused      the single fused torch op (FUSED below), where it differs from eager; else "same as eager"
  compile    torch.compile(reference, dynamic=False); `compile-max-autotune` with --max-autotune
             (mode max-autotune-no-cudagraphs: forge captures its own CUDA graphs around it)
  liger      Liger-Kernel's functional equivalent (LIGER below), when liger_kernel is importable

Every contestant is first run on fresh inputs and compared with the float64 oracle (validate.compare,
the op's tolerance); one that mismatches or raises is recorded and not timed. The others are timed
interleaved (A B C A B C ...) with the search's final sampling (engine.SAMPLING): CUDA-graph replays of
back-to-back launches over rotating input sets larger than 3x the L2 (timing.Bench), each contestant
with private input sets (a contestant may write into its inputs, and no one reads another's data from
L2). A contestant whose launches cannot be captured in a CUDA graph is timed with CUDA events around
the same number of back-to-back launches instead, labelled `cuda-events` (that includes host launch
cost when the launch takes longer than the kernel). On the interpreter every clock is the host's.

Peaks (copy bandwidth, dense matmul rate per dtype) are measured once per device and cached as JSON next
to the cache DB; % of roofline = achieved / min(peak FLOP/s, intensity x copy bandwidth).

Recheck goes through the search's worker pool: check_candidate in a worker (a crash or hang is recorded
against the entry) and the worker's interleaved timing against eager, as the search's finals did.
"""

from __future__ import annotations

import datetime as dt
import importlib
import json
import math
import os
import shutil
import tempfile
import time
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forge import key as keys
from forge import ops
from forge.cache import Cache, Entry
from forge.env import collect_env
from forge.loader import load_module, write_source
from forge.spec import KernelSpec
from forge.tuner import engine, stats
from forge.tuner.lock import device_lock

CONTESTANTS = ("forge", "eager", "fused", "compile", "compile-max-autotune", "liger")
Events = Callable[..., None]

# Validation inputs of the bench: a seed the search never used for validation (seed + 1000 * i) or timing
# (seed + 77 + i), so the cached kernel is checked on data it was not chosen on.
BENCH_VALIDATION_SEED = 4242
# --recheck validates in a worker with the search's check_candidate, at seed + 1 (the search's default is 0).
RECHECK_SEED_OFFSET = 1

# --- statistics for --recheck -----------------------------------------------------------------------
# --- the reference contestants ----------------------------------------------------------------------
@dataclass(frozen=True)
class Fused:
    """The fused torch op for an op family. same_as_eager: the op's eager reference already is this call,
    so timing it again would only measure noise; it is reported as "same as eager" instead."""

    label: str
    fn: Callable[[tuple, dict], Any]
    same_as_eager: bool = False


def _f():
    import torch.nn.functional as F

    return F


def _fused_reduce(inputs, attrs):
    import torch

    fn = {"sum": torch.sum, "mean": torch.mean, "amax": torch.amax, "argmax": torch.argmax}[attrs["kind"]]
    return fn(inputs[0], dim=-1, keepdim=attrs["keepdim"])


def _fused_sdpa(inputs, attrs):
    q, k, v = inputs
    kwargs = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
    return _f().scaled_dot_product_attention(q, k, v, is_causal=attrs["causal"], scale=attrs["scale"], **kwargs)


# Every op in kernels/ has an entry (tests/test_bench_cmd.py checks it): a Fused, or the reason there is none.
FUSED: dict[str, Fused | str] = {
    # The reference is the formula as users write it (5 kernels in eager); F.rms_norm is torch's fused op.
    "rmsnorm": Fused("F.rms_norm", lambda i, a: _f().rms_norm(i[0], (i[0].shape[-1],), i[1], a["eps"])),
    "softmax": Fused("torch.softmax", lambda i, a: __import__("torch").softmax(i[0], -1), same_as_eager=True),
    "log_softmax": Fused("F.log_softmax", lambda i, a: _f().log_softmax(i[0], -1), same_as_eager=True),
    "layer_norm": Fused("F.layer_norm", lambda i, a: _f().layer_norm(i[0], i[0].shape[-1:], i[1], i[2], a["eps"]),
                        same_as_eager=True),
    "gelu": Fused("F.gelu", lambda i, a: _f().gelu(i[0], approximate=a["approximate"]), same_as_eager=True),
    # torch has no fused silu-and-multiply: F.silu(a) * b is two kernels, which is what eager runs.
    "silu_mul": Fused("F.silu(a) * b", lambda i, a: _f().silu(i[0]) * i[1], same_as_eager=True),
    "sdpa": Fused("F.scaled_dot_product_attention", _fused_sdpa, same_as_eager=True),
    "matmul": Fused("torch.matmul", lambda i, a: __import__("torch").matmul(i[0], i[1]), same_as_eager=True),
    "cross_entropy": Fused("F.cross_entropy", lambda i, a: _f().cross_entropy(
        i[0], i[1], ignore_index=a["ignore_index"], reduction=a["reduction"]), same_as_eager=True),
    "reduce": Fused("torch.sum / mean / amax / argmax", _fused_reduce, same_as_eager=True),
    "rope": "torch has no fused rotary-embedding op",
}


class _Unavailable(Exception):
    """A contestant that cannot run here; the message says why (shown in the table and in --json)."""


def _liger_api(functional_name: str, ops_module: str, function_class: str) -> Callable:
    """liger_kernel.transformers.functional.<name> (the stable functional API), else <ops_module>.<Class>.apply."""
    try:
        functional = importlib.import_module("liger_kernel.transformers.functional")
        fn = getattr(functional, functional_name, None)
    except Exception:  # noqa: BLE001 - a broken liger install must not stop the bench
        fn = None
    if fn is None:
        try:
            fn = getattr(importlib.import_module(ops_module), function_class).apply
        except Exception as exc:  # noqa: BLE001
            raise _Unavailable(f"this liger_kernel has neither transformers.functional.{functional_name} nor "
                               f"{ops_module}.{function_class} ({type(exc).__name__})") from None
    return fn


def _liger_rmsnorm():
    fn = _liger_api("liger_rms_norm", "liger_kernel.ops.rms_norm", "LigerRMSNormFunction")
    return "liger_rms_norm", lambda i, a: fn(i[0], i[1], a["eps"])


def _liger_softmax():
    fn = _liger_api("liger_softmax", "liger_kernel.ops.softmax", "LigerSoftmaxFunction")
    return "liger_softmax", lambda i, a: fn(i[0])


def _liger_layer_norm():
    fn = _liger_api("liger_layer_norm", "liger_kernel.ops.layer_norm", "LigerLayerNormFunction")
    return "liger_layer_norm", lambda i, a: fn(i[0], i[1], i[2], a["eps"])


def _liger_swiglu():
    fn = _liger_api("liger_swiglu", "liger_kernel.ops.swiglu", "LigerSiLUMulFunction")
    return "liger_swiglu", lambda i, a: fn(i[0], i[1])


def _liger_cross_entropy():
    try:
        fn = importlib.import_module("liger_kernel.transformers.functional").liger_cross_entropy
    except Exception:  # noqa: BLE001 - the Function's positional signature changed across versions
        raise _Unavailable("this liger_kernel has no transformers.functional.liger_cross_entropy") from None

    def call(i, a):
        loss = fn(i[0], i[1], ignore_index=a["ignore_index"], reduction=a["reduction"])
        return loss[0] if isinstance(loss, tuple) else loss  # some versions return (loss, z_loss)

    return "liger_cross_entropy", call


LIGER: dict[str, Callable[[], tuple[str, Callable]] | str] = {
    "rmsnorm": _liger_rmsnorm,
    "softmax": _liger_softmax,
    "layer_norm": _liger_layer_norm,
    "silu_mul": _liger_swiglu,
    "cross_entropy": _liger_cross_entropy,
    "rope": ("Liger's rope rotates q and k in one call and reads only the first half of cos/sin (the Hugging "
             "Face layout, halves equal); forge's rope takes any (S, D) cos/sin"),
    "gelu": "Liger-Kernel has GeGLU (gelu(a) * b), not a plain gelu",
    "matmul": "Liger-Kernel has no matmul",
    "sdpa": "Liger-Kernel has no attention forward kernel",
    "reduce": "Liger-Kernel has no row reductions",
    "log_softmax": "Liger-Kernel has no log_softmax kernel",
}


def _liger(op: str) -> tuple[str, Callable]:
    what = LIGER.get(op, f"Liger-Kernel has no {op} kernel")
    if isinstance(what, str):
        raise _Unavailable(what)
    try:
        importlib.import_module("liger_kernel")
    except ImportError:
        raise _Unavailable("liger_kernel is not installed (pip install liger-kernel)") from None
    except Exception as exc:  # noqa: BLE001 - installed but broken (e.g. built for another triton)
        raise _Unavailable(f"liger_kernel failed to import: {_short(exc)}") from None
    return what()


def _cpp_compiler() -> str | None:
    """The C++ compiler torch.compile's CPU backend (inductor) would use, if one exists."""
    for name in (os.environ.get("CXX"), "g++", "clang++", "c++"):
        if name and shutil.which(name):
            return name
    return None


def _fresh_function(fn: Callable, tag: str) -> Callable:
    """A copy of `fn` with its own code object. Dynamo caches compiled code per code object, so two
    torch.compile modes (or many specs of one op in a manifest, past dynamo's recompile limit) on the same
    function would share (or exhaust) one cache."""
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}_{tag}")
    new = types.FunctionType(code, fn.__globals__, f"{fn.__name__}_{tag}", fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    return new


def _short(exc: BaseException, limit: int = 300) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    text = f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _fmt_params(params: dict | None) -> str:
    return ", ".join(f"{k}={v}" for k, v in (params or {}).items())


# --- peaks ------------------------------------------------------------------------------------------
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


# Ops whose flops are matrix products, so the dense matmul rate is their compute ceiling. The others'
# flops (exp, rsqrt, adds) run on the vector units, whose rate the GEMM says nothing about; their
# intensities are 0.25-4 flop/B, two orders of magnitude below the H200's ridge (~700e12 / 4.2e12 = 170
# flop/B), so the copy bandwidth is their roofline. (Without this rule the interpreter's CPU, whose fp16
# GEMM runs at ~1 GFLOP/s, would call rmsnorm compute-bound.)
GEMM_OPS = ("matmul", "sdpa")


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


# --- targets ----------------------------------------------------------------------------------------
@dataclass
class Target:
    """One (op, shape, dtype, attrs) to bench or recheck, and its cache entry (or why there is none)."""

    op: str
    shape: tuple[int, ...]
    dtype: str
    attrs: dict[str, Any]
    spec: KernelSpec | None = None
    key: str | None = None
    entry: Entry | None = None
    error: str | None = None

    @property
    def shape_str(self) -> str:
        return "x".join(map(str, self.shape))

    @property
    def label(self) -> str:
        attrs = " ".join(f"{k}={v}" for k, v in sorted(self.attrs.items()))
        return f"{self.op} {self.shape_str} {self.dtype}" + (f" {attrs}" if attrs else "")


def _search_hint(op: str, shape: str, dtype: str, attrs: dict, backend: str) -> str:
    extra = "".join(f" --attr {k}={json.dumps(v)}" for k, v in sorted(attrs.items()))
    dev = " --device cpu" if backend == "interpreter" else ""
    return f"forge search {op} --shape {shape} --dtype {dtype}{extra}{dev}"


def resolve_target(op: str, shape: tuple[int, ...], dtype: str, attrs: dict | None, backend: str,
                   cache: Cache) -> Target:
    """Build the spec and cache key exactly as `forge search` does and look the entry up. A spec that
    cannot be built raises UsageError; a missing entry is recorded in Target.error."""
    loc = keys.request(op, tuple(shape), dtype, backend, attrs)
    t = Target(op=op, shape=tuple(shape), dtype=dtype, attrs=dict(loc.spec.attrs), spec=loc.spec, key=loc.key)
    t.entry = cache.get(loc.key)
    if t.entry is None:
        t.error = (f"no cached decision for {t.label} on this device and environment ({backend}) in "
                   f"{cache.path}; run `{_search_hint(op, t.shape_str, dtype, attrs or {}, backend)}` first")
    return t


def target_of_entry(entry: Entry) -> Target:
    x = entry.spec["inputs"][0]
    return Target(op=entry.op, shape=tuple(x["shape"]), dtype=x["dtype"], attrs=dict(entry.spec.get("attrs", {})),
                  spec=KernelSpec.from_dict(entry.spec), key=entry.key, entry=entry)


def prepare_backend(backend: str) -> None:
    """The interpreter must be switched on before Triton compiles anything in this process (Triton reads
    TRITON_INTERPRET when a kernel module is loaded; workers and tests/conftest.py set it before import)."""
    if backend == "interpreter":
        os.environ["TRITON_INTERPRET"] = "1"


# --- bench ------------------------------------------------------------------------------------------
@dataclass
class BenchOptions:
    seed: int = 0
    rounds: int | None = None  # interleaved rounds; None: the search's finals (engine.SAMPLING)
    skip: frozenset[str] = frozenset()
    max_autotune: bool = False
    remeasure_peaks: bool = False
    timeout: float = 120.0  # --recheck: seconds per worker request
    drift_floor: float = stats.DRIFT_FLOOR


@dataclass
class ContestantResult:
    name: str
    label: str
    status: str = "pending"  # ok | mismatch | error | skipped | refused (forge: source fails its sha256)
    reason: str | None = None
    clock: str | None = None  # cuda-graph | cuda-events | host
    note: str | None = None
    quantiles: stats.Quantiles | None = None
    speedup: float | None = None  # eager p50 / this p50
    roofline: dict[str, float] | None = None
    # not serialized: how to run it
    call: Callable[[tuple], Any] | None = field(default=None, repr=False)
    timing: Callable[[Any], Callable[[int], None]] | None = field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        r = self.roofline or {}
        return {"name": self.name, "label": self.label, "status": self.status, "reason": self.reason,
                "clock": self.clock, "note": self.note,
                "quantiles": self.quantiles.to_dict() if self.quantiles else None,
                "speedup": self.speedup, "pct_roofline": r.get("pct_roofline"),
                "achieved_tbps": r.get("achieved_tbps"), "achieved_tflops": r.get("achieved_tflops")}


@dataclass
class TargetResult:
    target: Target
    contestants: list[ContestantResult] = field(default_factory=list)
    model: dict[str, Any] | None = None
    seconds: float = 0.0

    @property
    def fastest(self) -> str | None:
        ok = [c for c in self.contestants if c.quantiles is not None]
        return min(ok, key=lambda c: c.quantiles.p50).name if ok else None

    def contestant(self, name: str) -> ContestantResult | None:
        return next((c for c in self.contestants if c.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        t, e = self.target, self.target.entry
        stored = None
        if e is not None:
            stored = {"decision": e.decision, "variant": e.variant, "params": e.params, "winner": e.winner,
                      "baseline": e.baseline, "speedup": e.speedup}
        return {"op": t.op, "shape": t.shape_str, "dtype": t.dtype, "attrs": t.attrs, "key": t.key,
                "error": t.error, "stored": stored, **(self.model or {}),
                "contestants": [c.to_dict() for c in self.contestants], "fastest": self.fastest,
                "seconds": round(self.seconds, 3)}


@dataclass
class BenchReport:
    backend: str
    env: dict[str, Any]
    cache_path: str
    peaks: Peaks | None
    results: list[TargetResult]
    options: BenchOptions
    seconds: float = 0.0

    @property
    def missing(self) -> list[TargetResult]:
        return [r for r in self.results if r.target.error]

    @property
    def bad_kernels(self) -> list[TargetResult]:
        """Targets whose cached kernel failed its sha256 or the oracle check (the cache must not serve it)."""
        return [r for r in self.results
                if (c := r.contestant("forge")) is not None and c.status in ("refused", "mismatch", "error")]

    def to_dict(self) -> dict[str, Any]:
        return {"mode": "bench", "backend": self.backend,
                "timing_clock": ("device: CUDA-graph replays (cuda-events where a contestant cannot be captured)"
                                 if self.backend == "cuda" else "host (Triton interpreter)"),
                "env": self.env, "cache": self.cache_path, "peaks": self.peaks.to_dict() if self.peaks else None,
                "rounds": self.options.rounds or engine.SAMPLING[self.backend].final_rounds, "seed": self.options.seed,
                "targets": [r.to_dict() for r in self.results], "missing": len(self.missing),
                "bad_kernels": len(self.bad_kernels), "seconds": round(self.seconds, 3)}


def _contestants(target: Target, backend: str, src_dir: Path, opts: BenchOptions) -> list[ContestantResult]:
    opmod = ops.get(target.op).module
    spec, entry, attrs = target.spec, target.entry, target.spec.attrs
    out: list[ContestantResult] = []

    def generic(fn: Callable) -> tuple[Callable, Callable]:
        return (lambda inputs: fn(inputs, attrs)), (lambda bench: (lambda i: fn(bench.inputs[i], attrs)))

    # forge: the cached winner
    label = f"{entry.variant}({_fmt_params(entry.params)})" if entry.decision == "kernel" else "(eager decision)"
    c = ContestantResult("forge", label)
    if "forge" in opts.skip:
        c.status, c.reason = "skipped", "--skip forge"
    elif entry.decision != "kernel":
        c.status, c.reason = "skipped", "the cached decision is eager: no kernel beat eager by the margin"
    elif not keys.source_intact(entry):
        c.status, c.reason = "refused", ("the cached source does not match its sha256 (edited after the search): "
                                         f"not loaded; forge cache rm {entry.key[:12]}, then search again")
    else:
        try:
            module = load_module(write_source(entry.source, src_dir))
        except Exception as exc:  # noqa: BLE001 - a cached module that no longer imports
            c.status, c.reason = "error", f"the cached source does not import: {_short(exc)}"
        else:
            def run_forge(inputs, module=module):
                from forge.tuner.validate import poison

                res = opmod.alloc_output(inputs, spec)
                poison(res)
                opmod.run(module, inputs, res, attrs)
                return res

            c.call = run_forge
            c.timing = lambda bench, module=module: bench.candidate_fn(module)
    out.append(c)

    # eager: the op's reference, the search's baseline
    c = ContestantResult("eager", f"kernels/{target.op}.py reference")
    c.call = lambda inputs: opmod.reference(inputs, attrs)
    c.timing = lambda bench: bench.baseline_fn()
    out.append(c)

    # fused torch op
    fused = FUSED.get(target.op, f"no fused torch op is listed for {target.op} (forge/tuner/benchmark.py FUSED)")
    c = ContestantResult("fused", fused.label if isinstance(fused, Fused) else "-")
    if isinstance(fused, str):
        c.status, c.reason = "skipped", fused
    elif "fused" in opts.skip:
        c.status, c.reason = "skipped", "--skip fused"
    elif fused.same_as_eager:
        c.status, c.reason = "skipped", f"same as eager: the op's eager reference already is {fused.label}"
    else:
        c.call, c.timing = generic(fused.fn)
    out.append(c)

    # torch.compile of the reference
    modes = [("compile", None)]
    if opts.max_autotune:
        modes.append(("compile-max-autotune", "max-autotune-no-cudagraphs"))
    for name, mode in modes:
        c = ContestantResult(name, f"torch.compile(reference{', mode=' + repr(mode) if mode else ''})")
        if name in opts.skip:
            c.status, c.reason = "skipped", f"--skip {name}"
        elif backend == "interpreter" and _cpp_compiler() is None:
            c.status, c.reason = "skipped", ("torch.compile on the CPU needs a C++ compiler (g++, clang++ or $CXX); "
                                             "none found")
        else:
            try:
                import torch

                kwargs: dict[str, Any] = {"dynamic": False}
                if mode:
                    kwargs["mode"] = mode
                compiled = torch.compile(_fresh_function(opmod.reference, name.replace("-", "_")), **kwargs)
            except Exception as exc:  # noqa: BLE001 - e.g. an unsupported Python for dynamo
                c.status, c.reason = "skipped", f"torch.compile is unavailable: {_short(exc)}"
            else:
                c.call, c.timing = generic(compiled)
        out.append(c)

    # Liger-Kernel
    c = ContestantResult("liger", "-")
    if "liger" in opts.skip:
        c.status, c.reason = "skipped", "--skip liger"
    else:
        try:
            c.label, fn = _liger(target.op)
        except _Unavailable as exc:
            c.status, c.reason = "skipped", str(exc)
        else:
            c.call, c.timing = generic(fn)
    out.append(c)
    return out


def _validate(contestants: list[ContestantResult], opmod, spec: KernelSpec, seed: int, sync: Callable) -> None:
    """Run each pending contestant once on fresh inputs (a private clone each, so one that writes into
    its inputs cannot affect the next) and compare with the float64 oracle."""
    import torch

    from forge.tuner.validate import compare

    inputs = opmod.make_inputs(spec, seed + BENCH_VALIDATION_SEED, "normal")
    with torch.no_grad():
        ref = opmod.oracle(inputs, spec.attrs)
    tol = opmod.tolerance(spec.dtype)
    for c in contestants:
        if c.status != "pending":
            continue
        try:
            res = c.call(tuple(t.clone() for t in inputs))
            sync()
        except Exception as exc:  # noqa: BLE001 - a contestant may raise anything (compile errors too)
            c.status, c.reason = "error", _short(exc)
            continue
        reason = compare(res, ref, tol)
        if reason is not None:
            c.status, c.reason = "mismatch", f"does not match the float64 oracle, not timed: {reason}"


def _event_sampler(bench, fn: Callable[[int], None]) -> Callable[[], float]:
    """µs per call from CUDA events around K back-to-back launches (K sized like the graph replays)."""
    from forge.tuner import timing

    torch = bench.torch
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for k in range(10):
        fn(k % bench.n_sets)
    end.record()
    torch.cuda.synchronize()
    per_call_us = max(start.elapsed_time(end) * 1000.0 / 10, 0.5)
    k_launches = int(min(timing.MAX_LAUNCHES_PER_GRAPH, max(1, round(timing.TARGET_REPLAY_US / per_call_us))))
    counter = [0]

    def sample() -> float:
        start.record()
        for _ in range(k_launches):
            fn(counter[0] % bench.n_sets)
            counter[0] += 1
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1000.0 / k_launches

    sample.launches = k_launches
    return sample


def _time(contestants: list[ContestantResult], opmod, spec: KernelSpec, backend: str, opts: BenchOptions,
          sampling: engine.Sampling) -> None:
    from forge.tuner.timing import Bench
    from forge.tuner.validate import CandidateRaised

    cuda = backend == "cuda"
    samplers: dict[str, tuple[Callable[[], float], Any]] = {}
    for c in contestants:
        if c.status != "pending":
            continue
        bench = Bench(opmod, spec, backend, opts.seed)  # private rotating input sets
        fn = c.timing(bench)
        try:
            sampler = bench.prepare(fn)
            c.clock = "cuda-graph" if cuda else "host"
        except CandidateRaised as exc:
            if not (cuda and str(exc).startswith("CUDA-graph timing failed")):
                c.status, c.reason = "error", f"failed while being prepared for timing: {_short(exc.__cause__ or exc)}"
                continue
            try:
                bench.torch.cuda.synchronize()
                sampler = _event_sampler(bench, fn)
            except Exception as exc2:  # noqa: BLE001
                c.status, c.reason = "error", f"cannot be timed: {_short(exc2)}"
                continue
            c.clock = "cuda-events"
            c.note = (f"not capturable in a CUDA graph ({_short(exc.__cause__ or exc, 160)}): timed with CUDA events "
                      "around back-to-back launches, host launch cost included when it exceeds the kernel's")
        samplers[c.name] = (sampler, bench)
    by_name = {c.name: c for c in contestants}
    samples: dict[str, list[float]] = {name: [] for name in samplers}

    def one_round(keep: bool) -> None:
        for name in list(samplers):
            try:
                value = samplers[name][0]()
            except Exception as exc:  # noqa: BLE001 - a replay that fails part-way
                by_name[name].status, by_name[name].reason = "error", f"failed while being timed: {_short(exc)}"
                del samplers[name]
                continue
            if keep:
                samples[name].append(value)

    if sampling.settle_ms and samplers:  # bring the GPU to its steady clock with every contestant running
        end = time.perf_counter() + sampling.settle_ms / 1000
        while samplers and time.perf_counter() < end:
            one_round(keep=False)
    for _ in range(opts.rounds or sampling.final_rounds):
        one_round(keep=True)
    for name in samplers:
        by_name[name].status = "ok"
        by_name[name].quantiles = stats.Quantiles.of(samples[name])


def bench_target(target: Target, backend: str, cache: Cache, peaks: Peaks, opts: BenchOptions,
                 emit: Events) -> TargetResult:
    import torch

    t0 = time.monotonic()
    opmod = ops.get(target.op).module
    spec = target.spec
    res = TargetResult(target)
    res.model = roofline_model(opmod, spec, peaks)
    res.contestants = _contestants(target, backend, Path(cache.path).parent / "kernels-src", opts)
    sync = torch.cuda.synchronize if backend == "cuda" else (lambda: None)
    emit("validating", target=target, contestants=[c.name for c in res.contestants if c.status == "pending"])
    _validate(res.contestants, opmod, spec, opts.seed, sync)
    emit("timing", target=target, contestants=[c.name for c in res.contestants if c.status == "pending"])
    _time(res.contestants, opmod, spec, backend, opts, engine.SAMPLING[backend])
    eager = res.contestant("eager")
    for c in res.contestants:
        if c.quantiles is None:
            continue
        c.speedup = stats.speedup(c.quantiles, eager.quantiles if eager else None)
        c.roofline = roofline_pct(res.model, c.quantiles.p50, peaks, spec.dtype)
    if backend == "cuda":
        torch.cuda.empty_cache()
    res.seconds = time.monotonic() - t0
    return res


def run_bench(targets: list[Target], *, backend: str, cache: Cache, options: BenchOptions | None = None,
              events: Events | None = None) -> BenchReport:
    """Bench every target that has a cached decision (the others are reported with their error)."""
    opts = options or BenchOptions()
    emit = events or (lambda *a, **k: None)
    prepare_backend(backend)
    t0 = time.monotonic()
    env = collect_env(backend)
    results: list[TargetResult] = []
    peaks = None
    with device_lock(engine.device_id(env), on_wait=lambda p: emit("waiting-for-lock", path=str(p))):
        if any(t.entry is not None for t in targets) or (not targets and opts.remeasure_peaks):
            peaks = device_peaks(backend, Path(cache.path).parent, opts.remeasure_peaks, emit)
        for n, t in enumerate(targets):
            emit("target", index=n, total=len(targets), target=t)
            if t.entry is None:
                results.append(TargetResult(t))
                continue
            results.append(bench_target(t, backend, cache, peaks, opts, emit))
    return BenchReport(backend=backend, env=env, cache_path=str(cache.path), peaks=peaks, results=results,
                       options=opts, seconds=time.monotonic() - t0)


# --- recheck ----------------------------------------------------------------------------------------
INVALID_STATUSES = ("invalid", "sha256-mismatch")


@dataclass
class RecheckResult:
    target: Target
    status: str = "pending"  # ok | drifted | invalid | sha256-mismatch | skipped | missing
    reason: str | None = None
    new_kernel: stats.Quantiles | None = None
    new_baseline: stats.Quantiles | None = None

    @property
    def stored_speedup(self) -> float | None:
        e = self.target.entry
        return e.speedup if e is not None else None

    @property
    def new_speedup(self) -> float | None:
        return stats.speedup(self.new_kernel, self.new_baseline)

    @property
    def ratio(self) -> float | None:
        old, new = self.stored_speedup, self.new_speedup
        return new / old if old and new else None

    def to_dict(self) -> dict[str, Any]:
        t, e = self.target, self.target.entry
        return {"key": t.key, "op": t.op, "shape": t.shape_str, "dtype": t.dtype, "attrs": t.attrs,
                "status": self.status, "reason": self.reason,
                "variant": e.variant if e else None, "params": e.params if e else None,
                "stored": {"winner": e.winner if e else None, "baseline": e.baseline if e else None,
                           "speedup": self.stored_speedup},
                "new": {"winner": self.new_kernel.to_dict() if self.new_kernel else None,
                        "baseline": self.new_baseline.to_dict() if self.new_baseline else None,
                        "speedup": self.new_speedup},
                "ratio": self.ratio}


@dataclass
class RecheckReport:
    backend: str
    cache_path: str
    results: list[RecheckResult]
    options: BenchOptions
    seconds: float = 0.0

    def count(self, *statuses: str) -> int:
        return sum(r.status in statuses for r in self.results)

    def to_dict(self) -> dict[str, Any]:
        return {"mode": "recheck", "backend": self.backend, "cache": self.cache_path,
                "timing_clock": "device: CUDA-graph replays" if self.backend == "cuda" else "host (Triton interpreter)",
                "drift_floor": self.options.drift_floor, "seed": self.options.seed + RECHECK_SEED_OFFSET,
                "rounds": self.options.rounds or engine.SAMPLING[self.backend].final_rounds,
                "entries": [r.to_dict() for r in self.results],
                "invalid": self.count(*INVALID_STATUSES), "drifted": self.count("drifted"),
                "missing": self.count("missing"), "seconds": round(self.seconds, 3)}


def _env_mismatch(entry: Entry, here: keys.Located) -> str | None:
    """Why forge would not serve `entry` here (None if it would)."""
    if entry.env.get("backend") != here.env["backend"]:
        return f"made for backend {entry.env.get('backend')!r}; this run is {here.env['backend']!r}"
    if here.key == entry.key:
        return None
    diff = keys.env_diff(entry.env, here.env)
    return f"made for another environment ({', '.join(diff) or 'spec'} differ): forge does not serve it here"


def _recheck_one(r: RecheckResult, backend: str, pools: engine.Pools, src_dir: Path,
                 opts: BenchOptions, emit: Events) -> None:
    t, e = r.target, r.target.entry
    if e.decision != "kernel":
        r.status, r.reason = "skipped", "the cached decision is eager: no kernel to recheck"
        return
    if e.op not in ops.available():
        r.status, r.reason = "skipped", f"op {e.op!r} is not known to this forge"
        return
    why = _env_mismatch(e, keys.locate(ops.get(e.op), t.spec, backend))
    if why is not None:
        r.status, r.reason = "skipped", why
        return
    if not keys.source_intact(e):
        r.status, r.reason = "sha256-mismatch", ("the cached source does not match its sha256 (edited after the "
                                                 f"search): refused, not loaded; forge cache rm {e.key[:12]}, then "
                                                 "search again")
        return
    path = str(write_source(e.source, src_dir))
    sampling = engine.SAMPLING[backend]
    setup = {"cmd": "setup", "op": e.op, "spec": e.spec, "seed": opts.seed + RECHECK_SEED_OFFSET}
    pool = pools.get(backend, 1, setup)
    emit("recheck-validate", target=t)
    reply = pool.call({"cmd": "validate", "path": path}, opts.timeout)
    if reply.get("status") != "ok":
        r.status, r.reason = "invalid", f"validation now fails ({reply.get('status')}): {reply.get('reason')}"
        return
    emit("recheck-time", target=t)
    rounds = opts.rounds or sampling.final_rounds
    reply = pool.call({"cmd": "time", "paths": [path], "baseline": True, "rounds": rounds, "reps": 1,
                       "settle_ms": sampling.settle_ms}, opts.timeout * 2)
    if reply.get("status") != "ok":
        r.status, r.reason = "invalid", f"validates but fails while being timed ({reply.get('status')}): " \
                                        f"{reply.get('reason')}"
        return
    r.new_kernel = stats.Quantiles.of(reply["samples"][path])
    r.new_baseline = stats.Quantiles.of(reply["samples"]["eager"])
    if not e.winner or not e.baseline:
        r.status, r.reason = "ok", "no stored quantiles to compare with"
        return
    stored_k, stored_b = stats.Quantiles.from_dict(e.winner), stats.Quantiles.from_dict(e.baseline)
    if stats.drifted(stored_k, stored_b, r.new_kernel, r.new_baseline, opts.drift_floor):
        lo, hi = stats.speedup_interval(stored_k, stored_b)
        r.status = "drifted"
        r.reason = (f"speedup now {r.new_speedup:.3g}x vs {r.stored_speedup:.3g}x stored (stored p20-p80 range "
                    f"{lo:.3g}-{hi:.3g}x; drift floor {opts.drift_floor:.0%}); re-search with --force")
    else:
        r.status = "ok"


def run_recheck(targets: Iterable[Target], *, backend: str, cache: Cache, options: BenchOptions | None = None,
                events: Events | None = None) -> RecheckReport:
    opts = options or BenchOptions()
    emit = events or (lambda *a, **k: None)
    prepare_backend(backend)
    t0 = time.monotonic()
    env = collect_env(backend)
    results = [RecheckResult(t) for t in targets]
    for r in results:
        if r.target.entry is None:
            r.status, r.reason = "missing", r.target.error
    src_dir = Path(cache.path).parent / "kernels-src"
    todo = [r for r in results if r.status == "pending"]
    if todo:
        with device_lock(engine.device_id(env), on_wait=lambda p: emit("waiting-for-lock", path=str(p))), \
                engine.Pools() as pools:
            for n, r in enumerate(todo):
                emit("target", index=n, total=len(todo), target=r.target)
                _recheck_one(r, backend, pools, src_dir, opts, emit)
    return RecheckReport(backend=backend, cache_path=str(cache.path), results=results, options=opts,
                         seconds=time.monotonic() - t0)

