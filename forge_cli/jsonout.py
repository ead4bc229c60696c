"""The `--json` schema of every forge command (docs/json.md): one version for the whole CLI, the one function
that prints a command's document, and the error object printed in its place when a command given `--json`
fails.

Each document is one JSON object on stdout, nothing else there: `{"version": SCHEMA_VERSION, "command":
"cache ls", ...the command's own keys}`. A command that fails before printing its document prints
`{"version", "command", "error": {"type", "exit_code", "message"}}` instead, with the same exit status (the
human message still goes to stderr, a bug's traceback too). A command that printed its document and still
exits non-zero (search: every candidate failed; bench: a cached kernel no longer validates) prints nothing
more: its document says what happened, the exit status says it too.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import typer
from typer.core import TyperGroup

from forge.errors import ExitCode

# Bumped when a key of any command's document is removed or changes meaning; adding a key does not bump it.
SCHEMA_VERSION = 1
RESERVED = ("version", "command")  # the first two keys of every document; no command sets them itself


@dataclass
class _Run:
    """One invocation of the CLI: whether --json was asked for, the command path as Click resolved it, and
    whether a document is on stdout already (there is never a second one)."""

    json: bool
    path: list[str] = field(default_factory=list)
    printed: bool = False


# Per invocation, not per process: tests run many invocations in one process (typer.testing.CliRunner).
_run: ContextVar[_Run | None] = ContextVar("forge_json_run", default=None)


def command() -> str | None:
    """The forge subcommand being run, e.g. "cache ls" (None before one was resolved)."""
    run = _run.get()
    return " ".join(run.path) if run is not None and run.path else None


def emit(doc: Mapping[str, Any], *, default: Callable[[Any], Any] | None = None) -> None:
    """Print a command's --json document on stdout: the version and the command first, then `doc`'s keys
    unchanged. `default` is json.dumps's, for documents holding values JSON has no type for."""
    clash = [k for k in RESERVED if k in doc]
    if clash:
        raise ValueError(f"a --json document may not set {', '.join(clash)}: jsonout owns them")
    _print({"version": SCHEMA_VERSION, "command": command(), **doc}, default=default)


def _print(doc: dict[str, Any], *, default: Callable[[Any], Any] | None = None) -> None:
    run = _run.get()
    if run is not None and run.printed:
        raise RuntimeError("a second --json document: stdout holds exactly one")
    text = json.dumps(doc, indent=2, default=default)  # whole before printing: no partial document on stdout
    print(text)
    if run is not None:
        run.printed = True


# -- failures ---------------------------------------------------------------------------------------------
class Failed(typer.Exit):
    """The exit of a command that failed with a message (forge_cli.render.fail prints it on stderr); the
    message goes into the --json error object."""

    def __init__(self, code: int, message: str):
        super().__init__(code)
        self.message = message


def _click_error(exc: BaseException) -> bool:
    """A usage error Click found (bad option value, unknown command or option), already shown on stderr by
    the time the process exits. Older Typer raises click's exceptions, newer Typer its own copy of them
    (typer._click): both have an int exit_code and format_message(); forge's own errors have no
    format_message (one that escapes a command is a bug)."""
    return isinstance(getattr(exc, "exit_code", None), int) and callable(getattr(exc, "format_message", None))


def error_object(exc: BaseException) -> dict[str, Any] | None:
    """{"type", "exit_code", "message"} for an exception leaving a command, with the exit status the process
    will have; None for a successful exit (typer.Exit(0), e.g. --version)."""
    if isinstance(exc, typer.Exit):
        code = exc.exit_code
        message = getattr(exc, "message", None) or f"exit status {code}"
    elif _click_error(exc):
        code, message = exc.exit_code, exc.format_message()
    else:  # a bug: Python prints its traceback on stderr and exits 1
        code, message = ExitCode.INTERNAL, f"{type(exc).__name__}: {exc}"
    if code == 0:
        return None
    try:
        kind = ExitCode(code).name.lower()
    except ValueError:  # an exit status forge does not define (Typer's 130 for Ctrl-C)
        kind = "other"
    return {"type": kind, "exit_code": int(code), "message": message}


def report_failure(exc: BaseException) -> None:
    """Under --json, the error object for `exc` on stdout, unless the command's document is there already."""
    run = _run.get()
    if run is None or not run.json or run.printed:
        return
    error = error_object(exc)
    if error is not None:
        _print({"version": SCHEMA_VERSION, "command": command(), "error": error})


def wants_json(argv: Sequence[str]) -> bool:
    """--json among the options (before a `--`, after which everything is an argument). Read from the raw
    command line: a usage error can come before Click has parsed the option."""
    for arg in argv:
        if arg == "--":
            return False
        if arg == "--json":
            return True
    return False


@contextmanager
def _reported() -> Iterator[None]:
    try:
        yield
    except Exception as exc:  # every way out of a command: reported, then handled as before (message, exit)
        report_failure(exc)
        raise


class Group(TyperGroup):
    """The Typer group of `forge` and of `forge cache` (Typer(cls=Group)): records the command path as it
    resolves, and at the root turns a failure under --json into the error object on stdout."""

    def main(self, args: Sequence[str] | None = None, *rest: Any, **kwargs: Any) -> Any:
        if args is not None:
            args = list(args)
        token = _run.set(_Run(json=wants_json(sys.argv[1:] if args is None else args)))
        try:
            return super().main(args, *rest, **kwargs)
        finally:
            _run.reset(token)

    def make_context(self, info_name: str | None, args: list[str], parent: Any = None, **extra: Any) -> Any:
        if parent is not None:
            return super().make_context(info_name, args, parent=parent, **extra)
        with _reported():  # the root's own options (`forge --bogus --json`)
            return super().make_context(info_name, args, parent=parent, **extra)

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        name, cmd, rest = super().resolve_command(ctx, args)
        run = _run.get()
        if run is not None and name is not None:
            run.path.append(name)
        return name, cmd, rest

    def invoke(self, ctx: Any) -> Any:
        if ctx.parent is not None:  # a subgroup (cache): the root reports for it
            return super().invoke(ctx)
        with _reported():
            return super().invoke(ctx)
