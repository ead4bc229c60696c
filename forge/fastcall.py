"""The C++ fast path for cache hits (forge/_fastcall.cpp): building it, and making one for a binding.

A cache hit through Python costs a signature key, an output allocation through torch's Python binding
and Triton's C launch function: 11-17 µs on the H200 hosts, above a single eager aten op (7-10 µs,
docs/notes.md "Cache-hit latency"). The extension does the same checks and work in one C++ call. It is
an optimisation only: every call it does not recognise returns None and takes the Python path, and
anything that stops it from being built or made (no compiler, an unverified Triton, a kernel parameter
type it does not pack) leaves the Python path in place, with the reason for `forge.explain`.

Policy (`FORGE_FASTCALL`): "0" never; "1" on any Triton; unset: on for the Triton versions in VERIFIED,
whose kernel parameter layout (non-constexpr arguments, then the global and profile scratch pointers)
was checked on a GPU, where `launch.build` has also proved the recorded launches. The extension is
compiled once per machine and torch version by torch.utils.cpp_extension (~30 s), in a child process
started from a background thread: calls take the Python path until it is ready.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import threading
from pathlib import Path
from typing import Any

VERIFIED = ("3.6.",)
SOURCE = Path(__file__).with_name("_fastcall.cpp")

# Parameter kinds, as enum Kind in _fastcall.cpp.
PTR, NULLPTR, I8, I16, I32, I64, U8, U16, U32, U64, F32, F64 = range(12)
# Triton scalar types -> kinds, with the widths Triton's launchers pass (ty_to_cpp / FLOAT_STORAGE_TYPE:
# i1 is an int8_t, fp32 a 4-byte float).
SCALAR_KINDS = {"i1": I8, "i8": I8, "i16": I16, "i32": I32, "i64": I64, "u1": U8, "u8": U8, "u16": U16,
                "u32": U32, "u64": U64, "fp32": F32, "f32": F32, "fp64": F64}

_lock = threading.Lock()
_state: dict[str, Any] = {"module": None, "error": None, "thread": None}


class Unsupported(Exception):
    """This binding cannot have a fast call; the message says why."""


def policy() -> str | None:
    """None if the fast path may be used here, else why not."""
    flag = os.environ.get("FORGE_FASTCALL", "")
    if flag == "0":
        return "FORGE_FASTCALL=0"
    if flag == "1":
        return None
    import triton

    if not triton.__version__.startswith(VERIFIED):
        return (f"triton {triton.__version__} is not among the versions whose kernel parameter layout was "
                f"checked on a GPU ({', '.join(v.rstrip('.') for v in VERIFIED)}); FORGE_FASTCALL=1 forces it")
    return None


def _load():
    """Compile (if torch's extension cache does not hold this source yet) and import the extension."""
    from torch.utils.cpp_extension import load

    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    return load(name=f"forge_fastcall_{digest}", sources=[str(SOURCE)], extra_cflags=["-O2"], verbose=False)


def _build():
    """Compile in a child process of its own, then import here (~0.3 s once compiled).

    Why a child: the build takes ~30 s in the background of the user's program, which may exit first. A
    compile killed half way leaves torch's build lock file behind, and every later build then waits on it
    for ever; a child in its own session, writing to a file rather than a pipe, finishes regardless."""
    import sys
    import tempfile

    # the child imports this very forge: its package root first on its path (PYTHONPATH may be relative)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SOURCE.resolve().parent.parent),
                                                     env.get("PYTHONPATH", "")) if p)
    fd, log = tempfile.mkstemp(prefix="forge-fastcall-build-", suffix=".log")
    try:
        with os.fdopen(fd, "w") as out:
            rc = subprocess.run([sys.executable, "-c", "from forge import fastcall; fastcall._load()"],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env,
                                cwd=tempfile.gettempdir()).returncode
        if rc != 0:
            lines = [ln.strip() for ln in Path(log).read_text(errors="replace").splitlines() if ln.strip()]
            # the compiler's first error says more than ninja's closing "build stopped" line
            errors = [ln for ln in lines if ": error:" in ln or ": fatal error:" in ln]
            raise RuntimeError((errors or lines or [f"the build process exited with {rc}"])[0 if errors else -1])
    finally:
        os.unlink(log)
    return _load()


def _build_into_state() -> None:
    try:
        mod = _build()
    except (RuntimeError, OSError, ImportError, subprocess.CalledProcessError) as exc:
        _state["error"] = f"building {SOURCE.name} failed: {str(exc).strip().splitlines()[-1] if str(exc) else exc!r}"
    else:
        _state["module"] = mod


def module(wait: bool = False):
    """The compiled extension, or None while it builds (started on the first request) or if the build
    failed (`error()` says why). `wait=True` builds in this thread."""
    mod = _state["module"]
    if mod is not None or _state["error"] is not None:
        return mod
    with _lock:
        if _state["module"] is None and _state["error"] is None:
            t = _state["thread"]
            if wait:
                if t is not None:
                    t.join()
                else:
                    _build_into_state()
            elif t is None:
                t = threading.Thread(target=_build_into_state, name="forge-fastcall-build", daemon=True)
                _state["thread"] = t
                t.start()
    if wait and _state["thread"] is not None:
        _state["thread"].join()
    return _state["module"]


def error() -> str | None:
    return _state["error"]


def launch_params(ln) -> list[tuple[int, int, int, float]]:
    """The kernel parameters of one recorded launch (forge/launch.py's _Launch) as (kind, slot, int,
    float) rows: the non-constexpr arguments in order, then the two scratch pointers (null)."""
    ck = ln.kernel
    if ck is None:
        raise Unsupported("the launch was recorded without its CompiledKernel")
    names = list(ck.src.fn.arg_names)
    sig = ck.src.signature
    if len(ln.args) != len(names):
        raise Unsupported(f"the launcher got {len(ln.args)} kernel arguments for {len(names)} parameters")
    slot_of = dict(ln.slots)
    rows: list[tuple[int, int, int, float]] = []
    for i, name in enumerate(names):
        ty = sig.get(name, sig.get(i))
        if ty is None:
            raise Unsupported(f"no signature type for argument {name}")
        if ty == "constexpr":
            continue
        v = ln.args[i]
        if ty.startswith("*"):
            if i in slot_of:
                rows.append((PTR, slot_of[i], 0, 0.0))
            elif v is None:
                rows.append((NULLPTR, 0, 0, 0.0))
            else:
                raise Unsupported(f"pointer argument {name} is neither a tensor nor None")
        elif ty in SCALAR_KINDS:
            kind = SCALAR_KINDS[ty]
            rows.append((kind, 0, 0, float(v)) if kind in (F32, F64) else (kind, 0, int(v), 0.0))
        else:
            raise Unsupported(f"argument {name} has type {ty}, which the fast path does not pack")
    return rows + [(NULLPTR, 0, 0, 0.0)] * 2


def launch_row(ln) -> tuple:
    ck = ln.kernel
    md = ck.metadata
    if getattr(md, "num_ctas", 1) != 1:
        raise Unsupported("a kernel with num_ctas > 1 (clusters)")
    if getattr(md, "launch_cooperative_grid", False) or getattr(md, "launch_pdl", False):
        raise Unsupported("a cooperative or PDL launch")
    if getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0):
        raise Unsupported("a kernel that needs scratch memory")
    gx, gy, gz = ln.grid
    return (int(ln.function), gx, gy, gz, 32 * md.num_warps, md.shared, launch_params(ln))


def _ready_module(args: tuple):
    """The built extension for a call of `args`, or None while it builds; raises Unsupported when the
    call cannot be served (too many arguments) or the build failed."""
    if len(args) > 64:
        raise Unsupported("more than 64 arguments")
    mod = module()  # first: while the extension builds, every Python-path call asks again, cheaply
    if mod is None and error() is not None:
        raise Unsupported(error())
    return mod


def _arg_specs(args: tuple, full: bool) -> list[tuple]:
    """Per positional argument, ("tensor", layout) or ("value", v). A kernel's layout is (sizes, strides,
    dtype, requires_grad), the rest being fixed by what the shim binds kernels for (requires_grad: a
    module's parameters, which the backend's regions read under no_grad, do); `full` adds 16-byte
    alignment, is_cuda and device index, as the Python key has them (forge/shim.py _tensor_sig)."""
    import torch

    specs = []
    for a in args:
        if not isinstance(a, torch.Tensor):
            specs.append(("value", a))
        elif full:
            specs.append(("tensor", (tuple(a.shape), tuple(a.stride()), a.dtype, a.requires_grad,
                                     a.data_ptr() % 16 == 0, a.is_cuda, a.get_device())))
        else:
            specs.append(("tensor", (tuple(a.shape), tuple(a.stride()), a.dtype, a.requires_grad)))
    return specs


def make(plan, args: tuple, sources: list, out, grad: bool):
    """A FastCall for a binding's compiled plan and the positional call `args` that bound it.

    sources: per kernel input, the index of the positional argument that supplies it, or a tensor the
    binding holds (an input the user's code did not pass). `out` is an output of that call (for its
    sizes, strides and dtype). Raises Unsupported; returns None while the extension builds."""
    import torch
    from triton import knobs

    reason = policy()
    if reason is not None:
        raise Unsupported(reason)
    if grad and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        raise Unsupported("an argument requires grad with grad mode on (a kernel records no autograd graph)")
    mod = _ready_module(args)
    if mod is None:
        return None
    rows = [launch_row(ln) for ln in plan.launches]
    out_layout = (tuple(out.shape), tuple(out.stride()), out.dtype)
    return mod.FastCall(grad, plan.device_index, _arg_specs(args, full=False), list(sources), out_layout, rows,
                        knobs.runtime, getattr(knobs, "HookChain", None), torch._C._cuda_getCurrentRawStream,
                        torch._C._cuda_getDevice)


def make_eager(fn, args: tuple, grad: bool, autocast: bool):
    """An EagerCall for a positional call signature the shim runs eagerly: one C++ check of the
    signature, then `fn(*args)`, saving the Python key and lookup (~3 µs on the H200 host). Only for
    signatures whose tensors are all on CUDA (a CPU-only program is not made to compile an extension);
    no Triton version policy (nothing is launched). Raises Unsupported; None while the extension builds."""
    import torch

    if os.environ.get("FORGE_FASTCALL", "") == "0":
        raise Unsupported("FORGE_FASTCALL=0")
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not tensors or not all(t.is_cuda for t in tensors):
        raise Unsupported("not every tensor argument is on CUDA")
    mod = _ready_module(args)
    if mod is None:
        return None
    return mod.EagerCall(grad, autocast, _arg_specs(args, full=True), fn)
