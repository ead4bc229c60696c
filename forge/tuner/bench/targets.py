"""What `forge bench` and `--recheck` run on: one (op, shape, dtype, attrs) and its cache entry."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from forge import key as keys
from forge.cache import Cache, Entry
from forge.spec import KernelSpec


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

