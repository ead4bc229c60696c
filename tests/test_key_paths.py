"""Every public path finds exactly the entry `search` stored (forge/key.py is the one key path).

For each spec: the key `search` uses is read off the engine (a cache hit on a recording cache), an
entry is stored under it, and then the public API, the CLI (one op and a manifest), `bench`, `export`,
`trace`, the shim and `forge.load` must each find that very entry."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

import forge
from forge import codegen, ops
from forge import key as keys
from forge._version import __version__
from forge.cache import Cache, Entry
from forge.errors import UsageError
from forge.loader import source_sha256
from forge.tuner import bench, engine, export, tracetools
from forge_cli import cli

# (op, problem shape, dtype, attrs, the user's code for it)
CASES = [
    ("rmsnorm", (4, 64), "float32", {"eps": 1e-5},
     lambda x, w: x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + 1e-5) * w),
    ("softmax", (3, 40), "float16", {}, lambda x: torch.softmax(x, dim=-1)),
    ("layer_norm", (5, 48), "bfloat16", {}, lambda x, w, b: F.layer_norm(x, (48,), w, b)),
    ("reduce", (4, 33), "float32", {"kind": "mean"}, lambda x: x.mean(-1)),
    ("sdpa", (1, 4, 9, 11, 16), "float32", {"causal": True},
     lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
    ("matmul", (7, 5, 3), "float16", {}, lambda a, b: a @ b),
    ("gelu", (3, 7), "float32", {"approximate": "tanh"}, lambda x: F.gelu(x, approximate="tanh")),
    ("cross_entropy", (6, 10), "float32", {}, lambda logits, target: F.cross_entropy(logits, target)),
]
IDS = [c[0] for c in CASES]


class Recording(Cache):
    """A cache that records the keys looked up and answers each with an eager decision."""

    def __init__(self, path):
        super().__init__(path)
        self.looked_up: list[str] = []

    def get(self, key):
        self.looked_up.append(key)
        return Entry(key=key, op="?", spec={}, env={"backend": "interpreter"}, decision="eager", variant=None,
                     params=None, source=None, source_sha256=None, template_hash="", winner=None,
                     baseline=None, candidates=[], search_seconds=0.0, forge_version=__version__,
                     created_at=time.time())


def _search_key(tmp_path, op, shape, dtype, attrs) -> str:
    rec = Recording(tmp_path / "recording.db")
    report = engine.search(op, shape, dtype, device="cpu", cache=rec, attrs=dict(attrs))
    assert report.cache_hit and rec.looked_up == [report.key]
    return report.key


def _store_kernel(db: Cache, key: str, op_name: str, shape, dtype, attrs) -> Entry:
    op, spec = keys.build_spec(op_name, shape, dtype, "interpreter", attrs)
    cand = op.module.default(spec)
    source = codegen.render(op, spec, cand)
    entry = Entry(key=key, op=op_name, spec=spec.to_dict(), env=keys.environment(op, "interpreter"),
                  decision="kernel", variant=cand.variant, params=cand.p, source=source,
                  source_sha256=source_sha256(source), template_hash=op.template_hash,
                  winner={"p20": 9.0, "p50": 10.0, "p80": 11.0, "n": 5},
                  baseline={"p20": 19.0, "p50": 20.0, "p80": 21.0, "n": 5}, candidates=[], search_seconds=1.0,
                  forge_version=__version__, created_at=time.time())
    db.put(entry)
    return entry


@pytest.mark.parametrize(("op", "shape", "dtype", "attrs", "fn"), CASES, ids=IDS)
def test_every_public_path_finds_the_entry_search_stored(tmp_path, op, shape, dtype, attrs, fn):
    key = _search_key(tmp_path, op, shape, dtype, attrs)
    db = Cache(tmp_path / "forge.db")
    stored = _store_kernel(db, key, op, shape, dtype, attrs)

    # the public Python API and the CLI report a cache hit of that entry
    report = forge.search(op, shape, dtype, device="cpu", cache=db, **attrs)
    assert report.cache_hit and report.key == key and report.decision == "kernel"
    spec = forge.kernel_spec(op, shape, dtype, device="cpu", **attrs)
    assert forge.search(spec, cache=db).key == key
    attr_args = [a for k, v in attrs.items() for a in ("--attr", f"{k}={json.dumps(v)}")]
    res = CliRunner().invoke(cli.app, ["search", op, "--shape", "x".join(map(str, shape)), "--dtype", dtype,
                                       "--device", "cpu", "--cache", str(db.path), "--json", *attr_args])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["cache_hit"] and doc["key"] == key

    # bench, export and trace look up the same entry
    target = bench.resolve_target(op, shape, dtype, attrs, "interpreter", db)
    assert target.key == key and target.entry is not None and target.entry.key == key
    fam, found = export.lookup(db, op, shape, dtype, "cpu", attrs)
    assert found == stored and fam.name == op
    args = ops.get(op).module.make_inputs(spec, seed=7)
    result = tracetools.trace(tracetools.Target(fn, tuple(args), op), "cpu")
    (region,) = result.regions
    tracetools.annotate_with_cache(result, db, "interpreter")
    assert (region.op, region.decision) == (op, "kernel"), region

    # the shim binds that entry's kernel, and forge.load finds it
    why = forge.explain(forge.optimize(fn, interpreter=True, cache=db.path, warn=False), *args)
    assert (why.uses, why.key) == ("kernel", key), why
    assert callable(forge.load(op, shape, dtype, device="cpu", cache=str(db.path), **attrs))


def test_a_manifest_run_finds_the_entries_search_stored(tmp_path):
    db = Cache(tmp_path / "forge.db")
    lines = ['[defaults]\ndevice = "cpu"\n']
    wanted = {}
    for op, shape, dtype, attrs, _ in CASES:
        key = _search_key(tmp_path, op, shape, dtype, attrs)
        _store_kernel(db, key, op, shape, dtype, attrs)
        wanted[(op, "x".join(map(str, shape)))] = key
        extra = "".join(f"{k} = {json.dumps(v)}\n" for k, v in attrs.items())
        lines.append(f'[[op]]\nop = "{op}"\nshapes = ["{"x".join(map(str, shape))}"]\ndtype = "{dtype}"\n{extra}')
    (tmp_path / "m.toml").write_text("\n".join(lines))
    res = CliRunner().invoke(cli.app, ["search", "--manifest", str(tmp_path / "m.toml"), "--cache", str(db.path),
                                       "--json"])
    assert res.exit_code == 0, res.output
    entries = json.loads(res.stdout)["entries"]
    assert {(e["op"], e["shape"]): (e["status"], e["key"]) for e in entries} == {
        k: ("cached", v) for k, v in wanted.items()}


def test_a_spec_forge_does_not_build_is_refused(tmp_path):
    spec = forge.kernel_spec("rmsnorm", (4, 64), "float32", device="cpu")
    odd = dataclasses.replace(spec, inputs=(spec.inputs[0], dataclasses.replace(spec.inputs[1], shape=(32,),
                                                                                 strides=(1,))))
    with pytest.raises(UsageError, match="not one rmsnorm builds"):
        forge.search(odd, cache=tmp_path / "forge.db")
    with pytest.raises(UsageError, match="device='cuda' but the KernelSpec's tensors are on 'cpu'"):
        forge.search(spec, device="cuda", cache=tmp_path / "forge.db")


def test_the_public_search_api_searches_and_loads_no_cli(tmp_path):
    """forge.search runs a real search (interpreter, budget 2) in a process that never imports Typer or
    Rich, and a second call is a cache hit of the same key."""
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    code = f"""
import json, sys, forge
r = forge.search("softmax", (2, 8), "float32", device="cpu", budget=2, cache={str(tmp_path / "f.db")!r})
again = forge.search("softmax", (2, 8), "float32", device="cpu", budget=2, cache={str(tmp_path / "f.db")!r})
print(json.dumps({{"decision": r.decision, "key": r.key, "n": len(r.candidates), "hit": again.cache_hit,
                  "same": again.key == r.key,
                  "cli": sorted(m for m in sys.modules if m.split(".")[0] in ("typer", "rich", "forge_cli"))}}))
"""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert doc["decision"] in ("kernel", "eager") and len(doc["key"]) == 64 and doc["n"] == 2
    assert doc["hit"] and doc["same"] and doc["cli"] == []
