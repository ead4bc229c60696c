"""forge/fastcall.py + forge/_fastcall.cpp: the C++ cache-hit path, without a GPU.

The extension is built here (torch.utils.cpp_extension, ~30 s on 2 cores) and run on CPU tensors with
no kernel launched (fn = 0): the signature checks, the output allocation and the parameter packing are
the same code the CUDA path runs. The launches themselves are checked against the Python plan, bit for
bit, in tests/test_gpu.py."""

from __future__ import annotations

import struct
from types import SimpleNamespace

import pytest
import torch

from forge import fastcall, launch


@pytest.fixture(scope="module")
def ext():
    mod = fastcall.module(wait=True)
    assert mod is not None, fastcall.error()
    return mod


def _fast(ext, args_spec, sources, out_spec, rows=(), grad=False):
    launches = [(0, 3, 1, 1, 128, 0, list(rows))] if rows else []
    return ext.FastCall(grad, -1, args_spec, sources, out_spec, launches, None, None, None, None)


def _t(shape, stride, dtype=torch.float32):
    return ("tensor", (shape, stride, dtype))


def test_the_bound_signature_gets_a_fresh_output_of_the_bound_layout(ext):
    f = _fast(ext, [_t((4, 8), (8, 1)), _t((8,), (1,)), ("value", 1e-6)], [0, 1], ((4, 8), (8, 1), torch.float16))
    x, w = torch.randn(4, 8), torch.randn(8)
    with torch.no_grad():
        a, b = f(x, w, 1e-6), f(x, w, 1e-6)
    assert a.shape == (4, 8) and a.stride() == (8, 1) and a.dtype == torch.float16 and a.device.type == "cpu"
    assert a.data_ptr() != b.data_ptr()  # a new allocation per call, never a shared buffer


@pytest.mark.parametrize("change", ["shape", "stride", "dtype", "requires_grad", "grad_mode", "misaligned",
                                    "value", "arity", "not_a_tensor", "device"])
def test_anything_but_the_bound_signature_returns_none(ext, change):
    f = _fast(ext, [_t((4, 8), (8, 1)), ("value", 1e-6)], [0], ((4, 8), (8, 1), torch.float32))
    x, v, grad = torch.randn(4, 8), 1e-6, False
    args = None
    if change == "shape":
        x = torch.randn(5, 8)
    elif change == "stride":
        x = torch.randn(4, 16)[:, :8]  # (4, 8) with stride (16, 1)
    elif change == "dtype":
        x = x.double()
    elif change == "requires_grad":
        x.requires_grad_(True)
    elif change == "grad_mode":
        grad = True
    elif change == "misaligned":
        x = torch.randn(33)[1:].view(4, 8)  # 4 bytes past an aligned allocation, same shape and strides
        assert x.data_ptr() % 16
    elif change == "value":
        v = 1e-5
    elif change == "arity":
        args = (x,)
    elif change == "not_a_tensor":
        args = ([[0.0] * 8] * 4, v)
    elif change == "device":
        x = x.to("meta")
    with torch.set_grad_enabled(grad):
        assert f(*(args or (x, v))) is None
    with torch.no_grad():
        assert f(torch.randn(4, 8), 1e-6) is not None  # and the bound one still passes


def test_a_parameter_read_under_no_grad_is_part_of_the_bound_signature(ext):
    """The backend's regions read a module's parameters (requires_grad=True) under no_grad: the fast call made
    from such a call matches the same call again (before, its spec said requires_grad=False and every call
    missed: GPT-2's add_norm and layer_norm regions took the Python path on each call, 2026-12-06)."""
    x, w = torch.randn(4, 8), torch.nn.Parameter(torch.randn(8))
    specs = fastcall._arg_specs((x, w), full=False)
    assert specs[1][1][3] is True and specs[0][1][3] is False
    f = _fast(ext, specs, [0, 1], ((4, 8), (8, 1), torch.float32))
    with torch.no_grad():
        assert f(x, w) is not None and f(torch.randn(4, 8), w) is not None
        assert f(x, w.detach()) is None  # another signature: a tensor that does not require grad
        assert f(w.detach().expand(4, 8).contiguous().requires_grad_(), w) is None  # nor the other way round
    assert f(x, w) is None  # grad mode on: the signature was bound under no_grad


def test_make_refuses_an_argument_requiring_grad_with_grad_mode_on(monkeypatch):
    monkeypatch.setenv("FORGE_FASTCALL", "1")
    monkeypatch.setattr(fastcall, "_ready_module", lambda args: pytest.fail("the refusal comes first"))
    w = torch.nn.Parameter(torch.randn(8))
    with pytest.raises(fastcall.Unsupported, match="requires grad with grad mode on"):
        fastcall.make(SimpleNamespace(launches=[]), (w,), [0], torch.empty(8), grad=True)


def test_autocast_on_is_a_miss(ext):
    f = _fast(ext, [_t((4, 8), (8, 1))], [0], ((4, 8), (8, 1), torch.float32))
    x = torch.randn(4, 8)
    with torch.no_grad():
        assert f(x) is not None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert f(x) is None  # the shim binds kernels only with autocast off


def test_values_compare_by_equality_and_a_failing_comparison_is_a_miss(ext):
    class Odd:
        def __eq__(self, other):
            raise ValueError("no")

    f = _fast(ext, [_t((2,), (1,)), ("value", (1, 2))], [0], ((2,), (1,), torch.float32))
    with torch.no_grad():
        assert f(torch.randn(2), (1, 2)) is not None and f(torch.randn(2), [1, 2]) is None
        assert f(torch.randn(2), Odd()) is None
    g = _fast(ext, [_t((2,), (1,)), ("value", 1)], [0], ((2,), (1,), torch.float32))
    with torch.no_grad():
        assert g(torch.randn(2), 1) is not None
        assert g(torch.randn(2), 1.0) is None and g(torch.randn(2), True) is None  # same type required
        assert g(torch.randn(2), torch.tensor(1)) is None


def test_parameters_are_packed_at_triton_widths(ext):
    rows = [(fastcall.PTR, 2, 0, 0.0), (fastcall.PTR, 0, 0, 0.0), (fastcall.I32, 0, -7, 0.0),
            (fastcall.I64, 0, 1 << 40, 0.0), (fastcall.F32, 0, 0, 1e-6), (fastcall.F64, 0, 0, 0.1),
            (fastcall.I8, 0, 1, 0.0), (fastcall.U16, 0, 65535, 0.0), (fastcall.NULLPTR, 0, 0, 0.0)]
    f = _fast(ext, [_t((2,), (1,)), _t((2,), (1,))], [0, 1], ((2,), (1,), torch.float32), rows)
    got = f.packed(0, [0x1000, 0x2000, 0x3000])
    assert got == struct.pack("<QQiqfdBHQ", 0x3000, 0x1000, -7, 1 << 40, 1e-6, 0.1, 1, 65535, 0)


def test_held_inputs_and_argument_indices_both_feed_pointer_slots(ext):
    held = torch.ones(8)
    rows = [(fastcall.PTR, 0, 0, 0.0), (fastcall.PTR, 1, 0, 0.0), (fastcall.PTR, 2, 0, 0.0)]
    f = _fast(ext, [("value", 3), _t((8,), (1,))], [1, held], ((8,), (1,), torch.float32), rows)
    with torch.no_grad():
        assert f(3, torch.randn(8)) is not None
    assert struct.unpack("<QQQ", f.packed(0, [1, 2, 3])) == (1, 2, 3)


@pytest.mark.parametrize(("bad", "needle"), [
    (lambda a: ([("bogus", 1)], [0], a[2], a[3]), "tensor' or 'value"),
    (lambda a: (a[0], [5], a[2], a[3]), "source index"),
    (lambda a: (a[0], ["x"], a[2], a[3]), "argument index or a tensor"),
    (lambda a: (a[0], [0] * 65, a[2], a[3]), "too many kernel inputs"),
    (lambda a: (a[0], a[1], a[2], [(0, 1, 1, 1, 32, 0, [(99, 0, 0, 0.0)])]), "unknown parameter kind"),
    (lambda a: (a[0], a[1], a[2], [(0, 1, 1, 1, 32, 0, [(0, 7, 0, 0.0)])]), "slot out of range"),
    (lambda a: (a[0], a[1], a[2], [(5, 1, 1, 1, 32, 0, [])]), "needs a CUDA device"),
])
def test_construction_refuses_malformed_descriptions(ext, bad, needle):
    good = ([_t((2,), (1,))], [0], ((2,), (1,), torch.float32), [])
    with pytest.raises(ValueError, match=needle):
        ext.FastCall(False, -1, *bad(good), None, None, None, None)


# --- building a description from a recorded launch -----------------------------------------------------
def _recorded(signature, args, slots, **md):
    meta = {"num_ctas": 1, "num_warps": 4, "shared": 256, "launch_cooperative_grid": False, "launch_pdl": False,
            "global_scratch_size": 0, "profile_scratch_size": 0, **md}
    ck = SimpleNamespace(src=SimpleNamespace(fn=SimpleNamespace(arg_names=list(signature)), signature=signature),
                         metadata=SimpleNamespace(**meta))
    return launch._Launch("L", (5, 1, 1), 1234, None, list(args), tuple(slots), ck)


def test_launch_params_follow_the_signature_and_end_with_the_scratch_pointers():
    sig = {"X": "*fp16", "W": "*fp16", "Y": "*fp16", "n": "i32", "eps": "fp32", "flag": "i1", "BLOCK": "constexpr",
           "opt": "*fp32"}
    ln = _recorded(sig, [None, None, None, 4096, 1e-6, True, 1024, None], [(0, 0), (1, 1), (2, 2)])
    assert fastcall.launch_params(ln) == [
        (fastcall.PTR, 0, 0, 0.0), (fastcall.PTR, 1, 0, 0.0), (fastcall.PTR, 2, 0, 0.0),
        (fastcall.I32, 0, 4096, 0.0), (fastcall.F32, 0, 0, 1e-6), (fastcall.I8, 0, 1, 0.0),
        (fastcall.NULLPTR, 0, 0, 0.0), (fastcall.NULLPTR, 0, 0, 0.0), (fastcall.NULLPTR, 0, 0, 0.0)]
    assert fastcall.launch_row(ln)[:6] == (1234, 5, 1, 1, 128, 256)


@pytest.mark.parametrize(("sig", "args", "md", "needle"), [
    ({"X": "fp16"}, [1.0], {}, "does not pack"),
    ({"X": "*fp16"}, [7], {}, "neither a tensor nor None"),
    ({"X": "i32", "Y": "i32"}, [1], {}, "1 kernel arguments for 2"),
    ({"X": "i32"}, [1], {"num_ctas": 2}, "num_ctas"),
    ({"X": "i32"}, [1], {"launch_pdl": True}, "PDL"),
    ({"X": "i32"}, [1], {"global_scratch_size": 64}, "scratch"),
])
def test_launches_the_fast_path_cannot_make_are_refused_with_a_reason(sig, args, md, needle):
    with pytest.raises(fastcall.Unsupported, match=needle):
        fastcall.launch_row(_recorded(sig, args, [], **md))


def test_policy(monkeypatch):
    import triton

    monkeypatch.setenv("FORGE_FASTCALL", "0")
    assert fastcall.policy() == "FORGE_FASTCALL=0"
    monkeypatch.setenv("FORGE_FASTCALL", "1")
    assert fastcall.policy() is None
    monkeypatch.delenv("FORGE_FASTCALL")
    verified = triton.__version__.startswith(fastcall.VERIFIED)
    assert (fastcall.policy() is None) == verified
    if not verified:
        assert "FORGE_FASTCALL=1 forces it" in fastcall.policy()


def test_a_failed_build_is_a_reason_not_an_exception(monkeypatch):
    monkeypatch.setattr(fastcall, "_state", {"module": None, "error": None, "thread": None})

    def broken():
        raise RuntimeError("Error building extension 'forge_fastcall'\nninja: build stopped: subcommand failed.")
    monkeypatch.setattr(fastcall, "_build", broken)
    assert fastcall.module(wait=True) is None
    assert "subcommand failed" in fastcall.error()
    monkeypatch.setenv("FORGE_FASTCALL", "1")
    with pytest.raises(fastcall.Unsupported, match="subcommand failed"):
        fastcall.make(SimpleNamespace(launches=[]), (), [], torch.empty(1), False)


def test_a_failing_build_process_reports_its_last_line(monkeypatch, tmp_path):
    """The compile runs in a child process (so the user's program may exit during it); its failure
    comes back as the last line it printed."""
    import sys

    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'compiling...'\necho 'fatal error: Python.h: No such file' >&2\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))
    with pytest.raises(RuntimeError, match="Python.h: No such file"):
        fastcall._build()
    fake.write_text("#!/bin/sh\nexit 4\n")
    with pytest.raises(RuntimeError, match="exited with 4"):
        fastcall._build()


def test_the_build_runs_in_the_background_and_is_asked_once(monkeypatch):
    import threading

    monkeypatch.setattr(fastcall, "_state", {"module": None, "error": None, "thread": None})
    gate, calls = threading.Event(), []

    def slow():
        calls.append(1)
        gate.wait(5)
        return "MODULE"
    monkeypatch.setattr(fastcall, "_build", slow)
    assert fastcall.module() is None and fastcall.module() is None  # building; callers go on
    gate.set()
    assert fastcall.module(wait=True) == "MODULE" and calls == [1]


# --- the shim's routing: which signature holds the fast path ----------------------------------------------
def test_shim_routes_the_bound_signature_to_the_fast_call_and_follows_a_new_one(monkeypatch):
    """With a stand-in for fastcall.make: the first plan-bound signature gets the fast call; another
    signature takes it over after _FAST_SWITCH Python-path calls; a refused one is not asked again."""
    import forge
    from forge import shim

    made = []

    class Fake:
        def __init__(self, key_shape):
            self.shape, self.calls = key_shape, 0

        def __call__(self, *args):
            if args and isinstance(args[0], torch.Tensor) and tuple(args[0].shape) == self.shape:
                self.calls += 1
                return "FAST"
            return None

    def fake_make(plan, args, sources, out, grad):
        assert sources == [0] and grad is torch.is_grad_enabled()
        made.append(Fake(tuple(args[0].shape)))
        return made[-1]

    monkeypatch.setattr(fastcall, "make", fake_make)

    def f(x):
        return torch.softmax(x, dim=-1)

    opt = forge.optimize(f, search=False, warn=False)

    class Binding:
        plan, fast, slots = object(), None, [(0, None)]

        def __call__(self, tensors, root=None):
            return "PY"

    def bind(key, args, kwargs, allow_search):
        hit = (Binding(), None)
        opt._bound[key] = hit
        return hit
    monkeypatch.setattr(opt, "_bind", bind)
    a, b = torch.randn(2, 8), torch.randn(1, 8)
    assert opt(a) == "PY" and len(made) == 1  # first call: Python path, then the fast call is made
    assert opt(a) == "FAST" and opt(a) == "FAST"
    for _ in range(shim._FAST_SWITCH - 1):
        assert opt(b) == "PY"
    assert len(made) == 1
    assert opt(b) == "PY" and len(made) == 2  # the new signature took it over
    assert opt(b) == "FAST" and opt(a) == "PY"

    def refuse(*a):
        raise fastcall.Unsupported("no")
    monkeypatch.setattr(fastcall, "make", refuse)
    c = torch.randn(3, 8)
    for _ in range(2 * shim._FAST_SWITCH):
        assert opt(c) == "PY"
    binding = opt._bound[next(k for k in opt._bound if k[2][0] == (3, 8))][0]
    assert binding.fast == "off" and binding.fast_reason == "no"


# --- signatures decided eager: the C++ check, then the user's function ----------------------------------
def _eager_spec(t):
    return ("tensor", (tuple(t.shape), tuple(t.stride()), t.dtype, t.requires_grad, t.data_ptr() % 16 == 0,
                       t.is_cuda, t.get_device()))


def test_eager_call_runs_the_function_once_and_wraps_even_none(ext):
    calls = []

    def fn(x, scale):
        calls.append(scale)
        return None if scale == 0 else x * scale

    x = torch.randn(4, 8)
    e = ext.EagerCall(True, False, [_eager_spec(x), ("value", 2)], fn)
    (y,) = e(x, 2)
    assert torch.equal(y, x * 2) and calls == [2]
    none = ext.EagerCall(True, False, [_eager_spec(x), ("value", 0)], fn)
    assert none(x, 0) == (None,) and calls == [2, 0]  # a None result is a hit, not a miss
    assert e(x, 3) is None and calls == [2, 0]  # a miss never runs the function


@pytest.mark.parametrize("change", ["requires_grad", "misaligned", "grad_mode", "autocast", "device"])
def test_eager_call_checks_what_the_python_key_holds(ext, change):
    x = torch.randn(4, 8)
    e = ext.EagerCall(True, False, [_eager_spec(x)], lambda t: t)
    assert e(x) is not None
    y, grad = torch.randn(4, 8), True
    if change == "requires_grad":
        y.requires_grad_(True)
    elif change == "misaligned":
        y = torch.randn(33)[1:].view(4, 8)
    elif change == "grad_mode":
        grad = False
    elif change == "device":
        y = y.to("meta")
    with torch.set_grad_enabled(grad), torch.autocast("cpu", enabled=change == "autocast"):
        assert e(y) is None
    # the other way round: a signature bound with grad required and autocast on matches only that
    z = torch.randn(4, 8, requires_grad=True)
    both = ext.EagerCall(True, True, [_eager_spec(z)], lambda t: t)
    with torch.autocast("cpu"):
        assert both(z) is not None and both(z.detach()) is None
    assert both(z) is None


def test_eager_call_lets_the_functions_exception_through(ext):
    def boom(x):
        raise KeyError("from the user's code")

    x = torch.randn(2)
    with pytest.raises(KeyError, match="from the user's code"):
        ext.EagerCall(True, False, [_eager_spec(x)], boom)(x)


def test_make_eager_is_for_cuda_tensors_only(monkeypatch):
    with pytest.raises(fastcall.Unsupported, match="on CUDA"):
        fastcall.make_eager(lambda t: t, (torch.randn(2),), True, False)
    monkeypatch.setenv("FORGE_FASTCALL", "0")
    with pytest.raises(fastcall.Unsupported, match="FORGE_FASTCALL=0"):
        fastcall.make_eager(lambda t: t, (torch.randn(2),), True, False)


def test_shim_serves_an_eager_signature_through_the_eager_call_once_per_call(monkeypatch):
    """A signature decided eager gets an EagerCall (stand-in here): each call runs the function once,
    also when it returns None; a refused signature is remembered and not asked again."""
    import forge

    runs = []

    def f(x):
        runs.append(1)
        return None

    made = []

    def fake_make_eager(fn, args, grad, autocast):
        assert fn is f and grad is torch.is_grad_enabled() and autocast is False
        shape = tuple(args[0].shape)
        made.append(shape)
        return lambda *a: (fn(*a),) if tuple(a[0].shape) == shape else None

    monkeypatch.setattr(fastcall, "make_eager", fake_make_eager)
    opt = forge.optimize(f, search=False, warn=False)
    x = torch.randn(2, 8)
    assert opt(x) is None  # the first call traces (fx runs the body once) and runs f
    base = len(runs)
    for n in range(1, 4):
        assert opt(x) is None and len(runs) == base + n  # once per call, through the eager call
    assert made == [(2, 8)] and opt._fast[1] is True

    def refuse(*a):
        raise fastcall.Unsupported("not every tensor argument is on CUDA")
    monkeypatch.setattr(fastcall, "make_eager", refuse)
    monkeypatch.setattr(opt, "_fast", None)
    y = torch.randn(3, 8)
    assert opt(y) is None
    base = len(runs)
    assert opt(y) is None and opt(y) is None and len(runs) == base + 2
    assert list(opt._fast_off.values()) == ["not every tensor argument is on CUDA"]


def test_backend_region_calls_take_the_fast_call_once_the_plan_exists(monkeypatch):
    """forge/backend.py _RegionCall: the first plan-path call makes the fast call (sources from the
    binding's slots, held tensors included; the grad mode of that call); later calls go through it; a call
    it refuses (None) takes the guarded Python path; a refusal is not asked again; a torch op's region gets the
    C++ signature check (EagerCall) in front of its call."""
    from forge import backend, shim

    made = []

    class Fake:
        def __init__(self, shape):
            self.shape, self.calls = shape, 0

        def __call__(self, *leaves):
            if tuple(leaves[0].shape) == self.shape:
                self.calls += 1
                return torch.full(self.shape, 7.0)
            return None

    held = torch.ones(8)

    def fake_make(plan, args, sources, out, grad):
        assert sources == [0, held] and grad is torch.is_grad_enabled() and out.shape == (2, 8)
        if plan == "building":
            return None
        made.append(Fake(tuple(args[0].shape)))
        return made[-1]

    monkeypatch.setattr(fastcall, "make", fake_make)

    class Binding:
        plan, getters, slots = None, (), [(0, None), (None, held)]

        def __call__(self, tensors, root=None):
            return tensors[0] * 2

    x = torch.randn(2, 8)
    b = Binding()
    call = backend._RegionCall(b, [x], lambda t: t + 100, x * 2)
    assert torch.equal(call(x), x * 2) and call.fast is None  # no plan yet (the JIT path records it)
    b.plan = "building"
    assert torch.equal(call(x), x * 2) and call.fast is None and call.fast_reason is None  # asked again later
    b.plan = "compiled"
    assert torch.equal(call(x), x * 2) and len(made) == 1  # made after this plan-path call
    assert torch.equal(call(x), torch.full((2, 8), 7.0)) and made[0].calls == 1
    y = torch.randn(3, 8)  # another signature: the fast call refuses, the guard sends it to the region's nodes
    assert torch.equal(call(y), y + 100) and call.fallbacks == 1 and len(made) == 1
    assert call.calls == 5

    def refuse(*a):
        raise fastcall.Unsupported("no")
    monkeypatch.setattr(fastcall, "make", refuse)
    other = backend._RegionCall(b, [x], lambda t: t, x * 2)
    other(x)
    assert other.fast is None and other.fast_reason == "no"
    monkeypatch.setattr(fastcall, "make", lambda *a: pytest.fail("asked again"))
    other(x)

    # a torch op's region: the C++ check alone (EagerCall, a 1-tuple of the op's result), made after its first
    # call with that call's grad mode and autocast state
    eager_made = []

    def fake_make_eager(fn, args, grad, autocast):
        assert grad is torch.is_grad_enabled() and autocast is False and len(args) == 1
        eager_made.append(fn)
        return lambda *leaves: (fn(*leaves),) if tuple(leaves[0].shape) == (2, 8) else None
    monkeypatch.setattr(fastcall, "make_eager", fake_make_eager)
    fused = SimpleNamespace(fn=lambda inputs, attrs: inputs[0] * 3, label="torch.op")
    torch_call = backend._RegionCall(shim._TorchCall(fused, None, [0], (None,), {}), [x], lambda t: t + 100, x * 3)
    assert torch.equal(torch_call(x), x * 3) and len(eager_made) == 1 and torch_call.fast_eager
    assert torch.equal(torch_call(x), x * 3) and len(eager_made) == 1  # through the check: unwrapped
    assert torch.equal(torch_call(y), y + 100)  # another signature: refused there, the guard falls back
    assert torch_call.calls == 3 and torch_call.fallbacks == 1

    def cpu_only(*a):
        raise fastcall.Unsupported("not every tensor argument is on CUDA")
    monkeypatch.setattr(fastcall, "make_eager", cpu_only)
    cpu_call = backend._RegionCall(shim._TorchCall(fused, None, [0], (None,), {}), [x], lambda t: t, x * 3)
    cpu_call(x)
    assert cpu_call.fast is None and cpu_call.fast_reason == "not every tensor argument is on CUDA"
