"""forge's logging: the logger "forge" (and "forge.<module>"), silent unless FORGE_LOG names a level.

    FORGE_LOG=info     each decision: op, shape, dtype, key, decision, winner and its parameters, p50 against
                       eager's, search time, candidates tried (forge/tuner/engine.py)
    FORGE_LOG=debug    also every candidate's outcome and every cache hit
    FORGE_SEARCH_LOG=FILE.csv   one row per candidate of every search, appended (as Helion's
                       HELION_AUTOTUNE_LOG): time, key, op, shape, dtype, variant, params, status, p50_us, reason

An application that configures logging itself can leave FORGE_LOG unset and attach its own handlers to
the "forge" logger. Runtime layer: stdlib only, so `import forge` stays light.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import sys
import time
from typing import Any

logger = logging.getLogger("forge")
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
CSV_FIELDS = ("time", "key", "op", "shape", "dtype", "variant", "params", "status", "p50_us", "reason")
_HANDLER_MARK = "_forge_log_handler"


def configure(env: dict[str, str] | None = None) -> None:
    """Attach one stderr handler at the level FORGE_LOG names (idempotent); an unknown level is one warning."""
    env = os.environ if env is None else env
    name = (env.get("FORGE_LOG") or "").strip().lower()
    if not name:
        return
    level = LEVELS.get(name)
    if level is None:
        print(f"forge: warning: FORGE_LOG={name!r} is not one of {', '.join(LEVELS)}; logging stays off",
              file=sys.stderr)
        return
    logger.setLevel(level)
    if not any(getattr(h, _HANDLER_MARK, False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("forge %(levelname)s %(name)s: %(message)s"))
        setattr(handler, _HANDLER_MARK, True)
        logger.addHandler(handler)


def candidates_csv(path: str, key: str, op: str, shape: str, dtype: str, candidates: list[dict[str, Any]]) -> None:
    """Append one row per candidate to FORGE_SEARCH_LOG's CSV (a header when the file is new). A file that
    cannot be written is one warning on the logger, never a failed search."""
    now = time.strftime("%Y-%m-%dT%H:%M:%S")
    try:
        new = not os.path.exists(path) or os.path.getsize(path) == 0
        with open(path, "a", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=CSV_FIELDS)
            if new:
                w.writeheader()
            for c in candidates:
                w.writerow({"time": now, "key": key, "op": op, "shape": shape, "dtype": dtype,
                            "variant": c.get("variant"), "params": json.dumps(c.get("params"), sort_keys=True),
                            "status": c.get("status"), "p50_us": c.get("p50_us"), "reason": c.get("reason")})
    except OSError as exc:
        logger.warning("FORGE_SEARCH_LOG=%s: cannot append (%s)", path, exc)
