"""The op-family registry: every `kernels/<op>.py` (plus directories on $FORGE_OPS_PATH) is one op.

Op modules are loaded by file path under the name `forge_ops.<op>`, never as a top-level package
named `kernels` (that would shadow Hugging Face's `kernels`, an export target).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from forge.errors import UsageError

_PKG = Path(__file__).resolve().parent
# The contract every kernels/<op>.py must fulfil (checked on load, so a new op fails loudly).
REQUIRED = ("NAME", "TEMPLATES", "DEFAULT_ATTRS", "make_spec", "make_inputs", "reference", "oracle",
            "alloc_output", "run", "space", "default", "render_context", "bytes_moved", "flops",
            "tolerance")
# Optional, used where present:
#   match(expr) -> ([input index or None, ...], attrs) | None   recognise the op in a trace (forge/trace.py forms)
#   fill_missing(inputs) -> tuple            inputs the user's code left out (rmsnorm's weight of ones)
#   problem(inputs, attrs) -> shape          the spec's problem shape when it is not inputs[0].shape (matmul
#                                            (M, N, K)); raises ValueError for layouts it does not take; may
#                                            complete `attrs` in place with what only the tensors show (sdpa's
#                                            kv_heads)
#   tolerance_for(spec) -> Tolerance         a spec-exact tolerance (matmul's grows with K)
#   problem_shape(spec) -> shape             the request shape make_spec rebuilds `spec` from, when it is not
#                                            inputs[0].shape (matmul, sdpa); forge.search(KernelSpec) uses it
#   TEST_SHAPES, MID_SHAPE, test_candidates(spec)   what tests/test_templates.py runs for this op


def _builtin_dirs() -> tuple[Path, Path]:
    """(kernels dir, templates dir): inside the installed wheel, else the source tree."""
    installed = (_PKG / "_kernels", _PKG / "_templates")
    if installed[0].is_dir():
        return installed
    root = _PKG.parent
    return root / "kernels", root / "templates"


@dataclass(frozen=True)
class OpFamily:
    name: str
    module: ModuleType
    path: Path
    template_dir: Path

    def template_path(self, variant: str) -> Path:
        return self.template_dir / self.module.TEMPLATES[variant]

    def problem_shape(self, spec) -> tuple[int, ...]:
        """The shape a request names for `spec` (matmul's MxNxK, attention's BxHxSqxSkvxD), so that
        make_spec(problem_shape(spec), ...) rebuilds it; the first input's shape unless the op says."""
        own = getattr(self.module, "problem_shape", None)
        return tuple(own(spec)) if own is not None else tuple(spec.inputs[0].shape)

    @functools.cached_property
    def template_hash(self) -> str:
        """sha256 over the op file and every template it uses: any edit makes new cache keys."""
        h = hashlib.sha256()
        h.update(self.path.read_bytes())
        for variant in sorted(self.module.TEMPLATES):
            h.update(variant.encode())
            h.update(self.template_path(variant).read_bytes())
        return h.hexdigest()


def _search_dirs() -> list[tuple[Path, Path]]:
    dirs = [_builtin_dirs()]
    for entry in filter(None, os.environ.get("FORGE_OPS_PATH", "").split(os.pathsep)):
        d = Path(entry)
        dirs.append((d, d / "templates"))
    return dirs


def _load(path: Path, template_dir: Path) -> OpFamily:
    name = f"forge_ops.{path.stem}"
    mod = sys.modules.get(name)
    if mod is None or getattr(mod, "__file__", None) != str(path):
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    missing = [attr for attr in REQUIRED if not hasattr(mod, attr)]
    if missing:
        raise TypeError(f"op module {path} lacks {', '.join(missing)}")
    if mod.NAME != path.stem:
        raise TypeError(f"op module {path} declares NAME={mod.NAME!r}; it must match its file name")
    for variant, tmpl in mod.TEMPLATES.items():
        if not (template_dir / tmpl).is_file():
            raise TypeError(f"op {mod.NAME}: template {tmpl} for variant {variant!r} not in {template_dir}")
    return OpFamily(mod.NAME, mod, path, template_dir)


def available() -> dict[str, tuple[Path, Path]]:
    found: dict[str, tuple[Path, Path]] = {}
    for kdir, tdir in _search_dirs():
        if not kdir.is_dir():
            continue
        for p in sorted(kdir.glob("*.py")):
            if not p.name.startswith("_"):
                found.setdefault(p.stem, (p.resolve(), tdir.resolve()))
    return found


def get(name: str) -> OpFamily:
    ops = available()
    if name not in ops:
        raise UsageError(f"unknown op {name!r}; known ops: {', '.join(sorted(ops)) or '(none)'}")
    return _load(*ops[name])
