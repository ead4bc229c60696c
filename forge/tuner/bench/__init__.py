"""`forge bench` (engine side): re-time cached winners against the other ways to run the op, with the
roofline against the device's measured peaks; and `--recheck`, which re-validates and re-times cached
winners and flags the ones that drifted.

Bench, for each target (op, shape, dtype, attrs) that has a cached decision, in this process:

  forge      the cached winner's source, launched exactly as the search timed it; checked first (sha256, then
             forge/key.py verify_entry: params in the op's space, source re-rendered from the installed
             templates), "refused" and never imported when it fails
  eager      the op's reference (kernels/<op>.py: what a user writes; the search's baseline)
  fused      the single fused torch op (FUSED below), where it differs from eager; else "same as eager"
  compile    torch.compile(reference, dynamic=False); `compile-max-autotune` with --max-autotune
             (mode max-autotune-no-cudagraphs: forge captures its own CUDA graphs around it)
  liger      Liger-Kernel's functional equivalent (LIGER below), when liger_kernel is importable

Every contestant is first run on fresh inputs and compared with the float64 oracle (validate.compare,
the op's tolerance); one that mismatches or raises is recorded and not timed (a cached forge kernel that
mismatches: exit 5), except eager: the user's code as written (a bf16 formula rounding at every step, a
residual add that cancels) may be less exact than forge must be and is still the baseline every speedup
is against, so it is timed and reported with status "mismatch" and its numbers. The others are timed
interleaved (A B C A B C ...) with the search's final sampling (engine.SAMPLING): CUDA-graph replays of
back-to-back launches over rotating input sets larger than 3x the L2 (timing.Bench), each contestant
with private input sets (a contestant may write into its inputs, and no one reads another's data from
L2). A contestant whose launches cannot be captured in a CUDA graph is timed with CUDA events around
the same number of back-to-back launches instead, labelled `cuda-events` (that includes host launch
cost when the launch takes longer than the kernel). On the interpreter every clock is the host's.

Peaks (copy bandwidth, dense matmul rate per dtype) are measured once per device and cached as JSON next
to the cache DB; % of roofline = achieved / min(peak FLOP/s, intensity x copy bandwidth).

Recheck refuses (invalid, never imported) an entry that fails verify_entry, then goes through the search's
worker pool: check_candidate in a worker (a crash or hang is recorded against the entry) and the worker's
interleaved timing against eager, as the search's finals did.

The modules; each imports only modules above it in this list (no cycles):

  _common      tiny helpers (_short, _fmt_params, the Events callback type)
  contestants  the reference contestants: FUSED, LIGER, the torch.compile helpers
  peaks        the device's measured peaks, cached in peaks.json
  roofline     GEMM_OPS, roofline_model, roofline_pct
  targets      Target, resolve_target, target_of_entry, prepare_backend
  run          the bench: BenchOptions, the result types, run_bench
  recheck      --recheck: RecheckResult, RecheckReport, run_recheck
"""

from __future__ import annotations

from forge.tuner.bench._common import Events
from forge.tuner.bench.contestants import CONTESTANTS, FUSED, LIGER, Fused
from forge.tuner.bench.peaks import MATMUL_DTYPES, PEAKS_FILE, PEAKS_VERSION, Peaks, device_peaks, peaks_key
from forge.tuner.bench.recheck import RECHECK_SEED_OFFSET, RecheckReport, RecheckResult, run_recheck
from forge.tuner.bench.roofline import GEMM_OPS, roofline_model, roofline_pct
from forge.tuner.bench.run import (
    BENCH_VALIDATION_SEED,
    BenchOptions,
    BenchReport,
    ContestantResult,
    TargetResult,
    bench_target,
    run_bench,
)
from forge.tuner.bench.targets import Target, prepare_backend, resolve_target, target_of_entry

__all__ = [
    "BENCH_VALIDATION_SEED", "CONTESTANTS", "FUSED", "GEMM_OPS", "LIGER", "MATMUL_DTYPES",
    "PEAKS_FILE", "PEAKS_VERSION", "RECHECK_SEED_OFFSET", "BenchOptions", "BenchReport", "ContestantResult",
    "Events", "Fused", "Peaks", "RecheckReport", "RecheckResult", "Target", "TargetResult", "bench_target",
    "device_peaks", "peaks_key", "prepare_backend", "resolve_target", "roofline_model", "roofline_pct",
    "run_bench", "run_recheck", "target_of_entry",
]
