"""One lock per timing device, so two forge processes on one machine (e.g. `make -j`) never
validate or time on the same GPU at the same time. An OS file lock (flock): released by the kernel
when the holder dies, so a crashed forge never leaves a stale lock behind."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from forge.errors import UsageError


def lock_dir() -> Path:
    # Machine-wide (not per cache): two forge runs with different caches still share the GPU.
    return Path(os.environ.get("FORGE_LOCK_DIR") or Path(tempfile.gettempdir()) / "forge-locks")


@contextlib.contextmanager
def device_lock(device_id: str, on_wait=None) -> Iterator[Path]:
    """Hold the lock for `device_id` (e.g. 'cuda-GPU-<uuid>' or 'interpreter'). Calls on_wait(path)
    once if another process holds it, then blocks until it is free."""
    d = lock_dir()
    path = d / (re.sub(r"[^A-Za-z0-9_.-]", "_", device_id) + ".lock")
    try:
        d.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as exc:
        where = "FORGE_LOCK_DIR" if os.environ.get("FORGE_LOCK_DIR") else "the default lock directory"
        raise UsageError(f"cannot use {d} for forge's device locks ({where}): {exc.strerror or exc}; "
                         "set FORGE_LOCK_DIR to a writable directory") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait(path)
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {time.time():.0f}\n".encode())
        yield path
    finally:
        os.close(fd)  # closing the descriptor releases the flock
