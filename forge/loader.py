"""Load a rendered kernel module from its source file.

Triton's @jit reads the kernel's source through `inspect`, so a rendered kernel must live in a real
file; the file is content-addressed (its name is the source's sha256), so two processes writing the
same kernel write the same bytes.
"""

from __future__ import annotations

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
    """Write `source` to DIRECTORY/forge_<sha[:20]>.py atomically (rename), return the path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"forge_{source_sha256(source)[:20]}.py"
    if path.exists() and path.read_text() == source:
        return path
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(source)
    os.replace(tmp, path)
    return path


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
