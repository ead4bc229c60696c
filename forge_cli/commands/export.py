"""`forge export`: write a cached kernel as a standalone module, or tuned kernels into a Hugging Face
kernels repository (forge.tuner.export, forge.tuner.hf_export)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from forge import ops
from forge.cache import CacheError
from forge.errors import ForgeError, UsageError
from forge.tuner import export as export_mod
from forge.tuner import hf_export
from forge.tuner import manifest as manifest_mod
from forge_cli.jsonout import emit
from forge_cli.options import (
    AttrOpt,
    CacheOpt,
    DeviceOpt,
    DtypeOpt,
    JsonOpt,
    ShapeOpt,
    check_settings,
    complete_op,
    parse_attrs,
    parse_shape_opt,
    with_help,
)
from forge_cli.render import cache_exit_code, err, fail, open_cache, out

OpArg = Annotated[str | None, typer.Argument(help="Op family, e.g. rmsnorm (or use --key).",
                                             autocompletion=complete_op)]
OutDirOpt = Annotated[Path, typer.Option("-o", "--out", help="Directory to write into (created if missing).")]
FormatOpt = Annotated[str, typer.Option("--format", help="module (one standalone .py file) or hf-kernels "
                                                         "(adds to the Hugging Face kernels repository forge-NAME).")]
NameOpt = Annotated[str | None, typer.Option("--name", help="Module name (default: OP_SHAPE_DTYPE), or hf-kernels "
                                                            "repository name (default: OP; forge- is prefixed).")]
AllShapesOpt = Annotated[bool, typer.Option("--all-shapes", help="hf-kernels: export every tuned kernel of OP in the "
                                                                 "cache (narrowed by --dtype, --device).")]
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
    all_shapes: AllShapesOpt = False,
    dtype: DtypeOpt = None,
    device: DeviceOpt = None,
    attr: ExportAttrOpt = None,
    json_out: JsonOpt = False,
    cache: CacheOpt = None,
) -> None:
    """Export a cached kernel as Python code that runs without forge.

    The entry is the one `forge search` with the same OP, --shape, --dtype, --attr and --device finds on
    this machine (or --key's). --format module writes one .py file with a plain function of the op's
    natural signature that checks its arguments against the spec it was tuned for; --format hf-kernels adds
    it to the Hugging Face kernels repository DIR/forge-OP (or forge-NAME), keeping every kernel already
    there, with layers for kernels.kernelize. --all-shapes adds every tuned kernel of OP instead. An eager
    decision or a miss is exit 2."""
    skipped: list[tuple] = []
    try:
        if fmt not in export_mod.FORMATS:
            raise UsageError(f"unknown --format {fmt!r}; expected one of {', '.join(export_mod.FORMATS)}")
        if all_shapes:
            selection = _all_shapes(op, shape, key, attr, fmt, dtype, device, cache)
            skipped = selection.skipped
            done = hf_export.export_hf(selection.entries, out_dir, name=name)
        else:
            family, entry = _one_entry(op, shape, key, attr, dtype, device, cache)
            done = export_mod.export(entry, family, out_dir, fmt=fmt, name=name)
    except CacheError as exc:
        raise fail(exc, cache_exit_code(exc)) from None
    except ForgeError as exc:
        raise fail(exc, exc.exit_code) from None
    if done.format == "hf-kernels":
        _report(done, skipped, json_out)
        return
    if json_out:
        emit(done.to_dict())
        return
    out.print(f"exported {entry.op} {export_mod.default_name(entry)} ({entry.variant}) "
              f"to [bold]{done.path}[/]")
    out.print(f"  import it (torch + triton only) and call {done.function}(...); "
              f"metadata in {done.name}.METADATA")
    if entry.env.get("backend") == "interpreter":
        err.print("[yellow]note:[/] this kernel was tuned on the Triton interpreter (CPU): it runs with "
                  "TRITON_INTERPRET=1 on CPU tensors only")


def _one_entry(op, shape, key, attr, dtype, device, cache):
    """(op family, entry): the entry `forge search` with these options would find, or --key's."""
    if key is not None and (op is not None or shape is not None or attr or dtype or device):
        raise UsageError("give either --key or OP and --shape (with --dtype, --device, --attr), not both")
    if key is not None:
        entry = open_cache(cache).find(key)
        return ops.get(entry.op), entry
    if op is None or shape is None:
        raise UsageError("give OP and --shape (e.g. forge export rmsnorm --shape 2048x4096 -o DIR), "
                         "or --key KEY")
    shape_t = parse_shape_opt(shape)
    cli_opts = {"dtype": dtype, "device": device}
    check_settings(cli_opts, ("dtype", "device"), name_flags=True)
    r_dtype = manifest_mod.resolve("dtype", cli_opts, os.environ)
    r_device = manifest_mod.resolve("device", cli_opts, os.environ)
    attrs = parse_attrs(attr or [])
    return export_mod.lookup(open_cache(cache), op, shape_t, r_dtype, r_device, attrs)


def _all_shapes(op, shape, key, attr, fmt, dtype, device, cache) -> hf_export.Selection:
    """Every exportable kernel of OP (--all-shapes), narrowed by --dtype and --device where given (not by
    their FORGE_* defaults: those say what to tune, not what to leave out)."""
    if fmt != "hf-kernels":
        raise UsageError("--all-shapes writes a Hugging Face kernels repository: add --format hf-kernels "
                         "(a module holds one kernel)")
    if op is None or shape is not None or key is not None or attr:
        raise UsageError("--all-shapes exports every tuned kernel of OP: give OP (narrowed by --dtype and "
                         "--device), not --shape, --attr or --key")
    cli_opts = {"dtype": dtype, "device": device}
    check_settings(cli_opts, ("dtype", "device"), name_flags=True)
    return hf_export.op_entries(open_cache(cache), op, dtype=cli_opts["dtype"], device=cli_opts["device"])


def _report(done: export_mod.Exported, skipped: list[tuple], json_out: bool) -> None:
    """What an hf-kernels export wrote (and, for --all-shapes, which cached kernels it could not export)."""
    for _, reason in skipped:
        err.print(f"[yellow]skipped:[/] {reason}")
    if json_out:
        doc = done.to_dict()
        doc["skipped"] = [{"key": entry.key, "reason": reason} for entry, reason in skipped]
        emit(doc)
        return
    x = done.extra
    out.print(f"exported {len(x['keys'])} {done.function} kernel(s) to [bold]{done.path}[/]: "
              f"{len(x['added'])} added, {len(x['replaced'])} replaced, {len(x['unchanged'])} unchanged, "
              f"{len(x['superseded'])} superseded; {x['entries']} in the repository "
              f"[dim](build variants {', '.join(sorted(x['variants']))})[/]")
    out.print(f"  k = kernels.get_local_kernel(Path({str(done.path)!r})); "
              "kernelize(model, ...) under use_kernel_mapping(k.kernel_mapping()); see its README.md")
    if "torch-cpu" in x["variants"]:
        err.print("[yellow]note:[/] kernels tuned on the Triton interpreter (build/torch-cpu) run with "
                  "TRITON_INTERPRET=1 on CPU tensors only")


def register(app: typer.Typer, cache_app: typer.Typer) -> None:
    app.command("export")(export_cmd)
