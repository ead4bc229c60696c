"""`forge` command line: the Typer app, assembled from the command modules (forge_cli/commands/).

A thin layer over the library: each command parses its options (forge_cli/options.py), calls forge.tuner,
forge.cache or forge.key, and renders the result (forge_cli/render.py): Rich for people (tables on stdout,
progress and diagnostics on stderr), `--json` for scripts (one JSON document on stdout, nothing else there;
its schema and the error object a failing command prints instead: forge_cli/jsonout.py, docs/json.md).
"""

from __future__ import annotations

import typer

from forge._version import __version__
from forge.errors import EXIT_CODES_HELP
from forge_cli.commands import bench, bundle, cache, export, ops, replay, search, trace
from forge_cli.jsonout import Group

app = typer.Typer(
    name="forge",
    help="Auto-tune Triton kernels for PyTorch ops: search, validate, time, cache.\n\n" + EXIT_CODES_HELP,
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion SHELL (Typer: bash, zsh, fish, powershell)
    pretty_exceptions_enable=False,
    cls=Group,  # the command path of --json documents, and failures under --json as the error object
)
cache_app = typer.Typer(help="Inspect and edit the kernel cache. " + EXIT_CODES_HELP, no_args_is_help=True, cls=Group)
app.add_typer(cache_app, name="cache")

# Registration order is the order of `forge --help` and `forge cache --help`.
for _module in (search, cache, trace, bench, export, bundle, ops, replay):
    _module.register(app, cache_app)


def _version(value: bool) -> None:
    if value:
        print(f"forge {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print forge's version and exit.")) -> None:
    """Auto-tune Triton kernels for PyTorch ops: search, validate, time, cache."""


def main() -> None:
    app()


if __name__ == "__main__":
    main()
