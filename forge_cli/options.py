"""The option and argument types the forge commands share, declared once, and the parsing of their values.

Each type is `Annotated[type, typer.Option(...)]`; Typer copies the option per command, so one type serves
every command that takes the option. A command whose help text for an option differs gets its own copy with
`with_help` (same flag, type and default, its own text).
"""

from __future__ import annotations

import copy
import json
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any

import typer

from forge.errors import UsageError
from forge.spec import parse_shape
from forge.tuner import manifest as manifest_mod


def complete_op(incomplete: str) -> list[str]:
    """Shell completion of an op argument (`forge search rms<TAB>`): the op families forge has."""
    from forge import ops

    return [name for name in sorted(ops.available()) if name.startswith(incomplete)]


# -- the options of every command that touches the cache ----------------------------------------------
CacheOpt = Annotated[Path | None, typer.Option("--cache", help="Cache DB (default: $FORGE_CACHE_DIR/forge.db "
                                                               "or ~/.cache/forge/forge.db).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout, nothing else (an error "
                                                       "object if the command fails; docs/json.md).")]

# -- what to tune / bench / export: one spec ----------------------------------------------------------
ShapeOpt = Annotated[str | None, typer.Option("--shape", help="Input shape, e.g. 2048x4096.")]
DtypeOpt = Annotated[str | None, typer.Option("--dtype", help="float16, bfloat16 or float32 (default: float16).")]
DeviceOpt = Annotated[str | None, typer.Option("--device", help="cuda or cpu (Triton interpreter) "
                                                                "(default: cuda if available, else cpu).")]
AttrOpt = Annotated[list[str] | None, typer.Option("--attr", help="Scalar attribute NAME=VALUE, "
                                                                  "e.g. --attr eps=1e-5.")]
ManifestOpt = Annotated[Path | None, typer.Option("--manifest", help="Tune every entry of a TOML manifest "
                                                                     "(see docs/manifest.md).")]

# -- search settings (command line > FORGE_* environment > manifest > built-in) -----------------------
BudgetOpt = Annotated[int | None, typer.Option("--budget", help="Maximum number of candidates (default: the "
                                                                "effort's: 50).")]
EffortOpt = Annotated[str | None, typer.Option("--effort", help="quick (12 candidates), default (50) or full (every "
                                                                "valid point); an explicit --budget wins.")]
StrategyOpt = Annotated[str | None, typer.Option("--strategy", help="evolve, grid, random, halving or llm (default: "
                                                                    "evolve, the best on the H200's replay tables; "
                                                                    "forge replay compares them).")]
SeedOpt = Annotated[int | None, typer.Option("--seed", help="Seed for --strategy random and evolve and the test inputs "
                                                            "(default: 0).")]
TimeoutOpt = Annotated[float | None, typer.Option("--timeout", help="Seconds per candidate before its worker is "
                                                                    "killed (default: 120).")]
WorkersOpt = Annotated[int | None, typer.Option("--workers", help="Worker processes (default: by backend).")]
TimeBudgetOpt = Annotated[float | None, typer.Option("--time-budget", help="Seconds of wall clock for the whole "
                                                    "run: no search starts after it, a running one stops timing "
                                                    "new candidates and decides from what it timed "
                                                    "(default: no limit).")]


def with_help(option: Any, help: str) -> Any:
    """`option` (an Annotated option type of this module) with another help text."""
    base, info, *rest = typing.get_args(option)
    info = copy.copy(info)
    info.help = help
    return Annotated[(base, info, *rest)]


# -- parsing ----------------------------------------------------------------------------------------------
def parse_attrs(items: Iterable[str]) -> dict[str, Any]:
    """--attr NAME=VALUE items: VALUE as JSON when it parses (1e-5, true, [1, 2]), else as the string."""
    attrs: dict[str, Any] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise UsageError(f"--attr expects NAME=VALUE, got {item!r}")
        try:
            attrs[name] = json.loads(value)
        except json.JSONDecodeError:
            attrs[name] = value
    return attrs


def parse_shape_opt(shape: str) -> tuple[int, ...]:
    """--shape 2048x4096; a malformed one is a usage error (exit 2)."""
    try:
        return parse_shape(shape)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def check_settings(values: dict[str, Any], names: Iterable[str], *, name_flags: bool) -> None:
    """Check the given command-line settings as a manifest's are checked (in place: checked values replace the
    raw ones); `name_flags` names the flag (--dtype) in the error message."""
    for name in names:
        if values[name] is not None:
            values[name] = manifest_mod.check_setting(name, values[name], f"--{name}" if name_flags else None)
