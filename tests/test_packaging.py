"""The wheel carries kernels/ and templates/ (as forge._kernels/_templates), has no top-level
`kernels` package, and an installed forge finds its ops there."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import zipfile

import pytest

from tests.conftest import ROOT


@pytest.mark.skipif(importlib.util.find_spec("setuptools") is None, reason="needs setuptools to build")
def test_wheel_ships_ops_and_installed_forge_finds_them(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path / "dist")], check=True, capture_output=True, cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("forge_kernel-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "forge/_kernels/rmsnorm.py" in names and "forge/_templates/softmax_row.j2" in names
    assert "forge/_fastcall.cpp" in names  # the C++ fast path is built from source on the user's machine
    assert not any(n.startswith("kernels/") or n.startswith("templates/") for n in names)
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                    str(wheel)], check=True, capture_output=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(target)
    code = ("from forge import ops; import forge; "
            "print(ops.get('rmsnorm').path); print(ops.get('softmax').template_dir); print(forge.__file__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=tmp_path, check=True).stdout.splitlines()
    assert out[2].startswith(str(target)), out  # the installed copy, not the source tree
    assert out[0] == str(target / "forge" / "_kernels" / "rmsnorm.py")
    assert out[1] == str(target / "forge" / "_templates")
