"""forge command line: Typer + Rich over the tuner library (forge.tuner); see forge_cli/cli.py."""
