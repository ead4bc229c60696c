"""The `--json` schema (docs/json.md, forge_cli/jsonout.py): every command's document starts with the schema
version and the command; a command given --json that fails prints the error object instead (one JSON
document on stdout either way), with its exit status unchanged. Cheap inputs only: cache hits, a
hand-made cache entry, a missing bench target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from forge.cache import Cache
from forge_cli import cli, jsonout
from forge_cli.commands import ops as ops_cmd
from forge_cli.jsonout import SCHEMA_VERSION
from tests.conftest import HAS_CUDA
from tests.test_export import kernel_entry

runner = CliRunner()
SHAPE = ["softmax", "--shape", "3x40", "--dtype", "float32", "--device", "cpu"]  # kernel_entry's spec
TABLE = Path(__file__).parent / "replay_tables" / "synthetic-rows.json"


def _invoke(args: list, code: int) -> dict:
    res = runner.invoke(cli.app, [*map(str, args), "--json"])
    assert res.exit_code == code, res.output
    return json.loads(res.stdout)  # exactly one document: json.loads refuses anything after it


def _doc(command: str, args: list, code: int = 0) -> dict:
    doc = _invoke(args, code)
    assert list(doc)[:2] == ["version", "command"], list(doc)
    assert doc["version"] == SCHEMA_VERSION and doc["command"] == command
    assert "error" not in doc
    return doc


def _error(command: str | None, args: list, code: int, kind: str) -> str:
    doc = _invoke(args, code)
    message = doc.get("error", {}).get("message")
    assert doc == {"version": SCHEMA_VERSION, "command": command,
                   "error": {"type": kind, "exit_code": code, "message": message}}
    assert isinstance(message, str) and message
    return " ".join(message.split())


@pytest.fixture
def db(tmp_path):
    """A cache holding one kernel for softmax 3x40 float32 on this machine's interpreter."""
    path = tmp_path / "forge.db"
    entry = kernel_entry("softmax", (3, 40), "float32")
    with Cache(path) as c:
        c.put(entry)
    return path, entry


# -- every command with --json has a test below ---------------------------------------------------------
COVERED = {"search", "bench", "trace", "export", "ops", "replay", "cache ls", "cache show", "cache rm",
           "cache path", "cache export", "cache import", "cache merge", "cache prune"}


def _json_commands() -> set[str]:
    found = set()

    def walk(group, prefix: str) -> None:
        for name, cmd in group.commands.items():
            path = f"{prefix} {name}".strip()
            if hasattr(cmd, "commands"):
                walk(cmd, path)
            elif any("--json" in p.opts for p in cmd.params):
                found.add(path)

    walk(typer.main.get_command(cli.app), "")
    return found


def test_every_json_command_is_covered_here():
    assert _json_commands() == COVERED


# -- documents --------------------------------------------------------------------------------------------
def test_ops_and_replay():
    doc = _doc("ops", ["ops"])
    assert "softmax" in {r["op"] for r in doc["ops"]}
    doc = _doc("replay", ["replay", TABLE, "--seeds", "1", "--strategy", "random"])
    assert doc["seeds"] == 1 and set(doc["strategies"]) == {"random"} and set(doc["tables"]) == {TABLE.stem}


def test_cache_ls_empty_and_one_entry(tmp_path, db):
    empty = _doc("cache ls", ["cache", "ls", "--cache", tmp_path / "empty.db"])
    assert empty["entries"] == [] and empty["cache"] == str(tmp_path / "empty.db")
    path, entry = db
    doc = _doc("cache ls", ["cache", "ls", "--cache", path])
    assert [(r["key"], r["op"], r["shape"], r["decision"]) for r in doc["entries"]] == [
        (entry.key, "softmax", "3x40", "kernel")]


def test_cache_show_path_rm(db):
    path, entry = db
    doc = _doc("cache show", ["cache", "show", entry.key[:12], "--cache", path])
    assert doc["key"] == entry.key and doc["source"] == entry.source
    assert _doc("cache path", ["cache", "path", "--cache", path])["path"] == str(path)
    assert _doc("cache rm", ["cache", "rm", "--all", "--cache", path]) == {
        "version": SCHEMA_VERSION, "command": "cache rm", "cache": str(path), "removed": 1}
    assert _doc("cache ls", ["cache", "ls", "--cache", path])["entries"] == []


def test_cache_export_import_merge_prune(tmp_path, db):
    path, entry = db
    bundle = tmp_path / "b.json"
    doc = _doc("cache export", ["cache", "export", bundle, "--cache", path])
    assert doc["count"] == 1 and doc["keys"] == [entry.key] and doc["bundle"] == str(bundle)
    doc = _doc("cache import", ["cache", "import", bundle, "--cache", tmp_path / "imported.db"])
    assert doc["added"] == [entry.key] and doc["rejected"] == []
    doc = _doc("cache merge", ["cache", "merge", path, "--cache", tmp_path / "merged.db"])
    assert doc["added"] == [entry.key]
    doc = _doc("cache prune", ["cache", "prune", "--dry-run", "--cache", path])
    assert doc["dry_run"] is True and doc["criteria"] == ["env", "stale"] and doc["entries"] == []


def test_search_one_op_and_a_manifest_from_the_cache(tmp_path, db):
    path, entry = db
    doc = _doc("search", ["search", *SHAPE, "--cache", path])
    assert doc["cache_hit"] is True and doc["key"] == entry.key and doc["decision"] == "kernel"
    manifest = tmp_path / "m.toml"
    manifest.write_text('[defaults]\ndevice = "cpu"\nworkers = 1\n\n'
                        '[[op]]\nop = "softmax"\nshape = "3x40"\ndtype = "float32"\n')
    doc = _doc("search", ["search", "--manifest", manifest, "--cache", path])
    assert doc["jobs"] == 1 and [(e["status"], e["key"]) for e in doc["entries"]] == [("cached", entry.key)]


def test_bench_document_then_a_failing_exit_prints_no_error_object(tmp_path):
    # Nothing cached: bench reports the target missing in its document, then exits 2; stdout holds that
    # document only (_invoke's json.loads would fail on a second one).
    doc = _doc("bench", ["bench", "rmsnorm", "--shape", "4x8", "--device", "cpu", "--cache", tmp_path / "x.db"],
               code=2)
    assert doc["mode"] == "bench" and doc["missing"] == 1
    doc = _doc("bench", ["bench", "--recheck", "--device", "cpu", "--cache", tmp_path / "x.db"])
    assert doc["mode"] == "recheck" and doc["entries"] == []


def test_trace_a_function_and_a_directory(tmp_path):
    (tmp_path / "f.py").write_text("import torch\n\n\ndef f(x):\n    return torch.softmax(x, dim=-1)\n")
    doc = _doc("trace", ["trace", f"{tmp_path / 'f.py'}:f", "--input", "4x8:float32", "--device", "cpu"])
    assert [(r["op"], r["shape"]) for r in doc["regions"]] == [("softmax", [4, 8])]
    problems = tmp_path / "level1"
    problems.mkdir()
    (problems / "1_broken.py").write_text("import forge_no_such_module_for_tests\n")
    doc = _doc("trace", ["trace", problems, "--device", "cpu", "--cache", tmp_path / "x.db"])
    assert doc["directory"] == str(problems) and [p["name"] for p in doc["problems"]] == ["1_broken.py"]
    assert doc["problems"][0]["correct"] is False


def test_export_module_and_hf_kernels(tmp_path, db):
    path, entry = db
    doc = _doc("export", ["export", "--key", entry.key, "-o", tmp_path / "out", "--cache", path])
    assert doc["format"] == "module" and doc["key"] == entry.key and Path(doc["path"]).is_file()
    doc = _doc("export", ["export", "softmax", "--all-shapes", "--format", "hf-kernels", "-o", tmp_path / "hub",
                          "--cache", path])
    assert doc["format"] == "hf-kernels" and doc["keys"] == [entry.key] and doc["skipped"] == []


# -- errors -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("args", "command", "needle"), [
    (["search", "nosuchop", "--shape", "4x4", "--device", "cpu"], "search", "unknown op 'nosuchop'"),
    (["search", "rmsnrm", "--shape", "4x4", "--device", "cpu"], "search", "did you mean 'rmsnorm'"),
    (["search", "rmsnorm", "--shape", "4xq", "--device", "cpu"], "search", "malformed shape '4xq'"),
    (["bench", "rmsnorm", "--shape", "8x64", "--csv", "-"], "bench", "both want stdout"),
    (["cache", "rm"], "cache rm", "give exactly one of KEY, --op OP, --all"),
    (["export", "--key", "ffffffff"], "export", "ffffffff"),
    (["trace", "nosuch.py", "--device", "cpu"], "trace", "no such file"),  # raised under stdout -> stderr
    # Click's own usage errors: a bad option value, an unknown command or option
    (["replay", TABLE, "--seeds", "x"], "replay", "Invalid value for '--seeds'"),
    (["search", "rmsnorm", "--shape", "4x4", "--bogus"], "search", "No such option: --bogus"),
    (["serch"], None, "No such command 'serch'"),
    (["cache", "nosuch"], "cache", "No such command 'nosuch'"),
])
def test_usage_errors_are_the_error_object_with_exit_2(args, command, needle):
    assert needle in _error(command, args, 2, "usage")


@pytest.mark.skipif(HAS_CUDA, reason="needs a machine without a CUDA GPU")
def test_no_gpu_for_device_cuda_is_an_environment_error():
    assert "no CUDA GPU" in _error("search", ["search", "rmsnorm", "--shape", "4x4", "--device", "cuda"], 3,
                                   "environment")


def test_damaged_cache_is_a_cache_error(tmp_path):
    bad = tmp_path / "broken.db"
    bad.write_bytes(b"this is not a sqlite database" * 200)
    assert str(bad) in _error("cache ls", ["cache", "ls", "--cache", bad], 5, "cache")


def test_a_bug_prints_the_error_object_and_keeps_its_traceback(monkeypatch):
    def boom(name):
        raise RuntimeError("boom")

    monkeypatch.setattr(ops_cmd, "describe", boom)
    res = runner.invoke(cli.app, ["ops", "--json"])
    assert res.exit_code == 1 and isinstance(res.exception, RuntimeError)  # propagates: Python's traceback
    assert json.loads(res.stdout) == {"version": SCHEMA_VERSION, "command": "ops",
                                      "error": {"type": "internal", "exit_code": 1, "message": "RuntimeError: boom"}}


def test_without_json_stdout_gets_no_error_object():
    res = runner.invoke(cli.app, ["search", "nosuchop", "--shape", "4x4", "--device", "cpu"])
    assert res.exit_code == 2 and res.stdout == "" and "unknown op" in res.stderr
    res = runner.invoke(cli.app, ["replay", str(TABLE), "--seeds", "x"])
    assert res.exit_code == 2 and res.stdout == ""


# -- the module's rules -----------------------------------------------------------------------------------
def test_json_flag_is_read_before_a_double_dash_only():
    assert jsonout.wants_json(["search", "x", "--json"])
    assert not jsonout.wants_json(["trace", "f.py", "--", "--json"])
    assert not jsonout.wants_json([])


def test_emit_owns_version_and_command_and_prints_one_document(capsys):
    with pytest.raises(ValueError, match="version"):
        jsonout.emit({"version": 2})
    token = jsonout._run.set(jsonout._Run(json=True, path=["cache", "ls"]))
    try:
        jsonout.emit({"entries": []})
        with pytest.raises(RuntimeError, match="second"):
            jsonout.emit({"entries": []})
    finally:
        jsonout._run.reset(token)
    assert json.loads(capsys.readouterr().out) == {"version": SCHEMA_VERSION, "command": "cache ls",
                                                   "entries": []}


def test_docs_list_every_json_command():
    text = (Path(__file__).parent.parent / "docs" / "json.md").read_text()
    for command in COVERED:
        assert f"`forge {command}" in text, command
    assert f"version {SCHEMA_VERSION}" in " ".join(text.split())
