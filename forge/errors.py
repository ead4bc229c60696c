"""Exit codes and the errors that map to them. Documented in `forge --help` and the README."""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0  # decided: a kernel or eager was chosen (or found in the cache)
    INTERNAL = 1  # a bug in forge: please report it with the traceback
    USAGE = 2  # bad arguments or manifest
    ENVIRONMENT = 3  # triton missing, no GPU for --device cuda, workers cannot start
    ALL_FAILED = 4  # every candidate failed (nothing cached)
    CACHE = 5  # the cache database is damaged or unusable


EXIT_CODES_HELP = (
    "Exit codes: 0 decided (kernel or eager, or a cache hit); 2 usage error; "
    "3 environment error (no triton, no GPU for --device cuda, workers cannot start, forge's own work out of "
    "memory); "
    "4 every candidate failed; 5 cache database damaged or unusable, bundle entries rejected, or a cached "
    "kernel that no longer validates (bench --recheck); 1 internal error."
)


class ForgeError(Exception):
    exit_code = ExitCode.INTERNAL


class UsageError(ForgeError):
    exit_code = ExitCode.USAGE


class EnvironmentProblem(ForgeError):
    exit_code = ExitCode.ENVIRONMENT


def cut(text: str, limit: int = 80) -> str:
    """`text` cut to `limit` characters for a message: user input can be megabytes long."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def shown(value, limit: int = 80) -> str:
    """repr(value), cut to `limit` characters."""
    return cut(repr(value), limit)
