"""`forge export`: standalone modules for every op family (run in a fresh process where forge cannot
be imported, compared with the float64 oracle), argument checks, and every error path's exit code. The
hf-kernels repositories: tests/test_export_hf.py."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from forge import codegen, ops
from forge._version import __version__
from forge.cache import Cache, Entry
from forge.env import collect_env
from forge.key import cache_key
from forge.loader import source_sha256
from forge.tuner import engine, export, stats, validate
from forge_cli import cli
from tests.conftest import HAS_CUDA

pytestmark = pytest.mark.skipif(HAS_CUDA, reason="exercises the interpreter path (CPU tensors)")
runner = CliRunner()

# One small problem per op family (attrs chosen to cover the glue's branches: reduction="none" writes
# one loss per row, argmax returns int64, GQA + causal attention).
CASES = [
    ("rmsnorm", (3, 40), "float32", {}),
    ("softmax", (3, 40), "float16", {}),
    ("layer_norm", (3, 40), "float32", {"eps": 1e-5}),
    ("reduce", (4, 33), "float32", {"kind": "argmax", "keepdim": True}),
    ("gelu", (5, 7), "float32", {"approximate": "tanh"}),
    ("silu_mul", (3, 7), "float32", {}),
    ("matmul", (7, 5, 16), "float32", {}),
    ("rope", (2, 3, 5, 8), "float32", {}),
    ("sdpa", (1, 2, 7, 9, 16), "float32", {"causal": True, "kv_heads": 1}),
    ("cross_entropy", (7, 33), "float32", {"reduction": "none"}),
    ("cross_entropy", (7, 33), "float32", {}),
]


def _generic_cases() -> list[tuple]:
    """Op families added later get a case too: the first of their TEST_SHAPES (else a row shape) and
    dtype that their make_spec accepts."""
    known = {c[0] for c in CASES}
    out = []
    for name in sorted(ops.available()):
        if name in known:
            continue
        mod = ops.get(name).module
        shapes = list(getattr(mod, "TEST_SHAPES", None) or []) + [(3, 40), (2, 3, 5, 8)]
        tries = [(tuple(s), d) for s in shapes[1:] + shapes[:1] for d in ("float32", "float16")]
        for shape, dtype in tries:
            try:
                mod.make_spec(shape, dtype, "cpu", {})
            except (ValueError, TypeError, IndexError):
                continue
            out.append((name, shape, dtype, {}))
            break
        else:
            out.append((name, shapes[0], "float32", {}))  # fails below with a message asking for a case
    return out


def kernel_entry(op_name: str, shape, dtype: str = "float32", attrs: dict | None = None, *,
                 decision: str = "kernel", created_at: float | None = None, env: dict | None = None) -> Entry:
    """A cache entry exactly as the engine writes one for the interpreter, for the op's default
    candidate (no search: rendering is what makes the source; the timings are placeholders)."""
    op = ops.get(op_name)
    spec = op.module.make_spec(tuple(shape), dtype, "cpu", attrs or {})
    env = env or {**collect_env("interpreter"), "templates": op.template_hash}
    cand = op.module.default(spec)
    kernel = decision == "kernel"
    source = codegen.render(op, spec, cand) if kernel else None
    return Entry(
        key=cache_key(spec, env), op=op_name, spec=spec.to_dict(), env=env, decision=decision,
        variant=cand.variant if kernel else None, params=cand.p if kernel else None, source=source,
        source_sha256=source_sha256(source) if kernel else None, template_hash=op.template_hash,
        winner={"p20": 90.0, "p50": 100.0, "p80": 110.0, "n": 5} if kernel else None,
        baseline={"p20": 190.0, "p50": 200.0, "p80": 210.0, "n": 5},
        candidates=[{**cand.to_dict(), "status": "ok"}], search_seconds=1.5, forge_version=__version__,
        created_at=time.time() if created_at is None else created_at)


# A fresh interpreter where forge cannot be imported even if it is installed (CI installs it
# editable into the venv): cwd elsewhere, no PYTHONPATH, and a meta-path finder refusing forge.
NO_FORGE = textwrap.dedent("""
    import sys
    class _NoForge:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("forge", "forge_cli", "forge_ops"):
                raise ImportError(f"{name} is blocked: the exported code must not need forge")
    sys.meta_path.insert(0, _NoForge())
    try:
        import forge  # noqa: F401
        sys.exit("forge is importable in the clean process")
    except ImportError:
        pass
""")
_RUNNER = NO_FORGE + textwrap.dedent("""
    import importlib.util, json
    import torch
    jobs = json.load(open(sys.argv[1]))
    results = {}
    for job in jobs:
        spec = importlib.util.spec_from_file_location(job["module"], job["path"])
        mod = importlib.util.module_from_spec(spec)
        sys.modules[job["module"]] = mod
        spec.loader.exec_module(mod)
        inputs = torch.load(job["inputs"])
        results[job["module"]] = getattr(mod, job["function"])(*inputs)
    torch.save(results, sys.argv[2])
    print("forge-free ok", sorted(m for m in sys.modules if m.split(".")[0] == "forge"))
""")


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP")}
    env["TRITON_INTERPRET"] = "1"
    return env


def run_clean(jobs: list[dict], workdir: Path) -> dict:
    (workdir / "jobs.json").write_text(json.dumps(jobs))
    (workdir / "runner.py").write_text(_RUNNER)
    res = subprocess.run([sys.executable, str(workdir / "runner.py"), "jobs.json", "out.pt"], cwd=workdir,
                         env=_clean_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "forge-free ok []" in res.stdout, res.stdout
    return torch.load(workdir / "out.pt")


def _tolerance(op, spec):
    tol_for = getattr(op.module, "tolerance_for", None)
    return tol_for(spec) if tol_for else op.module.tolerance(spec.dtype)


def test_every_op_family_exports_and_matches_the_oracle_without_forge(tmp_path):
    """Each family's exported module, imported in a process without forge, against float64."""
    db = Cache(tmp_path / "forge.db")
    jobs, expected = [], {}
    for i, (name, shape, dtype, attrs) in enumerate(CASES + _generic_cases()):
        op = ops.get(name)
        try:
            entry = kernel_entry(name, shape, dtype, attrs)
        except ValueError as exc:  # a later op whose TEST_SHAPES convention we guessed wrong
            pytest.fail(f"{name}: give it a case in CASES ({exc})")
        db.put(entry)
        module_name = f"{name}_{i}"
        done = export.export(entry, op, tmp_path / "out", name=module_name)
        assert done.path == tmp_path / "out" / f"{module_name}.py"
        spec = op.module.make_spec(tuple(shape), dtype, "cpu", attrs)
        inputs = op.module.make_inputs(spec, seed=7)
        torch.save(inputs, tmp_path / f"in_{i}.pt")
        jobs.append({"module": module_name, "path": str(done.path), "function": name,
                     "inputs": str(tmp_path / f"in_{i}.pt")})
        with torch.no_grad():
            expected[module_name] = (op, spec, op.module.oracle(inputs, spec.attrs))
    outputs = run_clean(jobs, tmp_path)
    for module_name, (op, spec, ref) in expected.items():
        out = outputs[module_name]
        reason = validate.compare(out, ref, _tolerance(op, spec))
        assert reason is None, f"{module_name}: {reason}"


def test_module_header_signature_and_verbatim_source(tmp_path):
    entry = kernel_entry("rmsnorm", (3, 40), attrs={"eps": 1e-5})
    path = export.export(entry, ops.get("rmsnorm"), tmp_path).path
    text = path.read_text()
    doc = ast.get_docstring(ast.parse(text))
    for needle in ("rmsnorm 3x40 float32", "rmsnorm(x, w, *, eps=1e-05) -> output", "x: float32 (3, 40)",
                   "w: float32 (40,)", "interpreter", f"torch {torch.__version__}", "kernel 90.00 / 100.00 / 110.00",
                   "eager 190.00 / 200.00 / 210.00", "speedup 2.00x", entry.key, entry.source_sha256):
        assert needle in doc, needle
    begin = text.index("(verbatim) ----\n") + len("(verbatim) ----\n")
    assert text[begin:text.index("# ---- end of forge kernel source")] == entry.source
    assert "forge" not in {n.split(".")[0] for n in _imports(text)}


def _imports(text: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def _load(path: Path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"exported_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_exported_function_refuses_what_it_was_not_tuned_for(tmp_path):
    entry = kernel_entry("rmsnorm", (3, 40))
    mod = _load(export.export(entry, ops.get("rmsnorm"), tmp_path, name="rms_checks").path)
    x, w = torch.randn(3, 40), torch.randn(40)
    y = mod.rmsnorm(x, w)
    ref = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    assert torch.allclose(y.double(), ref, rtol=1e-4, atol=1e-5)
    bad = [
        ((torch.randn(4, 40), w), {}, "x must be float32 of shape (3, 40)"),
        ((x.half(), w), {}, "x must be float32 of shape (3, 40)"),
        ((x, w[:39]), {}, "w must be float32 of shape (40,)"),
        ((x, w.tolist()), {}, "w must be a torch.Tensor"),
        ((torch.randn(3, 41)[:, 1:], w), {}, "x must be contiguous"),
        ((torch.randn(121)[1:].view(3, 40), w), {}, "x must be 16-byte aligned"),
        ((torch.empty(3, 40, device="meta"), w), {}, "x must be on cpu"),
        ((x.clone().requires_grad_(), w), {}, "forward-only"),
        ((x, w), {"eps": 1e-5}, "tuned for eps=1e-06, got eps=1e-05"),
    ]
    for args, kwargs, needle in bad:
        with pytest.raises(ValueError, match=re.escape(needle)):
            mod.rmsnorm(*args, **kwargs)
    with torch.no_grad():  # grad off: inputs requiring grad are fine
        assert torch.equal(mod.rmsnorm(x.clone().requires_grad_(), w), y)
    assert mod.SPEC.inputs[0].shape == (3, 40) and mod.METADATA["key"] == entry.key


def test_interpreter_kernel_needs_triton_interpret(tmp_path, monkeypatch):
    entry = kernel_entry("softmax", (2, 16))
    mod = _load(export.export(entry, ops.get("softmax"), tmp_path, name="sm_env").path)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        mod.softmax(torch.randn(2, 16))


# -- the CLI --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    """One real search on the interpreter (acceptance forced, as eager always wins there)."""
    d = tmp_path_factory.mktemp("searched")
    old = os.environ.get("FORGE_LOCK_DIR")
    os.environ["FORGE_LOCK_DIR"] = str(d / "locks")
    mp = pytest.MonkeyPatch()
    mp.setattr(stats, "accepts", lambda *a, **k: True)
    try:
        db = Cache(d / "forge.db")
        report = engine.search("rmsnorm", (6, 48), "float32", device="cpu", cache=db,
                               options=engine.SearchOptions(budget=1, workers=1))
        assert report.decision == "kernel"
        db.put(kernel_entry("softmax", (2, 16), decision="eager"))  # what a search eager won writes
        db.close()
    finally:
        mp.undo()
        if old is None:
            os.environ.pop("FORGE_LOCK_DIR", None)
        else:
            os.environ["FORGE_LOCK_DIR"] = old
    return d / "forge.db"


@pytest.mark.slow
def test_cli_export_of_a_searched_entry_runs_without_forge(searched, tmp_path):
    out = tmp_path / "exported"
    res = runner.invoke(cli.app, ["export", "rmsnorm", "--shape", "6x48", "--dtype", "float32", "--device", "cpu",
                                  "--cache", str(searched), "-o", str(out), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["format"] == "module" and doc["function"] == "rmsnorm"
    path = Path(doc["module"])
    assert path == out / "rmsnorm_6x48_float32.py"
    x, w = torch.randn(6, 48), torch.randn(48)
    torch.save((x, w), tmp_path / "in.pt")
    y = run_clean([{"module": "rms", "path": str(path), "function": "rmsnorm", "inputs": str(tmp_path / "in.pt")}],
                  tmp_path)["rms"]
    ref = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    assert validate.compare(y, ref, ops.get("rmsnorm").module.tolerance("float32")) is None
    meta = _load(path).METADATA
    assert meta["candidates"] == 1 and meta["winner_us"]["p50"] > 0 and meta["env"]["backend"] == "interpreter"
    # The same entry by key, as a person reads it.
    res = runner.invoke(cli.app, ["export", "--key", meta["key"][:10], "--cache", str(searched), "-o", str(out),
                                  "--name", "by_key"])
    assert res.exit_code == 0, res.output
    assert "by_key.py" in res.stdout and (out / "by_key.py").read_text().count(meta["key"]) >= 1


@pytest.mark.slow
@pytest.mark.parametrize("args,code,needle", [
    (["export", "softmax", "--shape", "2x16", "--dtype", "float32", "--device", "cpu"], 2, "eager"),
    (["export", "rmsnorm", "--shape", "6x49", "--dtype", "float32", "--device", "cpu"], 2, "not tuned"),
    (["export", "nosuchop", "--shape", "6x48"], 2, "unknown op"),
    (["export", "rmsnorm", "--shape", "6by48"], 2, "malformed shape"),
    (["export", "rmsnorm", "--shape", "6x48", "--dtype", "float64"], 2, "dtype"),
    (["export", "rmsnorm", "--shape", "6x48", "--attr", "bogus"], 2, "NAME=VALUE"),
    (["export", "rmsnorm", "--shape", "6x48", "--attr", "alpha=1"], 2, "attributes"),
    (["export", "rmsnorm", "--shape", "6x48", "--device", "tpu"], 2, "'cuda' or 'cpu'"),
    (["export", "rmsnorm", "--shape", "6x48", "--device", "cuda"], 3, "no CUDA GPU"),
    (["export", "rmsnorm", "--shape", "6x48", "--device", "cpu", "--format", "wheel"], 2, "--format"),
    (["export", "rmsnorm", "--shape", "6x48", "--dtype", "float32", "--device", "cpu", "--name", "not-a-module"], 2,
     "importable"),
    (["export"], 2, "give OP and --shape"),
    (["export", "rmsnorm", "--shape", "6x48", "--key", "abcd"], 2, "either"),
    (["export", "--key", "ffffffff"], 2, "no entry"),
    (["export", "--key", "abcd", "--dtype", "float32"], 2, "either"),
])
def test_cli_export_errors(searched, tmp_path, args, code, needle):
    res = runner.invoke(cli.app, [*args, "--cache", str(searched), "-o", str(tmp_path / "o")])
    assert res.exit_code == code, res.output
    assert needle in " ".join(res.output.split()) and "Traceback" not in res.output
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


def test_cli_export_tampered_unwritable_or_damaged(tmp_path):
    db = Cache(tmp_path / "forge.db")
    entry = kernel_entry("rmsnorm", (3, 40))
    db.put(entry)
    base = ["export", "rmsnorm", "--shape", "3x40", "--dtype", "float32", "--device", "cpu", "--cache",
            str(tmp_path / "forge.db"), "-o"]

    def invoke(*args):
        res = runner.invoke(cli.app, [*args])
        assert "Traceback" not in res.output
        return res.exit_code, " ".join(res.output.split())

    (tmp_path / "file").write_text("not a directory")
    code, text = invoke(*base, str(tmp_path / "file"))
    assert code == 2 and "cannot write" in text
    db._conn.execute("UPDATE entries SET source = source || '# edited' WHERE key = ?", (entry.key,))
    code, text = invoke(*base, str(tmp_path / "o"))
    assert code == 2 and "does not match its source_sha256" in text
    # A source that is intact but not what the installed templates render (e.g. imported with --trust).
    other = entry.source.replace("BLOCK_N=64", "BLOCK_N=128")
    assert other != entry.source
    db._conn.execute("UPDATE entries SET source = ?, source_sha256 = ? WHERE key = ?",
                     (other, source_sha256(other), entry.key))
    code, text = invoke(*base, str(tmp_path / "o"))
    assert code == 2 and "does not re-render" in text
    assert not (tmp_path / "o").exists()
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"not a database" * 100)
    code, text = invoke(*base[:-3], "--cache", str(bad), "-o", str(tmp_path / "o"))
    assert code == 5 and str(bad) in text


def test_an_op_whose_glue_needs_forge_is_refused_by_name(tmp_path, monkeypatch):
    """The glue is copied generically; one that calls into forge at run time cannot be, and says so."""
    import shutil

    from tests.conftest import ROOT

    src = (ROOT / "kernels" / "softmax.py").read_text()
    src = src.replace('NAME = "softmax"', 'NAME = "forgeful"')
    src = src.replace("def run(module, inputs, out, attrs) -> None:\n",
                      "def run(module, inputs, out, attrs) -> None:\n    opkit.next_pow2(2)\n")
    (tmp_path / "forgeful.py").write_text(src)
    shutil.copytree(ROOT / "templates", tmp_path / "templates")
    monkeypatch.setenv("FORGE_OPS_PATH", str(tmp_path))
    op = ops.get("forgeful")
    with pytest.raises(export.NotExportable, match=r"forgeful cannot be exported standalone: .*run.*'opkit' "
                                                   r"from forge, which is part of forge"):
        export.glue(op, 1)
    # The same op's unmodified glue exports fine (helpers and imports it uses are copied along).
    assert "def run(" in export.glue(ops.get("softmax"), 1).source
