"""Recording cache misses for offline tuning (the forge backend's miss="record", as PyTorch TunableOp's
record-untuned mode): each (op, shape, dtype, attrs) a model needed and the cache did not hold is added
to a manifest that `forge search --manifest` reads (docs/manifest.md's format: [defaults] device, one
[[op]] per (op, dtype, attrs) with every shape). Several processes may record into one file: each
update holds an exclusive lock and replaces the file atomically, so nothing recorded is lost."""

from __future__ import annotations

import contextlib
import fcntl
import os
import tomllib
from pathlib import Path
from typing import Any

from forge.loader import atomic_write


def _entry_id(e: dict[str, Any]) -> tuple:
    attrs = {k: v for k, v in e.items() if k not in ("op", "dtype", "shapes", "shape", "share")}
    return e.get("op"), e.get("dtype"), tuple(sorted((k, repr(v)) for k, v in attrs.items()))


@contextlib.contextmanager
def _locked(path: Path):
    with open(path.with_name(path.name + ".lock"), "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def record(path: str | os.PathLike, op: str, shape: tuple, dtype: str, device: str, attrs: dict[str, Any]) -> str:
    """Add one miss to the manifest at `path`; returns what happened, in words ("recorded", "already
    recorded", or "not recorded: why" — never raises for a file it cannot write: the model runs on)."""
    import tomli_w

    path = Path(path)
    shape_s = "x".join(map(str, shape))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _locked(path):
            doc: dict[str, Any] = {}
            if path.exists():
                doc = tomllib.loads(path.read_text(encoding="utf-8"))
            defaults = doc.setdefault("defaults", {})
            if defaults.setdefault("device", device) != device:
                return f"not recorded: {path} holds {defaults['device']} entries, this miss is on {device}"
            entries = doc.setdefault("op", [])
            new = {"op": op, "dtype": dtype, **attrs}
            for e in entries:
                if _entry_id(e) == _entry_id(new):
                    shapes = e.setdefault("shapes", [e.pop("shape")] if "shape" in e else [])
                    if shape_s in shapes:
                        return "already recorded"
                    shapes.append(shape_s)
                    break
            else:
                entries.append({"op": op, "shapes": [shape_s], "dtype": dtype, **attrs})
            atomic_write(path, tomli_w.dumps(doc))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        return f"not recorded: {path}: {exc}"
    return "recorded"
