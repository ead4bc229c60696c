"""The fast launch path for bound kernels on CUDA: replay the Triton `CompiledKernel` launches that a
rendered module's `launch()` makes, calling each kernel's compiled launcher directly: Triton's C launch
function where the launcher's Python wrapper is a known layout (3.6, 3.9), else the launcher object.
(forge/fastcall.py goes one step further, into C++, for plain positional calls.)

Why: a Triton JIT launch (`kernel[grid](...)`) costs ~17.5 µs of host time on the H200 machine
(argument binding, specialisation key, cache lookup), more than a decode-shape rmsnorm takes on the
device. For one call signature (shapes, strides, dtypes, devices and alignment all fixed), everything
but the tensor pointers is the same on every call, so the launches can be recorded once and replayed.

Recording is self-checking, so a Triton version that launches differently is detected, not trusted:
  1. `launch()` runs once under a TorchDispatchMode; any aten op that is not a view (an allocation,
     a copy, a fill) means the module does work besides kernel launches, and the plan is refused.
  2. Every `CompiledKernel` launcher call made by this thread is recorded (the `run` property is
     wrapped for the duration). The call must have the layout triton 3.6-3.9 use:
     (grid_x, grid_y, grid_z, stream, function, packed_metadata, launch_metadata, enter_hook,
     exit_hook, *kernel_args) with `function`/`packed_metadata` those of the kernel, no launch hooks
     active (None or an empty HookChain), and every tensor argument identical (by data pointer) to
     exactly one of the op's inputs or its output; other arguments must be plain scalars or Triton's
     host-side TensorDescriptors whose base is (by data pointer) one of those tensors: a replay passes a
     copy of the recorded descriptor around the new tensor (its shape, strides and block shape are the
     signature's; the launcher's wrapper encodes the TMA descriptor from it on every call, as on the JIT
     path). GPT-2's lm_head (kernels/linear.py's persistent variant) launched through the JIT before.
  3. The replayed launches must reproduce the JIT path's output bit for bit on the same inputs (the
     direct C launch first, the launcher objects if that fails).
Anything else: no plan, and the binding keeps using the JIT path (`forge.explain(...).launch` says why).
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Any

# aten ops that only make views (no allocation, no data movement): allowed inside launch().
VIEW_OPS = {"view", "_unsafe_view", "reshape", "_reshape_alias", "alias", "as_strided", "t", "transpose",
            "unsqueeze", "squeeze", "expand", "permute", "select", "slice", "detach", "flatten", "unflatten"}
_SCALARS = (int, float, bool, type(None))
_N_FIXED = 9  # grid x3, stream, function, packed_metadata, launch_metadata, enter hook, exit hook
# One recording at a time: it swaps a class attribute of triton's CompiledKernel.
_RECORD_LOCK = threading.Lock()


def hook_inactive(h) -> bool:
    """Triton passes its launch hooks to every launch: None, or (3.6+) a HookChain that calls nothing
    while empty. Replay passes None (the launcher skips None), which is only right while nothing is
    hooked in (e.g. proton, the profiler, adds hooks)."""
    return h is None or (type(h).__name__ == "HookChain" and not getattr(h, "calls", True))


class Refused(Exception):
    """The recorded launches cannot be replayed safely; the message says why."""


@dataclass
class _Launch:
    launcher: Any  # the CompiledKernel's launcher (what its `run` property returns)
    grid: tuple[int, int, int]
    function: Any
    packed_metadata: Any
    args: list  # kernel arguments, tensors replaced by None
    slots: tuple[tuple[int, int], ...]  # (argument position, index into inputs + (out,))
    kernel: Any = None  # the CompiledKernel itself (for diagnostics and bench/latency.py's probes)
    # (argument position, index into inputs + (out,), a function making the descriptor around that tensor)
    descs: tuple[tuple[int, int, Any], ...] = ()


def _is_descriptor(v) -> bool:
    """Triton's host-side TensorDescriptor (triton.tools.tensor_descriptor), by its shape: the class name, a
    tensor base and the fields its launcher wrapper reads."""
    return (type(v).__name__ == "TensorDescriptor" and hasattr(v, "__dict__") and hasattr(v, "base")
            and hasattr(v.base, "data_ptr") and all(hasattr(v, f) for f in ("shape", "strides", "block_shape")))


def _rebased(template) -> Any:
    """A function base -> a copy of the descriptor `template` with that base. The dataclass's __init__ (its
    alignment and shape asserts) is skipped: the call signature the plan serves fixes the shapes, strides,
    dtype and 16-byte alignment the recorded descriptor passed them for. The template keeps no reference to
    the recording's tensor."""
    cls, fields = type(template), {k: v for k, v in vars(template).items() if k != "base"}

    def rebased(base):
        d = object.__new__(cls)
        d.__dict__.update(fields)
        d.base = base
        return d
    return rebased


# Triton's launcher object (CudaLauncher) is a Python wrapper: its __call__ allocates scratch memory
# (none when the kernel's scratch sizes are 0) and forwards to a C function, `self.launch`, in an
# argument order that differs between versions. Calling that C function directly skips the wrapper.
# The order is trusted only when the wrapper's source contains exactly one of these calls (whitespace
# ignored); `build` then proves the direct replay bit for bit, else the wrapper is called as recorded.
_C_LAYOUTS = {
    # triton 3.6: the kernel's packed metadata, launch metadata and hooks travel in *args
    "args": ("self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, "
             "self.launch_pdl, global_scratch, profile_scratch, *args)"),
    # triton 3.9: one generic C launcher fed the argument annotations and the kernel args as a tuple
    "tuple": ("self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, "
              "self.launch_pdl, kernel_metadata, launch_metadata, launch_enter_hook, launch_exit_hook, "
              "global_scratch, profile_scratch, self.arg_annotations, self.kernel_signature, kernel_args)"),
}


def _squeeze(text: str) -> str:
    return "".join(text.split())


@functools.cache
def wrapper_layout(cls) -> str | None:
    """Which _C_LAYOUTS call a launcher class's __call__ makes (exactly one, else None)."""
    import inspect

    try:
        src = _squeeze(inspect.getsource(cls.__call__))
    except (OSError, TypeError, AttributeError):
        return None
    found = [name for name, text in _C_LAYOUTS.items() if _squeeze(text) in src]
    return found[0] if len(found) == 1 else None


def c_layout(launcher) -> str | None:
    """The C layout to call this launcher's `launch` with, or None (unknown wrapper, scratch memory
    needed, sanitizer on): then the wrapper itself is called."""
    if getattr(launcher, "global_scratch_size", 1) != 0 or getattr(launcher, "profile_scratch_size", 1) != 0:
        return None
    if getattr(launcher, "gsan_enabled", False):  # 3.9's sanitizer appends arguments of its own
        return None
    if not callable(getattr(launcher, "launch", None)):
        return None
    return wrapper_layout(type(launcher))


def _call_form(ln: _Launch, direct: bool) -> tuple[Any, tuple, bool]:
    """(callable, the arguments between the stream and the kernel's, kernel args packed in one tuple?)."""
    layout = c_layout(ln.launcher) if direct else None
    if layout == "args":
        lc = ln.launcher
        return lc.launch, (ln.function, lc.launch_cooperative_grid, lc.launch_pdl, None, None,
                           ln.packed_metadata, None, None, None), False
    if layout == "tuple":
        lc = ln.launcher
        return lc.launch, (ln.function, lc.launch_cooperative_grid, lc.launch_pdl, ln.packed_metadata,
                           None, None, None, None, None, lc.arg_annotations, lc.kernel_signature), True
    # the wrapper, as JITFunction.run calls it, with launch metadata and (inactive) hooks as None
    return ln.launcher, (ln.function, ln.packed_metadata, None, None, None), False


def _compile_fire(launches: list[_Launch], direct: bool):
    """One Python function `fire(stream, tensors)` making every recorded launch with new tensors.

    Generated so that a call is a handful of bytecodes: no per-call list building or slot loop
    (measured on the H200 host: see docs/notes.md, "cache-hit latency"). Pointers are passed as ints
    (`data_ptr()`): Triton's C launcher then skips its own data_ptr call and its cuPointerGetAttribute
    check, which the call signature already guarantees (CUDA tensors on this device). The generated
    text holds only names and integer indices; values live in the function's globals."""
    env: dict[str, Any] = {}
    body = []
    via = set()
    for i, ln in enumerate(launches):
        fn, mid, packed = _call_form(ln, direct)
        via.add("C launch function" if fn is not ln.launcher else "launcher object")
        env[f"f{i}"], env[f"m{i}"] = fn, mid
        slot_of = dict(ln.slots)
        desc_of = {pos: (idx, make) for pos, idx, make in ln.descs}
        kargs = []
        for pos, v in enumerate(ln.args):
            if pos in slot_of:
                kargs.append(f"t[{slot_of[pos]}].data_ptr()")
            elif pos in desc_of:
                env[f"d{i}_{pos}"] = desc_of[pos][1]
                kargs.append(f"d{i}_{pos}(t[{desc_of[pos][0]}])")
            else:
                env[f"a{i}_{pos}"] = v
                kargs.append(f"a{i}_{pos}")
        grid = ", ".join(str(int(g)) for g in ln.grid)
        joined = ", ".join(kargs)
        tail = f"({joined},)" if packed else joined
        body.append(f"    f{i}({grid}, stream, *m{i}{', ' if tail else ''}{tail})")
    src = "def fire(stream, t):\n" + ("\n".join(body) if body else "    pass") + "\n"
    exec(compile(src, "<forge.launch plan>", "exec"), env)  # noqa: S102 - our own text, see docstring
    return env["fire"], src, " + ".join(sorted(via)) or "nothing"


class Plan:
    """Replays recorded launches with new tensors of the same signature."""

    def __init__(self, launches: list[_Launch], device_index: int, direct: bool = True):
        import torch
        from triton import knobs

        self.launches = launches
        self.device_index = device_index
        self._fire, self.source, self.via = _compile_fire(launches, direct)
        self._stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # absent on CPU-only builds
        # torch._C._cuda_getDevice is what torch.cuda.current_device() returns, minus a Python frame
        self._current_device = getattr(torch._C, "_cuda_getDevice", None)
        self._runtime = knobs.runtime
        self._chain = getattr(knobs, "HookChain", None)

    def usable(self) -> bool:
        """False when a profiler installed Triton launch hooks or the current device changed: the
        JIT path then does the launch (the hooks must see it; Triton launches on the current device)."""
        rt, chain = self._runtime, self._chain
        e, x = rt.launch_enter_hook, rt.launch_exit_hook
        # hook_inactive, inlined for the common case (an empty HookChain): this runs on every call
        return ((e is None or (type(e) is chain and not e.calls) or hook_inactive(e))
                and (x is None or (type(x) is chain and not x.calls) or hook_inactive(x))
                and self._current_device() == self.device_index)

    def __call__(self, tensors: tuple) -> None:
        self._fire(self._stream(self.device_index), tensors)


def _compiled_kernel_class():
    try:
        from triton.compiler.compiler import CompiledKernel
    except ImportError as exc:
        raise Refused(f"triton has no triton.compiler.compiler.CompiledKernel ({exc})") from None
    if not isinstance(CompiledKernel.__dict__.get("run"), property):
        raise Refused("CompiledKernel.run is not a property on this triton version")
    return CompiledKernel


def record(run_once, inputs: tuple, out, device_index: int) -> list[_Launch]:
    """Run `run_once(out)` (the JIT path into `out`) under recording; the launches, or raise Refused."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    ck_cls = _compiled_kernel_class()
    original = ck_cls.__dict__["run"]
    me = threading.get_ident()
    calls: list[tuple[Any, tuple]] = []
    foreign_ops: list[str] = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)
            if name not in VIEW_OPS:
                foreign_ops.append(name)
            return func(*args, **(kwargs or {}))

    def recording_run(ck):
        launcher = original.fget(ck)
        if threading.get_ident() != me:
            return launcher

        def rec(*a):
            calls.append((ck, launcher, a))
            return launcher(*a)
        return rec

    with _RECORD_LOCK:
        ck_cls.run = property(recording_run)
        try:
            with Watch():
                run_once(out)
        finally:
            ck_cls.run = original
    torch.cuda.synchronize(device_index)
    if foreign_ops:
        raise Refused(f"launch() runs aten ops besides views: {sorted(set(foreign_ops))}")
    if not calls:
        raise Refused("launch() made no CompiledKernel launch")
    stream = torch._C._cuda_getCurrentRawStream(device_index)
    return [check_call(ck, launcher, a, (*inputs, out), stream) for ck, launcher, a in calls]


def check_call(ck, launcher, a: tuple, pool: tuple, stream_now: int) -> _Launch:
    """One recorded launcher call as a replayable _Launch; `pool` = (*inputs, out)."""
    if len(a) < _N_FIXED:
        raise Refused(f"launcher called with {len(a)} arguments; expected at least {_N_FIXED}")
    gx, gy, gz, stream, function, packed, _meta, enter, exit_ = a[:_N_FIXED]
    if function is not ck.function or packed is not ck.packed_metadata:
        raise Refused("launcher arguments are not laid out as (grid, stream, function, packed_metadata, ...)")
    if stream != stream_now:
        raise Refused("launcher's stream argument is not the current stream")
    if not (hook_inactive(enter) and hook_inactive(exit_)):
        raise Refused("Triton launch hooks are installed (a profiler?)")
    # launch_metadata only feeds the hooks; with none active it is dropped (None on replay).
    if not all(isinstance(g, int) for g in (gx, gy, gz)):
        raise Refused("grid is not three ints")
    ptrs = [t.data_ptr() for t in pool]
    if len(set(ptrs)) != len(ptrs):
        raise Refused("inputs/output share memory, tensor arguments cannot be told apart")
    args, slots, descs = [], [], []
    for pos, v in enumerate(a[_N_FIXED:]):
        if hasattr(v, "data_ptr"):
            p = v.data_ptr()
            if p not in ptrs:
                raise Refused(f"kernel argument {pos} is a tensor that is neither an input nor the output")
            slots.append((pos, ptrs.index(p)))
            args.append(None)
        elif isinstance(v, _SCALARS):
            args.append(v)
        elif _is_descriptor(v):
            p = v.base.data_ptr()
            if p not in ptrs:
                raise Refused(f"kernel argument {pos} is a tensor descriptor over a tensor that is neither an "
                              "input nor the output")
            descs.append((pos, ptrs.index(p), _rebased(v)))
            args.append(None)
        else:
            raise Refused(f"kernel argument {pos} is a {type(v).__name__}, not a tensor, a tensor descriptor "
                          "or a scalar")
    return _Launch(launcher, (gx, gy, gz), function, packed, args, tuple(slots), ck, tuple(descs))


def same_bits(a, b) -> bool:
    """Bit-for-bit equality (NaN == NaN when the bits agree), for any dtype and shape."""
    import torch

    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def build(binding_run, alloc, inputs: tuple, first_out, device_index: int) -> Plan:
    """Record the JIT path's launches and prove the replay reproduces `first_out` (the output of
    the call just made through the JIT path on the same inputs); raise Refused otherwise.

    The direct C launch is tried first; if its replay raises a TypeError (the C function parsed its
    arguments differently than the layout says) or differs in any bit, the launcher objects are
    replayed instead, and only if that fails too is the plan refused."""
    import torch

    again = alloc()
    launches = record(binding_run, inputs, again, device_index)
    if not same_bits(again, first_out):
        raise Refused("a second JIT run gave different bits (non-deterministic kernel)")
    failures = []
    for direct in (True, False):
        plan = Plan(launches, device_index, direct=direct)
        if direct and plan.via == "launcher object":
            continue  # no C layout recognised: the second round is the same plan
        replayed = alloc()
        try:
            plan((*inputs, replayed))
        except TypeError as exc:  # argument parsing in Triton's C launcher
            failures.append(f"{plan.via}: {exc}")
            continue
        torch.cuda.synchronize(device_index)
        if same_bits(replayed, first_out):
            return plan
        failures.append(f"{plan.via}: the replayed launches did not reproduce the JIT path's output")
    raise Refused("; ".join(failures))
