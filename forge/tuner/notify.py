"""Webhook notifications when a search completes or fails (issue 17, the original design's Discord hooks).

    FORGE_WEBHOOK_COMPLETION=URL   a search decided (kernel, torch op or eager; not a cache hit)
    FORGE_WEBHOOK_ERRORS=URL       a search failed (an exception, or every candidate failed: decision none)
    DISCORD_WEBHOOK_COMPLETION / DISCORD_WEBHOOK_ERRORS are read where the FORGE_ names are unset.

The body is Discord's webhook JSON (`content` plus one embed whose fields are op, shape, dtype, decision,
speedup, wall time and host); other receivers read the same fields. Posting never fails or slows a search:
it runs on a daemon thread with a 5 s timeout; a URL that cannot be reached or answers an error is one
warning on stderr per URL for the process; at exit forge waits at most EXIT_WAIT_S for posts still in
flight (a CLI process would otherwise end before they are sent).
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any

TIMEOUT_S = 5.0
EXIT_WAIT_S = 3.0
ENV = {"completion": ("FORGE_WEBHOOK_COMPLETION", "DISCORD_WEBHOOK_COMPLETION"),
       "errors": ("FORGE_WEBHOOK_ERRORS", "DISCORD_WEBHOOK_ERRORS")}

_pending: list[threading.Thread] = []
_warned: set[str] = set()
_lock = threading.Lock()


def url_for(kind: str, env: dict[str, str] | None = None) -> str | None:
    env = os.environ if env is None else env
    for name in ENV[kind]:
        if env.get(name):
            return env[name]
    return None


def payload(title: str, fields: dict[str, Any]) -> dict[str, Any]:
    """Discord-compatible webhook JSON."""
    shown = [{"name": k, "value": str(v)[:1024], "inline": True} for k, v in fields.items() if v is not None]
    line = " · ".join(f"{k} {v}" for k, v in fields.items() if v is not None and k not in ("host",))
    return {"content": f"forge: {title}: {line}"[:2000], "embeds": [{"title": title[:256], "fields": shown}]}


def _post(url: str, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    try:
        req = urllib.request.Request(url, data=data, method="POST",
                                     headers={"Content-Type": "application/json", "User-Agent": "forge-kernel"})
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:
            resp.read()
    except (urllib.error.URLError, OSError, ValueError) as exc:  # unreachable, HTTP error, malformed URL
        with _lock:
            if url in _warned:
                return
            _warned.add(url)
        print(f"forge: warning: webhook {url[:80]} failed ({exc}); notifications to it are dropped",
              file=sys.stderr)


def send(kind: str, title: str, fields: dict[str, Any]) -> threading.Thread | None:
    """Post in the background to the webhook of `kind` ("completion" or "errors"), if one is set."""
    url = url_for(kind)
    if not url:
        return None
    t = threading.Thread(target=_post, args=(url, payload(title, fields)), name="forge-webhook", daemon=True)
    with _lock:
        _pending[:] = [p for p in _pending if p.is_alive()]
        _pending.append(t)
    t.start()
    return t


def _drain(limit: float = EXIT_WAIT_S) -> None:
    end = time.monotonic() + limit
    for t in list(_pending):
        t.join(max(0.0, end - time.monotonic()))


atexit.register(_drain)


def search_done(report) -> None:
    """A search that decided (not a cache hit): completion; every candidate failed: errors."""
    if report.cache_hit:
        return
    spec = report.spec
    fields = {"op": report.op, "shape": spec.shape_str, "dtype": spec.dtype, "decision": report.decision,
              "speedup": f"{report.speedup:.2f}x" if report.speedup else None,
              "wall time": f"{report.seconds:.1f} s", "host": socket.gethostname()}
    if report.decision == "none":
        send("errors", f"{report.op} {spec.shape_str}: no candidate was correct"
                       + (f" ({report.cut_short})" if report.cut_short else ""), fields)
    else:
        send("completion", f"{report.op} {spec.shape_str} {spec.dtype} -> {report.decision}", fields)


def search_failed(op: str, shape: str, dtype: str, exc: BaseException, seconds: float) -> None:
    send("errors", f"{op} {shape} {dtype} failed",
         {"op": op, "shape": shape, "dtype": dtype, "error": f"{type(exc).__name__}: {exc}"[:500],
          "wall time": f"{seconds:.1f} s", "host": socket.gethostname()})
