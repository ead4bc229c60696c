"""`forge export --format hf-kernels`: a Hugging Face `kernels` repository of every tuned shape of an op
(or of several ops: one per model), with `layers` for `kernels.kernelize` (docs/export.md).

    forge-rmsnorm/
      README.md                         kernel card: the layers, the tuned specs, how to load and kernelize
      build/torch-<backend>/            noarch build variant: torch-cuda, or torch-cpu for interpreter kernels
        __init__.py                     the index: ENTRIES (one per tuned spec), one function per op, `layers`
        metadata.json                   what `kernels` reads: name, id, backend
        _forge_<op>_<key16>.py          one tuned kernel entry: forge/tuner/export.py's module, unchanged
        _forge_dispatch.py, layers.py   fixed code (forge/tuner/hf_runtime.py): dispatch and the layers
        <python name>/__init__.py       for older `kernels` releases: re-exports ../__init__.py

Exporting into an existing repository adds entries and keeps every one it had (an entry of the same spec
is replaced by the newer export). Under an exclusive lock, the new entry modules and the fixed files are
written first, each atomically, and the index last: a reader sees the old set of kernels or the new one.
"""

from __future__ import annotations

import ast
import contextlib
import fcntl
import hashlib
import json
import pprint
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forge import key as keys
from forge import ops
from forge.cache import Cache, Entry
from forge.errors import UsageError
from forge.ops import OpFamily
from forge.spec import KernelSpec
from forge.tuner import hf_runtime
from forge.tuner.export import (
    Exported,
    NotExportable,
    atomic_write,
    check_exportable,
    docstring_safe,
    glue,
    render_module,
)

_HF_NAME = re.compile(r"^[a-z][a-z0-9-]*[a-z0-9]$")
_ENTRY_MODULE = re.compile(r"^_forge_[a-z0-9_]+_[0-9a-f]{16}\.py$")
_ROW_KEYS = {"module", "op", "key", "inputs", "spec"}  # what a row of ENTRIES needs (the index reads them)
# Names the index binds itself; an op family of one of these names cannot get its function there.
_INDEX_NAMES = {"ENTRIES", "layers", "find", "call", "tuned", "stats", "reset_stats", "kernel_mapping",
                "annotations", "_forge_dispatch"}


def repo_name(name: str) -> str:
    """The `kernels` repository name for --name (or an op): lowercase, dashes, prefixed `forge-`."""
    kernel_name = name.lower().replace("_", "-")
    if not kernel_name.startswith("forge-"):
        kernel_name = "forge-" + kernel_name
    if not _HF_NAME.match(kernel_name) or "--" in kernel_name:
        raise UsageError(f"{kernel_name!r} is not a valid Hugging Face kernel name (lowercase letters, digits "
                         "and single dashes, starting with a letter)")
    return kernel_name


def _backend(entry: Entry) -> str:
    return "cuda" if entry.env.get("backend") == "cuda" else "cpu"


def _spec_id(spec: dict) -> str:
    return KernelSpec.from_dict(spec).canonical()


# -- choosing the entries ------------------------------------------------------------------------------

@dataclass
class Selection:
    entries: list[Entry]  # one per (spec, backend): the one made on this machine, else the newest
    skipped: list[tuple[Entry, str]]  # kernel entries that cannot be exported, and why
    eager: int  # entries whose decision is eager (nothing to export)


def op_entries(cache: Cache, op_name: str, *, dtype: str | None = None, device: str | None = None) -> Selection:
    """Every kernel entry of `op_name` in `cache` that can be exported (`forge export OP --all-shapes`),
    narrowed to `dtype` and `device` ("cuda", or "cpu" for the interpreter) when given."""
    ops.get(op_name)  # an unknown op is a usage error, not an empty selection
    here = keys.machine_envs()
    chosen: dict[tuple[str, str], Entry] = {}
    skipped: list[tuple[Entry, str]] = []
    eager = 0
    for entry in cache.entries(op_name):  # newest first
        spec = KernelSpec.from_dict(entry.spec)
        if (dtype is not None and spec.dtype != dtype) or (device is not None and _backend(entry) != device):
            continue
        if entry.decision != "kernel":
            eager += 1
            continue
        try:
            check_exportable(entry, f"{entry.op} {spec.shape_str} {spec.dtype}")
        except NotExportable as exc:
            skipped.append((entry, str(exc)))
            continue
        slot = (_spec_id(entry.spec), _backend(entry))
        # Several environments may have tuned one spec (another GPU, an older torch): one kernel per spec in
        # the repository, the one tuned on this machine if any, else the newest.
        if slot not in chosen or (keys.made_here(entry.env, here) and not keys.made_here(chosen[slot].env, here)):
            chosen[slot] = entry
    if not chosen:
        what = f"{op_name}" + (f" {dtype}" if dtype else "") + (f" on {device}" if device else "")
        detail = [f"{eager} decision(s) without a forge kernel (eager, or torch's own op)"] if eager else []
        detail += [reason for _, reason in skipped[:3]]
        raise NotExportable(f"no exportable kernel entry of {what} in {cache.path}"
                            + (f" ({'; '.join(detail)})" if detail else "")
                            + f": run `forge search {op_name} --shape ...` first")
    return Selection(list(chosen.values()), skipped, eager)


# -- the repository ------------------------------------------------------------------------------------

def _entry_row(entry: Entry, op: OpFamily) -> dict[str, Any]:
    spec = KernelSpec.from_dict(entry.spec)
    return {"module": f"_forge_{entry.op}_{entry.key[:16]}", "op": entry.op, "key": entry.key,
            "inputs": glue(op, len(spec.inputs)).input_names, "spec": entry.spec, "variant": entry.variant,
            "params": entry.params, "speedup": entry.speedup, "created_at": entry.created_at}


def _read_index(path: Path) -> list[dict[str, Any]]:
    """ENTRIES of an existing index, checked against the files it names (nothing may be silently lost)."""
    if not path.exists():
        return []
    try:
        tree = ast.parse(path.read_text(), filename=str(path))
        node = next(n for n in tree.body if isinstance(n, ast.Assign) and len(n.targets) == 1
                    and isinstance(n.targets[0], ast.Name) and n.targets[0].id == "ENTRIES")
        rows = ast.literal_eval(node.value)
    except (SyntaxError, ValueError, StopIteration) as exc:
        raise UsageError(f"{path} is not the index of a forge hf-kernels repository (no ENTRIES table: "
                         f"{type(exc).__name__}); it may have been written by an older `forge export`, one "
                         "kernel per repository: export into another directory or remove it") from None
    if not isinstance(rows, list) or not all(_valid_row(r) for r in rows):
        raise UsageError(f"{path}: its ENTRIES table is not one forge export writes (rows with "
                         f"{', '.join(sorted(_ROW_KEYS))}); was it edited? Remove the repository and export again")
    for row in rows:
        if not (path.parent / f"{row['module']}.py").is_file():
            raise UsageError(f"{path} lists {row['module']}.py, which is missing: the repository is damaged "
                             "(restore the file, or remove the repository and export again)")
    return rows


def _valid_row(row: Any) -> bool:
    if not (isinstance(row, dict) and _ROW_KEYS <= row.keys() and isinstance(row["module"], str)
            and _ENTRY_MODULE.match(row["module"] + ".py")):
        return False
    try:
        _spec_id(row["spec"])
    except (KeyError, TypeError, ValueError):
        return False
    return True


def _op_function(op_name: str, rows: list[dict[str, Any]]) -> str:
    """The index's function for one op: the op's natural signature; an attribute's default is its tuned
    value when every entry of the op has the same one, else it must be given."""
    inputs = rows[0]["inputs"]
    names = sorted({k for r in rows for k in r["spec"]["attrs"] if k.isidentifier()})
    params = []
    for name in names:
        values = {json.dumps(r["spec"]["attrs"].get(name), sort_keys=True) for r in rows}
        params.append(f"{name}={rows[0]['spec']['attrs'][name]!r}" if len(values) == 1 else name)
    sig = ", ".join(inputs) + (", *, " + ", ".join(params) if params else "")
    call_attrs = "{" + ", ".join(f"{n!r}: {n}" for n in names) + "}"
    comma = "," if len(inputs) == 1 else ""
    return (f"\n\ndef {op_name}({sig}):\n"
            f'    """{op_name} with the tuned kernel whose spec this call matches exactly (see tuned());\n'
            '    ValueError otherwise."""\n'
            f"    return _forge_dispatch.call({op_name!r}, ({', '.join(inputs)}{comma}), {call_attrs})\n")


def _render_index(kernel_name: str, variant: str, rows: list[dict[str, Any]]) -> str:
    by_op: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_op.setdefault(row["op"], []).append(row)
    clash = set(by_op) & _INDEX_NAMES
    if clash:
        raise NotExportable(f"op(s) {sorted(clash)} would clash with the names of the repository's index")
    layers = sorted(hub for hub, (_, op) in hf_runtime.HUB_LAYERS.items() if op in by_op)
    lines = []
    for row in rows:
        spec = row["spec"]
        named = zip(row["inputs"], spec["inputs"], strict=True)
        ins = ", ".join(f"{n} {t['dtype']} {tuple(t['shape'])}" for n, t in named)
        attrs = "".join(f" {k}={v!r}" for k, v in sorted(spec["attrs"].items()))
        lines.append(f"  {row['op']}: {ins};{attrs or ' no attributes'} (key {row['key'][:12]})")
    header = (f'"""{kernel_name}, build variant {variant}: {len(rows)} Triton kernel(s) tuned by forge.\n\n'
              "Generated by `forge export --format hf-kernels`: needs torch and triton, not forge.\n"
              f"Layers for kernels.kernelize (layers.py): {', '.join(layers) or 'none for these ops'}; "
              "kernel_mapping() gives the mapping.\n"
              f"Functions: {', '.join(sorted(by_op))}; find(), tuned(), stats().\n\n"
              "Tuned specs (a call runs a kernel only when it matches one exactly):\n"
              + "\n".join(lines) + '\n"""\n')
    parts = [
        docstring_safe(header),
        "\nfrom __future__ import annotations\n\n",
        "# One row per tuned kernel entry of this variant. `forge export` rewrites this file last, atomically,\n"
        "# after the modules it names: a reader sees the old set of kernels or the new one, never a mix.\n",
        "ENTRIES = " + pprint.pformat(rows, width=110, sort_dicts=True) + "\n\n",
        "# Imported after ENTRIES, which _forge_dispatch reads.\n",
        "from . import _forge_dispatch, layers  # noqa: E402\n",
        "from ._forge_dispatch import find, kernel_mapping, reset_stats, stats, tuned  # noqa: E402\n",
        *(_op_function(op_name, op_rows) for op_name, op_rows in sorted(by_op.items())),
        "\n\n__all__ = " + pprint.pformat(["ENTRIES", "layers", "find", "tuned", "stats", "reset_stats",
                                           "kernel_mapping", *sorted(by_op)], width=110, compact=True) + "\n",
    ]
    text = "".join(parts)
    compile(text, f"<forge export {kernel_name} index>", "exec")  # a bug here must not reach the user's repo
    return text


@contextlib.contextmanager
def _repo_lock(out_dir: Path, kernel_name: str):
    """Exclusive while one export reads, extends and rewrites a repository: two exports into one repository
    at once would otherwise each write an index without the other's kernels. The lock file sits next to
    the repository, not in it (it is not part of what is uploaded)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / f".{kernel_name}.lock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # released when the file is closed, also if this process dies
        yield


def export_hf(entries: list[Entry], out_dir: Path, *, name: str | None = None) -> Exported:
    """Add `entries` (kernel decisions, any ops and backends) to the repository DIR/forge-<name> (default
    name: the op, when all entries are of one op), creating it if needed. Returns what was written; its
    extra lists the keys added, the keys replaced (the repository's older kernel for the same spec), those
    already there (unchanged), and those superseded (not written: the repository has a newer kernel for
    that spec, as `forge cache merge` keeps the newer entry)."""
    if not entries:
        raise UsageError("nothing to export")
    op_names = sorted({e.op for e in entries})
    if name is None and len(op_names) > 1:
        raise UsageError(f"entries of several ops ({', '.join(op_names)}): give the repository a --name")
    kernel_name = repo_name(name or op_names[0])
    python_name = kernel_name.replace("-", "_")
    families = {n: ops.get(n) for n in op_names}
    for entry in entries:
        spec = KernelSpec.from_dict(entry.spec)
        check_exportable(entry, f"{entry.op} {spec.shape_str} {spec.dtype}")
    repo = out_dir / kernel_name
    by_backend: dict[str, list[Entry]] = {}
    for entry in entries:
        by_backend.setdefault(_backend(entry), []).append(entry)
    added, replaced, unchanged, superseded, variants = [], [], [], [], {}
    try:
        with _repo_lock(out_dir, kernel_name):
            for backend, group in sorted(by_backend.items()):
                variant = f"torch-{backend}"
                result = _export_variant(repo / "build" / variant, kernel_name, python_name, backend, group,
                                         families)
                added += result["added"]
                replaced += result["replaced"]
                unchanged += result["unchanged"]
                superseded += result["superseded"]
                variants[variant] = {"kernel_id": result["kernel_id"], "entries": result["entries"]}
            atomic_write(repo / "README.md", _render_readme(kernel_name, repo))
    except OSError as exc:
        raise UsageError(f"cannot write to {out_dir}: {exc.strerror or exc}") from None
    first = sorted(variants)[0]
    extra = {"keys": [e.key for e in entries], "added": added, "replaced": replaced, "unchanged": unchanged,
             "superseded": superseded, "variants": variants, "entries": sum(v["entries"] for v in variants.values())}
    if len(entries) == 1:
        extra["key"] = entries[0].key
    return Exported(repo, repo / "build" / first / "__init__.py", kernel_name, ", ".join(op_names), "hf-kernels",
                    extra)


def _export_variant(build: Path, kernel_name: str, python_name: str, backend: str, entries: list[Entry],
                    families: dict[str, OpFamily]) -> dict[str, Any]:
    index_path = build / "__init__.py"
    old_rows = _read_index(index_path)
    rows = {_spec_id(r["spec"]): r for r in old_rows}
    added, replaced, unchanged, superseded, texts = [], [], [], [], {}
    for entry in entries:
        sid = _spec_id(entry.spec)
        row = _entry_row(entry, families[entry.op])
        previous = rows.get(sid)
        if previous is None:
            added.append(entry.key)
        elif previous["key"] == entry.key:
            unchanged.append(entry.key)
        elif previous.get("created_at", 0) > entry.created_at:
            superseded.append(entry.key)  # the repository holds a newer kernel for this spec: keep it
            continue
        else:
            replaced.append(previous["key"])
        rows[sid] = row
        texts[row["module"]] = render_module(entry, families[entry.op])
    new_rows = sorted(rows.values(), key=lambda r: (r["op"], _spec_id(r["spec"])))
    index = _render_index(kernel_name, build.name, new_rows)
    # `kernels` registers the package under this id in sys.modules, and Python its submodules below it: the
    # id is unique per content, so two versions of one repository loaded in one process share no module.
    modules = [texts.get(r["module"]) or (build / f"{r['module']}.py").read_text() for r in new_rows]
    digest = hashlib.sha256("\0".join([index, hf_runtime.DISPATCH, hf_runtime.LAYERS, *modules]).encode())
    meta = {"name": kernel_name, "id": f"_{python_name}_{backend}_{digest.hexdigest()[:10]}", "version": 1,
            "license": "apache-2.0", "python-depends": [], "backend": {"type": backend}}
    for module_name, text in texts.items():
        atomic_write(build / f"{module_name}.py", text)
    atomic_write(build / hf_runtime.DISPATCH_FILE, hf_runtime.DISPATCH)
    atomic_write(build / hf_runtime.LAYERS_FILE, hf_runtime.LAYERS)
    atomic_write(build / python_name / "__init__.py", _HF_COMPAT.replace("@ID@", meta["id"]))
    atomic_write(build / "metadata.json", json.dumps(meta, indent=2) + "\n")
    atomic_write(index_path, index)  # the commit point
    live = {f"{r['module']}.py" for r in new_rows}
    for path in build.iterdir():  # modules of replaced entries, no longer in the index
        if _ENTRY_MODULE.match(path.name) and path.name not in live:
            path.unlink(missing_ok=True)
    return {"added": added, "replaced": replaced, "unchanged": unchanged, "superseded": superseded,
            "kernel_id": meta["id"], "entries": len(new_rows)}


def _render_readme(kernel_name: str, repo: Path) -> str:
    variants = sorted(p for p in (repo / "build").iterdir() if (p / "__init__.py").is_file())
    rows = [(v.name, r) for v in variants for r in _read_index(v / "__init__.py")]
    ops_here = sorted({r["op"] for _, r in rows})
    layer_lines = [f"| `{hub}` | `{cls}` | {op} |" for hub, (cls, op) in hf_runtime.HUB_LAYERS.items()
                   if op in ops_here]
    spec_lines = []
    for variant, r in rows:
        spec = r["spec"]
        ins = ", ".join(f"{t['dtype']} {'x'.join(map(str, t['shape']))}" for t in spec["inputs"])
        attrs = ", ".join(f"{k}={v!r}" for k, v in sorted(spec["attrs"].items())) or "-"
        speed = f"{r['speedup']:.2f}x" if r.get("speedup") else "-"
        spec_lines.append(f"| {r['op']} | {ins} | {attrs} | {variant} | {r['variant']} | {speed} | "
                          f"`{r['key'][:12]}` |")
    device = "cuda" if any(v.name == "torch-cuda" for v in variants) else "cpu"
    return _HF_README.format(
        kernel_name=kernel_name, ops=", ".join(ops_here), n=len(rows), device=device,
        layers="\n".join(layer_lines) or "| (none for these ops) | | |", specs="\n".join(spec_lines),
        first_op=ops_here[0] if ops_here else "rmsnorm")


_HF_COMPAT = '''"""Compatibility layout for older `kernels` releases: the kernel is ../__init__.py."""

import importlib.util
import sys
from pathlib import Path

_name = "@ID@"
_module = sys.modules.get(_name)
if _module is None:
    _spec = importlib.util.spec_from_file_location(_name, Path(__file__).resolve().parent.parent / "__init__.py")
    _module = importlib.util.module_from_spec(_spec)
    sys.modules[_name] = _module
    _spec.loader.exec_module(_module)
globals().update({k: v for k, v in vars(_module).items() if not k.startswith("__")})
__all__ = list(_module.__all__)
'''

_HF_README = """---
tags:
- kernels
- forge
---

# {kernel_name}

Triton kernels for {ops}, tuned by forge ({n} tuned spec(s)) and exported with
`forge export --format hf-kernels`. Pure Python (Triton JIT-compiles on first use): noarch build variants,
`build/torch-cuda` for kernels tuned on CUDA, `build/torch-cpu` for kernels tuned on the Triton interpreter
(those run with `TRITON_INTERPRET=1`).

## Layers for `kernels.kernelize`

| hub layer name | class in `layers` | forge op |
|---|---|---|
{layers}

A layer runs a tuned kernel only for a call that matches one of the specs below exactly (shapes, dtypes,
device, contiguity, attributes such as eps; autograd off); any other call runs the model layer's own
forward.

```python
from pathlib import Path
import torch
from kernels import Mode, get_local_kernel, kernelize, use_kernel_mapping

repo = Path("{kernel_name}")
k = get_local_kernel(repo)
with use_kernel_mapping(k.kernel_mapping(device="{device}")):   # LocalLayerRepository(repo, layer_name=...)
    model = kernelize(model, mode=Mode.INFERENCE, device="{device}")
with torch.no_grad():
    logits = model(input_ids).logits
print(k.stats())   # kernel launches per cache key, original-forward calls per layer (and why)
```

Or call the ops directly: `k.{first_op}(...)` (ValueError for an untuned spec); `k.tuned()` lists the specs.

## Tuned specs

| op | inputs | attributes | variant | template | speedup | cache key |
|---|---|---|---|---|---|---|
{specs}
"""
