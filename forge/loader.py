"""Load a rendered kernel module from its source file.

Triton's @jit reads the kernel's source through `inspect`, so a rendered kernel must live in a real
file; the file is content-addressed (its name is the source's sha256), so two processes writing the
same kernel write the same bytes.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib.util
import os
import sys
import tempfile
from pathlib import Path
from types import ModuleType


def source_sha256(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()


def write_source(source: str, directory: str | os.PathLike) -> Path:
    """Write `source` to DIRECTORY/forge_<sha[:20]>.py atomically (rename), return the path.

    A directory that cannot be written (a cache on a read-only mount) falls back to a per-user
    directory under the system temp dir: the file name is the content's hash, so any copy will do.
    A full disk is a CacheError (exit 5) saying so, with no partial file left behind."""
    path = Path(directory) / f"forge_{source_sha256(source)[:20]}.py"
    try:
        if path.is_file() and path.read_text() == source:
            return path
    except OSError:
        pass
    try:
        return _write_atomically(source, Path(directory), path.name)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise _disk_full(directory, exc) from None
        if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EEXIST):
            raise
    fallback = Path(tempfile.gettempdir()) / f"forge-kernels-src-{os.getuid()}"
    try:
        return _write_atomically(source, fallback, path.name)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise _disk_full(fallback, exc) from None
        raise


def _write_atomically(source: str, directory: Path, name: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    if path.is_file() and path.read_text() == source:
        return path
    atomic_write(path, source)
    return path


def atomic_write(path: Path, text: str) -> None:
    """Replace `path` with `text` in one step (a reader sees the old file or the new one; nothing partial
    is left behind). The one writer of files that others read while they change: kernel sources, export
    modules and repositories, recorded-miss manifests."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _disk_full(directory, exc: OSError):
    from forge.cache import CacheError

    return CacheError(f"cannot write a kernel source to {directory}: the disk is full ({exc.strerror}); "
                      "free some space")


def load_module(path: str | os.PathLike) -> ModuleType:
    """Import a rendered kernel module by path (re-uses an already imported one)."""
    path = Path(path)
    name = f"forge_rendered.{path.stem}"
    mod = sys.modules.get(name)
    if mod is not None:
        return mod
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load kernel module from {path}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[name]
        raise
    return mod
