"""`forge cache export | import | merge | prune`: round trip, tampered entries rejected and listed,
--trust, other-environment entries kept but never served, merge newer-wins and idempotent, prune by
each criterion, and every error path's exit code (no traceback)."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
import torch
from typer.testing import CliRunner

import forge
from forge.cache import Cache
from forge.key import cache_key, imported_version
from forge.loader import source_sha256
from forge.spec import KernelSpec
from forge.tuner import bundle
from forge_cli import cli
from tests.conftest import HAS_CUDA
from tests.test_export import kernel_entry

runner = CliRunner()
DAY = 86400.0


def _db(tmp_path, name="forge.db") -> Cache:
    return Cache(tmp_path / name)


def _invoke(*args):
    res = runner.invoke(cli.app, [str(a) for a in args])
    assert "Traceback" not in res.output, res.output
    return res


def _rekey(entry, **changes):
    """The entry as another machine would have made it: changed fields, and the key that goes with them."""
    e = dataclasses.replace(entry, **changes)
    return dataclasses.replace(e, key=cache_key(KernelSpec.from_dict(e.spec), e.env))


def _other_env(entry):
    return _rekey(entry, env={**entry.env, "torch": "0.0.0", "cpu": "some other CPU"})


def _edited(entry):
    """Intact (sha256 matches) but not what the templates render: what --trust is about."""
    source = entry.source + "\nimport os  # added behind forge's back\n"
    return dataclasses.replace(entry, source=source, source_sha256=source_sha256(source))


@pytest.fixture
def entries():
    now = time.time()
    return {
        "rms": kernel_entry("rmsnorm", (3, 40), created_at=now - 3600),
        "sm": kernel_entry("softmax", (2, 16), created_at=now - 7200),
        "eager": kernel_entry("gelu", (5, 7), decision="eager", created_at=now - 60),
    }


def _imported(e):
    """An entry as an import stores it: marked as imported (its timings were measured elsewhere)."""
    return dataclasses.replace(e, forge_version=imported_version(e.forge_version))


def test_export_import_round_trip(tmp_path, entries):
    src = _db(tmp_path, "src.db")
    for e in entries.values():
        src.put(e)
    res = _invoke("cache", "export", tmp_path / "b.json", "--cache", tmp_path / "src.db", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["count"] == 3
    doc = json.loads((tmp_path / "b.json").read_text())
    assert doc["format"] == "forge-cache-bundle" and doc["format_version"] == 1 and len(doc["entries"]) == 3
    res = _invoke("cache", "import", tmp_path / "b.json", "--cache", tmp_path / "dst.db")
    assert res.exit_code == 0, res.output
    assert "3 added, 0 replaced (newer), 0 kept" in " ".join(res.stdout.split())
    dst = _db(tmp_path, "dst.db")
    assert {e.key: e for e in dst.entries()} == {e.key: _imported(e) for e in entries.values()}
    # --op filters; importing again changes nothing.
    res = _invoke("cache", "export", tmp_path / "rms.json", "--op", "rmsnorm", "--cache", tmp_path / "src.db")
    assert res.exit_code == 0 and "exported 1 entry" in res.stdout
    res = _invoke("cache", "import", tmp_path / "b.json", "--cache", tmp_path / "dst.db", "--json")
    report = json.loads(res.stdout)
    assert res.exit_code == 0 and report["added"] == [] and sorted(report["kept"]) == sorted(e.key for e in
                                                                                            entries.values())


def test_tampered_bundle_entries_are_rejected_and_listed(tmp_path, entries):
    good = entries["rms"]
    edited = _edited(entries["sm"])
    broken = dataclasses.replace(kernel_entry("layer_norm", (3, 40)), source="print('hi')\n")  # sha256 stale
    stolen_key = dataclasses.replace(_other_env(kernel_entry("silu_mul", (3, 7))),
                                     key=kernel_entry("silu_mul", (3, 7)).key)  # claims this machine's key
    rows = [bundle.entry_to_json(e) for e in (good, edited, broken, stolen_key)]
    rows.append({"key": "0" * 64, "op": "rmsnorm"})  # malformed
    bundle.write_bundle(tmp_path / "b.json", [])
    doc = json.loads((tmp_path / "b.json").read_text())
    doc["entries"] = rows
    (tmp_path / "b.json").write_text(json.dumps(doc))

    res = _invoke("cache", "import", tmp_path / "b.json", "--cache", tmp_path / "dst.db")
    assert res.exit_code == 5, res.output
    flat = " ".join(res.output.split())
    assert "1 added" in flat and "4 rejected" in flat and "4 entries were rejected" in flat
    for e in (edited, broken, stolen_key):
        assert e.key[:12] in res.stdout
    assert "does not re-render from the installed templates" in flat
    assert "does not match its source_sha256" in flat
    assert "key is not sha256(spec, env)" in flat
    assert "malformed entry: missing" in flat
    assert [e.key for e in _db(tmp_path, "dst.db").entries()] == [good.key]

    res = _invoke("cache", "import", tmp_path / "b.json", "--cache", tmp_path / "dst2.db", "--json")
    report = json.loads(res.stdout)
    assert res.exit_code == 5 and report["added"] == [good.key]
    assert {r["key"] for r in report["rejected"]} == {edited.key, broken.key, stolen_key.key, "0" * 64}


def test_trust_imports_unverified_sources_with_a_warning(tmp_path, entries):
    edited = _edited(entries["sm"])
    unknown_op = _rekey(entries["rms"], op="not_installed",
                        spec={**entries["rms"].spec, "op": "not_installed"})
    bundle.write_bundle(tmp_path / "b.json", [edited, unknown_op, entries["rms"]])
    res = _invoke("cache", "import", tmp_path / "b.json", "--cache", tmp_path / "a.db")
    assert res.exit_code == 5 and "is not installed here" in " ".join(res.output.split())
    res = _invoke("cache", "import", tmp_path / "b.json", "--cache", tmp_path / "b.db", "--trust", "--json")
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert sorted(report["added"]) == sorted([edited.key, unknown_op.key, entries["rms"].key])
    assert {t["key"] for t in report["trusted"]} == {edited.key, unknown_op.key}
    assert "warning" in res.stderr and "--trust" in res.stderr and edited.key[:12] in res.stderr
    assert _db(tmp_path, "b.db").get(edited.key).source == edited.source
    # --trust never overrides integrity: an edited source whose sha256 was not updated stays out.
    broken = dataclasses.replace(entries["rms"], source=entries["rms"].source + "#")
    bundle.write_bundle(tmp_path / "c.json", [broken])
    res = _invoke("cache", "import", tmp_path / "c.json", "--cache", tmp_path / "c.db", "--trust")
    assert res.exit_code == 5 and "source_sha256" in res.output


@pytest.mark.skipif(HAS_CUDA, reason="exercises the shim on the interpreter (CPU tensors)")
def test_other_environment_entries_are_kept_but_never_served(tmp_path, entries):
    theirs = _other_env(entries["rms"])
    bundle.write_bundle(tmp_path / "b.json", [theirs])
    db_path = tmp_path / "c" / "forge.db"
    res = _invoke("cache", "import", tmp_path / "b.json", "--cache", db_path, "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["other_env"] == [theirs.key]
    assert _db(tmp_path / "c").get(theirs.key) is not None
    # This machine's key for the same spec is another key: a miss, for load() and for the shim.
    with pytest.raises(LookupError, match="not tuned"):
        forge.load("rmsnorm", (3, 40), "float32", device="cpu", cache=db_path)

    def rms(x, w):
        return x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + 1e-6) * w

    x, w = torch.randn(3, 40), torch.randn(40)
    f = forge.optimize(rms, interpreter=True, search=False, warn=False, cache=db_path)
    assert forge.explain(f, x, w).reason.startswith("cache miss")
    assert torch.equal(f(x, w), rms(x, w))
    # Even stored under this machine's key (import refuses that), the shim refuses another env.
    db = _db(tmp_path / "c")
    db.put(dataclasses.replace(theirs, key=entries["rms"].key))
    g = forge.optimize(rms, interpreter=True, search=False, warn=False, cache=db_path)
    assert "another environment" in forge.explain(g, x, w).reason


def test_merge_newer_wins_and_is_idempotent(tmp_path, entries):
    old, other = entries["rms"], entries["sm"]
    newer = dataclasses.replace(old, winner={"p20": 1.0, "p50": 2.0, "p80": 3.0, "n": 5},
                                created_at=old.created_at + 100)
    a, b, dst = _db(tmp_path, "a.db"), _db(tmp_path, "b.db"), _db(tmp_path, "dst.db")
    a.put(old)
    b.put(newer)
    b.put(other)
    dst.put(entries["eager"])
    res = _invoke("cache", "merge", tmp_path / "a.db", tmp_path / "b.db", "--cache", tmp_path / "dst.db", "--json")
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert sorted(report["added"]) == sorted([old.key, other.key]) and report["replaced"] == []
    assert dst.get(old.key) == _imported(newer) and dst.get(other.key) == _imported(other)
    assert dst.get(entries["eager"].key)
    before = dst.entries()
    for order in (("a.db", "b.db"), ("b.db", "a.db")):
        res = _invoke("cache", "merge", *(tmp_path / n for n in order), "--cache", tmp_path / "dst.db", "--json")
        report = json.loads(res.stdout)
        assert res.exit_code == 0 and report["added"] == report["replaced"] == []
        assert dst.entries() == before
    res = _invoke("cache", "merge", tmp_path / "a.db", "--cache", tmp_path / "dst.db")
    assert res.exit_code == 0 and "0 added, 0 replaced (newer), 1 kept" in " ".join(res.stdout.split())
    # A merged DB is checked like a bundle: an edited source is rejected and listed.
    bad = _db(tmp_path, "bad.db")
    bad.put(_edited(entries["sm"]))
    res = _invoke("cache", "merge", tmp_path / "bad.db", "--cache", tmp_path / "dst.db")
    assert res.exit_code == 5 and "does not re-render" in " ".join(res.output.split())
    assert dst.get(other.key) == _imported(other)


def test_merge_leaves_source_dbs_untouched(tmp_path, entries):
    a = _db(tmp_path, "a.db")
    a.put(entries["rms"])
    a.close()
    before = (tmp_path / "a.db").read_bytes()
    res = _invoke("cache", "merge", tmp_path / "a.db", "--cache", tmp_path / "d" / "dst.db")
    assert res.exit_code == 0, res.output
    assert (tmp_path / "a.db").read_bytes() == before  # opened read-only (SQLite may add its -shm/-wal)
    assert _db(tmp_path / "d", "dst.db").get(entries["rms"].key) == _imported(entries["rms"])
    # A newer copy elsewhere replaces it; an older one does not.
    b = _db(tmp_path, "b.db")
    b.put(dataclasses.replace(entries["rms"], created_at=entries["rms"].created_at + 1, search_seconds=9.0))
    res = _invoke("cache", "merge", tmp_path / "b.db", "--cache", tmp_path / "d" / "dst.db", "--json")
    assert json.loads(res.stdout)["replaced"] == [entries["rms"].key]
    assert _db(tmp_path / "d", "dst.db").get(entries["rms"].key).search_seconds == 9.0


def _prune_db(tmp_path, entries):
    now = time.time()
    db = _db(tmp_path)
    rows = {
        "fresh": entries["rms"],
        "other_env": _other_env(entries["sm"]),
        "stale": _rekey(entries["eager"], template_hash="0" * 64, env={**entries["eager"].env, "templates": "0" * 64}),
        "old": kernel_entry("silu_mul", (3, 7), created_at=now - 10 * DAY),
    }
    for e in rows.values():
        db.put(e)
    return db, rows


@pytest.mark.parametrize("flags,gone", [
    (["--env"], {"other_env"}),
    (["--stale"], {"stale"}),
    (["--older-than", "5"], {"old"}),
    (["--older-than", "20"], set()),
    ([], {"other_env", "stale"}),
    (["--env", "--older-than", "5"], {"other_env", "old"}),
])
def test_prune_by_each_criterion_with_dry_run(tmp_path, entries, flags, gone):
    db, rows = _prune_db(tmp_path, entries)
    keys = {name: e.key for name, e in rows.items()}
    res = _invoke("cache", "prune", *flags, "--dry-run", "--json", "--cache", db.path)
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["dry_run"] is True and doc["removed"] == 0
    assert {r["key"] for r in doc["entries"]} == {keys[n] for n in gone}
    assert len(db.entries()) == 4  # nothing deleted
    res = _invoke("cache", "prune", *flags, "--dry-run", "--cache", db.path)
    assert f"would remove {len(gone)} entr" in res.stdout
    for n in gone:
        assert keys[n][:12] in res.stdout
    res = _invoke("cache", "prune", *flags, "--cache", db.path)
    assert res.exit_code == 0 and f"removed {len(gone)} entr" in res.stdout
    assert {e.key for e in db.entries()} == {keys[n] for n in rows if n not in gone}


def test_prune_reasons_are_specific(tmp_path, entries):
    db, rows = _prune_db(tmp_path, entries)
    res = _invoke("cache", "prune", "--env", "--stale", "--older-than", "5", "--dry-run", "--json",
                  "--cache", db.path)
    reasons = {r["key"]: " ".join(r["reasons"]) for r in json.loads(res.stdout)["entries"]}
    assert "torch 0.0.0" in reasons[rows["other_env"].key]
    assert "stale templates" in reasons[rows["stale"].key]
    assert "older than 5 days" in reasons[rows["old"].key]
    assert rows["fresh"].key not in reasons


@pytest.mark.parametrize("setup,args,code,needle", [
    (None, ["cache", "import", "{t}/missing.json"], 2, "cannot read bundle"),
    ("notjson", ["cache", "import", "{t}/f"], 2, "not JSON"),
    ("otherjson", ["cache", "import", "{t}/f"], 2, "not a forge cache bundle"),
    ("newer", ["cache", "import", "{t}/f"], 2, "newer than this forge reads"),
    ("noentries", ["cache", "import", "{t}/f"], 2, "no \"entries\" list"),
    ("bundle", ["cache", "import", "{t}/f", "--cache", "{t}/broken.db"], 5, "damaged"),
    (None, ["cache", "export", "{t}/f"], 0, "exported 0 entries"),
    ("file", ["cache", "export", "{t}/f/sub/b.json"], 2, "cannot write bundle"),
    (None, ["cache", "export", "{t}/b.json", "--cache", "{t}/broken.db"], 5, "damaged"),
    (None, ["cache", "merge", "{t}/nope.db"], 2, "no such cache DB"),
    (None, ["cache", "merge", "{t}/broken.db"], 5, "damaged"),
    ("otherjson", ["cache", "merge", "{t}/f"], 5, "not a database"),
    ("sqlite", ["cache", "merge", "{t}/f"], 5, "not a forge cache"),
    (None, ["cache", "prune", "--older-than", "-1"], 2, "--older-than"),
    (None, ["cache", "prune", "--cache", "{t}/broken.db"], 5, "damaged"),
    (None, ["cache", "merge"], 2, "Missing argument"),
])
def test_error_paths_exit_codes(tmp_path, setup, args, code, needle):
    import sqlite3

    (tmp_path / "broken.db").write_bytes(b"this is not a sqlite database" * 100)
    f = tmp_path / "f"
    if setup == "notjson":
        f.write_text("{nope")
    elif setup == "otherjson":
        f.write_text(json.dumps({"format": "something-else", "entries": []}))
    elif setup == "newer":
        f.write_text(json.dumps({"format": "forge-cache-bundle", "format_version": 99, "entries": []}))
    elif setup == "noentries":
        f.write_text(json.dumps({"format": "forge-cache-bundle", "format_version": 1}))
    elif setup == "bundle":
        bundle.write_bundle(f, [])
    elif setup == "file":
        f.write_text("a file, not a directory")
    elif setup == "sqlite":
        sqlite3.connect(f).execute("CREATE TABLE t (x)").connection.close()
    res = _invoke(*(a.format(t=tmp_path) for a in args))
    assert res.exit_code == code, res.output
    assert needle in " ".join(res.output.split())
