"""Refactors must not change what forge generates or where it stores it.

Two golden files, written once by the code *before* a refactor (FORGE_WRITE_GOLDEN=1 pytest
tests/test_golden.py) and checked by every run after it:

- golden/renders.json: a digest of every rendered candidate source, per op x device x dtype x shape,
  over every valid point of the op's space and its test candidates (the templates and their render
  contexts, byte for byte);
- golden/keys.json: the cache key of a fixed list of specs under a fixed stand-in environment (the
  spec each op builds from op/shape/dtype/attrs, and the key composed from spec + environment +
  template hash). The real environment and each op's template hash are replaced by fixed values:
  those change with the machine and with any edit of an op file, by design.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from forge import codegen, ops
from forge import key as keys
from forge.spec import DTYPES

GOLDEN = Path(__file__).resolve().parent / "golden"
WRITE = os.environ.get("FORGE_WRITE_GOLDEN") == "1"

# Row ops' masking shapes (tests/test_templates.py) and one realistic shape each; ops whose problem
# shape means something else list their own TEST_SHAPES / MID_SHAPE.
ROW_SHAPES = [(1, 1), (1, 7), (3, 7), (5, 300), (1, 4096), (7, 1), (2, 3, 33), (2, 65536), (1, 65537)]
REALISTIC = {
    "rmsnorm": [(2048, 4096), (8192, 4096)], "softmax": [(2048, 4096)], "log_softmax": [(2048, 4096)],
    "layer_norm": [(2048, 4096)], "gelu": [(2048, 4096)], "silu_mul": [(2048, 14336)],
    "cross_entropy": [(4096, 32000)], "reduce": [(2048, 4096)], "rope": [(1, 32, 2048, 128)],
    "matmul": [(4096, 4096, 4096)], "sdpa": [(4, 32, 2048, 2048, 128)], "pointwise": [(2048, 14336)],
    "linear": [(2048, 4096, 4096), (1, 4096, 4096)], "swiglu": [(2048, 14336, 4096)],
}
# Attribute sets whose specs (and so keys) must not move; every op's defaults are covered too.
ATTRS = {
    "rmsnorm": [{}, {"eps": 1e-5}], "layer_norm": [{}, {"eps": 1e-6}], "softmax": [{}, {"dim": -1}],
    "log_softmax": [{}], "gelu": [{}, {"approximate": "tanh"}], "silu_mul": [{}],
    "cross_entropy": [{}, {"reduction": "sum"}, {"ignore_index": 5}],
    "reduce": [{}, {"kind": "mean"}, {"kind": "amax", "keepdim": True}, {"kind": "argmax"}],
    "rope": [{}], "matmul": [{}], "sdpa": [{}, {"causal": True}, {"causal": True, "kv_heads": 8},
                                           {"scale": 0.125}],
}
# Issue 14's linear epilogues and SwiGLU (their own entries, added with the families).
ATTRS["linear"] = [{}, {"weight": "kn", "bias": "linear", "activation": "gelu_tanh"},
                   {"bias": "add", "activation": "silu", "scale": 0.5, "residual": True}]
ATTRS["swiglu"] = [{}]
# Issue 14's any-dims specs (added after the first golden files: their own entries, the ones above unmoved).
ATTRS["rmsnorm"] += [{"dims": 2}, {"dim": -2}]
ATTRS["layer_norm"] += [{"dims": 2}]
ATTRS["reduce"] += [{"kind": "amin"}, {"kind": "argmin", "dim": -2, "keepdim": True}, {"kind": "sum", "dim": -2}]
# Issue 14's generated pointwise chains (added later too: its own entries).
ATTRS["pointwise"] = [{}, {"expr": "add(mul(x0,2.0),relu(x1))"}, {"expr": "add(x0,x1)", "input_shapes": "c;4096"}]
# The KV cache's cat (its own entries, added with the family): a copy, and HF's empty past + the new keys.
ATTRS["cat"] = [{}, {"empty": 1}]
REALISTIC["cat"] = [(4, 16, 1024, 64)]
# Issue 14's residual add + norm (its own entries, added with the family).
ATTRS["add_norm"] = [{}, {"norm": "layer_norm", "eps": 1e-5}, {"form": "fused"}]
REALISTIC["add_norm"] = [(2048, 4096)]
# matmul's MID_SHAPE before the persistent variant moved it (issue 16): its renders stay checked.
REALISTIC["matmul"] += [(16, 1024, 1024)]
# ... and linear's and swiglu's, before their persistent variants moved them.
REALISTIC["linear"] += [(16, 1024, 1024)]
REALISTIC["swiglu"] += [(16, 1024, 1024)]
# Specs rendered besides the default-attribute ones: the variants only their attributes reach (an op's
# VARIANT_ATTRS) and the trailing-dims forms; keyed with the attributes.
RENDER_ATTRS = {
    "rmsnorm": [{"dim": -2}, {"dims": 2}], "layer_norm": [{"dims": 2}],
    "add_norm": [{"norm": "layer_norm", "eps": 1e-5}],
    "reduce": [{"dim": -2, "kind": k} for k in ("sum", "mean", "amax", "amin", "argmax", "argmin")]
    + [{"kind": "amin"}, {"kind": "argmin"}],
    "pointwise": [{"expr": "where(gt(x0,0.0),x0,mul(tanh(x1),0.01))"}, {"expr": "add(x0,x1)", "input_shapes": "c;33"}],
}
FIXED_ENV = {
    "cuda": {"backend": "cuda", "torch": "2.11.0+cu130", "triton": "3.6.0", "forge": "0.1.0",
             "gpu": "NVIDIA H200", "cc": "9.0", "sm_count": 132, "driver": "580.159.04", "cuda": "13.0"},
    "interpreter": {"backend": "interpreter", "torch": "2.13.0+cpu", "triton": "3.9.0", "forge": "0.1.0",
                    "gpu": None, "cpu": "Some CPU", "machine": "x86_64"},
}


def _builtin_ops() -> list[str]:
    saved = os.environ.pop("FORGE_OPS_PATH", None)
    try:
        return sorted(ops.available())
    finally:
        if saved is not None:
            os.environ["FORGE_OPS_PATH"] = saved


def _shapes(op_name: str) -> list[tuple[int, ...]]:
    mod = ops.get(op_name).module
    shapes = list(getattr(mod, "TEST_SHAPES", ROW_SHAPES))
    if hasattr(mod, "MID_SHAPE"):
        shapes.append(tuple(mod.MID_SHAPE))
    return shapes + REALISTIC.get(op_name, [])


def _render_digests(op_name: str) -> dict[str, str]:
    op = ops.get(op_name)
    mod = op.module
    out: dict[str, str] = {}
    for device in ("cuda", "cpu"):
        for dtype in DTYPES:
            for shape in _shapes(op_name):
                spec = mod.make_spec(shape, dtype, device, None)
                cands = list(mod.space(spec).all_points())
                if hasattr(mod, "test_candidates"):
                    cands += list(mod.test_candidates(spec))
                cands.append(mod.default(spec))
                h = hashlib.sha256()
                for cand in sorted(set(cands), key=lambda c: c.key):
                    h.update(cand.key.encode())
                    h.update(hashlib.sha256(codegen.render(op, spec, cand).encode()).digest())
                out[f"{device}/{dtype}/{'x'.join(map(str, shape))}/{len(set(cands))}"] = h.hexdigest()
                for attrs in RENDER_ATTRS.get(op_name, []):
                    try:
                        spec = mod.make_spec(shape, dtype, device, dict(attrs))
                    except ValueError:  # e.g. dims=2 of a 1-d shape
                        continue
                    cands = {*mod.space(spec).all_points(), mod.default(spec)}
                    h = hashlib.sha256()
                    for cand in sorted(cands, key=lambda c: c.key):
                        h.update(cand.key.encode())
                        h.update(hashlib.sha256(codegen.render(op, spec, cand).encode()).digest())
                    tag = json.dumps(attrs, sort_keys=True)
                    out[f"{device}/{dtype}/{'x'.join(map(str, shape))}/{tag}/{len(cands)}"] = h.hexdigest()
    return out


def _key_cases():
    for op_name in _builtin_ops():
        for attrs in ATTRS.get(op_name, [{}]):
            for shape in _shapes(op_name):
                for dtype in DTYPES:
                    for backend in ("cuda", "interpreter"):
                        yield op_name, shape, dtype, attrs, backend


def _golden_key(op_name, shape, dtype, attrs, backend, monkeypatch) -> str | None:
    """The key a search for these arguments uses, with the environment and template hash fixed."""
    monkeypatch.setattr(keys, "collect_env", lambda b, i=0: dict(FIXED_ENV[b]))
    monkeypatch.setattr(ops.OpFamily, "template_hash", property(lambda self: f"templates-of-{self.name}"))
    try:
        key = keys.request(op_name, shape, dtype, backend, dict(attrs)).key
    except Exception as exc:  # noqa: BLE001 - a refused spec is part of the golden record
        return f"refused: {type(exc).__name__}"
    return key


def _load(name: str) -> dict:
    return json.loads((GOLDEN / name).read_text())


def _store(name: str, data: dict) -> None:
    GOLDEN.mkdir(exist_ok=True)
    (GOLDEN / name).write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def test_rendered_sources_are_byte_identical_to_the_golden_digests():
    got = {op_name: _render_digests(op_name) for op_name in _builtin_ops()}
    if WRITE:
        _store("renders.json", got)
    want = _load("renders.json")
    assert sorted(got) == sorted(want), "the set of built-in ops changed"
    for op_name in want:
        diff = sorted(k for k in set(want[op_name]) | set(got[op_name])
                      if want[op_name].get(k) != got[op_name].get(k))
        assert not diff, f"{op_name}: rendered sources changed for {diff[:5]}"


def test_cache_keys_of_a_fixed_list_of_specs_are_unchanged(monkeypatch):
    got = {"|".join(map(str, (op, "x".join(map(str, shape)), dtype, json.dumps(attrs, sort_keys=True), backend))):
           _golden_key(op, shape, dtype, attrs, backend, monkeypatch)
           for op, shape, dtype, attrs, backend in _key_cases()}
    if WRITE:
        _store("keys.json", {"env": FIXED_ENV, "keys": got})
    want = _load("keys.json")
    assert want["env"] == FIXED_ENV
    assert len(want["keys"]) >= 300
    changed = sorted(k for k in set(want["keys"]) | set(got) if want["keys"].get(k) != got.get(k))
    assert not changed, f"{len(changed)} keys changed, e.g. {changed[:3]}"


@pytest.mark.skipif(WRITE, reason="writing the golden files")
def test_golden_key_check_is_not_vacuous(monkeypatch):
    """The same path with one environment field changed gives another key."""
    key = _golden_key("rmsnorm", (2048, 4096), "float16", {}, "cuda", monkeypatch)
    monkeypatch.setitem(FIXED_ENV["cuda"], "driver", "other")
    other = _golden_key("rmsnorm", (2048, 4096), "float16", {}, "cuda", monkeypatch)
    assert len(key) == 64 and len(other) == 64 and key != other
