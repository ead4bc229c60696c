"""Webhook notifications (forge/tuner/notify.py), against a local HTTP server on loopback."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from forge.cache import Cache
from forge.tuner import engine, notify


@pytest.fixture
def server():
    got: list[tuple[str, dict]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            got.append((self.path, body))
            self.send_response(204 if self.path != "/broken" else 500)
            self.end_headers()

        def log_message(self, *a):
            pass

    httpd = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", got
    httpd.shutdown()


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    for names in notify.ENV.values():
        for name in names:
            monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(notify, "_warned", set())


def _search(tmp_path, **kw):
    return engine.search("softmax", (4, 40), "float32", device="cpu", cache=Cache(tmp_path / "forge.db"),
                         options=engine.SearchOptions(budget=1, workers=1, timeout=120, **kw))


def test_a_search_posts_discord_json_on_completion_and_not_on_a_cache_hit(tmp_path, server, monkeypatch):
    url, got = server
    monkeypatch.setenv("FORGE_WEBHOOK_COMPLETION", url + "/done")
    rep = _search(tmp_path)
    notify._drain(5.0)
    assert len(got) == 1
    path, body = got[0]
    fields = {f["name"]: f["value"] for f in body["embeds"][0]["fields"]}
    assert path == "/done" and body["content"].startswith("forge: softmax 4x40 float32 -> ")
    assert fields["op"] == "softmax" and fields["shape"] == "4x40" and fields["decision"] == rep.decision
    assert fields["wall time"].endswith(" s") and fields["host"]
    _search(tmp_path)  # a cache hit: nothing posted
    notify._drain(5.0)
    assert len(got) == 1


def test_the_discord_names_work_and_errors_go_to_the_errors_hook(tmp_path, server, monkeypatch):
    url, got = server
    monkeypatch.setenv("DISCORD_WEBHOOK_ERRORS", url + "/err")

    def boom(*a, **k):
        raise RuntimeError("worker pool exploded")

    monkeypatch.setattr(engine, "_search_locked", boom)
    with pytest.raises(RuntimeError, match="exploded"):
        _search(tmp_path)
    notify._drain(5.0)
    (path, body), = got
    fields = {f["name"]: f["value"] for f in body["embeds"][0]["fields"]}
    assert path == "/err" and "failed" in body["content"] and "worker pool exploded" in fields["error"]


def test_a_bad_url_is_one_warning_and_never_fails_the_search(tmp_path, server, monkeypatch, capsys):
    url, got = server
    monkeypatch.setenv("FORGE_WEBHOOK_COMPLETION", url + "/broken")  # answers 500
    rep = _search(tmp_path)
    notify._drain(5.0)
    assert rep.decision in ("kernel", "eager", "torch")
    for t in (notify.send("completion", "again", {"op": "x"}), notify.send("completion", "again", {"op": "x"})):
        t.join(5.0)
    warnings = [ln for ln in capsys.readouterr().err.splitlines() if "webhook" in ln]
    assert len(warnings) == 1 and "failed" in warnings[0], warnings
    monkeypatch.setenv("FORGE_WEBHOOK_COMPLETION", "not a url")
    notify.send("completion", "x", {"op": "x"}).join(5.0)
    assert sum("webhook" in ln for ln in capsys.readouterr().err.splitlines()) == 1


def test_no_url_no_thread():
    assert notify.send("completion", "x", {}) is None and notify.url_for("errors") is None
    assert notify.url_for("errors", {"DISCORD_WEBHOOK_ERRORS": "u", "FORGE_WEBHOOK_ERRORS": "v"}) == "v"
