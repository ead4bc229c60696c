"""`forge ops`: every op family forge knows (built in and on $FORGE_OPS_PATH), with what a spec of it takes."""

from __future__ import annotations

from typing import Any

import typer
from rich.markup import escape
from rich.table import Table

from forge import ops
from forge_cli.jsonout import emit
from forge_cli.options import JsonOpt
from forge_cli.render import out


def describe(name: str) -> dict[str, Any]:
    op = ops.get(name)
    mod = op.module
    return {"op": name, "summary": getattr(mod, "SUMMARY", ""), "variants": sorted(mod.TEMPLATES),
            "attrs": {k: v for k, v in mod.DEFAULT_ATTRS.items()},
            "optional_attrs": list(getattr(mod, "OPTIONAL_ATTRS", ())),
            "strided_inputs": list(getattr(mod, "STRIDED_INPUTS", ())),
            "matches_traced_code": getattr(mod, "match", None) is not None,
            "path": str(op.path)}


def ops_cmd(json_out: JsonOpt = False) -> None:
    """List every op family: what it computes, its attributes (with defaults) and its kernel variants."""
    rows = [describe(name) for name in sorted(ops.available())]
    if json_out:
        emit({"ops": rows})
        return
    table = Table(title="forge op families")
    for col in ("op", "computes", "attributes (default)", "variants"):
        table.add_column(col)
    for r in rows:
        attrs = ", ".join(f"{k}={v!r}" for k, v in r["attrs"].items())
        if r["optional_attrs"]:
            attrs += ("; " if attrs else "") + "optional: " + ", ".join(r["optional_attrs"])
        table.add_row(r["op"], escape(r["summary"]), escape(attrs or "-"), ", ".join(r["variants"]))
    out.print(table)


def register(app: typer.Typer, cache_app: typer.Typer) -> None:
    app.command("ops")(ops_cmd)
