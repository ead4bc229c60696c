"""`forge cache ls | show | rm | path` and damaged-DB handling through the CLI."""

from __future__ import annotations

import hashlib
import json
import os
import time

import pytest
from typer.testing import CliRunner

from forge.cache import Cache, Entry
from forge_cli import cli

runner = CliRunner()
SOURCE = "import triton\n# kernel source\n"


def _entry(op: str, n: int, decision: str = "kernel") -> Entry:
    key = hashlib.sha256(f"{op}{n}{decision}".encode()).hexdigest()
    kernel = decision == "kernel"
    return Entry(
        key=key, op=op,
        spec={"op": op, "inputs": [{"shape": [n, 4096], "dtype": "float16", "strides": [4096, 1],
                                    "device": "cuda"}], "attrs": {"eps": 1e-6}},
        env={"backend": "cuda", "gpu": "NVIDIA H200"}, decision=decision,
        variant="row" if kernel else None, params={"num_warps": 8} if kernel else None,
        source=SOURCE if kernel else None,
        source_sha256=hashlib.sha256(SOURCE.encode()).hexdigest() if kernel else None,
        template_hash="t" * 64, winner={"p20": 9.9, "p50": 10.0, "p80": 10.1} if kernel else None,
        baseline={"p20": 49.0, "p50": 50.0, "p80": 51.0},
        candidates=[{"variant": "row", "params": {"num_warps": 8}, "status": "ok"},
                    {"variant": "looped", "params": {}, "status": "mismatch"}],
        search_seconds=12.5, forge_version="0.1.0", created_at=time.time() - 7200)


@pytest.fixture
def db():
    path = os.path.join(os.environ["FORGE_CACHE_DIR"], "forge.db")
    c = Cache(path)
    c.put(_entry("rmsnorm", 2048))
    c.put(_entry("softmax", 2048, "eager"))
    c.put(_entry("softmax", 4096))
    return c


def test_path_honours_env_and_option(tmp_path):
    res = runner.invoke(cli.app, ["cache", "path"])
    assert res.exit_code == 0 and res.stdout.strip() == os.path.join(os.environ["FORGE_CACHE_DIR"], "forge.db")
    res = runner.invoke(cli.app, ["cache", "path", "--cache", str(tmp_path / "x.db")])
    assert res.stdout.strip() == str(tmp_path / "x.db")


def test_ls_table_and_json(db):
    res = runner.invoke(cli.app, ["cache", "ls"])
    assert res.exit_code == 0, res.output
    for needle in ("rmsnorm", "softmax", "2048x4096", "float16", "NVIDIA H200", "kernel", "eager", "5.00x", "2h"):
        assert needle in res.stdout, needle
    res = runner.invoke(cli.app, ["cache", "ls", "--json", "--op", "softmax"])
    rows = json.loads(res.stdout)["entries"]
    assert sorted(r["decision"] for r in rows) == ["eager", "kernel"]
    assert {r["op"] for r in rows} == {"softmax"}
    assert [r["speedup"] for r in rows if r["decision"] == "kernel"] == [5.0]


def test_show_prints_metadata_and_source(db):
    key = _entry("rmsnorm", 2048).key
    res = runner.invoke(cli.app, ["cache", "show", key[:10]])
    assert res.exit_code == 0, res.output
    assert key in res.stdout and "num_warps=8" in res.stdout and "# kernel source" in res.stdout
    assert "1 mismatch, 1 ok" in res.stdout
    res = runner.invoke(cli.app, ["cache", "show", key, "--json"])
    assert json.loads(res.stdout)["source"] == SOURCE


def test_show_unknown_key_is_usage_error(db):
    res = runner.invoke(cli.app, ["cache", "show", "ffffffff"])
    assert res.exit_code == 2 and "error" in res.output


def test_rm_key_op_all(db):
    key = _entry("rmsnorm", 2048).key
    res = runner.invoke(cli.app, ["cache", "rm", key[:8]])
    assert res.exit_code == 0 and "removed 1 entry" in res.stdout
    assert db.get(key) is None
    res = runner.invoke(cli.app, ["cache", "rm", "--op", "softmax"])
    assert "removed 2 entries" in res.stdout and db.entries() == []
    db.put(_entry("rmsnorm", 1))
    res = runner.invoke(cli.app, ["cache", "rm", "--all"])
    assert "removed 1 entry" in res.stdout and db.entries() == []


@pytest.mark.parametrize("args", [["cache", "rm"], ["cache", "rm", "abcd", "--all"],
                                  ["cache", "rm", "--op", "x", "--all"]])
def test_rm_needs_exactly_one_selector(db, args):
    res = runner.invoke(cli.app, args)
    assert res.exit_code == 2 and "exactly one" in res.output


def test_damaged_db_gives_a_clear_error_not_a_traceback(tmp_path):
    bad = tmp_path / "broken.db"
    bad.write_bytes(b"this is not a sqlite database" * 200)
    for args in (["cache", "ls"], ["cache", "show", "abcd"],
                 ["search", "rmsnorm", "--shape", "2x8", "--device", "cpu"]):
        res = runner.invoke(cli.app, [*args, "--cache", str(bad)])
        assert res.exit_code == 5, (args, res.output)
        assert str(bad) in res.output and "Traceback" not in res.output
        assert "mv" in res.output or "move" in res.output.lower()
    assert bad.read_bytes().startswith(b"this is not")  # never overwritten


def test_help_documents_exit_codes():
    res = runner.invoke(cli.app, ["--help"])
    assert res.exit_code == 0
    flat = " ".join(res.stdout.split())
    for code in ("0 decided", "2 usage", "3 environment", "4 every candidate failed", "5 cache"):
        assert code in flat, code
