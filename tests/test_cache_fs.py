"""The cache on the file system (issue 12, items 11-14): another program's SQLite file is refused
untouched, a cache on a read-only mount can be read, a full disk says so, nothing is created by
reading, and only regular files are ever suggested for moving aside.

Read-only and full file systems are real: small tmpfs mounts (skipped where mounting is not allowed)."""

from __future__ import annotations

import contextlib
import hashlib
import sqlite3
import subprocess
import uuid
from pathlib import Path

import pytest

from forge.cache import Cache, CacheError
from forge.loader import write_source
from tests.test_cache import make_entry, make_key


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@contextlib.contextmanager
def tmpfs(where: Path, size: str = "2m"):
    where.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def _remount_read_only(where: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(where)], check=True, capture_output=True)


def test_a_foreign_sqlite_database_is_refused_unchanged(tmp_path):
    other = tmp_path / "other.db"
    conn = sqlite3.connect(other)
    conn.execute("CREATE TABLE notes (body TEXT)")
    conn.execute("INSERT INTO notes VALUES ('keep me')")
    conn.commit()
    conn.close()
    before = _sha(other)
    assert other.read_bytes()[18:20] == b"\x01\x01"  # rollback-journal mode, not WAL
    with pytest.raises(CacheError, match="not a forge cache") as exc:
        Cache(other)
    assert "mv " not in str(exc.value)  # never advise moving another program's file
    assert _sha(other) == before and not Path(f"{other}-wal").exists()


def test_reading_a_missing_cache_creates_nothing(tmp_path):
    path = tmp_path / "typo" / "forge.db"
    with Cache(path) as c:
        assert c.entries() == [] and c.get(make_key("k")) is None
        assert c.delete_all() == 0 and c.delete_op("softmax") == 0
    assert not (tmp_path / "typo").exists()


def test_dev_null_is_not_suggested_for_moving(tmp_path):
    with pytest.raises(CacheError, match="not a regular file") as exc:
        Cache("/dev/null")
    assert "mv " not in str(exc.value)


def test_a_cache_on_a_read_only_mount_can_be_read_not_written(tmp_path):
    with tmpfs(tmp_path / "mnt") as mnt:
        path = mnt / "forge.db"
        with Cache(path) as c:
            for label in ("a", "b"):
                c.put(make_entry(make_key(label)))
        _remount_read_only(mnt)
        with Cache(path) as c:
            assert {e.key for e in c.entries()} == {make_key("a"), make_key("b")}
            assert c.get(make_key("a")).key == make_key("a") and c.find(make_key("b")[:8]).key == make_key("b")
            with pytest.raises(CacheError, match="read-only .* it can be read"):
                c.put(make_entry(make_key("c")))
        with Cache.open_read_only(path) as c:  # the source side of `forge cache merge`
            assert len(c.entries()) == 2
        # a kernel source for the shim goes to a writable place instead of the read-only kernels-src
        src = write_source("x = 1\n", mnt / "kernels-src")
        assert src.read_text() == "x = 1\n" and not str(src).startswith(str(mnt))


def test_a_full_disk_is_named_and_leaves_nothing_behind(tmp_path):
    with tmpfs(tmp_path / "mnt", size="512k") as mnt:
        path = mnt / "forge.db"
        with Cache(path) as c:
            c.put(make_entry(make_key("a")))
        with open(mnt / "filler", "wb", buffering=0) as f:  # fill the file system to the last byte
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * 4096)
        big = "# " + "x" * 200_000 + "\n"
        with pytest.raises(CacheError, match="the disk is full"):
            write_source(big, mnt / "kernels-src")
        assert [p for p in (mnt / "kernels-src").iterdir()] == []  # no partial or temporary file
        with Cache(path) as c:
            assert [e.key for e in c.entries()] == [make_key("a")]  # a healthy cache still reads
            with pytest.raises(CacheError, match="the disk is full") as exc:
                for i in range(200):
                    c.put(make_entry(make_key(f"more-{i}-{uuid.uuid4()}")))
            assert "mv " not in str(exc.value)


def test_an_import_replaces_a_damaged_row_whatever_its_date(tmp_path):
    path = tmp_path / "forge.db"
    entry = make_entry(make_key("damaged"))
    with Cache(path) as c:
        c.put(entry)
    raw = sqlite3.connect(path)
    raw.execute("UPDATE entries SET candidates = '{not json', created_at = ? WHERE key = ?",
                (entry.created_at + 1e6, entry.key))
    raw.commit()
    raw.close()
    with Cache(path) as c:
        with pytest.raises(CacheError, match="damaged"):
            c.get(entry.key)
        assert c.put_newer([entry]) == ["replaced"]  # older than the damaged row's date, still replaces it
        assert c.get(entry.key) == entry
        assert c.put_newer([entry]) == ["kept"]  # a readable row of the same date is kept


def test_every_reader_works_on_a_read_only_mount(tmp_path):
    """cache ls and export, a search cache hit, merge from it, the shim and forge.load (issue 12, item 12)."""
    import json

    import torch
    from typer.testing import CliRunner

    import forge
    from forge_cli import cli
    from tests.test_export import kernel_entry

    entry = kernel_entry("softmax", (3, 40), "float32")
    with tmpfs(tmp_path / "mnt") as mnt:
        path = mnt / "forge.db"
        with Cache(path) as c:
            c.put(entry)
        _remount_read_only(mnt)
        before = {p.name: _sha(p) for p in mnt.iterdir()}
        run = CliRunner().invoke
        res = run(cli.app, ["cache", "ls", "--cache", str(path), "--json"])
        assert res.exit_code == 0 and [r["key"] for r in json.loads(res.stdout)["entries"]] == [entry.key], res.output
        res = run(cli.app, ["cache", "export", str(tmp_path / "b.json"), "--cache", str(path)])
        assert res.exit_code == 0 and (tmp_path / "b.json").is_file(), res.output
        res = run(cli.app, ["search", "softmax", "--shape", "3x40", "--dtype", "float32", "--device", "cpu",
                            "--cache", str(path), "--json"])
        assert res.exit_code == 0 and json.loads(res.stdout)["cache_hit"], res.output
        res = run(cli.app, ["cache", "merge", str(path), "--cache", str(tmp_path / "dst.db"), "--json"])
        assert res.exit_code == 0 and json.loads(res.stdout)["added"] == [entry.key], res.output
        x = torch.randn(3, 40)
        fn = forge.optimize(lambda t: torch.softmax(t, dim=-1), interpreter=True, cache=path, search=False)
        assert forge.explain(fn, x).uses == "kernel"
        torch.testing.assert_close(fn(x), torch.softmax(x, dim=-1))
        kernel = forge.load("softmax", (3, 40), "float32", device="cpu", cache=str(path))
        torch.testing.assert_close(kernel(x), torch.softmax(x, dim=-1))
        res = run(cli.app, ["cache", "rm", "--all", "--cache", str(path)])
        assert res.exit_code == 5 and "read-only" in res.output
        assert {p.name: _sha(p) for p in mnt.iterdir()} == before  # nothing written
