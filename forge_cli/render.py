"""What every forge command renders with: the two consoles, errors and their exit codes, number formats,
the status styles, and the cache-entry row of `forge cache ls` / `prune`.

One output path: Rich for people (tables on stdout, progress and diagnostics on stderr), `--json` for
scripts (one JSON document on stdout, nothing else there).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from forge import key as keys
from forge.cache import AmbiguousKey, Cache, CacheError, Entry, KeyNotFound, default_cache_path
from forge.errors import ExitCode
from forge.tuner.status import Status
from forge_cli.jsonout import Failed

# Piped output (CI logs, `| less`) gets a wide fixed width instead of Rich's 80-column default,
# which folds the candidate table into unreadable cells.
out = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
# Diagnostics are never hard-wrapped (soft_wrap): a recovery command in a message must stay on one line
# to be copied.
err = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else 160, soft_wrap=True)


# -- errors -------------------------------------------------------------------------------------------------
def fail(exc: Exception, code: int) -> Failed:
    """Print `exc` as an error on stderr; the caller raises the returned Exit (exit status `code`), which
    carries the message into the error object of --json (forge_cli/jsonout.py)."""
    err.print(f"[bold red]error:[/] {escape(str(exc))}")  # messages hold [[op]], forge-kernel[ray] ...
    return Failed(code, str(exc))


def cache_exit_code(exc: CacheError) -> int:
    """A key the user mistyped is a usage error; anything else about the DB is a cache error."""
    return ExitCode.USAGE if isinstance(exc, KeyNotFound | AmbiguousKey) else ExitCode.CACHE


def open_cache(path: Path | None) -> Cache:
    """The --cache DB (or the default one); one that cannot be opened is exit 5."""
    try:
        return Cache(path or default_cache_path())
    except CacheError as exc:
        raise fail(exc, ExitCode.CACHE) from None


def lock_wait(kind: str, data: dict[str, Any]) -> None:
    """The engine's notices, printed on stderr whatever the progress display: waiting for another
    process's device lock, and a worker count capped to what the machine has."""
    if kind == "waiting-for-lock":
        err.print(f"waiting for another forge process to release {data['path']} ...")
    elif kind == "workers-capped":
        err.print(escape(data["message"]))


# -- formats ------------------------------------------------------------------------------------------------
def fmt_us(x: float | None) -> str:
    return "-" if x is None else f"{x:,.2f}"


def fmt_speedup(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def fmt_speedup_small(x: float | None) -> str:
    """Speedups with small ones to 2 significant digits: interpreter speedups are often 0.00x at two decimals."""
    return "-" if x is None else f"{x:.2f}x" if x >= 0.1 else f"{x:.2g}x"


def fmt_pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}%"


def fmt_params(params: dict | None) -> str:
    return ", ".join(f"{k}={v}" for k, v in (params or {}).items())


def age(created: float) -> str:
    """How long ago `created` (a Unix time) was: 3d, 5h, 12m, 40s."""
    s = max(0.0, time.time() - created)
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= n:
            return f"{s / n:.0f}{unit}"
    return f"{s:.0f}s"


# -- statuses -----------------------------------------------------------------------------------------------
# The one style table for every status a command shows (search candidates, bench contestants, rechecked
# entries). Status is a StrEnum: a plain status string finds its style too.
STATUS_STYLE: dict[Status, str] = {
    Status.PENDING: "dim",
    Status.OK: "green",
    Status.MISMATCH: "red",
    Status.COMPILE_ERROR: "red",
    Status.ERROR: "red",
    Status.TIMEOUT: "yellow",
    Status.CRASHED: "magenta",
    Status.CUDA_ERROR: "magenta",
    Status.REFUSED: "red",
    Status.SKIPPED: "dim",
    Status.INVALID: "red",
    Status.SHA256_MISMATCH: "red",
    Status.DRIFTED: "yellow",
    Status.MISSING: "red",
}


def status_style(status: str) -> str:
    return STATUS_STYLE.get(status, "red")


def status_cell(status: str, reason: str | None = None, *, note: str = "", limit: int | None = None) -> str:
    """`status` in its style, then `note` (e.g. " (cuda-events)") and the reason, escaped (cut to `limit`)."""
    text = f"[{status_style(status)}]{status}{note}[/]"
    if reason:
        if limit is not None and len(reason) > limit:
            reason = reason[: limit - 3] + "..."
        text += f" {escape(reason)}"
    return text


# -- cache entries ------------------------------------------------------------------------------------------
def entry_row(e: Entry) -> dict[str, Any]:
    """One cache entry as a flat row: the --json rows of `forge cache ls` (and `prune`) and their tables."""
    x = e.spec["inputs"][0]
    return {"key": e.key, "op": e.op, "shape": "x".join(map(str, x["shape"])), "dtype": x["dtype"],
            "backend": e.env.get("backend"), "device": e.env.get("gpu") or e.env.get("cpu"),
            "decision": e.decision, "variant": e.variant, "params": e.params, "speedup": e.speedup,
            "p50_us": (e.winner or {}).get("p50"), "eager_p50_us": (e.baseline or {}).get("p50"),
            "created_at": e.created_at, "imported": keys.is_imported(e)}
