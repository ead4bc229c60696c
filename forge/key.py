"""The one key path: which cache entry serves a request, and whether a stored entry may be served.

Every caller (`forge search`, `bench`, `bench --recheck`, `export`, `trace`, bundles, the shim and
`forge.load`) goes through here, so they all find exactly the entry `search` stored:

    (op name, shape, dtype, attrs)     --build_spec-->  (op family, KernelSpec)
    (op, spec, backend, device index)  --locate----->   Located(op, spec, env, key)
    a stored entry                     --integrity_problem / env_diff-->  may it be served here?

The key is sha256 over the canonical JSON of the spec and the environment: the machine's fingerprint
(forge/env.py: backend, GPU, driver, CUDA, torch, triton, forge) plus the op's template hash (its op
file and templates). Any change of these is a new key, so an entry is never served where it was not made.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from forge import ops
from forge.env import collect_env
from forge.errors import UsageError
from forge.loader import source_sha256
from forge.spec import DTYPES, KernelSpec, canonical_json


def cache_key(spec: KernelSpec, env: dict[str, Any]) -> str:
    """sha256(spec, env). The environment's key order does not matter (canonical JSON)."""
    return hashlib.sha256(canonical_json({"spec": spec.to_dict(), "env": env}).encode()).hexdigest()


def environment(op: ops.OpFamily, backend: str, device_index: int | None = None) -> dict[str, Any]:
    """The environment an entry for `op` made here is keyed by: this machine's fingerprint for
    `backend` (the GPU at `device_index`, default 0) and the op's template hash."""
    index = device_index if backend == "cuda" and device_index is not None else 0
    return {**collect_env(backend, index), "templates": op.template_hash}


@dataclass(frozen=True)
class Located:
    op: ops.OpFamily
    spec: KernelSpec
    env: dict[str, Any]
    key: str


def locate(op: ops.OpFamily, spec: KernelSpec, backend: str, device_index: int | None = None) -> Located:
    env = environment(op, backend, device_index)
    return Located(op, spec, env, cache_key(spec, env))


def spec_device(backend: str) -> str:
    """The device type a spec names for a backend (the interpreter runs on CPU tensors)."""
    return "cuda" if backend == "cuda" else "cpu"


def build_spec(op_name: str, shape: tuple[int, ...], dtype: str, backend: str,
               attrs: dict[str, Any] | None = None) -> tuple[ops.OpFamily, KernelSpec]:
    """The spec the op family builds for a request; UsageError (naming the op) if it cannot."""
    op = ops.get(op_name)
    if dtype not in DTYPES:
        raise UsageError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
    try:
        spec = op.module.make_spec(tuple(shape), dtype, spec_device(backend), attrs)
    except ValueError as exc:
        raise UsageError(f"{op_name}: {exc}") from None
    return op, spec


def request(op_name: str, shape: tuple[int, ...], dtype: str, backend: str,
            attrs: dict[str, Any] | None = None, device_index: int | None = None) -> Located:
    """build_spec + locate: the entry a search with these arguments stores, or finds, on this machine."""
    op, spec = build_spec(op_name, shape, dtype, backend, attrs)
    return locate(op, spec, backend, device_index)


# -- stored entries ---------------------------------------------------------------------------------

def source_intact(entry) -> bool:
    """The entry's kernel source is present and is the source its sha256 was taken of."""
    return entry.source is not None and source_sha256(entry.source) == entry.source_sha256


def env_diff(stored: dict[str, Any], here: dict[str, Any]) -> list[str]:
    """The environment fields in which an entry's environment differs from this machine's."""
    return sorted(k for k in set(stored) | set(here) if stored.get(k) != here.get(k))
