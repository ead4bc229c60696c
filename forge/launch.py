"""The fast launch path for bound kernels on CUDA: replay the Triton `CompiledKernel` launches that a
rendered module's `launch()` makes, calling each kernel's compiled launcher directly.

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
     exactly one of the op's inputs or its output; other arguments must be plain scalars.
  3. The replayed launches must reproduce the JIT path's output bit for bit on the same inputs.
Anything else: no plan, and the binding keeps using the JIT path (`Plan.refused` says why).
"""

from __future__ import annotations

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


class Plan:
    """Replays recorded launches with new tensors of the same signature."""

    def __init__(self, launches: list[_Launch], device_index: int):
        import torch
        from triton import knobs

        self.launches = launches
        self.device_index = device_index
        self._stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # absent on CPU-only builds
        # torch._C._cuda_getDevice is what torch.cuda.current_device() returns, minus a Python frame
        self._current_device = getattr(torch._C, "_cuda_getDevice", None)
        self._runtime = knobs.runtime

    def usable(self) -> bool:
        """False when a profiler installed Triton launch hooks or the current device changed: the
        JIT path then does the launch (the hooks must see it; Triton launches on the current device)."""
        rt = self._runtime
        return (hook_inactive(rt.launch_enter_hook) and hook_inactive(rt.launch_exit_hook)
                and self._current_device() == self.device_index)

    def __call__(self, tensors: tuple) -> None:
        stream = self._stream(self.device_index)
        for ln in self.launches:
            args = ln.args.copy()
            for pos, src in ln.slots:
                args[pos] = tensors[src]
            ln.launcher(*ln.grid, stream, ln.function, ln.packed_metadata, None, None, None, *args)


def _compiled_kernel_class():
    try:
        from triton.compiler.compiler import CompiledKernel
    except ImportError as exc:
        raise Refused(f"triton has no triton.compiler.compiler.CompiledKernel ({exc})") from None
    if not isinstance(CompiledKernel.__dict__.get("run"), property):
        raise Refused("CompiledKernel.run is not a property on this triton version")
    return CompiledKernel


def record(run_once, inputs: tuple, out, device_index: int) -> Plan:
    """Run `run_once(out)` (the JIT path into `out`) under recording and build a Plan; raise Refused."""
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
    return Plan([check_call(ck, launcher, a, (*inputs, out), stream) for ck, launcher, a in calls], device_index)


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
    args, slots = [], []
    for pos, v in enumerate(a[_N_FIXED:]):
        if hasattr(v, "data_ptr"):
            p = v.data_ptr()
            if p not in ptrs:
                raise Refused(f"kernel argument {pos} is a tensor that is neither an input nor the output")
            slots.append((pos, ptrs.index(p)))
            args.append(None)
        elif isinstance(v, _SCALARS):
            args.append(v)
        else:
            raise Refused(f"kernel argument {pos} is a {type(v).__name__}, not a tensor or a scalar")
    return _Launch(launcher, (gx, gy, gz), function, packed, args, tuple(slots))


def same_bits(a, b) -> bool:
    """Bit-for-bit equality (NaN == NaN when the bits agree), for any dtype and shape."""
    import torch

    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def build(binding_run, alloc, inputs: tuple, first_out, device_index: int) -> Plan:
    """Record the JIT path's launches and prove the replay reproduces `first_out` (the output of
    the call just made through the JIT path on the same inputs); raise Refused otherwise."""
    import torch

    again = alloc()
    plan = record(binding_run, inputs, again, device_index)
    if not same_bits(again, first_out):
        raise Refused("a second JIT run gave different bits (non-deterministic kernel)")
    replayed = alloc()
    plan((*inputs, replayed))
    torch.cuda.synchronize(device_index)
    if not same_bits(replayed, first_out):
        raise Refused("the replayed launches did not reproduce the JIT path's output")
    return plan
