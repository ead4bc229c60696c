"""Visibility (issue 17): FORGE_LOG, FORGE_SEARCH_LOG's per-candidate CSV, and what the shim says on stderr when
a first call searches."""

from __future__ import annotations

import csv
import logging

import pytest
import torch

import forge
from forge import log
from forge.cache import Cache
from forge.tuner import engine


@pytest.fixture(autouse=True)
def _no_handlers():
    yield
    for h in [h for h in log.logger.handlers if getattr(h, log._HANDLER_MARK, False)]:
        log.logger.removeHandler(h)
    log.logger.setLevel(logging.NOTSET)


def _search(tmp_path, shape=(4, 40)):
    return engine.search("softmax", shape, "float32", device="cpu", cache=Cache(tmp_path / "forge.db"),
                         options=engine.SearchOptions(budget=2, workers=1, timeout=120))


def test_forge_log_info_says_each_decision_and_debug_each_candidate(tmp_path, capsys):
    log.configure({"FORGE_LOG": "info"})
    log.configure({"FORGE_LOG": "info"})  # idempotent: one handler
    assert sum(getattr(h, log._HANDLER_MARK, False) for h in log.logger.handlers) == 1
    rep = _search(tmp_path)
    err = capsys.readouterr().err
    line = next(ln for ln in err.splitlines() if ln.startswith("forge INFO forge.tuner.engine")
                or ln.startswith("forge INFO forge:"))
    assert f"softmax 4x40 float32 key {rep.key[:12]}: {rep.decision}" in line and "candidates" in line, line
    log.configure({"FORGE_LOG": "debug"})
    _search(tmp_path, (5, 40))
    _search(tmp_path, (5, 40))  # a cache hit
    msgs = [ln.split(": ", 1)[1] for ln in capsys.readouterr().err.splitlines() if ln.startswith("forge DEBUG")]
    assert sum(m.startswith("  ") for m in msgs) >= 2, msgs  # every candidate
    assert any("cache hit" in m for m in msgs)


def test_an_unknown_level_is_one_warning(capsys):
    log.configure({"FORGE_LOG": "loud"})
    assert "FORGE_LOG='loud'" in capsys.readouterr().err and not log.logger.handlers


def test_forge_search_log_appends_one_row_per_candidate(tmp_path, monkeypatch):
    path = tmp_path / "candidates.csv"
    monkeypatch.setenv("FORGE_SEARCH_LOG", str(path))
    a = _search(tmp_path)
    b = _search(tmp_path, (6, 40))
    rows = list(csv.DictReader(path.open()))
    assert len(rows) == len(a.candidates) + len(b.candidates)
    assert {r["key"] for r in rows} == {a.key, b.key} and all(r["op"] == "softmax" for r in rows)
    assert any(r["status"] == "ok" and float(r["p50_us"]) > 0 for r in rows)
    monkeypatch.setenv("FORGE_SEARCH_LOG", str(tmp_path / "no-such-dir" / "x.csv"))
    assert _search(tmp_path, (7, 40)).decision  # an unwritable log never fails the search


def test_the_shim_says_it_searches_for_how_long_at_most_and_the_result(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FORGE_SEARCH_TIME_BUDGET", "90")
    f = forge.optimize(lambda x: torch.softmax(x, dim=-1), interpreter=True, cache=tmp_path / "forge.db",
                       budget=2, warn=False)
    x = torch.randn(3, 24)
    assert torch.allclose(f(x), torch.softmax(x, dim=-1), atol=1e-6)
    err = capsys.readouterr().err
    assert "forge: softmax 3x24 float32 is not tuned on this device: searching (at most 2 candidates and 90 s" in err
    assert "forge: softmax 3x24 float32: " in err and "cached in" in err
    f(x)
    assert "searching" not in capsys.readouterr().err  # bound: no second search
    monkeypatch.setenv("FORGE_SEARCH_TIME_BUDGET", "soon")
    g = forge.optimize(lambda x: torch.softmax(x, dim=-1) * 2, interpreter=True, cache=tmp_path / "forge.db",
                       budget=2, warn=False)
    y = torch.randn(3, 28)
    assert torch.allclose(g(y), torch.softmax(y, dim=-1) * 2, atol=1e-6)
    assert "FORGE_SEARCH_TIME_BUDGET='soon'" in forge.explain(g, y).reason
