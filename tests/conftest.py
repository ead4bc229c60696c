"""Test set-up. On a machine without CUDA, in-process kernels run through the Triton interpreter,
which must be switched on before triton is first imported (hence here, at conftest import)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
# torch's fused op is a search candidate (forge/fused.py); on the interpreter it beats every kernel, so the
# many tests that force a kernel decision (stats.accepts patched) would get "torch" instead. Tests search
# kernels only (module-scoped fixtures too, hence here and not only per test); tests/test_torch_op.py
# switches it back on.
os.environ["FORGE_TORCH_OPS"] = "0"
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parent.parent
FAULT_OPS = Path(__file__).resolve().parent / "fault_ops"
# The device kernels run on in in-process tests: the GPU where there is one, else the interpreter.
DEVICE = "cuda" if HAS_CUDA else "cpu"


def load_bench(name: str):
    """A script of bench/ (not a package) imported as a module, for tests of its functions."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod

def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _isolated_dirs(tmp_path, monkeypatch):
    """Every test gets its own cache dir and lock dir: no test touches ~/.cache or another's lock."""
    monkeypatch.setenv("FORGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("FORGE_LOCK_DIR", str(tmp_path / "locks"))
    monkeypatch.delenv("FORGE_OPS_PATH", raising=False)
    monkeypatch.setenv("FORGE_TORCH_OPS", "0")  # see above: a test that changed it does not leak it
    for name in ("FORGE_WEBHOOK_COMPLETION", "FORGE_WEBHOOK_ERRORS", "DISCORD_WEBHOOK_COMPLETION",
                 "DISCORD_WEBHOOK_ERRORS"):
        monkeypatch.delenv(name, raising=False)  # a developer's webhook never hears from the test suite


@pytest.fixture
def fault_ops(monkeypatch):
    monkeypatch.setenv("FORGE_OPS_PATH", str(FAULT_OPS))
    return FAULT_OPS


def dynamo_graph(fn, *args):
    """The TraceGraph TorchDynamo hands a backend for fn(*args) (static shapes: aranges are calls there, not
    constants baked by fx; a literal torch.tensor([]) is a call too)."""
    from forge.trace import TraceGraph

    got = {}

    def backend(gm, example_inputs):
        got["g"] = TraceGraph.from_graph(gm, example_inputs)
        return gm.forward

    torch._dynamo.reset()
    try:
        torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)(*args)
    finally:
        torch._dynamo.reset()
    return got["g"]


def search_only(monkeypatch, *ops: str) -> None:
    """A backend test about some families: a miss of any other op is not searched (it runs as written), where
    searching every region of a model on the interpreter took most of such a test's time."""
    from forge import shim

    search = shim._searcher()
    monkeypatch.setattr(shim, "_search_on_miss",
                        lambda op, *a, **k: search(op, *a, **k) if op in ops else None)
