"""`forge export`: write a cached kernel as a standalone module or a Hugging Face kernels repo.

No `from __future__ import annotations` here: Typer evaluates the annotations, and the option types
come from forge_cli.cli inside register() (imported there to avoid an import cycle)."""

import json
import os
from pathlib import Path
from typing import Annotated

import typer


def register(app: typer.Typer, cache_app: typer.Typer) -> None:
    from forge import ops
    from forge.cache import CacheError
    from forge.errors import ForgeError, UsageError
    from forge.spec import parse_shape
    from forge.tuner import export as export_mod
    from forge.tuner import manifest as manifest_mod
    from forge_cli.cli import CacheOpt, JsonOpt, _cache_exit, _fail, _open_cache, _parse_attrs, err, out

    @app.command("export")
    def export_cmd(
        op: Annotated[str | None, typer.Argument(help="Op family, e.g. rmsnorm (or use --key).")] = None,
        shape: Annotated[str | None, typer.Option("--shape", help="Input shape, e.g. 2048x4096.")] = None,
        out_dir: Annotated[Path, typer.Option("-o", "--out", help="Directory to write into (created if missing).")]
        = Path("."),
        fmt: Annotated[str, typer.Option("--format", help="module (one standalone .py file) or hf-kernels "
                                                          "(a Hugging Face kernels repository).")] = "module",
        name: Annotated[str | None, typer.Option("--name", help="Module / repository name "
                                                                "(default: OP_SHAPE_DTYPE).")] = None,
        key: Annotated[str | None, typer.Option("--key", help="Export this cache entry (key or unique prefix) "
                                                              "instead of looking OP/--shape up.")] = None,
        dtype: Annotated[str | None, typer.Option(help="float16, bfloat16 or float32 (default: float16).")] = None,
        device: Annotated[str | None, typer.Option(help="cuda or cpu (Triton interpreter) "
                                                        "(default: cuda if available, else cpu).")] = None,
        attr: Annotated[list[str] | None, typer.Option("--attr", help="Scalar attribute NAME=VALUE, as for "
                                                                      "search.")] = None,
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
                try:
                    shape_t = parse_shape(shape)
                except ValueError as exc:
                    raise UsageError(str(exc)) from None
                cli_opts = {"dtype": dtype, "device": device}
                for opt in ("dtype", "device"):
                    if cli_opts[opt] is not None:
                        cli_opts[opt] = manifest_mod._check(opt, cli_opts[opt], f"--{opt}")
                r_dtype = manifest_mod.resolve("dtype", cli_opts, os.environ)
                r_device = manifest_mod.resolve("device", cli_opts, os.environ)
                attrs = _parse_attrs(attr or [])
                db = _open_cache(cache)
                family, entry = export_mod.lookup(db, op, shape_t, r_dtype, r_device, attrs)
            else:
                db = _open_cache(cache)
                entry = db.find(key)
                family = ops.get(entry.op)
            done = export_mod.export(entry, family, out_dir, fmt=fmt, name=name)
        except CacheError as exc:
            raise _fail(exc, _cache_exit(exc)) from None
        except ForgeError as exc:
            raise _fail(exc, exc.exit_code) from None
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
