"""The one key path: which cache entry serves a request, and whether a stored entry may be served.

Every caller (`forge search`, `bench`, `bench --recheck`, `export`, `trace`, bundles, the shim and
`forge.load`) goes through here, so they all find exactly the entry `search` stored:

    (op name, shape, dtype, attrs)     --build_spec-->  (op family, KernelSpec)
    (op, spec, backend, device index)  --locate----->   Located(op, spec, env, key)
    a stored entry                     --verify_entry / env_diff-->  may it be loaded, and served here?

The key is sha256 over the canonical JSON of the spec and the environment: the machine's fingerprint
(forge/env.py: backend, GPU, driver, CUDA, torch, triton, forge) plus the op's template hash (its op
file and templates). Any change of these is a new key, so an entry is never served where it was not made.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

from forge import ops
from forge.env import collect_env
from forge.errors import UsageError, cut
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


_ATTR_SHOWN = 60  # characters of a refused attribute value quoted back


def check_attrs(attrs: dict[str, Any]) -> None:
    """Attributes are plain scalars (bool, int, finite float, str, None): they go into the key as JSON,
    which has no NaN or infinity, and a kernel takes them as scalar arguments. ValueError names the
    first one that is not."""
    for name, value in attrs.items():
        ok = value is None or isinstance(value, bool | int | str) or (
            isinstance(value, float) and math.isfinite(value))
        if not ok:
            shown = cut(repr(value), _ATTR_SHOWN)
            what = "a finite number" if isinstance(value, float) else "a plain number, bool or string"
            raise ValueError(f"attribute {name}={shown} is not {what}")


def build_spec(op_name: str, shape: tuple[int, ...], dtype: str, backend: str,
               attrs: dict[str, Any] | None = None) -> tuple[ops.OpFamily, KernelSpec]:
    """The spec the op family builds for a request; UsageError (naming the op) if it cannot."""
    op = ops.get(op_name)
    if dtype not in DTYPES:
        raise UsageError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
    try:
        check_attrs(dict(attrs or {}))
        spec = op.module.make_spec(tuple(shape), dtype, spec_device(backend), attrs)
        check_attrs(spec.attrs)
    except (ValueError, TypeError, OverflowError) as exc:
        raise UsageError(f"{op_name}: {cut(str(exc), 300)}") from None
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


def machine_envs() -> dict[str, list[dict[str, Any]]]:
    """backend -> the environment fingerprints (without "templates") this machine has for it: one for the
    interpreter, one per visible GPU."""

    envs: dict[str, list[dict[str, Any]]] = {"interpreter": []}
    try:
        envs["interpreter"].append(collect_env("interpreter"))
    except Exception:  # noqa: BLE001 - no torch: nothing can be served here
        envs["interpreter"] = []
    envs["cuda"] = []
    try:
        import torch

        if torch.cuda.is_available():
            envs["cuda"] = [collect_env("cuda", i) for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001
        pass
    return envs


def made_here(env: dict[str, Any], envs: dict[str, list[dict[str, Any]]]) -> bool:
    """Whether `env` (an entry's, templates aside) is one of this machine's (`forge cache prune --env`)."""
    bare = {k: v for k, v in env.items() if k != "templates"}
    return any(bare == mine for mine in envs.get(env.get("backend"), []))


# -- may a stored entry be loaded? ------------------------------------------------------------------
#
# A cache entry (the local DB, a bundle, a merged DB) is untrusted input: its source is imported and run.
# verify_entry is the one check every loader makes before importing anything (the shim, forge.load,
# forge bench and --recheck, forge export, bundle import and merge, a `forge search` cache hit): the
# entry must be exactly what forge's own search would have stored, i.e. its source is what the
# installed templates render for its spec, variant and params, and those are a point of the op's
# declared space. Only then can nothing but forge's own template code run.

_VALUE_SHOWN = 60  # characters of a refused param value quoted back
PARAM_TYPES = (int, float, bool)  # the only types a param value may have (exactly: no subclasses)
IMPORTED_MARK = "imported"  # the local version label `cache import` / `merge` add to forge_version


def plain_param(value: Any) -> bool:
    """A param value a template may receive: a plain int, bool or finite float (`type(v) in PARAM_TYPES`)."""
    return type(value) in PARAM_TYPES and (type(value) is not float or math.isfinite(value))


def _shown(value: Any) -> str:
    return cut(repr(value), _VALUE_SHOWN)


def params_type_problem(params: Any) -> str | None:
    """Why `params` is not a dict of plain numbers (None if it is): what can be checked without the op."""
    if not isinstance(params, dict):
        return f"params are a {type(params).__name__}, not an object"
    for name, value in params.items():
        if not isinstance(name, str) or not name.isidentifier():
            return f"param name {_shown(name)} is not an identifier"
        if not plain_param(value):
            return (f"param {name}={_shown(value)} is a {type(value).__name__}, not a plain int, float or bool: "
                    "refused (nothing but numbers may reach a template)")
    return None


def spec_problem(op: ops.OpFamily, spec: KernelSpec) -> str | None:
    """Why `spec` is not a spec `op` builds itself (None if it is): make_spec must rebuild it exactly,
    so its attributes are values the op accepts (they are rendered into the kernel source too)."""
    try:
        check_attrs(spec.attrs)
        rebuilt = op.module.make_spec(op.problem_shape(spec), spec.dtype, spec.device, dict(spec.attrs))
        check_attrs(rebuilt.attrs)
    except Exception as exc:  # noqa: BLE001 - whatever the op refuses it with
        return f"spec is not one {op.name} builds: {cut(str(exc), 200)}"
    if rebuilt.canonical() != spec.canonical():
        return f"spec is not the one {op.name} builds for its shape and attributes ({cut(rebuilt.canonical(), 200)})"
    return None


def params_problem(op: ops.OpFamily, spec: KernelSpec, variant: Any, params: Any) -> str | None:
    """Why (variant, params) is not a point of `op`'s declared space for `spec` (None if it is): a known
    variant, exactly its params, every value one of its choices *and of that choice's type* (16.0 or
    True is not 16), and the space's validity rule accepts the point."""
    from forge.opkit import Candidate

    problem = params_type_problem(params)
    if problem is not None:
        return problem
    try:
        space = op.module.space(spec)
    except Exception as exc:  # noqa: BLE001
        return f"{op.name}'s space cannot be built for this spec: {cut(str(exc), 200)}"
    if not isinstance(variant, str) or variant not in space.variants or variant not in op.module.TEMPLATES:
        return f"variant {_shown(variant)} is not one of {op.name}'s variants ({', '.join(space.variants)})"
    grid = space.variants[variant]
    missing, extra = sorted(set(grid) - set(params)), sorted(set(params) - set(grid))
    if missing or extra:
        what = "; ".join(x for x in (f"missing {', '.join(missing)}" if missing else "",
                                     f"unexpected {', '.join(extra)}" if extra else "") if x)
        return f"params of {op.name}/{variant} must be exactly {', '.join(sorted(grid))} ({what})"
    for name in sorted(grid):
        value, choices = params[name], grid[name]
        if not any(type(value) is type(c) and value == c for c in choices):
            return (f"param {name}={_shown(value)} is not one of {op.name}/{variant}'s choices for it "
                    f"({', '.join(map(repr, choices))}, of their type)")
    try:
        valid = bool(space.valid(Candidate.make(variant, **params)))
    except Exception as exc:  # noqa: BLE001
        return f"{op.name}'s validity rule fails on params {params}: {cut(str(exc), 200)}"
    if not valid:
        return f"params {params} of {op.name}/{variant} are outside the space for this spec (its validity rule)"
    return None


def rendered_source(op: ops.OpFamily, spec: KernelSpec, variant: str, params: dict[str, Any]) -> str:
    """What the installed templates render for (spec, variant, params). Imports the renderer (jinja2)
    lazily: `import forge` stays light."""
    from forge import codegen
    from forge.opkit import Candidate

    return codegen.render(op, spec, Candidate.make(variant, **params))


def render_problem(entry, op: ops.OpFamily, spec: KernelSpec) -> str | None:
    """Why the entry's source is not what the installed templates render for it (None if it is)."""
    try:
        expected = rendered_source(op, spec, entry.variant, entry.params)
    except Exception as exc:  # noqa: BLE001 - any failure to re-render means the source is unverified
        return (f"source cannot be re-rendered from the installed templates "
                f"({type(exc).__name__}: {cut(str(exc), 200)})")
    if expected == entry.source:
        return None
    stale = (" (the entry was made with other templates: template_hash differs)"
             if op.template_hash != entry.template_hash else "")
    return ("source does not re-render from the installed templates with its variant and params "
            f"(sha256 {str(entry.source_sha256)[:12]}... vs {source_sha256(expected)[:12]}...){stale}")


def verify_entry(entry, *, rerender: bool = True) -> str | None:
    """The reason a stored entry must not be loaded, or None if it may. For a kernel decision: its source
    is present and matches its sha256; its op is installed here; its key is sha256(its spec, its env);
    its spec is one the op builds; its variant and params are a point of the op's space for that spec;
    and (unless rerender=False) its source is byte for byte what the installed templates render for
    them. An eager decision loads nothing: None. Call it before importing anything."""
    if entry.decision != "kernel":
        return None
    if entry.source is None or entry.variant is None or entry.params is None:
        return "a kernel decision without source, variant or params"
    if not source_intact(entry):
        return "source does not match its source_sha256 (damaged or edited)"
    try:
        op = ops.get(entry.op)
    except Exception:  # noqa: BLE001 - UsageError, or an op file that no longer loads
        return f"op {entry.op!r} is not installed here, so its source cannot be checked"
    try:
        spec = KernelSpec.from_dict(entry.spec)
        key = cache_key(spec, entry.env)
    except Exception as exc:  # noqa: BLE001
        return f"malformed spec or env ({cut(str(exc), 200)})"
    if spec.op != entry.op:
        return f"op {entry.op!r} differs from its spec's op {spec.op!r}"
    if key != entry.key:
        return "key is not sha256(spec, env): the entry would be served for a spec or environment it was not made for"
    problem = spec_problem(op, spec) or params_problem(op, spec, entry.variant, entry.params)
    if problem is None and rerender:
        problem = render_problem(entry, op, spec)
    return problem


def is_imported(entry) -> bool:
    """Whether the entry came in through `forge cache import` or `merge` (its timings were measured
    elsewhere): forge_version carries the local version label "imported" ("0.4.0+imported")."""
    _, _, local = str(entry.forge_version).partition("+")
    return IMPORTED_MARK in local.split(".")


def imported_version(forge_version: str) -> str:
    """forge_version with the "imported" label added (idempotent)."""
    version = str(forge_version)
    if IMPORTED_MARK in version.partition("+")[2].split("."):
        return version
    return f"{version}{'.' if '+' in version else '+'}{IMPORTED_MARK}"
