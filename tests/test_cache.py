"""Tests of forge.cache: round trips, lookups, schema checks, damaged files and concurrent writers."""

from __future__ import annotations

import dataclasses
import hashlib
import multiprocessing
import os
import sqlite3
import threading
import traceback
from pathlib import Path

import pytest

from forge.cache import (
    SCHEMA_VERSION,
    AmbiguousKey,
    Cache,
    CacheError,
    Entry,
    KeyNotFound,
    default_cache_path,
)

# --- helpers (module level: the spawned worker processes import them) ----------------------------


def make_key(label: str) -> str:
    return hashlib.sha256(label.encode()).hexdigest()


def make_entry(key: str, *, op: str = "softmax", decision: str = "kernel",
               created_at: float = 1_700_000_000.0, tag: str = "") -> Entry:
    """A realistic entry; `tag` is woven into several fields so torn or mixed rows are detectable."""
    if decision == "kernel":
        source = f"@triton.jit\ndef kernel_{tag or 'x'}(X, Y, N):\n    pass  # {key}\n"
        return Entry(
            key=key,
            op=op,
            spec={"op": op, "inputs": [{"shape": [4096, 1024], "dtype": "float16", "strides": [1024, 1],
                                        "device": "cuda"}], "attrs": {"dim": -1, "tag": tag}},
            env={"backend": "cuda", "gpu": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0"},
            decision="kernel",
            variant="online",
            params={"BLOCK": 1024, "num_warps": 8, "tag": tag},
            source=source,
            source_sha256=hashlib.sha256(source.encode()).hexdigest(),
            template_hash="t" * 16,
            winner={"p20": 10.25, "p50": 11.5, "p80": 12.75},
            baseline={"p20": 20.0, "p50": 23.0, "p80": 25.5},
            candidates=[{"variant": "online", "params": {"BLOCK": 1024}, "status": "ok", "p50": 11.5,
                         "tag": tag},
                        {"variant": "two_pass", "params": {"BLOCK": 512}, "status": "mismatch",
                         "error": "max abs err 0.5 > 0.01"}],
            search_seconds=12.345,
            forge_version="0.1.0",
            created_at=created_at,
        )
    return Entry(
        key=key,
        op=op,
        spec={"op": op, "inputs": [{"shape": [7], "dtype": "float32", "strides": [1], "device": "cuda"}],
              "attrs": {"tag": tag}},
        env={"backend": "interpreter", "gpu": None, "cpu": "x86"},
        decision="eager",
        variant=None,
        params=None,
        source=None,
        source_sha256=None,
        template_hash="e" * 16,
        winner=None,
        baseline={"p20": 1.0, "p50": 2.0, "p80": 3.0},
        candidates=[{"variant": "online", "status": "slower", "p50": 2.5}],
        search_seconds=0.5,
        forge_version="0.1.0",
        created_at=created_at,
    )


def assert_intact(entry: Entry, tag: str) -> None:
    """Every tagged field of `entry` comes from the same put (no row mixing two writers)."""
    assert entry.params["tag"] == tag
    assert entry.spec["attrs"]["tag"] == tag
    assert entry.candidates[0]["tag"] == tag
    assert f"kernel_{tag}(" in entry.source
    assert entry.source_sha256 == hashlib.sha256(entry.source.encode()).hexdigest()


def _report_failure(err_path: str) -> None:
    Path(err_path).write_text(traceback.format_exc())
    raise SystemExit(1)


def _writer_worker(db_path: str, worker: int, barrier, err_path: str) -> None:
    """Put 25 entries of its own and re-put 5 keys every worker shares, as fast as possible."""
    try:
        barrier.wait(timeout=60)
        with Cache(db_path) as cache:
            for i in range(25):
                cache.put(make_entry(make_key(f"w{worker}-{i}"), op=f"op{worker}", created_at=float(i),
                                     tag=f"w{worker}i{i}"))
                if i % 5 == 0:
                    shared = make_key(f"shared-{i // 5}")
                    cache.put(make_entry(shared, op="shared", tag=f"shared{i // 5}w{worker}"))
    except BaseException:
        _report_failure(err_path)


def _creator_worker(db_dir: str, worker: int, rounds: int, barrier, err_path: str) -> None:
    """In each round, open (and so create) the same brand-new file as the other worker at once."""
    try:
        for r in range(rounds):
            barrier.wait(timeout=60)
            with Cache(Path(db_dir) / f"new{r}.db") as cache:
                cache.put(make_entry(make_key(f"round{r}-w{worker}"), tag=f"r{r}w{worker}"))
    except BaseException:
        _report_failure(err_path)


def run_processes(target, args_per_process: list[tuple], tmp_path: Path) -> None:
    """Start one spawned process per args tuple (a barrier and an error file are appended) and
    fail with the worker's traceback if any of them failed."""
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(len(args_per_process))
    err_paths = [tmp_path / f"worker{i}.err" for i in range(len(args_per_process))]
    procs = [ctx.Process(target=target, args=(*args, barrier, str(err)))
             for args, err in zip(args_per_process, err_paths, strict=True)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        if p.is_alive():
            p.kill()
            p.join()
    errors = [err.read_text() for err in err_paths if err.exists()]
    assert not errors, "\n".join(errors)
    assert [p.exitcode for p in procs] == [0] * len(procs)


@pytest.fixture
def cache(tmp_path: Path):
    with Cache(tmp_path / "forge.db") as c:
        yield c


# --- round trips and lookups ------------------------------------------------------------------------


@pytest.mark.parametrize("decision", ["kernel", "eager"])
def test_round_trip_keeps_every_field(cache: Cache, decision: str) -> None:
    entry = make_entry(make_key(decision), decision=decision, tag="rt")
    cache.put(entry)
    got = cache.get(entry.key)
    assert got is not None
    assert dataclasses.asdict(got) == dataclasses.asdict(entry)
    assert got == entry
    assert type(got.search_seconds) is float and type(got.created_at) is float


def test_round_trip_survives_reopen(tmp_path: Path) -> None:
    entry = make_entry(make_key("persist"))
    with Cache(tmp_path / "forge.db") as c:
        c.put(entry)
    with Cache(tmp_path / "forge.db") as c:
        assert c.get(entry.key) == entry


def test_get_missing_returns_none(cache: Cache) -> None:
    assert cache.get(make_key("nothing")) is None
    assert cache.get("not even hex") is None


def test_put_replaces_by_key(cache: Cache) -> None:
    key = make_key("k")
    cache.put(make_entry(key, tag="first"))
    cache.put(make_entry(key, decision="eager", tag="second", created_at=5.0))
    got = cache.get(key)
    assert got.decision == "eager" and got.spec["attrs"]["tag"] == "second" and got.created_at == 5.0
    assert len(cache.entries()) == 1


def test_entries_filter_and_newest_first(cache: Cache) -> None:
    cache.put(make_entry(make_key("a"), op="softmax", created_at=100.0))
    cache.put(make_entry(make_key("b"), op="layernorm", created_at=300.0))
    cache.put(make_entry(make_key("c"), op="softmax", created_at=200.0))
    cache.put(make_entry(make_key("d"), op="softmax", created_at=50.0, decision="eager"))
    assert [e.created_at for e in cache.entries()] == [300.0, 200.0, 100.0, 50.0]
    assert [e.key for e in cache.entries(op="softmax")] == [make_key("c"), make_key("a"), make_key("d")]
    assert [e.op for e in cache.entries(op="layernorm")] == ["layernorm"]
    assert cache.entries(op="matmul") == []


def test_find_exact_and_prefix(cache: Cache) -> None:
    key = make_key("findme")
    cache.put(make_entry(key))
    cache.put(make_entry(make_key("other")))
    assert cache.find(key).key == key
    assert cache.find(key[:4]).key == key
    assert cache.find(key[:10].upper()).key == key  # users may paste upper case
    assert cache.find(f"  {key[:8]} ").key == key


def test_find_ambiguous_prefix(cache: Cache) -> None:
    k1, k2 = "abcd" + "0" * 60, "abcd" + "1" * 60
    cache.put(make_entry(k1))
    cache.put(make_entry(k2))
    with pytest.raises(AmbiguousKey) as excinfo:
        cache.find("abcd")
    message = str(excinfo.value)
    assert k1 in message and k2 in message and str(cache.path) in message
    assert isinstance(excinfo.value, CacheError)
    assert cache.find("abcd0").key == k1
    assert cache.find("abcd1").key == k2


@pytest.mark.parametrize("query", ["ffff", make_key("absent"), "abc", "", "zzzzzz", "a*", "ab%d"])
def test_find_not_found(cache: Cache, query: str) -> None:
    cache.put(make_entry("abcd" + "0" * 60))
    with pytest.raises(KeyNotFound) as excinfo:
        cache.find(query)
    assert isinstance(excinfo.value, CacheError)
    assert str(cache.path) in str(excinfo.value)


def test_delete_counts(cache: Cache) -> None:
    keys = [make_key(f"k{i}") for i in range(6)]
    for i, key in enumerate(keys):
        cache.put(make_entry(key, op="softmax" if i < 3 else "layernorm"))
    cache.put(make_entry("abcd" + "0" * 60, op="rmsnorm"))
    cache.put(make_entry("abcd" + "1" * 60, op="rmsnorm"))

    assert cache.delete(keys[0][:6]) == 1
    assert cache.get(keys[0]) is None
    with pytest.raises(KeyNotFound):
        cache.delete(keys[0])
    with pytest.raises(AmbiguousKey):
        cache.delete("abcd")
    assert len(cache.entries(op="rmsnorm")) == 2  # an ambiguous delete deletes nothing

    assert cache.delete_op("softmax") == 2
    assert cache.delete_op("softmax") == 0
    assert cache.entries(op="softmax") == []
    assert cache.delete_all() == 5
    assert cache.entries() == []
    assert cache.delete_all() == 0


def test_speedup() -> None:
    kernel = make_entry(make_key("s"))
    assert kernel.speedup == pytest.approx(23.0 / 11.5)
    assert make_entry(make_key("e"), decision="eager").speedup is None  # no winner
    no_baseline = dataclasses.replace(kernel, baseline=None)
    assert no_baseline.speedup is None
    assert dataclasses.replace(kernel, winner={"p20": 0.0, "p50": 0.0, "p80": 0.0}).speedup is None


# --- put validation -------------------------------------------------------------------------------


def test_put_rejects_source_hash_mismatch(cache: Cache) -> None:
    entry = make_entry(make_key("bad"))
    wrong = dataclasses.replace(entry, source_sha256=hashlib.sha256(b"something else").hexdigest())
    with pytest.raises(ValueError, match="does not match"):
        cache.put(wrong)
    with pytest.raises(ValueError):
        cache.put(dataclasses.replace(entry, source=entry.source + "# edited\n"))
    with pytest.raises(ValueError, match="no source"):
        cache.put(dataclasses.replace(entry, source=None, source_sha256=None))
    assert cache.get(entry.key) is None


@pytest.mark.parametrize("change", [{"key": "abc"}, {"key": "G" * 64}, {"key": make_key("x").upper()},
                                    {"decision": "maybe"}])
def test_put_rejects_malformed_entries(cache: Cache, change: dict) -> None:
    with pytest.raises(ValueError):
        cache.put(dataclasses.replace(make_entry(make_key("m")), **change))
    assert cache.entries() == []


# --- schema ---------------------------------------------------------------------------------------


def test_schema_version_row_and_columns(tmp_path: Path) -> None:
    path = tmp_path / "forge.db"
    with Cache(path) as c:
        c.put(make_entry(make_key("first")))  # the first write creates the file and its schema
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("SELECT version FROM schema_version").fetchall() == [(SCHEMA_VERSION,)]
        columns = [row[1] for row in conn.execute("PRAGMA table_info(entries)")]
        assert columns == [f.name for f in dataclasses.fields(Entry)]
        indexes = [row[1] for row in conn.execute("PRAGMA index_list(entries)")]
        assert "entries_op" in indexes
    finally:
        conn.close()
    with Cache(path) as c:  # reopening and writing again does not add a second version row
        c.put(make_entry(make_key("second")))
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("SELECT version FROM schema_version").fetchall() == [(SCHEMA_VERSION,)]
    finally:
        conn.close()
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("SELECT count(*) FROM schema_version").fetchone() == (1,)
    finally:
        conn.close()


def _downgrade_to_v1(path: Path) -> None:
    """Rewrite a cache file as schema 1 wrote it (the CHECK admitted kernel and eager only)."""
    conn = sqlite3.connect(path)
    with conn:
        ddl = conn.execute("SELECT sql FROM sqlite_master WHERE name = 'entries'").fetchone()[0]
        conn.execute("ALTER TABLE entries RENAME TO entries_new")
        conn.execute("DROP INDEX entries_op")
        conn.execute(ddl.replace("'kernel', 'torch', 'eager'", "'kernel', 'eager'"))
        conn.execute("CREATE INDEX entries_op ON entries (op)")
        conn.execute("INSERT INTO entries SELECT * FROM entries_new")
        conn.execute("DROP TABLE entries_new")
        conn.execute("UPDATE schema_version SET version = 1")
    conn.close()


def test_a_version_1_cache_is_read_as_is_and_migrated_on_the_first_write(tmp_path: Path) -> None:
    """Schema 2 admits decision "torch" (torch's fused op, issue 14). A schema-1 file reads unchanged
    (a read-only mount keeps working) and its first write rebuilds the table, every entry kept."""
    path = tmp_path / "forge.db"
    old = make_entry(make_key("old"), tag="v1")
    with Cache(path) as c:
        c.put(old)
    _downgrade_to_v1(path)
    with Cache(path, read_only=True) as c:
        assert c.get(old.key) == old
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT version FROM schema_version").fetchall() == [(1,)]
    conn.close()
    torch_entry = dataclasses.replace(make_entry(make_key("torch"), tag="t"), decision="torch", variant="torch",
                                      params={}, source=None, source_sha256=None)
    with Cache(path) as c:
        c.put(torch_entry)
        assert c.get(old.key) == old and c.get(torch_entry.key) == torch_entry
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("SELECT version FROM schema_version").fetchall() == [(SCHEMA_VERSION,)]
        assert "entries_op" in [r[1] for r in conn.execute("PRAGMA index_list(entries)")]
        assert {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")} == {
            "schema_version", "entries"}
        with pytest.raises(sqlite3.IntegrityError):  # the CHECK still refuses anything else
            conn.execute("UPDATE entries SET decision = 'maybe'")
    finally:
        conn.close()


def test_a_torch_decision_has_no_source(tmp_path: Path) -> None:
    e = dataclasses.replace(make_entry(make_key("t")), decision="torch", variant="torch", params={})
    with Cache(tmp_path / "forge.db") as c, pytest.raises(ValueError, match="decides 'torch' but has a kernel source"):
        c.put(e)


def test_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "forge.db"
    with Cache(path) as c:
        c.put(make_entry(make_key("old")))
    conn = sqlite3.connect(path)
    with conn:
        conn.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION + 1,))
    conn.close()
    with pytest.raises(CacheError) as excinfo:
        Cache(path)
    message = str(excinfo.value)
    assert str(path) in message and str(SCHEMA_VERSION + 1) in message and "mv" in message


def test_foreign_sqlite_database_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "other.db"
    conn = sqlite3.connect(path)
    with conn:
        conn.execute("CREATE TABLE notes (body TEXT)")
    conn.close()
    with pytest.raises(CacheError, match="not a forge cache"):
        Cache(path)
    conn = sqlite3.connect(path)
    try:
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    finally:
        conn.close()
    assert tables == {"notes"}  # left untouched


def test_wal_mode_is_on(cache: Cache) -> None:
    cache.put(make_entry(make_key("wal")))
    conn = sqlite3.connect(cache.path)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        conn.close()


def test_zero_byte_file_is_a_new_cache(tmp_path: Path) -> None:
    path = tmp_path / "forge.db"
    path.touch()
    with Cache(path) as c:
        c.put(make_entry(make_key("z")))
        assert c.get(make_key("z")) is not None


def test_creates_parent_directories(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "forge.db"
    with Cache(str(path)) as c:
        assert c.path == path
        assert c.get(make_key("x")) is None and c.entries() == []
        assert not (tmp_path / "a").exists()  # reading never creates anything
        c.put(make_entry(make_key("x")))
    assert path.is_file()


def test_unusable_directory_is_a_cache_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(CacheError) as excinfo:
        Cache(blocker / "forge.db").put(make_entry(make_key("x")))  # parent "directory" is a file
    assert str(blocker) in str(excinfo.value)
    directory = tmp_path / "adir"
    directory.mkdir()
    with pytest.raises(CacheError) as excinfo:
        Cache(directory)  # the path itself is a directory
    assert str(directory) in str(excinfo.value)


def test_read_only_cache_is_a_cache_error(tmp_path: Path) -> None:
    path = tmp_path / "forge.db"
    with Cache(path) as c:
        c.put(make_entry(make_key("ro")))
    path.chmod(0o444)
    try:
        if os.access(path, os.W_OK):
            pytest.skip("file permissions are not enforced for this user (root)")
        with pytest.raises(CacheError) as excinfo, Cache(path) as c:
            c.put(make_entry(make_key("new")))
    finally:
        path.chmod(0o644)
    message = str(excinfo.value)
    assert str(path) in message and "writable" in message


def test_closed_cache_refuses_use(tmp_path: Path) -> None:
    with Cache(tmp_path / "forge.db") as c:
        pass
    c.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        c.get(make_key("x"))


# --- damaged files --------------------------------------------------------------------------------


def test_garbage_file_is_a_cache_error(tmp_path: Path) -> None:
    path = tmp_path / "forge.db"
    path.write_bytes(b"not a database" * 100)
    with pytest.raises(CacheError) as excinfo:
        Cache(path)
    message = str(excinfo.value)
    assert str(path) in message
    assert "mv" in message or "move" in message.lower()
    assert path.read_bytes() == b"not a database" * 100  # never overwritten


def _read_everything(path: Path, keys: list[str]) -> None:
    with Cache(path) as c:
        c.entries()
        for key in keys:
            c.get(key)
        c.find(keys[-1][:8])


def _write_big_cache(path: Path) -> list[str]:
    """A cache of ~650 KB (each entry carries ~2 KB of source, so the table spans many pages)."""
    keys = [make_key(f"t{i}") for i in range(150)]
    with Cache(path) as c:
        for i, key in enumerate(keys):
            entry = make_entry(key, tag=f"t{i}")
            source = entry.source + "# padding\n" * 200
            c.put(dataclasses.replace(entry, source=source,
                                      source_sha256=hashlib.sha256(source.encode()).hexdigest()))
    # Closing the last connection checkpoints the WAL into the main file and removes it, so the
    # damage below hits the only copy of the data.
    assert not Path(str(path) + "-wal").exists()
    assert path.stat().st_size > 100_000
    return keys


def _read_everything(path: Path, keys: list[str]) -> None:
    with Cache(path) as c:
        c.entries()
        for key in keys:
            c.get(key)
        c.find(keys[-1][:8])


def test_truncated_database_is_a_cache_error(tmp_path: Path) -> None:
    path = tmp_path / "forge.db"
    keys = _write_big_cache(path)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2 + 1234)  # mid-page
    with pytest.raises(CacheError) as excinfo:
        _read_everything(path, keys)
    assert not isinstance(excinfo.value, KeyNotFound)  # lost rows must not pass for missing keys
    message = str(excinfo.value)
    assert str(path) in message and "mv" in message


def test_scribbled_pages_are_a_cache_error_on_read(tmp_path: Path) -> None:
    path = tmp_path / "forge.db"
    keys = _write_big_cache(path)
    size = path.stat().st_size
    with open(path, "r+b") as f:  # header and schema intact, table pages overwritten
        f.seek(size // 2)
        f.write(b"\xde\xad\xbe\xef" * (size // 8))
    with pytest.raises(CacheError) as excinfo:
        _read_everything(path, keys)
    assert not isinstance(excinfo.value, KeyNotFound)
    message = str(excinfo.value)
    assert str(path) in message and "mv" in message


def test_damaged_json_is_a_cache_error(tmp_path: Path) -> None:
    path = tmp_path / "forge.db"
    key = make_key("j")
    with Cache(path) as c:
        c.put(make_entry(key))
    conn = sqlite3.connect(path)
    with conn:
        conn.execute("UPDATE entries SET params = '{broken' WHERE key = ?", (key,))
    conn.close()
    with Cache(path) as c:
        with pytest.raises(CacheError) as excinfo:
            c.get(key)
        assert key in str(excinfo.value) and str(path) in str(excinfo.value)
        assert c.delete(key) == 1  # the damaged entry can still be removed


# --- concurrency ----------------------------------------------------------------------------------


def test_threads_share_one_cache(cache: Cache) -> None:
    def work(t: int) -> None:
        for i in range(25):
            cache.put(make_entry(make_key(f"t{t}-{i}"), tag=f"t{t}i{i}"))
            cache.get(make_key(f"t{t}-{i}"))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(cache.entries()) == 100
    for t in range(4):
        for i in range(25):
            assert_intact(cache.get(make_key(f"t{t}-{i}")), f"t{t}i{i}")


class _WriterBetweenQueries:
    """A connection whose first SELECT is followed, before the next statement, by another process's first write
    (here: another Cache creating the schema and putting an entry), the interleaving of a reader opening a
    brand-new cache while its creator commits."""

    def __init__(self, conn, write):
        self.conn, self.write, self.fired = conn, write, False

    @property
    def in_transaction(self):
        return self.conn.in_transaction

    def execute(self, sql, *args):
        cur = self.conn.execute(sql, *args)
        if sql.lstrip().upper().startswith("SELECT") and not self.fired:
            self.fired = True
            self.write()
        return cur


def test_a_reader_checks_the_schema_in_one_snapshot(tmp_path: Path) -> None:
    """Two autocommit SELECTs see two states: "no schema_version table" and then "some table" made a new
    forge cache look like another program's database to a reader opening it while its creator committed."""
    db = tmp_path / "forge.db"
    raw = sqlite3.connect(db)
    assert raw.execute("PRAGMA journal_mode=WAL").fetchone()[0] == "wal"  # the creator's first step
    raw.close()
    reader = Cache(db)  # an empty database: no connection kept yet
    assert reader._conn is None

    def racing_put(tag):
        return lambda: Cache(db).put(make_entry(make_key(tag), tag=tag))

    conn = sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True, isolation_level=None)
    with pytest.raises(CacheError, match="not a forge cache"):  # the two states, as before the fix
        reader._check_schema(_WriterBetweenQueries(conn, racing_put("a")))
    conn.close()
    db.unlink()
    for suffix in ("-wal", "-shm"):
        Path(str(db) + suffix).unlink(missing_ok=True)
    raw = sqlite3.connect(db)
    raw.execute("PRAGMA journal_mode=WAL")
    raw.close()
    conn = sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True, isolation_level=None)
    assert reader._check_schema_snapshot(_WriterBetweenQueries(conn, racing_put("b"))) is False  # one state
    assert not conn.in_transaction
    conn.close()
    assert Cache(db).get(make_key("b")).candidates[0]["tag"] == "b"  # the racing write landed


def test_concurrent_writer_processes(tmp_path: Path) -> None:
    db = tmp_path / "forge.db"
    run_processes(_writer_worker, [(str(db), w) for w in range(4)], tmp_path)
    with Cache(db) as c:
        for w in range(4):
            assert len(c.entries(op=f"op{w}")) == 25
            for i in range(25):
                got = c.get(make_key(f"w{w}-{i}"))
                assert got is not None, (w, i)
                assert_intact(got, f"w{w}i{i}")
                assert got.op == f"op{w}" and got.created_at == float(i)
        shared = c.entries(op="shared")
        assert len(shared) == 5
        for entry in shared:
            index = [make_key(f"shared-{j}") for j in range(5)].index(entry.key)
            # Whichever worker wrote last won, and the row is entirely that worker's.
            tag = entry.params["tag"]
            assert tag in {f"shared{index}w{w}" for w in range(4)}
            assert_intact(entry, tag)
        assert len(c.entries()) == 105


def test_concurrent_creation_of_a_new_database(tmp_path: Path) -> None:
    rounds = 10
    run_processes(_creator_worker, [(str(tmp_path), w, rounds) for w in range(2)], tmp_path)
    for r in range(rounds):
        with Cache(tmp_path / f"new{r}.db") as c:
            assert {e.key for e in c.entries()} == {make_key(f"round{r}-w{w}") for w in range(2)}
        conn = sqlite3.connect(tmp_path / f"new{r}.db")
        try:
            assert conn.execute("SELECT version FROM schema_version").fetchall() == [(SCHEMA_VERSION,)]
        finally:
            conn.close()


# --- default path ---------------------------------------------------------------------------------


def test_default_cache_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("FORGE_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert default_cache_path() == tmp_path / "home" / ".cache" / "forge" / "forge.db"

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_path() == tmp_path / "xdg" / "forge" / "forge.db"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # invalid per the XDG spec: ignored
    assert default_cache_path() == tmp_path / "home" / ".cache" / "forge" / "forge.db"

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("FORGE_CACHE_DIR", str(tmp_path / "forge-dir"))
    assert default_cache_path() == tmp_path / "forge-dir" / "forge.db"
    monkeypatch.setenv("FORGE_CACHE_DIR", "")  # empty counts as unset
    assert default_cache_path() == tmp_path / "xdg" / "forge" / "forge.db"
