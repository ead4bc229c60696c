"""The cache and bundles are untrusted input (issue 12, items 1-4): param values that are code, values outside
the op's space, a source edited behind a recomputed sha256, forged timings and dates, and a damaged entry
hit by `forge search`. Every loader (the shim, forge.load, bench, bench --recheck, export, bundle import and
merge, a search cache hit) refuses such an entry before importing anything (forge/key.py verify_entry)."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import time
from pathlib import Path

import pytest
import torch

import forge
from forge import codegen, ops
from forge import key as keys
from forge.cache import Cache
from forge.loader import source_sha256
from forge.opkit import Candidate
from forge.spec import KernelSpec
from forge.tuner import bench, bundle, engine, export
from forge.tuner.bench import run as bench_run
from forge.tuner.status import Status
from tests.conftest import HAS_CUDA
from tests.test_bundle import _rekey
from tests.test_export import kernel_entry

pytestmark = pytest.mark.skipif(HAS_CUDA, reason="exercises the interpreter path (CPU tensors)")

SHAPE = (64, 16)  # softmax rows: the multirow variant's ROWS is pasted into the launch code


def sm(x):
    return torch.softmax(x, -1)


def _forged(base, variant: str, params: dict, *, source: str | None = None):
    """`base` with another variant and params, and the source forge's own codegen rendered from them before
    it checked param types (values pasted verbatim), its sha256 recomputed: what an attacker ships."""
    if source is None:
        op, spec = ops.get(base.op), KernelSpec.from_dict(base.spec)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(codegen, "check_params", lambda op, cand: None, raising=False)
            try:
                source = codegen.render(op, spec, Candidate(variant, tuple(sorted(params.items()))))
            except Exception:  # noqa: BLE001 - e.g. a param missing: the template cannot render it at all
                source = base.source
    return dataclasses.replace(base, variant=variant, params=params, source=source,
                               source_sha256=source_sha256(source),
                               candidates=[{"variant": variant, "params": params, "status": "ok"}])


def _import(db: Cache, *entries, trust: bool = False, now: float | None = None) -> bundle.ImportReport:
    """Through a bundle file, as `forge cache import FILE` does."""
    path = Path(db.path).parent / "b.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [e if isinstance(e, dict) else bundle.entry_to_json(e) for e in entries]
    path.write_text(json.dumps({"format": bundle.FORMAT, "format_version": bundle.FORMAT_VERSION, "entries": rows}))
    when = {} if now is None else {"now": now}
    return bundle.import_entries(db, [(str(path), r) for r in bundle.read_bundle(path)], trust=trust,
                                 source=str(path), **when)


def _raw_sql(db_path, sql: str, *args) -> None:
    """Edit the DB behind forge's back (Cache.put refuses a source that does not match its sha256)."""
    conn = sqlite3.connect(db_path)
    conn.execute(sql, args)
    conn.commit()
    conn.close()


def _every_loader_refuses(db_path: Path, entry, needle: str, side_effect: Path, tmp_path: Path) -> None:
    """The entry is in the DB under this machine's key: each loader refuses it, naming `needle`, and nothing
    of its source ever runs (`side_effect` is the file it would create)."""
    x = torch.randn(*SHAPE)
    # The shim: eager, with the reason; the correct result.
    f = forge.optimize(sm, interpreter=True, search=False, warn=False, cache=db_path)
    assert torch.equal(f(x), sm(x))
    why = forge.explain(f, x)
    assert why.uses == "eager" and "refused, not loaded" in why.reason and needle in why.reason
    # forge.load: LookupError with the reason.
    with pytest.raises(LookupError, match="refused, not loaded") as info:
        forge.load("softmax", SHAPE, "float32", device="cpu", cache=db_path)
    assert needle in str(info.value)
    db = Cache(db_path)
    target = bench.target_of_entry(db.get(entry.key))
    # forge bench: the forge contestant is refused, not loaded.
    opts = bench.BenchOptions(skip=frozenset({"compile", "liger", "fused"}))
    forge_c = bench_run._contestants(target, "interpreter", tmp_path / "bench-src", opts)[0]
    assert forge_c.status == Status.REFUSED and needle in forge_c.reason and forge_c.call is None
    # forge bench --recheck: invalid (exit 5), and the source is never written out for a worker to import.
    rep = bench.run_recheck([target], backend="interpreter", cache=db)
    (r,) = rep.results
    assert r.status == Status.INVALID and "refused, not loaded" in r.reason and needle in r.reason
    assert rep.to_dict()["invalid"] == 1
    src_dir = Path(db_path).parent / "kernels-src"
    assert not any(entry.source == p.read_text() for p in src_dir.glob("*.py"))
    # forge export: refused (exit 2), nothing written.
    with pytest.raises(export.NotExportable, match="cannot be exported") as info:
        export.export(db.get(entry.key), ops.get("softmax"), tmp_path / "out")
    assert needle in str(info.value) and not (tmp_path / "out").exists()
    assert not side_effect.exists()


# -- item 1: code injection through params ------------------------------------------------------------------

def test_pwned_bundle_is_rejected_and_its_code_never_runs(tmp_path):
    pwned = tmp_path / "PWNED"
    params = {"ROWS": f"__import__('os').system('touch {pwned}') or 32", "num_warps": 16}
    evil = _forged(kernel_entry("softmax", SHAPE), "multirow", params)
    assert f"system('touch {pwned}')" in evil.source  # the attack of the issue, rendered by forge's templates
    db = Cache(tmp_path / "c" / "forge.db")
    for trust in (False, True):  # --trust never skips the param validation
        report = _import(db, evil, trust=trust)
        assert report.added == report.replaced == report.trusted == []
        (rejected,) = report.rejected
        assert rejected["key"] == evil.key and "param ROWS=" in rejected["reason"]
        assert "not a plain int, float or bool" in rejected["reason"]
    # merge (Entry objects from another DB) rejects it the same way
    report = bundle.import_entries(db, [("other.db", evil)], trust=True, source="other.db")
    assert report.added == [] and "param ROWS=" in report.rejected[0]["reason"]
    assert db.get(evil.key) is None and not pwned.exists()
    # The renderer refuses it outright.
    with pytest.raises(ValueError, match="param ROWS=.* not a plain int, float or bool"):
        codegen.render(ops.get("softmax"), KernelSpec.from_dict(evil.spec), Candidate.make("multirow", **params))
    # An entry that got into a cache anyway (before these checks): every loader refuses it.
    db.put(evil)
    _every_loader_refuses(db.path, evil, "param ROWS=", pwned, tmp_path)


@pytest.mark.parametrize("params,needle", [
    ({"ROWS": 3, "num_warps": 1}, "param ROWS=3 is not one of softmax/multirow's choices"),
    ({"ROWS": 2, "num_warps": "16, debug=True"}, "param num_warps='16, debug=True' is a str"),
    ({"ROWS": 2, "num_warps": 16.0}, "param num_warps=16.0 is not one of"),  # 16.0 is not 16
    ({"ROWS": 2, "num_warps": True}, "param num_warps=True is not one of"),  # True is not 1
    ({"ROWS": 2}, "missing num_warps"),
    ({"ROWS": 2, "num_warps": 1, "debug": 1}, "unexpected debug"),
])
def test_params_outside_the_space_are_rejected_by_name(tmp_path, params, needle):
    entry = _forged(kernel_entry("softmax", SHAPE), "multirow", params)
    assert keys.verify_entry(entry) is not None and needle in keys.verify_entry(entry)
    db = Cache(tmp_path / "c" / "forge.db")
    report = _import(db, entry, trust=True)
    assert report.added == [] and needle in report.rejected[0]["reason"]
    assert db.get(entry.key) is None


def test_rows_3_in_the_cache_runs_eager_instead_of_raising(tmp_path):
    """Before: the shim loaded it and the user's call raised ValueError("arange's range must be a power of 2")."""
    entry = _forged(kernel_entry("softmax", SHAPE), "multirow", {"ROWS": 3, "num_warps": 1})
    db = Cache(tmp_path / "forge.db")
    db.put(entry)
    x = torch.randn(*SHAPE)
    f = forge.optimize(sm, interpreter=True, search=False, warn=False, cache=tmp_path / "forge.db")
    assert torch.equal(f(x), sm(x))
    assert "param ROWS=3" in forge.explain(f, x).reason
    with pytest.raises(export.NotExportable, match="param ROWS=3"):
        export.export(entry, ops.get("softmax"), tmp_path / "out")


def test_renderer_takes_plain_numbers_only():
    op = ops.get("softmax")
    spec = op.module.make_spec(SHAPE, "float32", "cpu", {})
    for bad in ("16", "16, debug=True", None, [16], 16 + 0j, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="param num_warps=.*not a plain int, float or bool"):
            codegen.render(op, spec, Candidate.make("row", num_warps=bad))

    class Sneaky(int):
        def __repr__(self):
            return "__import__('os')"

    with pytest.raises(ValueError, match="not a plain"):
        codegen.render(op, spec, Candidate.make("row", num_warps=Sneaky(4)))
    # Types only: candidates outside space() still render (tests/test_templates.py relies on it).
    assert "ROWS=3" in codegen.render(op, spec, Candidate.make("multirow", ROWS=3, num_warps=1))
    assert "num_warps=4" in codegen.render(op, spec, Candidate.make("row", num_warps=4))


def test_verify_entry_checks_spec_key_and_op():
    good = kernel_entry("softmax", SHAPE)
    assert keys.verify_entry(good) is None
    assert keys.verify_entry(kernel_entry("gelu", (5, 7), decision="eager")) is None
    # A spec attribute is rendered too: one the op would never build is refused, even with a matching key.
    gelu = kernel_entry("gelu", (5, 7), attrs={"approximate": "tanh"})
    spec = {**gelu.spec, "attrs": {"approximate": 'tanh")\nimport os  # '}}
    evil = _rekey(gelu, spec=spec)
    evil = _forged(evil, gelu.variant, gelu.params)
    assert "spec is not one gelu builds" in keys.verify_entry(evil)
    # A key that is not the entry's own; an op that is not installed; an unknown variant.
    assert "key is not sha256(spec, env)" in keys.verify_entry(dataclasses.replace(good, key="0" * 64))
    other = _rekey(good, op="not_installed", spec={**good.spec, "op": "not_installed"})
    assert "not installed" in keys.verify_entry(other)
    unknown = _forged(good, "nope", {"num_warps": 1}, source=good.source)
    assert "variant 'nope' is not one of softmax's variants" in keys.verify_entry(unknown)
    assert "validity rule" in keys.verify_entry(_forged(good, "row", {"num_warps": 32}))  # < 1 value per thread


def test_import_forge_does_not_load_the_renderer():
    import subprocess
    import sys

    from tests.conftest import ROOT

    code = "import sys, forge, forge.key; print([m for m in ('jinja2', 'forge.codegen') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


# -- item 2: an edited source with a recomputed sha256 ------------------------------------------------------

def test_edited_source_with_recomputed_sha256_is_refused_everywhere(tmp_path):
    side = tmp_path / "SIDE_EFFECT"
    good = kernel_entry("softmax", SHAPE)
    source = (good.source + f"\nopen({str(side)!r}, 'w').close()\n"
              "\n_forge_launch = launch\n\ndef launch(*args):\n    _forge_launch(*args)\n    args[1].mul_(2.0)\n")
    edited = dataclasses.replace(good, source=source, source_sha256=source_sha256(source))
    assert keys.source_intact(edited)  # the sha256 matches: only the re-render tells
    db_path = tmp_path / "c" / "forge.db"
    Cache(db_path).put(edited)
    _every_loader_refuses(db_path, edited, "does not re-render from the installed templates", side, tmp_path)
    # The same entry intact loads and runs the kernel.
    Cache(db_path).put(good)
    x = torch.randn(*SHAPE)
    f = forge.optimize(sm, interpreter=True, search=False, warn=False, cache=db_path)
    assert forge.explain(f, x).uses == "kernel"
    assert torch.allclose(f(x), sm(x), rtol=1e-4, atol=1e-6)
    assert not side.exists()


# -- item 3: bundle metadata --------------------------------------------------------------------------------

def _measured(created_at: float | None = None):
    """A kernel entry with the candidates list a search writes: the winner's quantiles are its final ones,
    every speedup is the baseline's p50 over the candidate's."""
    e = kernel_entry("softmax", SHAPE, created_at=created_at)
    base = e.baseline
    win = {"p20": 90.0, "p50": 100.0, "p80": 110.0, "n": 5}
    other = {"p20": 130.0, "p50": 150.0, "p80": 170.0, "n": 3}
    cands = [
        {"variant": e.variant, "params": e.params, "status": "ok", "reason": None, "sha256": e.source_sha256,
         "screen": {"p20": 95.0, "p50": 101.0, "p80": 120.0, "n": 3}, "final": win,
         "speedup": base["p50"] / win["p50"]},
        {"variant": "multirow", "params": {"ROWS": 2, "num_warps": 1}, "status": "ok", "reason": None,
         "sha256": "0" * 64, "screen": other, "final": None, "speedup": base["p50"] / other["p50"]},
        {"variant": "row", "params": {"num_warps": 2}, "status": "mismatch", "reason": "wrong", "sha256": "1" * 64,
         "screen": None, "final": None, "speedup": None},
    ]
    return dataclasses.replace(e, winner=dict(win), candidates=cands)


def _with(entry, **changes) -> dict:
    return {**bundle.entry_to_json(entry), **changes}


@pytest.mark.parametrize("change,needle", [
    # the bundle: the winner's p50 edited to 1.0 (cache ls showed "26154.56x")
    (lambda e: {"winner": {**e.winner, "p50": 1.0}}, "winner quantiles are not ordered"),
    (lambda e: {"winner": {"p20": 0.9, "p50": 1.0, "p80": 1.1, "n": 5}}, "are not those of the listed winner"),
    (lambda e: {"baseline": {**e.baseline, "p50": 2e6, "p80": 3e6}}, "baseline quantiles are inconsistent"),
    (lambda e: {"winner": {**e.winner, "p20": float("nan")}}, "winner quantile p20=nan"),
    (lambda e: {"baseline": {**e.baseline, "p20": -1.0}}, "baseline quantile p20=-1.0"),
    (lambda e: {"winner": {**e.winner, "p50": "100"}}, "winner quantile p50='100'"),
    (lambda e: {"winner": None}, "without winner and baseline"),
    (lambda e: {"search_seconds": -3.0}, "search_seconds"),
    (lambda e: {"created_at": 1e15}, "is in the future"),
])
def test_forged_timings_and_dates_are_rejected(tmp_path, change, needle):
    e = _measured()
    db = Cache(tmp_path / "forge.db")
    report = _import(db, _with(e, **change(e)))
    assert report.added == [] and needle in report.rejected[0]["reason"], report.rejected
    assert db.get(e.key) is None
    # The consistent entry imports, marked as imported.
    report = _import(db, e)
    assert report.added == [e.key]
    stored = db.get(e.key)
    assert keys.is_imported(stored) and stored.forge_version == keys.imported_version(e.forge_version)
    assert not keys.is_imported(e) and stored.speedup == pytest.approx(2.0)


def test_imported_marking_is_idempotent_and_survives_export(tmp_path):
    e = _measured()
    a = Cache(tmp_path / "a.db")
    assert _import(a, e).added == [e.key]
    marked = a.get(e.key)
    assert marked.forge_version.endswith("+imported")
    assert _import(a, e).kept == [e.key] and a.get(e.key) == marked  # importing again changes nothing
    # Exported again and imported elsewhere: still marked once.
    b = Cache(tmp_path / "b" / "b.db")
    assert _import(b, marked).added == [e.key]
    assert b.get(e.key).forge_version == marked.forge_version
    assert keys.imported_version("0.4.0+local") == "0.4.0+local.imported"


def test_future_timestamps_never_win(tmp_path):
    now = time.time()
    db = Cache(tmp_path / "forge.db")
    stored = _measured(created_at=now - 100)
    db.put(stored)
    # The created_at = 1e15: rejected, the stored entry stays.
    forged = _with(stored, created_at=1e15, search_seconds=99.0)
    report = _import(db, forged)
    assert report.added == report.replaced == [] and "in the future" in report.rejected[0]["reason"]
    assert db.get(stored.key) == stored
    # An hour ahead (clock skew): accepted but clamped, and it does not replace the stored entry.
    skewed = dataclasses.replace(stored, created_at=now + 3600, search_seconds=7.0)
    report = _import(db, skewed, now=now)
    assert report.kept == [stored.key] and report.clamped == [stored.key] and report.rejected == []
    assert db.get(stored.key) == stored
    # Where nothing is stored it is added, dated now: a later genuine entry replaces it.
    other = Cache(tmp_path / "other.db")
    assert _import(other, skewed, now=now).added == [stored.key]
    assert other.get(stored.key).created_at == now
    later = dataclasses.replace(stored, created_at=now + 10, search_seconds=8.0)
    assert _import(other, later, now=now + 20).replaced == [stored.key]
    assert other.get(stored.key).search_seconds == 8.0
    # A stored entry dated far ahead (imported before these checks) makes way for a valid copy.
    db.put(dataclasses.replace(stored, created_at=1e15))
    report = _import(db, dataclasses.replace(stored, search_seconds=5.0), now=now)
    assert report.replaced == [stored.key] and db.get(stored.key).search_seconds == 5.0


# -- item 4: a search cache hit of a damaged entry ----------------------------------------------------------

def test_search_cache_hit_of_a_damaged_entry_searches_again(tmp_path, monkeypatch):
    db = Cache(tmp_path / "forge.db")
    good = kernel_entry("softmax", (2, 8))
    loc = keys.request("softmax", (2, 8), "float32", "interpreter")
    assert good.key == loc.key
    db.put(good)
    _raw_sql(db.path, "UPDATE entries SET source = source || '# damaged' WHERE key = ?", good.key)
    assert not keys.source_intact(db.get(good.key))
    searched = []
    decision = {"value": "kernel"}

    def fake_search(op, spec, env, key, backend, cache, opts, emit, t0, pools=None, gpu=None):
        searched.append(key)
        if decision["value"] == "kernel":
            cache.put(dataclasses.replace(good, created_at=time.time()))
        return engine.SearchReport(op=op.name, spec=spec, env=env, key=key, decision=decision["value"],
                                   cache_hit=False, seconds=0.0, cache_path=str(cache.path))

    monkeypatch.setattr(engine, "_search_locked", fake_search)
    events = []
    rep = engine.search("softmax", (2, 8), "float32", device="cpu", cache=db,
                        options=engine.SearchOptions(budget=2), events=lambda kind, **d: events.append((kind, d)))
    assert searched == [good.key] and rep.cache_hit is False
    assert "failed its check" in rep.note and "does not match its source_sha256" in rep.note
    assert rep.to_dict()["note"] == rep.note
    assert [d["key"] for k, d in events if k == "stored-entry-refused"] == [good.key]
    assert keys.verify_entry(db.get(good.key)) is None  # replaced by the new search's entry
    # The next search is a plain cache hit.
    rep = engine.search("softmax", (2, 8), "float32", device="cpu", cache=db, options=engine.SearchOptions(budget=2))
    assert rep.cache_hit and rep.decision == "kernel" and rep.note is None and searched == [good.key]
    # A damaged entry whose new search stores nothing (every candidate failed) is gone all the same.
    _raw_sql(db.path, "UPDATE entries SET source = source || '# damaged' WHERE key = ?", good.key)
    decision["value"] = "none"
    rep = engine.search("softmax", (2, 8), "float32", device="cpu", cache=db, options=engine.SearchOptions(budget=2))
    assert rep.decision == "none" and rep.note and db.get(good.key) is None


def test_search_cache_hit_of_an_edited_source_searches_again(tmp_path, monkeypatch):
    """The sha256 recomputed after the edit: only the re-render tells (the shim refuses the same entry)."""
    db = Cache(tmp_path / "forge.db")
    good = kernel_entry("softmax", (2, 8))
    source = good.source + "\nimport os  # added behind forge's back\n"
    db.put(dataclasses.replace(good, source=source, source_sha256=source_sha256(source)))
    calls = []

    def fake_search(op, spec, env, key, *a, **k):
        calls.append(key)
        db.put(good)
        return engine.SearchReport(op=op.name, spec=spec, env=env, key=key, decision="kernel", cache_hit=False,
                                   seconds=0.0)

    monkeypatch.setattr(engine, "_search_locked", fake_search)
    rep = engine.search("softmax", (2, 8), "float32", device="cpu", cache=db)
    assert calls == [good.key] and "does not re-render" in rep.note
    assert db.get(good.key) == good
