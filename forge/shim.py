"""The runtime shim: `@forge.optimize`, `forge.load`, `forge.explain`.

First call per signature: trace with torch.fx (forge/trace.py), match an op family, build the
KernelSpec from the actual arguments, look the decision up in the cache (searching on a miss unless
searching is off), and bind either the cached kernel or the eager function. Later calls with the same
signature: one dict lookup and a launch (forge/launch.py's recorded plan) or, for plain positional calls
once the extension is built, one C++ call that checks the signature and launches (forge/fastcall.py).

Never a wrong result: anything forge cannot vouch for runs the user's eager function, with the reason
kept for `forge.explain` and a one-time warning.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forge import key as keys
from forge.cache import Cache, CacheError, default_cache_path
from forge.errors import ForgeError
from forge.loader import load_module, write_source
from forge.spec import DTYPES, dtype_name, same_layout

ALIGNMENT = 16  # bytes; kernels are validated on freshly allocated (>= 256-byte aligned) tensors


@dataclass(frozen=True)
class Explanation:
    """What forge does for one call signature."""

    uses: str  # "kernel" | "torch" (torch's fused op, a cached "torch" decision) | "eager" | "regions"
    reason: str
    op: str | None = None
    key: str | None = None
    variant: str | None = None
    params: dict | None = None
    # How the kernel is launched once bound: "compiled (C launch function)" or "compiled (launcher object)"
    # (recorded CompiledKernel launches replayed, forge/launch.py),
    # "jit" (Triton's JIT dispatch, with the reason the compiled path was refused), or None (not yet called).
    launch: str | None = None
    # A function that is not one op runs through TorchDynamo with the forge backend (forge/backend.py):
    # its report per region (a backend.ModelExplanation). uses == "regions" when a region runs a kernel.
    model: Any = None

    def __str__(self) -> str:
        if self.model is not None:
            return f"{self.uses}: {self.reason}\n{self.model}"
        if self.uses == "kernel":
            how = f" (launch: {self.launch})" if self.launch else ""
            return (f"forge kernel {self.op}/{self.variant}({self.params}) [{self.key[:12]}]: "
                    f"{self.reason}{how}")
        if self.uses == "torch":
            return f"torch op for {self.op} [{self.key[:12]}]: {self.reason}"
        return f"eager: {self.reason}"


# The runtime never imports the tuner (imports point down: docs/adr/0002-layers.md). The package facade
# (forge/__init__.py) installs the function that searches on a cache miss; it imports the tuner lazily.
_search_on_miss: Callable[..., Any] | None = None


def set_searcher(fn: Callable[..., Any] | None) -> None:
    """fn(op_name, shape, dtype, *, device, cache, attrs, budget, gpu) searches and stores a decision."""
    global _search_on_miss
    _search_on_miss = fn


def _searcher() -> Callable[..., Any]:
    if _search_on_miss is None:
        raise RuntimeError("forge.shim has no searcher installed (forge/__init__.py installs it on import)")
    return _search_on_miss


def _search_enabled(flag: bool) -> bool:
    return flag and os.environ.get("FORGE_SEARCH", "1") != "0"


_hot: dict[str, Any] = {}  # torch objects the hot path uses, bound on first use (import-light module)


def _torch_hot() -> dict[str, Any]:
    if not _hot:
        import torch

        _hot.update(Tensor=torch.Tensor, grad=torch.is_grad_enabled, autocast=torch._C._is_any_autocast_enabled)
    return _hot


def _tensor_sig(v) -> tuple:
    # get_device() (an int) rather than .device (a new torch.device object per access); is_cuda tells
    # cuda:0 from cpu (-1). Measured on the H200 host: the whole per-call key for two tensors was ~7 µs
    # with tuple(shape) + .device + a closure, about a third of that written this way.
    # is_meta: a meta tensor reports get_device() -1 like a CPU one (and has no storage to align).
    return (v.shape, v.dtype, v.stride(), v.is_cuda, v.get_device(), v.is_meta, v.requires_grad,
            v.is_meta or v.data_ptr() % ALIGNMENT == 0)


def _value_sig(v):
    if isinstance(v, _hot["Tensor"]):
        return _tensor_sig(v)
    try:
        hash(v)
    except TypeError:
        return ("id", id(v))
    return v


def _signature(args: tuple, kwargs: dict) -> tuple:
    """Everything a bound kernel depends on: grad mode, autocast, and each argument — tensors by
    shape/dtype/strides/device/grad/alignment, other values by value (or identity if unhashable)."""
    h = _torch_hot()
    key = [h["grad"](), h["autocast"]()]
    key += [_value_sig(a) for a in args]
    if kwargs:
        key += [(k, _value_sig(v)) for k, v in sorted(kwargs.items())]
    return tuple(key)


_SCALARS = (int, float, bool, str)
_FAST_SWITCH = 4  # Python-path calls of another signature before it takes over the C++ fast path


def _module_state(root) -> tuple:
    """A module's parameters and buffers (model.half(), a reassigned weight) and the plain scalar
    attributes of it and its submodules (eps, training, a scale), as part of the signature: fx bakes
    such attributes into the trace as constants, so a change must mean a new trace."""
    scalars = tuple((name, k, v) for name, m in root.named_modules() for k, v in vars(m).items()
                    if isinstance(v, _SCALARS))
    return (tuple(_tensor_sig(t) for t in root.parameters()) + tuple(_tensor_sig(t) for t in root.buffers())
            + scalars)


def _scalar_reads(fn) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The global names and closure cells of `fn` that hold plain scalars (an EPS = 1e-6 at module
    level): fx bakes their values into the trace, so they are part of the signature. Only `fn`'s own
    code is inspected; a helper it calls that reads a global of its own is not covered."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return (), ()
    g = getattr(fn, "__globals__", {})
    names = tuple(n for n in code.co_names if isinstance(g.get(n), _SCALARS))
    cells = tuple(i for i, c in enumerate(getattr(fn, "__closure__", None) or ())
                  if isinstance(_cell(c), _SCALARS))
    return names, cells


def _cell(c):
    try:
        return c.cell_contents
    except ValueError:  # an empty cell
        return None


class _Binding:
    """A kernel bound to one signature: picks the op inputs from the call's tensors, launches."""

    def __init__(self, opmod, module, spec, indices: list, defaults: tuple, attrs: dict, getters=(),
                 device_index: int | None = None):
        self.opmod, self.module, self.spec, self.attrs = opmod, module, spec, attrs
        # Inputs the user's code did not pass (rmsnorm's weight of ones) are made once, here; the first
        # call's own tensors are not kept (that would hold the caller's memory for the binding's life).
        self.slots = [(i, d if i is None else None) for i, d in zip(indices, defaults, strict=True)]
        self.getters = tuple(getters)  # module parameters, fetched on every call (they may be reassigned)
        self.device_index = device_index
        self._identity = list(indices) == list(range(len(indices)))  # inputs are the call's tensors as-is
        self.plan = None
        self.launch = None if device_index is not None else "jit (the interpreter has no compiled launcher)"
        self.fast: str | None = None  # "C++" | "off" (fast_reason says why) | None (not yet made)
        self.fast_reason = ""
        self._record_lock = threading.Lock()

    def __call__(self, tensors: list, root=None):
        if self.getters:
            tensors = [*tensors, *(g(root) for g in self.getters)]
        if self._identity and len(tensors) == len(self.slots):
            inputs = tuple(tensors)
        else:
            inputs = tuple(tensors[i] if i is not None else d for i, d in self.slots)
        plan = self.plan
        if plan is not None and plan.usable():
            out = self.opmod.alloc_output(inputs, self.spec)
            plan((*inputs, out))
            return out
        out = self.opmod.alloc_output(inputs, self.spec)
        self.opmod.run(self.module, inputs, out, self.attrs)
        if self.launch is None:
            self._record(inputs, out)
        return out

    def _record(self, inputs: tuple, out) -> None:
        """After the first JIT-path call: try to build the compiled launch plan (forge/launch.py)."""
        from forge import launch

        with self._record_lock:
            if self.launch is not None:
                return
            try:
                self.plan = launch.build(lambda o: self.opmod.run(self.module, inputs, o, self.attrs),
                                         lambda: self.opmod.alloc_output(inputs, self.spec), inputs, out,
                                         self.device_index)
                self.launch = f"compiled ({self.plan.via})"
            except launch.Refused as exc:
                self.launch = f"jit ({exc})"


class _TorchCall:
    """torch's fused op bound to one signature (a "torch" decision: the search measured it faster than the
    user's code as written and than every kernel; forge/fused.py). Picks the op's inputs from the call's
    tensors as _Binding does and calls torch; there is no forge kernel to launch, so no compiled plan and
    no C++ fast path (torch's own dispatch is the call)."""

    def __init__(self, fused, spec, indices: list, defaults: tuple, attrs: dict, getters=()):
        self.fn, self.label, self.spec, self.attrs = fused.fn, fused.label, spec, attrs
        self.slots = [(i, d if i is None else None) for i, d in zip(indices, defaults, strict=True)]
        self.getters = tuple(getters)
        self.plan = None
        self.launch = f"torch op {fused.label}"
        self.fast, self.fast_reason = "off", "a torch op (no forge kernel to launch)"

    def __call__(self, tensors: list, root=None):
        if self.getters:
            tensors = [*tensors, *(g(root) for g in self.getters)]
        return self.fn(tuple(tensors[i] if i is not None else d for i, d in self.slots), self.attrs)


class Optimized:
    def __init__(self, fn: Callable, *, budget: int = 50, search: bool = True, warn: bool = True,
                 interpreter: bool | None = None, cache: str | os.PathLike | None = None, regions: bool = True):
        self.fn = fn
        self.regions = regions
        self.budget = budget
        self.search = search
        self.warn = warn
        self.interpreter = (os.environ.get("FORGE_INTERPRETER") == "1") if interpreter is None else interpreter
        self.cache_path = Path(cache) if cache else None
        self._bound: dict[tuple, tuple[Any, Explanation]] = {}
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        from forge.trace import _trace_target

        # root: the nn.Module whose parameters the computation reads (None for a plain function).
        self._root, _, self._sig = _trace_target(fn)
        # Tensor defaults are traced as arguments but absent from a positional call: such functions take
        # the general path, which binds defaults the way the trace did.
        self._tensor_defaults = any(_is_tensor(p.default) for p in self._sig.parameters.values())
        self._scalar_names, self._scalar_cells = _scalar_reads(fn) if self._root is None else ((), ())
        self._has_scalar_reads = bool(self._scalar_names or self._scalar_cells)
        # The C++ fast path (forge/fastcall.py) serves one signature: plain positional calls of a plain
        # function, whose key is the arguments alone. It follows the signature in use: another one that
        # the Python path serves _FAST_SWITCH times in a row takes it over (prefill, then decode).
        self._fast_ok = self._root is None and not self._tensor_defaults and not self._has_scalar_reads
        # (callable, eager?): a FastCall returns the output, an EagerCall (for a signature decided eager)
        # a 1-tuple of the function's result (which may be None); both return None for another signature.
        self._fast: tuple[Any, bool] | None = None
        self._fast_key: tuple | None = None
        self._fast_misses: dict[tuple, int] = {}
        self._fast_off: dict[tuple, str] = {}  # signatures the fast path cannot serve, with the reason
        try:
            functools.update_wrapper(self, fn)
        except AttributeError:  # an nn.Module instance has no __name__ etc.
            pass

    # -- hot path ---------------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        fast = self._fast
        if fast is not None and not kwargs:
            call, eager = fast
            out = call(*args)  # None unless this is exactly the signature it was made for
            if out is not None:
                return out[0] if eager else out
        root = self._root
        if kwargs or root is not None or self._tensor_defaults:
            return self._call_general(args, kwargs)
        # The common case, kept to one pass over the arguments (a cache hit costs this plus a launch).
        h = _hot or _torch_hot()
        tensor_cls = h["Tensor"]
        key = [h["grad"](), h["autocast"]()]  # as _signature builds it
        tensors = []
        for a in args:
            if isinstance(a, tensor_cls):
                tensors.append(a)
                key.append(_tensor_sig(a))
            else:
                key.append(_value_sig(a))
        if self._has_scalar_reads:
            key.append(self._extra_state())
        key = tuple(key)
        hit = self._bound.get(key)
        if hit is None:
            hit = self._bind(key, args, kwargs, allow_search=True)
        binding = hit[0]
        if binding is None:
            if self._fast_ok and key != self._fast_key and key not in self._fast_off:
                self._offer_fast(key, None, args, None)
            return self.fn(*args)
        if type(binding) is _Regions:
            return binding(self, key, args, kwargs)
        out = binding(tensors)
        if binding.plan is not None and self._fast_ok and key != self._fast_key and binding.fast != "off":
            self._offer_fast(key, binding, args, out)
        return out

    def _offer_fast(self, key: tuple, binding, args: tuple, out) -> None:
        """After a Python-path call of a plan-bound signature (binding) or of one decided eager (binding
        None): make the C++ fast call for it (first signature, or one that keeps coming while another
        holds the fast path)."""
        from forge import fastcall

        if self._fast is not None:
            n = self._fast_misses.get(key, 0) + 1
            self._fast_misses[key] = n
            if n < _FAST_SWITCH:
                return
        with self._lock:
            try:
                if binding is None:
                    fc = fastcall.make_eager(self.fn, args, key[0], key[1])
                else:
                    tensor_pos = [k for k, a in enumerate(args) if isinstance(a, _hot["Tensor"])]
                    sources = [tensor_pos[i] if i is not None else d for i, d in binding.slots]
                    fc = fastcall.make(binding.plan, args, sources, out, key[0])
            except fastcall.Unsupported as exc:
                self._fast_off[key] = str(exc)
                if binding is not None:
                    binding.fast, binding.fast_reason = "off", str(exc)
                return
            if fc is None:  # the extension is still building: the next call asks again
                return
            self._fast, self._fast_key = (fc, binding is None), key
            self._fast_misses.clear()
            if binding is not None:
                binding.fast = "C++"

    def _extra_state(self) -> tuple:
        """What the trace depends on besides the arguments: a module's state, or the scalar globals and
        closure values a function reads."""
        if self._root is not None:
            return _module_state(self._root)
        if not self._has_scalar_reads:
            return ()
        g = self.fn.__globals__
        cells = self.fn.__closure__ or ()
        return (tuple(g.get(n) for n in self._scalar_names), tuple(_cell(cells[i]) for i in self._scalar_cells))

    def _call_general(self, args, kwargs):
        root = self._root
        sig = _signature(args, kwargs)
        if root is not None or self._has_scalar_reads:
            sig += (self._extra_state(),)
        hit = self._bound.get(sig)
        if hit is None:
            hit = self._bind(sig, args, kwargs, allow_search=True)
        binding, _ = hit
        if binding is None:
            return self.fn(*args, **kwargs)
        if type(binding) is _Regions:
            return binding(self, sig, args, kwargs)
        return binding(_tensor_args(self._sig, args, kwargs), root)

    # -- first call of a signature -----------------------------------------------------------------
    def explain(self, *args, **kwargs) -> Explanation:
        sig = _signature(args, kwargs)
        if self._root is not None or self._has_scalar_reads:
            sig += (self._extra_state(),)
        hit = self._bound.get(sig) or self._bind(sig, args, kwargs, allow_search=False, remember=False)
        binding, why = hit
        if type(binding) is _Regions:
            return binding.explain(why)
        if binding is not None and binding.launch is not None:
            launch = binding.launch
            if binding.fast == "C++" and sig == self._fast_key:
                launch += "; fast path: C++ (forge/_fastcall.cpp)"
            elif binding.fast == "off":
                launch += f"; no C++ fast path: {binding.fast_reason}"
            return dataclasses.replace(why, launch=launch)
        return why

    def _bind(self, sig, args, kwargs, *, allow_search: bool, remember: bool = True):
        with self._lock:  # thread-safe first call: one search per signature
            if sig in self._bound:
                return self._bound[sig]
            binding, why = self._decide(args, kwargs, allow_search)
            if binding is None and self.warn and remember and why.reason not in self._warned:
                self._warned.add(why.reason)
                warnings.warn(f"forge: {getattr(self.fn, '__name__', 'function')} runs eager: {why.reason}",
                              RuntimeWarning, stacklevel=4)
            if remember:  # also eager: a search-off miss must not re-trace on every call
                self._bound[sig] = (binding, why)
            return binding, why

    def _regions_or_eager(self, reason: str, args, kwargs, allow_search: bool):
        """A function that is not one op: its regions through TorchDynamo and the forge backend
        (forge/backend.py), when regions=True. A real call binds a _Regions (compiled on its first
        call, dropped for eager if no region runs a kernel); explain() captures once without searching."""
        if not self.regions:
            return None, Explanation("eager", reason)
        if allow_search:
            return _Regions(self, reason), Explanation("regions", f"{reason}; its regions run through TorchDynamo "
                                                       "with the forge backend (not yet called)")
        report = _Regions(self, reason, dry_run=True).capture(args, kwargs)
        if isinstance(report, str):
            return None, Explanation("eager", f"{reason}; {report}")
        return None, Explanation(report.uses, f"{reason}; under TorchDynamo: "
                                 f"{report.reason}", model=report)

    def _decide(self, args, kwargs, allow_search: bool):

        from forge.trace import Untraceable, canonical, describe

        def eager(reason: str, **kw) -> tuple[None, Explanation]:
            return None, Explanation("eager", reason, **kw)

        try:
            traced = canonical(self.fn, args, kwargs)
        except Untraceable as exc:
            return self._regions_or_eager(f"cannot trace: {exc}", args, kwargs, allow_search)
        from forge import ops

        found = None
        for op in ops.match_order():  # specific families first, the generic pointwise one last
            m = getattr(op.module, "match", None)
            if m is not None and (res := m(traced.expr)) is not None:
                found = (op, *res)
                break
        if found is None:
            return self._regions_or_eager(f"no op family matches this computation ({describe(traced.expr)})",
                                          args, kwargs, allow_search)
        op, indices, attrs = found
        tensors = traced.tensors
        if self._root is None and traced.params:
            # fx baked in tensors the function reads from globals or closures; rebinding such a name
            # later would not change the signature, so a bound kernel could keep the old tensor.
            return eager("reads tensors that are not its arguments (globals or closures): pass them as "
                         "arguments, or optimize an nn.Module whose parameters they are", op=op.name)
        picked = [tensors[i] if i is not None else None for i in indices]
        miss = "search" if allow_search and _search_enabled(self.search) else (
            "eager" if _search_enabled(self.search) else "off")
        return resolve(op, picked, indices, attrs, tensors, getters=traced.params, interpreter=self.interpreter,
                       cache_path=self.cache_path, miss=miss, budget=self.budget)


def resolve(op, picked: list, indices: list, attrs: dict, tensors: list, *, getters=(), interpreter: bool,
            cache_path, miss: str, budget: int, record: Callable[..., str] | None = None
            ) -> tuple[_Binding | None, Explanation]:
    """The kernel for one matched computation, or eager with the reason: the checks every cached kernel
    passes before it runs (grad, autocast, devices, layout, alignment, dtypes, the spec), the cache
    lookup, and on a miss what `miss` says: "search" (the installed searcher), "record" (record(op,
    shape, dtype, device, attrs) notes it for offline tuning and says so, in words), "eager" (a miss that
    would search, asked without searching), "skip" (never searches) or "off" (searching is switched
    off). picked: the op's
    inputs as the matcher picked them (None where the op fills one in); tensors: every tensor the
    computation reads (for the grad check). Shared by @forge.optimize (one op per function) and the
    TorchDynamo backend (one op per region of a graph, forge/backend.py)."""
    import torch

    def eager(reason: str, **kw) -> tuple[None, Explanation]:
        return None, Explanation("eager", reason, **kw)

    from forge import ops

    inputs = ops.fill_inputs(op.module, picked, attrs)
    x = inputs[0]
    if torch._C._is_any_autocast_enabled():
        # Under autocast eager's ops choose their own dtypes (softmax and pow in fp32, matmul in the
        # autocast dtype); a kernel computing in its inputs' dtype would return something else.
        return eager("autocast is enabled (eager's ops pick their own dtypes under it)", op=op.name)
    if any(t.requires_grad for t in tensors) and torch.is_grad_enabled():
        return eager("inputs require grad (forge kernels are forward-only)", op=op.name)
    if any(t.device != x.device for t in inputs):
        return eager("inputs are on different devices", op=op.name)
    layout, why = ops.strided_attrs(op, inputs, attrs)
    if why is not None:
        return eager(why, op=op.name)
    attrs = layout
    if any(t.data_ptr() % ALIGNMENT for t in inputs):
        return eager(f"input not {ALIGNMENT}-byte aligned (kernels are validated on aligned inputs)",
                     op=op.name)
    dtype = dtype_name(x.dtype)
    problem = getattr(op.module, "problem", None)
    if dtype not in DTYPES or (problem is None and any(str(t.dtype) != str(x.dtype) for t in inputs)):
        return eager(f"unsupported dtype mix {[str(t.dtype) for t in inputs]}", op=op.name)
    shape = tuple(x.shape)
    if problem is not None:  # ops whose problem size is not just the first input's shape
        try:
            shape = tuple(problem(inputs, attrs))
        except ValueError as exc:
            return eager(f"{op.name} does not support this call: {exc}", op=op.name)
    if x.device.type == "cuda":
        backend = "cuda"
    elif x.device.type == "cpu" and interpreter:
        if os.environ.get("TRITON_INTERPRET") != "1":
            return eager("CPU tensors need TRITON_INTERPRET=1 set before triton is imported", op=op.name)
        backend = "interpreter"
    else:
        return eager(f"{x.device.type} tensors without the interpreter opted in "
                     "(forge.optimize(interpreter=True) or FORGE_INTERPRETER=1)", op=op.name)
    try:
        spec = op.module.make_spec(shape, dtype, keys.spec_device(backend), attrs)
        keys.check_attrs(spec.attrs)
    except ValueError as exc:
        return eager(f"{op.name} does not support this call: {exc}", op=op.name)
    actual = [(tuple(t.shape), dtype_name(t.dtype)) for t in inputs]
    if actual != [(s.shape, s.dtype) for s in spec.inputs]:
        return eager(f"input shapes/dtypes {actual} do not fit {op.name}'s kernel", op=op.name)
    if not all(same_layout(s.shape, tuple(t.stride()), s.strides) for t, s in zip(inputs, spec.inputs, strict=True)):
        return eager(f"input strides {[tuple(t.stride()) for t in inputs]} are not the layout of {op.name}'s "
                     "spec", op=op.name)

    device_index = x.device.index if backend == "cuda" else None
    loc = keys.locate(op, spec, backend, device_index)
    key = loc.key
    try:
        cache = Cache(cache_path or default_cache_path())
        entry = cache.get(key)
        if entry is None and miss == "search":
            _searcher()(op.name, shape, dtype, device=keys.spec_device(backend), cache=cache, attrs=attrs,
                        budget=budget, gpu=device_index)
            entry = cache.get(key)
    except CacheError as exc:
        return eager(f"cache unusable: {exc}", op=op.name, key=key)
    except ForgeError as exc:  # the search could not run here (out of memory, no workers): eager, never a crash
        return eager(f"search failed: {exc}", op=op.name, key=key)
    if entry is None:
        if miss == "record" and record is not None:
            why = record(op.name, shape, dtype, keys.spec_device(backend), dict(spec.attrs))
        else:
            why = {"off": "searching is off (FORGE_SEARCH=0 or search=False)", "eager": "would search",
                   "skip": "not tuned (the backend's miss='eager': tune it with forge search)",
                   "search": "the search stored no decision"}.get(miss, "not tuned")
        return eager(f"cache miss: {why}", op=op.name, key=key)
    if entry.decision == "eager":
        return eager("cached decision is eager (no candidate beat eager by the required margin)",
                     op=op.name, key=key)
    if entry.decision == "torch":
        return _torch_decision(op, entry, loc, spec, indices, inputs, attrs, getters)
    if not keys.source_intact(entry):
        return eager("cached kernel source does not match its sha256; not loaded", op=op.name, key=key)
    if entry.env != loc.env:
        diff = keys.env_diff(entry.env, loc.env)
        return eager(f"cached entry was made for another environment ({', '.join(diff)})",
                     op=op.name, key=key)
    problem = keys.verify_entry(entry)  # before anything is imported: the cache is untrusted input
    if problem is not None:
        return eager(f"cached kernel refused, not loaded: {problem}", op=op.name, key=key)
    module = _load_kernel(entry, cache)
    why = Explanation("kernel", f"cached {entry.speedup or 0:.2f}x faster than eager", op=op.name, key=key,
                      variant=entry.variant, params=entry.params)
    return _Binding(op.module, module, spec, indices, inputs, attrs, getters, device_index), why


def _torch_decision(op, entry, loc, spec, indices, inputs, attrs, getters) -> tuple[_TorchCall | None, Explanation]:
    """A cached "torch" decision: torch's fused op for this spec, where this forge knows one (the entry is
    untrusted input: a decision for an op or attributes without a torch op here runs the code as written)."""
    from forge import fused

    f = fused.candidate(op.name, spec.attrs, spec)
    if f is None:
        return None, Explanation("eager", f"cached decision is a torch op, but forge knows none for {op.name} "
                                 f"{spec.attrs} (forge/fused.py)", op=op.name, key=entry.key)
    if entry.env != loc.env:
        diff = keys.env_diff(entry.env, loc.env)
        return None, Explanation("eager", f"cached entry was made for another environment ({', '.join(diff)})",
                                 op=op.name, key=entry.key)
    other = fused.timed_other_call(entry.candidates, f)
    if other is not None:
        return None, Explanation("eager", f"{other} (search again to time it)", op=op.name, key=entry.key)
    why = Explanation("torch", f"cached: torch's {f.label} {entry.speedup or 0:.2f}x faster than the code as "
                      "written (and than every forge kernel)", op=op.name, key=entry.key, variant="torch")
    return _TorchCall(f, spec, indices, inputs, attrs, getters), why


class _Regions:
    """One signature of a function that is not one op, run by TorchDynamo with the forge backend: each
    region with a cached kernel runs it, the rest runs as written. After the first call, a signature in
    which no region runs a kernel is rebound to the plain function (no Dynamo on the hot path)."""

    def __init__(self, owner: Optimized, reason: str, dry_run: bool = False):
        from forge import backend

        if dry_run:
            miss = "eager" if _search_enabled(owner.search) else "off"
        else:
            miss = "search" if _search_enabled(owner.search) else "off"
        self.reason = reason
        self.backend = backend.Backend(miss="eager", budget=owner.budget, cache=owner.cache_path,
                                       interpreter=owner.interpreter)
        self.backend.resolve_miss = miss  # the shim's own miss wording and policy (resolve())
        self.fn = owner.fn
        self.compiled = None

    def capture(self, args, kwargs):
        """Run the function once under Dynamo (explain): the report, or why it could not be captured."""
        import torch

        torch._dynamo.reset()
        try:
            torch.compile(self.fn, backend=self.backend, dynamic=False)(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - Dynamo or the user's code failed: say so, run eager
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            return f"TorchDynamo could not capture it either: {type(exc).__name__}: {first[:200]}"
        finally:
            torch._dynamo.reset()
        return self.backend.explain()

    def __call__(self, owner: Optimized, sig, args, kwargs):
        if self.compiled is None:
            import torch

            self.compiled = torch.compile(self.fn, backend=self.backend, dynamic=False)
            out = self.compiled(*args, **kwargs)
            report = self.backend.explain()
            if not (report.kernels or report.torch_ops):
                why = Explanation("eager", f"{self.reason}; under TorchDynamo: {report.reason}", model=report)
                owner._bound[sig] = (None, why)
                if owner.warn and why.reason not in owner._warned:
                    owner._warned.add(why.reason)
                    warnings.warn(f"forge: {getattr(self.fn, '__name__', 'function')} runs eager: {why.reason}",
                                  RuntimeWarning, stacklevel=3)
            return out
        return self.compiled(*args, **kwargs)

    def explain(self, why: Explanation) -> Explanation:
        if self.compiled is None:
            return why
        report = self.backend.explain()
        return Explanation("regions", f"{self.reason}; under TorchDynamo: {report.reason}", model=report)


def _load_kernel(entry, cache: Cache):
    return load_module(write_source(entry.source, Path(cache.path).parent / "kernels-src"))


def _tensor_args(sig, args, kwargs) -> list:
    """The tensor arguments in parameter order, defaults included (the order forge/trace.py indexes them)."""
    import torch

    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    return [v for v in bound.arguments.values() if isinstance(v, torch.Tensor)]


def _is_tensor(v) -> bool:
    t = type(v)
    return t.__module__.startswith("torch") and any(c.__name__ == "Tensor" for c in t.__mro__)


def optimize(fn: Callable | None = None, **options):
    """Decorator: `@forge.optimize` or `@forge.optimize(budget=50, search=True, warn=True,
    interpreter=None, cache=None)`."""
    if fn is None:
        return lambda f: Optimized(f, **options)
    return Optimized(fn, **options)


def load(op: str, shape, dtype: str = "float16", *, device: str = "cuda", cache=None, **attrs):
    """A callable for an already-tuned op, without a decorator: `forge.load("rmsnorm", (2048, 4096),
    "float16")(x, w)`. Raises LookupError (with the reason) when no kernel decision is cached."""
    from forge import ops

    fam = ops.get(op)
    backend = "cuda" if str(device).startswith("cuda") else "interpreter"
    device_index = _device_index(device) if backend == "cuda" else None
    spec = fam.module.make_spec(tuple(shape), dtype, keys.spec_device(backend), attrs)
    loc = keys.locate(fam, spec, backend, device_index)
    db = Cache(cache or default_cache_path())
    entry = db.get(loc.key)
    if entry is None:
        raise LookupError(f"{op} {shape} {dtype} on {backend} is not tuned in {db.path}: run `forge search`")
    want = [(s.shape, s.dtype) for s in spec.inputs]

    def checked(tensors) -> None:
        # No trace to vouch for the arguments here: check them against the spec the kernel was
        # validated for (a wrong shape would read out of bounds, not raise).
        got = [(tuple(t.shape), dtype_name(t.dtype)) for t in tensors]
        if got != want:
            raise ValueError(f"forge.load({op!r}) kernel takes {want}, got {got}")
        if any(not t.is_contiguous() or t.data_ptr() % ALIGNMENT or t.device.type != backend.replace(
                "interpreter", "cpu") for t in tensors):
            raise ValueError(f"forge.load({op!r}) kernel takes contiguous, {ALIGNMENT}-byte aligned "
                             f"{spec.device} tensors")

    if entry.decision == "torch":  # torch's fused op was measured fastest: that is what load returns
        from forge import fused

        f = fused.candidate(op, spec.attrs, spec)
        if f is None:
            raise LookupError(f"{op} {shape} {dtype}: the cached decision is a torch op, but forge knows none "
                              "for this spec")

        def call_torch(*tensors):
            checked(tensors)
            return f.fn(tensors, spec.attrs)

        return call_torch
    if entry.decision != "kernel":
        raise LookupError(f"{op} {shape} {dtype}: the cached decision is eager (no kernel beat it)")
    if not keys.source_intact(entry):
        raise LookupError(f"{op} {shape} {dtype}: cached source does not match its sha256")
    if entry.env != loc.env:  # the key already covers the environment; this guards an entry stored under a wrong key
        raise LookupError(f"{op} {shape} {dtype}: cached entry was made for another environment")
    problem = keys.verify_entry(entry)  # before anything is imported: the cache is untrusted input
    if problem is not None:
        raise LookupError(f"{op} {shape} {dtype}: cached kernel refused, not loaded: {problem}")
    module = _load_kernel(entry, db)
    binding = _Binding(fam.module, module, spec, list(range(len(spec.inputs))), (None,) * len(spec.inputs),
                       spec.attrs, device_index=device_index)

    def call(*tensors):
        checked(tensors)
        return binding(list(tensors))

    return call


def _device_index(device: str) -> int:
    import torch

    d = torch.device(device)
    return d.index if d.index is not None else torch.cuda.current_device()


def explain(fn, *args, **kwargs) -> Explanation:
    """Why forge uses a kernel or eager for this call (never searches)."""
    target = fn if isinstance(fn, Optimized) else Optimized(fn, warn=False)
    return target.explain(*args, **kwargs)
