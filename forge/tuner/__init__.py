"""The tuner as a library (no Typer, no Rich): search engine, strategies, statistics, validation,
worker pool, timing, bench, export, bundles, manifests and the trace tools. The CLI (forge_cli) is a
thin layer over it; `forge.search` is its public entry point."""
