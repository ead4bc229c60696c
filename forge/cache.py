"""The tuning cache: one SQLite file mapping a cache key to the decision forge made for it.

Import-light on purpose (stdlib only): the runtime shim opens the cache on the first call of every
new signature, so importing this module must not pull in torch, rich or typer.

Several processes (parallel tuning runs, a training job reading while the CLI writes) may use the
same file at once. SQLite in WAL mode gives us that: readers never block, and writers queue on
the write lock for up to `busy_timeout_s`. Every write is one explicit `BEGIN IMMEDIATE`
transaction, so no write can half-land and no writer can fail part-way on a lock it cannot upgrade.

Anything SQLite reports (damaged file, not a database, locked for too long, read-only, disk full)
leaves the public methods as a `CacheError` naming the file and saying how to recover.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shlex
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

# 2: decision may be "torch" (issue 14). A version-1 file is read as it is and migrated on the first write
# (_migrate: SQLite cannot alter a CHECK constraint, so the table is rebuilt in one transaction).
SCHEMA_VERSION = 2

DECISIONS = ("kernel", "torch", "eager")
# Decisions that replace the user's code with something measured faster: a forge kernel (its source is in the
# entry) or torch's fused op for the spec (forge/fused.py; no source). Both carry winner quantiles.
WINNING = ("kernel", "torch")

# Shortest prefix `find`/`delete` accept: shorter ones are too likely to match by accident.
MIN_PREFIX = 4

_HEX_DIGITS = frozenset("0123456789abcdef")
_KEY_LENGTH = 64  # hex sha256
_AMBIGUOUS_SHOWN = 5  # how many matching keys an AmbiguousKey message lists


class CacheError(Exception):
    """The cache DB cannot be used (damaged, not a database, newer schema, unwritable).

    The message always names the file and says how to recover."""


class AmbiguousKey(CacheError):
    """A key prefix matches several entries."""


class KeyNotFound(CacheError):
    """No entry matches a key or key prefix."""


def default_cache_path() -> Path:
    """$FORGE_CACHE_DIR/forge.db if FORGE_CACHE_DIR is set, else $XDG_CACHE_HOME/forge/forge.db,
    else ~/.cache/forge/forge.db."""
    # An empty variable counts as unset, the usual shell convention (`FORGE_CACHE_DIR= forge ...`).
    forge_dir = os.environ.get("FORGE_CACHE_DIR")
    if forge_dir:
        return Path(forge_dir).expanduser() / "forge.db"
    # The XDG base-directory spec says a relative XDG_CACHE_HOME is invalid and must be ignored.
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and Path(xdg).is_absolute():
        return Path(xdg) / "forge" / "forge.db"
    return Path.home() / ".cache" / "forge" / "forge.db"


@dataclass
class Entry:
    """One cached decision. Field order is the column order of the `entries` table."""

    key: str  # hex sha256 (64 chars), see forge.spec.cache_key
    op: str
    spec: dict  # KernelSpec.to_dict()
    env: dict  # environment fingerprint; has at least "backend"
    decision: str  # "kernel", "torch" (torch's fused op, forge/fused.py) or "eager"
    variant: str | None
    params: dict | None
    source: str | None  # rendered Triton source of the winner (None for eager)
    source_sha256: str | None
    template_hash: str
    winner: dict | None  # {"p20", "p50", "p80"} in microseconds; None for eager
    baseline: dict | None  # same quantiles for the eager baseline
    candidates: list  # one summary dict per candidate tried
    search_seconds: float
    forge_version: str
    created_at: float  # unix time

    @property
    def speedup(self) -> float | None:
        """Eager p50 / winner p50, when both were measured."""
        if not self.winner or not self.baseline:
            return None
        winner_p50 = self.winner.get("p50")
        baseline_p50 = self.baseline.get("p50")
        if winner_p50 is None or baseline_p50 is None or winner_p50 <= 0:
            return None
        return baseline_p50 / winner_p50


_COLUMNS = tuple(f.name for f in fields(Entry))
_JSON_COLUMNS = frozenset({"spec", "env", "params", "winner", "baseline", "candidates"})

# Every statement is idempotent (IF NOT EXISTS) and runs inside BEGIN IMMEDIATE, so two processes
# creating the same brand-new file serialize on the write lock and the second one finds it done.
_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)",
    """CREATE TABLE IF NOT EXISTS entries (
        key            TEXT PRIMARY KEY,
        op             TEXT NOT NULL,
        spec           TEXT,
        env            TEXT,
        decision       TEXT NOT NULL CHECK (decision IN ('kernel', 'torch', 'eager')),
        variant        TEXT,
        params         TEXT,
        source         TEXT,
        source_sha256  TEXT,
        template_hash  TEXT,
        winner         TEXT,
        baseline       TEXT,
        candidates     TEXT,
        search_seconds REAL,
        forge_version  TEXT,
        created_at     REAL
    )""",
    "CREATE INDEX IF NOT EXISTS entries_op ON entries (op)",
)

_SELECT = f"SELECT {', '.join(_COLUMNS)} FROM entries"
_INSERT = (
    f"INSERT OR REPLACE INTO entries ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))})"
)


def _move_aside(path: Path) -> str:
    if not path.is_file():  # /dev/null, a directory: never advise moving those
        return "point --cache or FORGE_CACHE_DIR at a forge cache file"
    return (
        f"move it aside: mv {shlex.quote(str(path))} {shlex.quote(str(path) + '.bak')}; "
        "forge will create a fresh cache"
    )


def _cannot_open(exc: sqlite3.Error) -> bool:
    name = getattr(exc, "sqlite_errorname", None) or ""
    return name.startswith("SQLITE_CANTOPEN") or "unable to open" in str(exc).lower()


def _disk_full(path: Path) -> bool:
    """Whether the file system holding `path` has no space left for an unprivileged writer."""
    d = path.parent
    while not d.exists() and d != d.parent:
        d = d.parent
    try:
        st = os.statvfs(d)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < 64 * 1024  # less than a few SQLite pages


def _is_busy(exc: sqlite3.Error) -> bool:
    # sqlite_errorname (3.11+) carries the extended code, e.g. SQLITE_BUSY_RECOVERY; the message
    # text is the fallback for errors raised by the sqlite3 module itself, which have no code.
    name = getattr(exc, "sqlite_errorname", None) or ""
    return name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")) or "locked" in str(exc).lower()


def _translate(path: Path, exc: sqlite3.Error, busy_timeout_s: float, writing: bool = False) -> CacheError:
    """Turn an sqlite3 exception into a CacheError that names the file and the way out."""
    name = getattr(exc, "sqlite_errorname", None) or ""
    text = str(exc)
    lowered = text.lower()
    if name.startswith("SQLITE_FULL") or "disk is full" in lowered or (
            name.startswith(("SQLITE_IOERR", "SQLITE_CANTOPEN")) or "disk i/o error" in lowered) and _disk_full(path):
        return CacheError(f"forge cache {path} cannot be written: the disk is full ({text}); free some space "
                          "(the cache itself is intact)")
    if name.startswith(("SQLITE_NOTADB", "SQLITE_CORRUPT")) or "not a database" in lowered \
            or "malformed" in lowered:
        return CacheError(
            f"forge cache {path} is damaged or is not a forge cache ({text}); {_move_aside(path)}"
        )
    if _is_busy(exc):
        return CacheError(
            f"forge cache {path} is locked by another process ({text}; busy timeout {busy_timeout_s:g} s); "
            f"retry when other forge processes have finished, or if none is running, {_move_aside(path)}"
        )
    if name.startswith(("SQLITE_READONLY", "SQLITE_CANTOPEN", "SQLITE_PERM")) or "readonly" in lowered \
            or "unable to open" in lowered:
        if writing and path.is_file():
            return CacheError(
                f"forge cache {path} is read-only ({text}): it can be read, but this needs to write it; make "
                f"{path} and its directory writable, or set FORGE_CACHE_DIR (or --cache) to a writable place"
            )
        return CacheError(
            f"forge cache {path} cannot be opened ({text}); make {path} and its directory "
            "readable and writable, or set FORGE_CACHE_DIR to a writable directory"
        )
    return CacheError(f"forge cache {path} cannot be used ({text}); if this persists, {_move_aside(path)}")


@contextlib.contextmanager
def _transaction(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    # IMMEDIATE takes the write lock up front (waiting up to the busy timeout). A deferred
    # transaction that reads first and writes later can fail at once with SQLITE_BUSY_SNAPSHOT in
    # WAL mode, without the busy handler ever being consulted.
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            # If the rollback fails too, SQLite has already rolled back; the first error is the one
            # worth reporting.
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
        raise


def _encode_json(value: Any) -> str | None:
    return None if value is None else json.dumps(value, sort_keys=True, separators=(",", ":"))


def _check_entry(entry: Entry) -> None:
    """Reject entries that would be wrong to store. These are forge bugs, hence ValueError."""
    if len(entry.key) != _KEY_LENGTH or not set(entry.key) <= _HEX_DIGITS:
        raise ValueError(f"cache key must be {_KEY_LENGTH} lowercase hex characters, got {entry.key!r}")
    if entry.decision not in DECISIONS:
        raise ValueError(f"decision must be one of {DECISIONS}, got {entry.decision!r}")
    if entry.decision == "kernel" and entry.source is None:
        raise ValueError(f"entry {entry.key} decides 'kernel' but has no source")
    if entry.decision != "kernel" and entry.source is not None:
        raise ValueError(f"entry {entry.key} decides {entry.decision!r} but has a kernel source")
    if entry.source is not None:
        digest = hashlib.sha256(entry.source.encode()).hexdigest()
        if entry.source_sha256 != digest:
            raise ValueError(
                f"entry {entry.key}: source_sha256 {entry.source_sha256!r} does not match its source "
                f"(sha256 {digest})"
            )


class Cache:
    """The cache file at `path`.

    Opened read-only and checked before anything is changed: another program's SQLite file is refused
    untouched, and a cache on a read-only mount can be read. A file that does not exist yet reads as
    empty and is created (with its directories) by the first write; reading never creates anything.
    The first write reopens the file read-write (WAL mode, schema created if new); a cache that cannot
    be written says so then, and only then.

    One SQLite connection per Cache; a lock makes one Cache object safe to share between threads.
    Use as a context manager, or call close().
    """

    def __init__(self, path: str | os.PathLike[str], *, busy_timeout_s: float = 60.0,
                 read_only: bool = False) -> None:
        self.path = Path(path).expanduser()
        self._busy_timeout_s = busy_timeout_s
        self._lock = threading.Lock()
        self._read_only = read_only
        self._version = SCHEMA_VERSION  # the open file's schema version (_check_schema)
        # The connection in use: read-only until the first write, then read-write. None while the file
        # does not exist or holds no tables yet (reads find nothing).
        self._conn: sqlite3.Connection | None = None
        self._writable = False
        self._closed = False
        if os.path.lexists(self.path):
            self._conn = self._open_for_reading()

    def _connect(self, target: str, uri: bool) -> sqlite3.Connection:
        # isolation_level=None: the sqlite3 module opens no transactions of its own; we issue
        # BEGIN/COMMIT explicitly. `timeout` is SQLite's busy timeout.
        return sqlite3.connect(target, uri=uri, timeout=self._busy_timeout_s, isolation_level=None,
                               check_same_thread=False)

    def _open_for_reading(self) -> sqlite3.Connection | None:
        if not self.path.is_file():
            raise CacheError(f"{self.path} is not a regular file, so it cannot be a forge cache; point --cache or "
                             "FORGE_CACHE_DIR at a forge cache file (or at a path where one may be created)")
        uri = self.path.resolve().as_uri()
        conn = None
        try:
            conn = self._connect(f"{uri}?mode=ro", uri=True)
            try:
                has_tables = self._check_schema_snapshot(conn)
            except sqlite3.OperationalError as exc:
                if not (_cannot_open(exc) or _disk_full(self.path)):
                    raise
                # A WAL cache on a read-only mount (or a full disk): SQLite cannot create the WAL index
                # beside it. Nobody can be writing the file then (on a full disk every writer fails), so
                # it is read as immutable: commits still in a WAL file of an unclean shutdown are not seen.
                conn.close()
                conn = self._connect(f"{uri}?mode=ro&immutable=1", uri=True)
                has_tables = self._check_schema_snapshot(conn)
        except sqlite3.Error as exc:
            if conn is not None:
                conn.close()
            raise _translate(self.path, exc, self._busy_timeout_s) from exc
        except BaseException:
            if conn is not None:
                conn.close()
            raise
        if not has_tables:  # a zero-byte file or an empty database: the first write makes the schema
            conn.close()
            return None
        return conn

    def _check_schema_snapshot(self, conn: sqlite3.Connection) -> bool:
        """_check_schema in one read transaction. The connection is in autocommit mode, where each SELECT
        sees the database as of its own start: a writer creating the schema between _check_schema's "is there
        a schema_version table" and "is there any table" made a new forge cache look like another program's
        database (test_concurrent_writer_processes failed so, once in a full run, 2026-12-04)."""
        conn.execute("BEGIN")
        try:
            return self._check_schema(conn)
        finally:
            if conn.in_transaction:
                conn.execute("COMMIT")

    def _check_schema(self, conn: sqlite3.Connection) -> bool:
        """Whether the file holds forge's tables (False: an empty database). Reads only. Garbage in the
        file is detected here, when the header is first read."""
        has_version_table = conn.execute(
            "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'schema_version'"
        ).fetchone()[0]
        if not has_version_table:
            if conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]:
                # Some other program's database: refuse it, unchanged.
                raise CacheError(f"{self.path} is an SQLite database but not a forge cache (left unchanged); "
                                 "point --cache or FORGE_CACHE_DIR at a forge cache")
            return False
        rows = conn.execute("SELECT version FROM schema_version").fetchall()
        if len(rows) != 1 or not isinstance(rows[0][0], int):
            raise CacheError(f"forge cache {self.path} has a damaged schema_version table; "
                             f"{_move_aside(self.path)}")
        version = rows[0][0]
        if version > SCHEMA_VERSION:
            raise CacheError(
                f"forge cache {self.path} has schema version {version}, newer than this forge supports "
                f"({SCHEMA_VERSION}); upgrade forge, or {_move_aside(self.path)}"
            )
        if version < 1:
            raise CacheError(
                f"forge cache {self.path} has unknown schema version {version}; {_move_aside(self.path)}"
            )
        self._version = version  # older ones read as they are (same columns); migrated on the first write
        return True

    def _open_for_writing(self) -> sqlite3.Connection:
        """The read-write connection (made on the first write): directories and file created, WAL mode,
        schema ensured. Raises CacheError saying what cannot be written."""
        if self._read_only:
            raise CacheError(f"forge cache {self.path} was opened read-only: nothing is written to it")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CacheError(
                f"cannot create the directory of forge cache {self.path} ({exc.strerror or exc}); "
                "set FORGE_CACHE_DIR to a writable directory"
            ) from exc
        try:
            conn = self._connect(str(self.path), uri=False)
        except sqlite3.Error as exc:
            raise _translate(self.path, exc, self._busy_timeout_s, writing=True) from exc
        try:
            try:
                self._enable_wal(conn)
                # In WAL mode NORMAL is still safe against application crashes (only a power cut
                # can lose the last commits), and it saves an fsync per write. Fine for a cache.
                conn.execute("PRAGMA synchronous=NORMAL")
                with _transaction(conn):
                    self._ensure_schema(conn)
            except sqlite3.Error as exc:
                raise _translate(self.path, exc, self._busy_timeout_s, writing=True) from exc
        except BaseException:
            conn.close()
            raise
        return conn

    def _enable_wal(self, conn: sqlite3.Connection) -> None:
        """Switch the file to WAL mode (a persistent property of the file, so usually a no-op)."""
        # Switching needs an exclusive lock, and SQLite answers SQLITE_BUSY at once, without
        # consulting the busy handler, when another connection holds a lock (e.g. a second process
        # creating the same new file at the same moment). So wait here, up to the busy timeout.
        deadline = time.monotonic() + self._busy_timeout_s
        delay = 0.001
        while True:
            try:
                if conn.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                    # The result may be another mode where WAL is impossible (e.g. a filesystem
                    # without shared memory); the cache still works then, with less concurrency.
                    conn.execute("PRAGMA journal_mode=WAL").fetchone()
                return
            except sqlite3.OperationalError as exc:
                if not _is_busy(exc) or time.monotonic() >= deadline:
                    raise
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def _ensure_schema(self, conn: sqlite3.Connection) -> None:
        if not self._check_schema(conn):
            for statement in _SCHEMA:
                conn.execute(statement)
            conn.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,))
        elif self._version < SCHEMA_VERSION:
            self._migrate(conn, self._version)

    def _migrate(self, conn: sqlite3.Connection, version: int) -> None:
        """Inside the write transaction: bring a version-`version` file to SCHEMA_VERSION, every entry kept.
        1 -> 2: the entries table is rebuilt with the CHECK that admits decision "torch"."""
        if version == 1:
            conn.execute("ALTER TABLE entries RENAME TO entries_v1")
            conn.execute("DROP INDEX IF EXISTS entries_op")
            for statement in _SCHEMA[1:]:
                conn.execute(statement)
            cols = ", ".join(_COLUMNS)
            conn.execute(f"INSERT INTO entries ({cols}) SELECT {cols} FROM entries_v1")
            conn.execute("DROP TABLE entries_v1")
        conn.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION,))
        self._version = SCHEMA_VERSION

    @contextlib.contextmanager
    def _use(self, write: bool = False) -> Iterator[sqlite3.Connection | None]:
        """Exclusive use of the connection (the read-write one if `write`; None when there is nothing to
        read yet); sqlite3 errors leave as CacheError."""
        with self._lock:
            if self._closed:
                # Using a closed cache is a programming error, like I/O on a closed file.
                raise ValueError(f"forge cache {self.path} is closed")
            if write and not self._writable:
                conn = self._open_for_writing()
                if self._conn is not None:
                    self._conn.close()
                self._conn, self._writable = conn, True
            elif self._conn is None and os.path.lexists(self.path):
                # Another process created the file (or its tables) since: read it from now on.
                self._conn = self._open_for_reading()
            try:
                yield self._conn
            except sqlite3.Error as exc:
                raise _translate(self.path, exc, self._busy_timeout_s, writing=write) from exc

    def _row_to_entry(self, row: tuple) -> Entry:
        values = dict(zip(_COLUMNS, row, strict=True))
        try:
            for name in _JSON_COLUMNS:
                if values[name] is not None:
                    values[name] = json.loads(values[name])
        except (TypeError, ValueError) as exc:
            raise CacheError(
                f"entry {values['key']} of forge cache {self.path} is damaged ({exc}); delete that entry, "
                f"or {_move_aside(self.path)}"
            ) from exc
        return Entry(**values)

    def _resolve(self, conn: sqlite3.Connection | None, key_or_prefix: str) -> str:
        """The one key that `key_or_prefix` names (case-insensitive, surrounding spaces ignored)."""
        prefix = key_or_prefix.strip().lower()
        if not MIN_PREFIX <= len(prefix) <= _KEY_LENGTH or not set(prefix) <= _HEX_DIGITS:
            raise KeyNotFound(
                f"{key_or_prefix!r} is not a cache key or key prefix (expected {MIN_PREFIX} to "
                f"{_KEY_LENGTH} hex characters); nothing looked up in forge cache {self.path}"
            )
        if conn is None:
            raise KeyNotFound(f"no entry of forge cache {self.path} matches {prefix!r} (the cache is empty)")
        # GLOB is case-sensitive, so SQLite can answer it from the primary-key index; the prefix is
        # plain hex, so it contains no GLOB wildcards.
        keys = [row[0] for row in conn.execute(
            "SELECT key FROM entries WHERE key GLOB ? ORDER BY key LIMIT ?",
            (prefix + "*", _AMBIGUOUS_SHOWN + 1),
        )]
        if not keys:
            raise KeyNotFound(f"no entry of forge cache {self.path} matches {prefix!r}")
        if len(keys) > 1:
            shown = ", ".join(keys[:_AMBIGUOUS_SHOWN]) + (", ..." if len(keys) > _AMBIGUOUS_SHOWN else "")
            raise AmbiguousKey(
                f"{prefix!r} matches several entries of forge cache {self.path} ({shown}); "
                "give more characters of the key"
            )
        return keys[0]

    # -- reading ---------------------------------------------------------------------------------

    def get(self, key: str) -> Entry | None:
        """The entry stored under exactly `key`, or None."""
        with self._use() as conn:
            row = None if conn is None else conn.execute(f"{_SELECT} WHERE key = ?", (key,)).fetchone()
        return None if row is None else self._row_to_entry(row)

    def find(self, key_or_prefix: str) -> Entry:
        """The entry whose key is `key_or_prefix` or starts with it (at least MIN_PREFIX hex chars).

        Raises KeyNotFound or AmbiguousKey."""
        with self._use() as conn:
            key = self._resolve(conn, key_or_prefix)
            row = None if conn is None else conn.execute(f"{_SELECT} WHERE key = ?", (key,)).fetchone()
        if row is None:  # another process deleted it between the two queries
            raise KeyNotFound(f"no entry of forge cache {self.path} matches {key_or_prefix!r}")
        return self._row_to_entry(row)

    def entries(self, op: str | None = None) -> list[Entry]:
        """All entries (of `op`, if given), newest first."""
        # key breaks ties so the order is deterministic.
        with self._use() as conn:
            if conn is None:
                return []
            if op is None:
                rows = conn.execute(f"{_SELECT} ORDER BY created_at DESC, key").fetchall()
            else:
                rows = conn.execute(f"{_SELECT} WHERE op = ? ORDER BY created_at DESC, key", (op,)).fetchall()
        return [self._row_to_entry(row) for row in rows]

    # -- writing ---------------------------------------------------------------------------------

    def put(self, entry: Entry) -> None:
        """Store `entry`, replacing any entry with the same key.

        Raises ValueError for an inconsistent entry (bad key, unknown decision, source hash mismatch)."""
        _check_entry(entry)
        # Encode before taking any lock: a value json cannot encode is the caller's TypeError.
        row = tuple(
            _encode_json(getattr(entry, name)) if name in _JSON_COLUMNS else getattr(entry, name)
            for name in _COLUMNS
        )
        with self._use(write=True) as conn, _transaction(conn):
            conn.execute(_INSERT, row)

    def delete(self, key_or_prefix: str) -> int:
        """Delete the entry `key_or_prefix` names, resolved like find(); returns rows deleted."""
        with self._use() as conn:
            self._resolve(conn, key_or_prefix)  # KeyNotFound before anything is opened for writing
        with self._use(write=True) as conn, _transaction(conn):
            key = self._resolve(conn, key_or_prefix)
            return conn.execute("DELETE FROM entries WHERE key = ?", (key,)).rowcount

    def delete_op(self, op: str) -> int:
        """Delete every entry of `op`; returns rows deleted."""
        if not self._has_rows("WHERE op = ?", (op,)):
            return 0
        with self._use(write=True) as conn, _transaction(conn):
            return conn.execute("DELETE FROM entries WHERE op = ?", (op,)).rowcount

    def delete_all(self) -> int:
        """Delete every entry; returns rows deleted."""
        if not self._has_rows("", ()):
            return 0
        with self._use(write=True) as conn, _transaction(conn):
            return conn.execute("DELETE FROM entries").rowcount

    def _has_rows(self, where: str, args: tuple) -> bool:
        """Whether a delete would delete anything (so a delete of nothing writes nothing)."""
        with self._use() as conn:
            return conn is not None and conn.execute(f"SELECT 1 FROM entries {where} LIMIT 1", args).fetchone() \
                is not None

    # -- bundles (forge cache import / merge / prune) ----------------------------------------------

    def put_newer(self, entries: list[Entry]) -> list[str]:
        """Store each entry unless the cache already holds a readable one under its key that is at least as
        new (created_at); one transaction for all, in order. Returns "added" | "replaced" | "kept" per entry.

        Ties keep the stored entry, so importing the same entries twice changes nothing."""
        for entry in entries:
            _check_entry(entry)
        rows = [tuple(_encode_json(getattr(e, name)) if name in _JSON_COLUMNS else getattr(e, name)
                      for name in _COLUMNS) for e in entries]
        outcome: list[str] = []
        with self._use(write=True) as conn, _transaction(conn):
            for entry, row in zip(entries, rows, strict=True):
                found = conn.execute(f"{_SELECT} WHERE key = ?", (entry.key,)).fetchone()
                if found is not None and not self._damaged(found) and (
                        found[_COLUMNS.index("created_at")] or 0.0) >= entry.created_at:
                    outcome.append("kept")
                    continue
                conn.execute(_INSERT, row)
                outcome.append("added" if found is None else "replaced")
        return outcome

    def _damaged(self, row: tuple) -> bool:
        """A stored row that cannot be read back as an entry: an import replaces it whatever its date."""
        try:
            self._row_to_entry(row)
        except CacheError:
            return True
        return not isinstance(row[_COLUMNS.index("created_at")], int | float)

    def delete_keys(self, keys: list[str]) -> int:
        """Delete the entries stored under exactly these keys (one transaction); returns rows deleted."""
        if not keys:
            return 0
        with self._use(write=True) as conn, _transaction(conn):
            return sum(conn.execute("DELETE FROM entries WHERE key = ?", (key,)).rowcount for key in keys)

    @classmethod
    def open_read_only(cls, path: str | os.PathLike[str], *, busy_timeout_s: float = 60.0) -> Cache:
        """An existing cache file, never created, converted or written (the source side of `forge cache
        merge`). Reading methods work; writing ones raise CacheError."""
        path = Path(path).expanduser()
        if not path.is_file():
            raise CacheError(f"forge cache {path} does not exist (or is not a file)")
        return cls(path, busy_timeout_s=busy_timeout_s, read_only=True)

    # -- lifetime --------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the connection. Idempotent."""
        with self._lock:
            conn, self._conn = self._conn, None
            self._closed = True
            if conn is not None:
                try:
                    conn.close()
                except sqlite3.Error as exc:
                    raise _translate(self.path, exc, self._busy_timeout_s) from exc

    def __enter__(self) -> Cache:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Cache({str(self.path)!r})"
