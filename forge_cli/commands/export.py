"""`forge export`: write a cached kernel as a standalone module or a Hugging Face kernels repo
(forge.tuner.export)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated

import typer

from forge import ops
from forge.cache import CacheError
from forge.errors import ForgeError, UsageError
from forge.tuner import export as export_mod
from forge.tuner import manifest as manifest_mod
from forge_cli.options import (
    AttrOpt,
    CacheOpt,
    DeviceOpt,
    DtypeOpt,
    JsonOpt,
    ShapeOpt,
    check_settings,
    parse_attrs,
    parse_shape_opt,
    with_help,
)
from forge_cli.render import cache_exit_code, err, fail, open_cache, out

OpArg = Annotated[str | None, typer.Argument(help="Op family, e.g. rmsnorm (or use --key).")]
OutDirOpt = Annotated[Path, typer.Option("-o", "--out", help="Directory to write into (created if missing).")]
FormatOpt = Annotated[str, typer.Option("--format", help="module (one standalone .py file) or hf-kernels "
                                                         "(a Hugging Face kernels repository).")]
NameOpt = Annotated[str | None, typer.Option("--name", help="Module / repository name (default: OP_SHAPE_DTYPE).")]
KeyOpt = Annotated[str | None, typer.Option("--key", help="Export this cache entry (key or unique prefix) "
                                                          "instead of looking OP/--shape up.")]
ExportAttrOpt = with_help(AttrOpt, "Scalar attribute NAME=VALUE, as for search.")


def export_cmd(
    op: OpArg = None,
    shape: ShapeOpt = None,
    out_dir: OutDirOpt = Path("."),
    fmt: FormatOpt = "module",
    name: NameOpt = None,
    key: KeyOpt = None,
    dtype: DtypeOpt = None,
    device: DeviceOpt = None,
    attr: ExportAttrOpt = None,
    json_out: JsonOpt = False,
    cache: CacheOpt = None,
) -> None:
    """Export a cached kernel as Python code that runs without forge.

    The entry is the one `forge search` with the same OP, --shape, --dtype, --attr and --device finds on
    this machine (or --key's). --format module writes one .py file with a plain function of the op's
    natural signature that checks its arguments against the spec it was tuned for; --format hf-kernels
    writes a Hugging Face kernels repository. An eager decision or a miss is exit 2."""
    try:
        if key is not None and (op is not None or shape is not None or attr or dtype or device):
            raise UsageError("give either --key or OP and --shape (with --dtype, --device, --attr), not both")
        if fmt not in export_mod.FORMATS:
            raise UsageError(f"unknown --format {fmt!r}; expected one of {', '.join(export_mod.FORMATS)}")
        if key is None:
            if op is None or shape is None:
                raise UsageError("give OP and --shape (e.g. forge export rmsnorm --shape 2048x4096 -o DIR), "
                                 "or --key KEY")
            shape_t = parse_shape_opt(shape)
            cli_opts = {"dtype": dtype, "device": device}
            check_settings(cli_opts, ("dtype", "device"), name_flags=True)
            r_dtype = manifest_mod.resolve("dtype", cli_opts, os.environ)
            r_device = manifest_mod.resolve("device", cli_opts, os.environ)
            attrs = parse_attrs(attr or [])
            db = open_cache(cache)
            family, entry = export_mod.lookup(db, op, shape_t, r_dtype, r_device, attrs)
        else:
            db = open_cache(cache)
            entry = db.find(key)
            family = ops.get(entry.op)
        done = export_mod.export(entry, family, out_dir, fmt=fmt, name=name)
    except CacheError as exc:
        raise fail(exc, cache_exit_code(exc)) from None
    except ForgeError as exc:
        raise fail(exc, exc.exit_code) from None
    if json_out:
        print(json.dumps(done.to_dict(), indent=2))
        return
    out.print(f"exported {entry.op} {export_mod.default_name(entry)} ({entry.variant}) "
              f"to [bold]{done.path}[/]")
    if done.format == "module":
        out.print(f"  import it (torch + triton only) and call {done.function}(...); "
                  f"metadata in {done.name}.METADATA")
    else:
        out.print(f"  kernels.get_local_kernel(Path({str(done.path)!r})).{done.function}(...)  "
                  f"[dim](build variant {done.extra['variant']})[/]")
    if entry.env.get("backend") == "interpreter":
        err.print("[yellow]note:[/] this kernel was tuned on the Triton interpreter (CPU): it runs with "
                  "TRITON_INTERPRET=1 on CPU tensors only")


def register(app: typer.Typer, cache_app: typer.Typer) -> None:
    app.command("export")(export_cmd)
