"""The forge commands, one module per command group; each has register(app, cache_app) (forge_cli/cli.py)."""
