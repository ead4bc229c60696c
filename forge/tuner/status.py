"""The one status type: what became of a candidate (worker, pool, engine), a bench contestant, or a
rechecked cache entry. A StrEnum, so a status compares equal to its string and serialises as it (JSON
reports, cache rows and worker replies keep their spelling); the CLI styles them (forge_cli/render.py).
"""

from __future__ import annotations

from enum import StrEnum


class Status(StrEnum):
    PENDING = "pending"  # not yet run
    OK = "ok"
    # a candidate that failed (the search records it with its reason and goes on)
    MISMATCH = "mismatch"  # wrong values against the float64 oracle
    COMPILE_ERROR = "compile-error"
    ERROR = "error"  # raised while running
    TIMEOUT = "timeout"  # no answer in time; its worker was killed
    CRASHED = "crashed"  # its worker died (segfault, exit)
    CUDA_ERROR = "cuda-error"  # left the CUDA context unusable; its worker was replaced
    OOM = "oom"  # ran out of (device or host) memory; its worker was replaced
    # forge bench contestants and --recheck entries
    REFUSED = "refused"  # not loaded: its source fails the integrity check
    SKIPPED = "skipped"  # not run, with the reason (--skip, an eager decision, another environment)
    INVALID = "invalid"  # a cached kernel that no longer validates
    SHA256_MISMATCH = "sha256-mismatch"  # a cached source edited after the search
    DRIFTED = "drifted"  # its speedup moved outside the stored range
    MISSING = "missing"  # nothing cached for the target


# What a candidate can fail with: each is recorded with its reason, the search goes on.
CANDIDATE_FAILURES = frozenset({Status.MISMATCH, Status.COMPILE_ERROR, Status.ERROR, Status.TIMEOUT,
                                Status.CRASHED, Status.CUDA_ERROR, Status.OOM})
# A cached kernel that must not be trusted any more (forge bench --recheck exits 5).
RECHECK_INVALID = frozenset({Status.INVALID, Status.SHA256_MISMATCH})
