"""Cache bundles: moving cache entries between machines without trusting their code.

A bundle is one JSON file (format in docs/cache.md): a header and every entry's columns. Import and
merge put entries through the same checks:

  - shape: every column present with the right type, a known decision;
  - key: the entry's key must be sha256(spec, env) — an entry stored under a key that is not its own
    would make the shim serve it for a spec or environment it was never made for;
  - integrity: source_sha256 is the sha256 of source;
  - metadata: winner and baseline quantiles are finite positive numbers with p20 <= p50 <= p80, and
    consistent with the listed candidates (the winner's are the quantiles of the listed candidate with
    its variant and params; each candidate's speedup is the baseline's p50 over its own); created_at is
    not more than FUTURE_SKEW_S ahead of this machine's clock;
  - params: the spec is one the installed op builds, and the variant and params are a point of the op's
    declared space for it (each value one of the choices, of its type) — param values are pasted into
    the templates, so this is what keeps anything but numbers out of kernel code. For an op that is not
    installed here only the types are checked (plain int, float or bool);
  - provenance: a kernel's source must re-render, byte for byte, from the *installed* templates with
    the entry's own spec, variant and params. Forge then runs only code its own templates produce.
    `--trust` imports entries that fail this check anyway (with a warning); the other checks are
    never overridden. (Every loader repeats the whole check before importing a source:
    forge/key.py verify_entry; a trusted entry is stored but never loaded unless it re-renders.)

Imported entries are marked: their forge_version gets the local version label "imported"
("0.4.0+imported", forge/key.py is_imported), so their timings are never mistaken for ones measured
here. A created_at up to FUTURE_SKEW_S ahead (clock skew) is clamped to the import time, reported as
`clamped`, and never replaces a stored entry: a future timestamp never wins a conflict. A stored entry
dated further ahead than that (imported before these checks) loses to any valid incoming copy.

Entries made for another environment (GPU, driver, torch, triton, templates) are kept: their key
contains that environment, so this machine never looks them up, and the shim refuses an entry whose
env differs from its own in any case. `forge cache prune` removes them.

On a key conflict the newer entry (created_at) wins; ties keep the stored one, so re-running an
import or merge changes nothing.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forge import key as keys
from forge import ops
from forge._version import __version__
from forge.cache import DECISIONS, SCHEMA_VERSION, WINNING, Cache, Entry
from forge.errors import UsageError
from forge.loader import source_sha256
from forge.spec import KernelSpec

FORMAT = "forge-cache-bundle"
FORMAT_VERSION = 1
# How far an entry's created_at may be ahead of this machine's clock (clock skew) before it is rejected.
FUTURE_SKEW_S = 86400.0
_QUANTILE_KEYS = ("p20", "p50", "p80")
_REL_TOL = 1e-9  # quantiles and speedups survive JSON exactly; this only absorbs float formatting

_FIELDS = {f.name: f for f in dataclasses.fields(Entry)}
# Expected JSON types per column; None is allowed where the column is nullable.
_TYPES: dict[str, tuple[type, ...]] = {
    "key": (str,), "op": (str,), "spec": (dict,), "env": (dict,), "decision": (str,),
    "variant": (str, type(None)), "params": (dict, type(None)), "source": (str, type(None)),
    "source_sha256": (str, type(None)), "template_hash": (str,), "winner": (dict, type(None)),
    "baseline": (dict, type(None)), "candidates": (list,), "search_seconds": (int, float),
    "forge_version": (str,), "created_at": (int, float),
}


class BundleError(UsageError):
    """The bundle file cannot be read as a forge cache bundle (exit 2: a bad FILE argument)."""


class Rejected(Exception):
    """An entry that must not be imported; the message says why."""


class Untrusted(Rejected):
    """An entry whose source does not re-render from the installed templates (`--trust` overrides)."""


# -- writing ----------------------------------------------------------------------------------------

def entry_to_json(entry: Entry) -> dict[str, Any]:
    return dataclasses.asdict(entry)


def write_bundle(path: str | os.PathLike, entries: Iterable[Entry]) -> int:
    """Write `entries` to `path` as one bundle, atomically (rename); returns how many."""
    rows = [entry_to_json(e) for e in entries]
    doc = {"format": FORMAT, "format_version": FORMAT_VERSION, "cache_schema_version": SCHEMA_VERSION,
           "forge_version": __version__, "created_at": time.time(), "count": len(rows), "entries": rows}
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(doc, f, indent=1, sort_keys=True, allow_nan=False)
                f.write("\n")
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        raise UsageError(f"cannot write bundle {path}: {exc.strerror or exc}") from None
    return len(rows)


# -- reading ----------------------------------------------------------------------------------------

def read_bundle(path: str | os.PathLike) -> list[Any]:
    """The raw entries of the bundle at `path`. Raises BundleError for anything that is not a bundle
    this forge can read (missing file, not JSON, another format, a newer format version)."""
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise BundleError(f"cannot read bundle {path}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BundleError(f"{path} is not a forge cache bundle (not JSON: {exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise BundleError(f"{path} is not a forge cache bundle (no \"format\": \"{FORMAT}\" header); "
                          "to merge another cache DB use `forge cache merge`")
    version = doc.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise BundleError(f"bundle {path} has no valid format_version")
    if version > FORMAT_VERSION:
        raise BundleError(f"bundle {path} has format version {version}, newer than this forge reads "
                          f"({FORMAT_VERSION}); upgrade forge")
    entries = doc.get("entries")
    if not isinstance(entries, list):
        raise BundleError(f"bundle {path} has no \"entries\" list")
    return entries


def parse_entry(raw: Any) -> Entry:
    """A bundle's entry as an Entry; Rejected (with the reason) when its shape is wrong."""
    if not isinstance(raw, dict):
        raise Rejected(f"malformed entry: expected an object, got {type(raw).__name__}")
    missing = sorted(set(_FIELDS) - set(raw))
    if missing:
        raise Rejected(f"malformed entry: missing {', '.join(missing)}")
    values = {name: raw[name] for name in _FIELDS}
    for name, types in _TYPES.items():
        value = values[name]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise Rejected(f"malformed entry: {name} is {type(value).__name__}")
    if values["decision"] not in DECISIONS:
        raise Rejected(f"malformed entry: unknown decision {values['decision']!r}")
    if not math.isfinite(values["created_at"]):
        raise Rejected("malformed entry: created_at is not a finite number")
    return Entry(**values)


# -- checking ---------------------------------------------------------------------------------------

def check_integrity(entry: Entry) -> None:
    """The checks `--trust` never overrides: the key is the entry's own, the source matches its hash."""
    try:
        spec = KernelSpec.from_dict(entry.spec)
        key = keys.cache_key(spec, entry.env)
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise Rejected(f"malformed spec or env ({exc})") from None
    if entry.key != key:
        raise Rejected(f"key is not sha256(spec, env) (that is {key[:12]}...): the entry would be served "
                       "for a spec or environment it was not made for")
    if spec.op != entry.op:
        raise Rejected(f"op {entry.op!r} differs from its spec's op {spec.op!r}")
    if entry.decision == "kernel":
        if entry.source is None or entry.variant is None or entry.params is None:
            raise Rejected("a kernel decision without source, variant or params")
    elif entry.source is not None:  # torch and eager decisions run no forge source
        raise Rejected(f"a {entry.decision} decision that carries a kernel source")
    if entry.source is not None and not keys.source_intact(entry):
        raise Rejected("source does not match its source_sha256 (damaged or edited)")


def check_params(entry: Entry) -> None:
    """Rejected unless a kernel entry's spec is one the installed op builds and its variant and params are
    a point of the op's space (forge/key.py params_problem). `--trust` never overrides this: param values
    are pasted into the templates. For an op that is not installed here, the values must at least be
    plain numbers (the space is checked again by verify_entry before the entry is ever loaded)."""
    if entry.decision != "kernel":
        return
    try:
        op = ops.get(entry.op)
    except Exception:  # noqa: BLE001 - not installed (or its op file does not load): check the types
        problem = keys.params_type_problem(entry.params)
        if problem is None and not isinstance(entry.variant, str):
            problem = f"variant {entry.variant!r} is not a name"
    else:
        spec = KernelSpec.from_dict(entry.spec)  # check_integrity parsed it already
        problem = keys.spec_problem(op, spec) or keys.params_problem(op, spec, entry.variant, entry.params)
    if problem is not None:
        raise Rejected(problem)


def rerender(entry: Entry) -> str:
    """The source the installed templates give for the entry's spec, variant and params.

    Raises Untrusted when that is impossible (unknown op or variant, a template error)."""
    try:
        op = ops.get(entry.op)
    except UsageError:
        raise Untrusted(f"op {entry.op!r} is not installed here, so its source cannot be checked") from None
    try:
        return keys.rendered_source(op, KernelSpec.from_dict(entry.spec), entry.variant, entry.params)
    except Exception as exc:  # noqa: BLE001 - any failure to re-render means the source is unverified
        raise Untrusted(f"source cannot be re-rendered from the installed templates "
                        f"({type(exc).__name__}: {exc})") from None


def check_source(entry: Entry) -> None:
    """Raises Untrusted unless a kernel entry's source is exactly what the installed templates render."""
    if entry.decision != "kernel":
        return
    expected = rerender(entry)
    if expected != entry.source:
        stale = ""
        try:
            if ops.get(entry.op).template_hash != entry.template_hash:
                stale = " (the entry was made with other templates: template_hash differs)"
        except UsageError:
            pass
        raise Untrusted("source does not re-render from the installed templates with its variant and params "
                        f"(sha256 {entry.source_sha256[:12]}... vs {source_sha256(expected)[:12]}...){stale}")


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=_REL_TOL, abs_tol=0.0)


def quantiles_problem(what: str, q: Any) -> str | None:
    """Why `q` is not a quantiles object forge writes ({p20, p50, p80, n}: finite positive µs, p20 <= p50
    <= p80, n a positive count), or None. None itself is fine (nothing measured)."""
    if q is None:
        return None
    if not isinstance(q, dict):
        return f"{what} quantiles are a {type(q).__name__}, not an object"
    extra = sorted(set(q) - {*_QUANTILE_KEYS, "n"})
    if extra:
        return f"{what} quantiles have unexpected fields {', '.join(map(str, extra))}"
    for k in _QUANTILE_KEYS:
        v = q.get(k)
        if type(v) not in (int, float) or not math.isfinite(v) or v <= 0:
            return f"{what} quantile {k}={v!r} is not a finite positive number"
    if not q["p20"] <= q["p50"] <= q["p80"]:
        return f"{what} quantiles are not ordered p20 <= p50 <= p80 ({q['p20']}, {q['p50']}, {q['p80']})"
    n = q.get("n")
    if n is not None and (type(n) is not int or n < 1):
        return f"{what} sample count n={n!r} is not a positive integer"
    return None


def _label(c: dict) -> str:
    params = c.get("params") if isinstance(c.get("params"), dict) else {}
    return f"{c.get('variant')}({', '.join(f'{k}={v}' for k, v in params.items())})"


def check_metadata(entry: Entry, now: float) -> None:
    """Rejected when the entry's timings or dates cannot be what a search wrote: malformed winner or baseline
    quantiles, quantiles inconsistent with the listed candidates, search_seconds not a finite non-negative
    number, or a created_at more than FUTURE_SKEW_S ahead of `now`."""
    problem = quantiles_problem("winner", entry.winner) or quantiles_problem("baseline", entry.baseline)
    if problem is not None:
        raise Rejected(problem)
    if entry.decision in WINNING and (entry.winner is None or entry.baseline is None):
        raise Rejected(f"a {entry.decision} decision without winner and baseline quantiles")
    if entry.decision == "eager" and entry.winner is not None:
        raise Rejected("an eager decision with winner quantiles")
    if not math.isfinite(entry.search_seconds) or entry.search_seconds < 0:
        raise Rejected(f"search_seconds {entry.search_seconds!r} is not a finite non-negative number")
    if entry.created_at > now + FUTURE_SKEW_S:
        raise Rejected(f"created_at {_utc(entry.created_at)} is in the future (more than "
                       f"{FUTURE_SKEW_S / 3600:g} h ahead of this machine's clock, {_utc(now)})")
    base_p50 = entry.baseline["p50"] if entry.baseline else None
    for c in entry.candidates:
        if not isinstance(c, dict):
            raise Rejected(f"malformed entry: a candidate is a {type(c).__name__}, not an object")
        label = _label(c)
        for phase in ("screen", "final"):
            problem = quantiles_problem(f"candidate {label} {phase}", c.get(phase))
            if problem is not None:
                raise Rejected(problem)
        q = c.get("final") or c.get("screen")
        speedup = c.get("speedup")
        if speedup is not None:
            if type(speedup) not in (int, float) or not math.isfinite(speedup):
                raise Rejected(f"candidate {label}: speedup {speedup!r} is not a finite number")
            expected = None if q is None or base_p50 is None else base_p50 / q["p50"]
            if q is not None and (expected is None or not _close(speedup, expected)):
                shown = "-" if expected is None else f"{expected:.6g}"
                raise Rejected(f"baseline quantiles are inconsistent with the candidates: candidate {label} lists "
                               f"speedup {speedup:.6g}, but baseline p50 / its p50 is {shown}")
    if entry.decision != "kernel":
        return
    listed = [c for c in entry.candidates if c.get("variant") == entry.variant and c.get("params") == entry.params]
    for c in listed:
        if c.get("status") not in (None, "ok"):
            raise Rejected(f"the winner {_label(c)} is listed with status {c.get('status')!r}, not ok")
        q = c.get("final") or c.get("screen")
        if q is None:
            continue
        same = all(_close(entry.winner[k], q[k]) for k in _QUANTILE_KEYS) and (
            entry.winner.get("n") is None or q.get("n") is None or entry.winner.get("n") == q.get("n"))
        if not same:
            shown = " / ".join(f"{entry.winner[k]:g}" for k in _QUANTILE_KEYS)
            listed_q = " / ".join(f"{q[k]:g}" for k in _QUANTILE_KEYS)
            raise Rejected(f"winner quantiles (p20/p50/p80 {shown}) are not those of the listed winner candidate "
                           f"{_label(c)} ({listed_q}): timings edited")


def _utc(t: float) -> str:
    try:
        return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    except (OverflowError, OSError, ValueError):
        return f"{t:.6g} (unix time)"


# -- importing --------------------------------------------------------------------------------------

@dataclass
class ImportReport:
    source: str  # the bundle file or DB(s)
    cache: str
    added: list[str] = field(default_factory=list)
    replaced: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # the cache already had it (same or newer)
    rejected: list[dict[str, Any]] = field(default_factory=list)  # {"key", "op", "reason", "from"}
    trusted: list[dict[str, Any]] = field(default_factory=list)  # imported with --trust despite the reason
    other_env: list[str] = field(default_factory=list)  # imported, made for another environment
    clamped: list[str] = field(default_factory=list)  # created_at was (slightly) in the future: set to now

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _describe(raw: Any) -> tuple[str, str]:
    if isinstance(raw, dict):
        return str(raw.get("key", "?")), str(raw.get("op", "?"))
    return "?", "?"


def check_entry(entry: Entry, *, trust: bool, now: float) -> str | None:
    """Every check import and merge make (Rejected with the reason). Returns the reason the source was
    let in unverified under `trust` (None when it re-renders)."""
    check_integrity(entry)
    check_metadata(entry, now)
    check_params(entry)
    try:
        check_source(entry)
    except Untrusted as exc:
        if not trust:
            raise
        return str(exc)
    return None


def import_entries(cache: Cache, raws: list[tuple[str, Any]], *, trust: bool, source: str,
                   now: float | None = None) -> ImportReport:
    """Check each (origin, raw entry) and store those that pass, newer-wins. `raws` may hold Entry
    objects (from another cache DB) or bundle dicts. Stored entries are marked imported (forge_version
    "+imported"); a created_at in the future (within FUTURE_SKEW_S) is clamped to `now`."""
    now = time.time() if now is None else now
    report = ImportReport(source=source, cache=str(cache.path))
    accepted: list[Entry] = []
    for origin, raw in raws:
        key, op = _describe(entry_to_json(raw) if isinstance(raw, Entry) else raw)
        try:
            entry = raw if isinstance(raw, Entry) else parse_entry(raw)
            unverified = check_entry(entry, trust=trust, now=now)
        except Rejected as exc:
            report.rejected.append({"key": key, "op": op, "reason": str(exc), "from": origin})
            continue
        if unverified is not None:
            report.trusted.append({"key": entry.key, "op": entry.op, "reason": unverified, "from": origin})
        accepted.append(dataclasses.replace(entry, forge_version=keys.imported_version(entry.forge_version)))
    if accepted:
        envs = keys.machine_envs()
        stored_at: dict[str, float | None] = {}
        for key in {e.key for e in accepted}:
            stored = cache.get(key)
            stored_at[key] = None if stored is None else stored.created_at
        # A stored entry dated beyond the skew allowance (imported before created_at was checked) would win
        # every conflict: it makes way for a valid incoming copy.
        future = sorted(k for k, t in stored_at.items() if t is not None and t > now + FUTURE_SKEW_S)
        if future:
            cache.delete_keys(future)
            stored_at.update(dict.fromkeys(future))
        # An incoming created_at ahead of this clock (within the skew allowance) is clamped to now, and never
        # wins over a stored entry: clamped to the stored one's date, a tie, which keeps the stored entry.
        # (Earlier copies of a key in this same import count as stored.)
        for i, entry in enumerate(accepted):
            held = stored_at[entry.key]
            if entry.created_at > now:
                report.clamped.append(entry.key)
                entry = accepted[i] = dataclasses.replace(entry, created_at=now if held is None else min(now, held))
            stored_at[entry.key] = entry.created_at if held is None else max(held, entry.created_at)
        # Per key, relative to the cache before: added if it was not there (even if a later duplicate
        # in the same import replaced it), else replaced if any copy was newer, else kept.
        final: dict[str, str] = {}
        rank = {"kept": 0, "replaced": 1, "added": 2}
        for entry, outcome in zip(accepted, cache.put_newer(accepted), strict=True):
            if entry.key in future and outcome == "added":
                outcome = "replaced"
            if rank[outcome] > rank[final.get(entry.key, "kept")] or entry.key not in final:
                final[entry.key] = outcome
            if not keys.made_here(entry.env, envs):
                report.other_env.append(entry.key)
        for key, outcome in final.items():
            getattr(report, outcome).append(key)
    for name in ("added", "replaced", "kept", "other_env", "clamped"):
        setattr(report, name, sorted(set(getattr(report, name))))
    return report


# -- pruning ----------------------------------------------------------------------------------------

PRUNE_CRITERIA = ("env", "stale", "age")


def prune_reasons(entries: list[Entry], *, env: bool, stale: bool, older_than_days: float | None,
                  now: float | None = None) -> list[tuple[Entry, list[str]]]:
    """(entry, reasons) for every entry that one of the chosen criteria removes."""
    from forge import ops

    now = time.time() if now is None else now
    envs = keys.machine_envs() if env else {}
    hashes: dict[str, str | None] = {}
    out = []
    for e in entries:
        reasons = []
        if env and not keys.made_here(e.env, envs):
            reasons.append(f"other environment ({e.env.get('backend')}: {e.env.get('gpu') or e.env.get('cpu')}, "
                           f"torch {e.env.get('torch')}, triton {e.env.get('triton')})")
        if stale:
            if e.op not in hashes:
                try:
                    hashes[e.op] = ops.get(e.op).template_hash
                except (UsageError, TypeError):
                    hashes[e.op] = None
            if hashes[e.op] is None:
                reasons.append(f"op {e.op!r} is not installed")
            elif hashes[e.op] != e.template_hash:
                reasons.append("stale templates (template_hash differs from the installed op's)")
        if older_than_days is not None and now - e.created_at > older_than_days * 86400:
            reasons.append(f"older than {older_than_days:g} days ({(now - e.created_at) / 86400:.1f} d)")
        if reasons:
            out.append((e, reasons))
    return out
