"""Small helpers shared by the modules of forge.tuner.bench (no imports from them)."""

from __future__ import annotations

from collections.abc import Callable

Events = Callable[..., None]


def _short(exc: BaseException, limit: int = 300) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    text = f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _fmt_params(params: dict | None) -> str:
    return ", ".join(f"{k}={v}" for k, v in (params or {}).items())
