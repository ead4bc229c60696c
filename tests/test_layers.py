"""Imports point down (docs/adr/0002-layers.md, docs/architecture.md). Every import statement of
forge's own code, top-level or inside a function, is read from the AST and checked against the layers:

    0 kit      forge/spec.py, opkit.py, formulas.py, hardware.py, errors.py, _version.py   what op families may use
    1 ops      kernels/*.py                                                    the op families
    2 runtime  the other modules of forge/                                     spec -> key -> cache -> shim
    3 tuner    forge/tuner/                                                    the tuner as a library
    4 facade   forge/__init__.py                                               the public API
    5 cli      forge_cli/                                                      Typer + Rich only
    6 main     forge/__main__.py                                               `python -m forge`

A module may import from its own layer and the layers below, never above; typer and rich only in the CLI.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

LAYERS = ("kit", "ops", "runtime", "tuner", "facade", "cli", "main")
KIT = {"spec", "opkit", "formulas", "hardware", "errors", "_version"}
CLI_ONLY = {"typer", "rich"}


def layer_of_file(path: Path, root: Path) -> str | None:
    rel = path.relative_to(root).parts
    if rel[0] == "kernels":
        return "ops"
    if rel[0] == "forge_cli":
        return "cli"
    if rel[0] != "forge":
        return None
    if rel[1:] == ("__init__.py",):
        return "facade"
    if rel[1:] == ("__main__.py",):
        return "main"
    if rel[1] == "tuner":
        return "tuner"
    return "kit" if Path(rel[1]).stem in KIT else "runtime"


def layer_of_module(name: str, root: Path) -> str | None:
    """The layer of an imported module name (None: not forge's own code)."""
    parts = name.split(".")
    if parts[0] == "forge_cli":
        return "cli"
    if parts[0] == "forge_ops":  # op modules loaded by path
        return "ops"
    if parts[0] != "forge":
        return None
    if len(parts) == 1:
        return "facade"
    if parts[1] == "tuner":
        return "tuner"
    if parts[1] == "__main__":
        return "main"
    return "kit" if parts[1] in KIT else "runtime"


def _imports(tree: ast.AST, root: Path) -> list[tuple[int, str]]:
    """(line, module) for every import; `from forge import key` names the module forge.key."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            base = node.module
            for a in node.names:
                sub = Path(root, *base.split("."), a.name)
                is_module = sub.with_suffix(".py").is_file() or (sub / "__init__.py").is_file()
                out.append((node.lineno, f"{base}.{a.name}" if is_module else base))
    return out


def violations(root: Path) -> list[str]:
    found = []
    files = [*root.glob("forge/**/*.py"), *root.glob("forge_cli/**/*.py"), *root.glob("kernels/*.py")]
    for path in sorted(files):
        here = layer_of_file(path, root)
        tree = ast.parse(path.read_text(), str(path))
        for line, name in _imports(tree, root):
            where = f"{path.relative_to(root)}:{line}"
            if name.split(".")[0] in CLI_ONLY and here != "cli":
                found.append(f"{where} imports {name}: Typer and Rich belong to forge_cli only")
            there = layer_of_module(name, root)
            if there is not None and LAYERS.index(there) > LAYERS.index(here):
                found.append(f"{where} ({here}) imports {name} ({there}): an arrow pointing up")
    return found


def test_no_import_points_up():
    assert violations(ROOT) == []


def test_the_layers_cover_every_module():
    files = [*ROOT.glob("forge/**/*.py"), *ROOT.glob("forge_cli/**/*.py"), *ROOT.glob("kernels/*.py")]
    assert len(files) > 40
    assert {layer_of_file(p, ROOT) for p in files} == set(LAYERS)


def _copy(tmp_path: Path) -> Path:
    for d in ("forge", "forge_cli", "kernels"):
        shutil.copytree(ROOT / d, tmp_path / d, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def test_a_planted_upward_import_is_caught(tmp_path):
    root = _copy(tmp_path)
    assert violations(root) == []
    with open(root / "forge" / "cache.py", "a") as f:  # runtime -> tuner, at top level
        f.write("\nfrom forge.tuner import engine  # noqa\n")
    with open(root / "kernels" / "softmax.py", "a") as f:  # ops -> runtime, lazily inside a function
        f.write("\n\ndef _planted():\n    from forge import shim\n    return shim\n")
    with open(root / "forge" / "tuner" / "stats.py", "a") as f:  # the tuner is a library: no Rich
        f.write("\nimport rich  # noqa\n")
    with open(root / "forge" / "key.py", "a") as f:  # runtime -> the facade's names
        f.write("\nfrom forge import optimize  # noqa\n")
    found = violations(root)
    assert len(found) == 4, found
    assert any(v.startswith("forge/cache.py:") and "forge.tuner.engine (tuner)" in v for v in found)
    assert any(v.startswith("kernels/softmax.py:") and "forge.shim (runtime)" in v for v in found)
    assert any(v.startswith("forge/tuner/stats.py:") and "forge_cli only" in v for v in found)
    assert any(v.startswith("forge/key.py:") and "imports forge (facade)" in v for v in found)


def test_import_forge_stays_light():
    """`import forge` (and a search-free shim) loads no Typer, Rich, Jinja2, triton, tuner or CLI."""
    code = ("import sys, forge\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('typer', 'rich', 'jinja2', 'triton', "
            "'forge_cli') or m.startswith('forge.tuner'))\n"
            "print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_the_public_search_api_loads_no_typer_or_rich():
    code = ("import sys, forge\n"
            "from forge.tuner import api, engine\n"
            "assert forge.search and api.search\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('typer', 'rich', 'forge_cli')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"
