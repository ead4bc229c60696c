"""forge/launch.py: the compiled launch path's detection and replay, without a GPU (fake launchers),
plus the installed triton's launcher layout (run on both triton versions by `make test-triton36`).
The real CUDA path is exercised in tests/test_gpu.py."""

from __future__ import annotations

import inspect

import pytest
import torch

from forge import launch


class FakeCK:
    function = object()
    packed_metadata = object()


def _call(ck, stream, *kernel_args, meta=None, enter=None, exit_=None):
    return (3, 1, 1, stream, ck.function, ck.packed_metadata, meta, enter, exit_, *kernel_args)


def test_installed_triton_launches_the_way_forge_records():
    """If a triton release changes how JITFunction.run calls the launcher, this fails in CI first;
    at run time the recorder refuses the plan instead (next tests), so users only lose speed."""
    from triton.runtime.jit import JITFunction

    ck_cls = launch._compiled_kernel_class()
    assert isinstance(ck_cls.__dict__["run"], property)
    src = inspect.getsource(JITFunction.run)
    assert ("kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata, "
            "launch_metadata,") in " ".join(src.split())


def test_check_call_maps_tensor_arguments_to_inputs_and_output():
    x, w, out = torch.randn(4, 8), torch.randn(8), torch.empty(4, 8)
    ck = FakeCK()
    rec = launch.check_call(ck, "L", _call(ck, 7, x.view(-1, 8), w, out, 8, 1e-6, None), (x, w, out), 7)
    assert rec.grid == (3, 1, 1) and rec.launcher == "L"
    assert rec.args == [None, None, None, 8, 1e-6, None]
    assert rec.slots == ((0, 0), (1, 1), (2, 2))


@pytest.mark.parametrize(("mutate", "needle"), [
    (lambda ck, a: a[:5], "expected at least 9"),
    (lambda ck, a: (*a[:4], object(), *a[5:]), "not laid out"),
    (lambda ck, a: (*a[:3], 99, *a[4:]), "not the current stream"),
    (lambda ck, a: (*a[:7], print, *a[8:]), "launch hooks"),
    (lambda ck, a: (*a[:9], torch.empty(3), *a[10:]), "neither an input nor the output"),
    (lambda ck, a: (*a[:9], [1, 2], *a[10:]), "not a tensor, a tensor descriptor or a scalar"),
    (lambda ck, a: (2.5, *a[1:]), "grid is not three ints"),
])
def test_check_call_refuses_what_it_cannot_replay(mutate, needle):
    x, out = torch.randn(4, 8), torch.empty(4, 8)
    ck = FakeCK()
    with pytest.raises(launch.Refused, match=needle):
        launch.check_call(ck, "L", mutate(ck, _call(ck, 7, x, out, 8)), (x, out), 7)


def test_check_call_refuses_aliased_inputs():
    x = torch.randn(4, 8)
    ck = FakeCK()
    with pytest.raises(launch.Refused, match="share memory"):
        launch.check_call(ck, "L", _call(ck, 7, x, x, 8), (x, x), 7)


def test_plan_replays_with_new_tensors_on_the_current_stream():
    x, w, out = torch.randn(4, 8), torch.randn(8), torch.empty(4, 8)
    ck = FakeCK()
    seen = []
    rec = launch.check_call(ck, lambda *a: seen.append(a), _call(ck, 7, x, w, out, 8), (x, w, out), 7)
    plan = launch.Plan([rec, rec], device_index=0)
    plan._stream = lambda dev: 11
    x2, w2, out2 = torch.randn(4, 8), torch.randn(8), torch.empty(4, 8)
    plan((x2, w2, out2))
    assert len(seen) == 2
    a = seen[0]
    assert a[:9] == (3, 1, 1, 11, ck.function, ck.packed_metadata, None, None, None)
    # pointers go as ints (the C launcher then skips data_ptr() and cuPointerGetAttribute)
    assert a[9:] == (x2.data_ptr(), w2.data_ptr(), out2.data_ptr(), 8)
    assert plan.via == "launcher object"


def test_tensor_descriptor_arguments_are_replayed_around_the_new_tensors():
    """A host-side TensorDescriptor (the persistent GEMM variants') over an input or the output is recorded as a
    slot; a replay passes a copy of it around the new call's tensor, every other field as recorded, and the
    plan keeps no reference to the recording's tensors."""
    import gc
    import weakref

    from triton.tools.tensor_descriptor import TensorDescriptor

    x, w, out = torch.randn(2, 16, 32), torch.randn(64, 32), torch.empty(2, 16, 64)
    ck = FakeCK()
    xd = TensorDescriptor(x, [32, 32], [32, 1], [16, 16])  # x's rows as one (M, K) matrix, as linear's launch()
    od = TensorDescriptor(out, [32, 64], [64, 1], [16, 32], padding="nan")
    rec = launch.check_call(ck, "L", _call(ck, 7, xd, w, od, 32), (x, w, out), 7)
    assert rec.args == [None, None, None, 32] and rec.slots == ((1, 1),)
    assert [(pos, idx) for pos, idx, _ in rec.descs] == [(0, 0), (2, 2)]
    seen = []
    rec.launcher = lambda *a: seen.append(a)
    plan = launch.Plan([rec], device_index=0, direct=False)
    plan._stream = lambda dev: 11
    ref = weakref.ref(x)
    del xd, od, x
    gc.collect()
    assert ref() is None  # the recorded descriptor's base is not held by the plan
    x2, w2, out2 = torch.randn(2, 16, 32), torch.randn(64, 32), torch.empty(2, 16, 64)
    plan((x2, w2, out2))
    (a,) = seen
    d0, d2 = a[9], a[11]
    assert type(d0) is TensorDescriptor and d0.base is x2 and d2.base is out2
    assert (d0.shape, d0.strides, d0.block_shape, d0.padding) == ([32, 32], [32, 1], [16, 16], "zero")
    assert (d2.shape, d2.strides, d2.block_shape, d2.padding) == ([32, 64], [64, 1], [16, 32], "nan")
    assert a[10] == w2.data_ptr() and a[12] == 32
    plan((x2, w2, out2))
    assert seen[1][9] is not d0  # a fresh descriptor per call: nothing shared between calls


def test_a_descriptor_over_a_foreign_tensor_is_refused():
    from triton.tools.tensor_descriptor import TensorDescriptor

    x, out = torch.randn(4, 8), torch.empty(4, 8)
    ck = FakeCK()
    foreign = TensorDescriptor(torch.randn(4, 8), [4, 8], [8, 1], [4, 8])
    with pytest.raises(launch.Refused, match="descriptor over a tensor that is neither an input nor the output"):
        launch.check_call(ck, "L", _call(ck, 7, foreign, out, 8), (x, out), 7)


def test_plan_is_not_used_under_launch_hooks_or_another_device(monkeypatch):
    from triton import knobs

    plan = launch.Plan([], device_index=0)
    plan._current_device = lambda: 0
    assert plan.usable()
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *a: None)
    assert not plan.usable()
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", None)
    assert plan.usable()
    plan._current_device = lambda: 1
    assert not plan.usable()


def test_hook_chains_count_as_inactive_only_when_empty():
    from triton import knobs

    chain = type(knobs.runtime.launch_enter_hook)()  # HookChain on triton 3.6+
    assert launch.hook_inactive(None) and launch.hook_inactive(chain)
    chain.add(print)
    assert not launch.hook_inactive(chain) and not launch.hook_inactive(print)


def test_same_bits():
    a = torch.tensor([1.0, float("nan"), 0.0])
    assert launch.same_bits(a, a.clone())
    assert not launch.same_bits(a, torch.tensor([1.0, float("nan"), -0.0]))
    assert not launch.same_bits(a, a.double())
    assert launch.same_bits(torch.tensor(3), torch.tensor(3))


# --- direct C launch: the wrapper's forwarding, reproduced --------------------------------------------
# Stand-ins for Triton's CudaLauncher of 3.6 ("args") and 3.9 ("tuple"): the same forwarding calls,
# recording what reaches the C function. The direct plan must hand the C function exactly what the
# wrapper would.

class Launcher36:
    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid, launch_pdl = False, True

    def __init__(self):
        self.seen = []
        self.launch = lambda *a: self.seen.append(a)

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        global_scratch = profile_scratch = None
        self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl,
                    global_scratch, profile_scratch, *args)


class Launcher39:
    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid, launch_pdl = True, False
    gsan_enabled = False
    arg_annotations, kernel_signature = ("ann",), b"sig"

    def __init__(self):
        self.seen = []
        self.launch = lambda *a: self.seen.append(a)

    def __call__(self, gridX, gridY, gridZ, stream, function, kernel_metadata, launch_metadata,
                 launch_enter_hook, launch_exit_hook, *args):
        global_scratch = profile_scratch = None
        kernel_args = args
        self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl,
                    kernel_metadata, launch_metadata, launch_enter_hook, launch_exit_hook, global_scratch,
                    profile_scratch, self.arg_annotations, self.kernel_signature, kernel_args)


@pytest.mark.parametrize(("cls", "layout"), [(Launcher36, "args"), (Launcher39, "tuple")])
def test_direct_plan_hands_the_c_function_what_the_wrapper_would(cls, layout):
    x, w, out = torch.randn(4, 8), torch.randn(8), torch.empty(4, 8)
    ck = FakeCK()
    lc = cls()
    assert launch.c_layout(lc) == layout
    rec = launch.check_call(ck, lc, _call(ck, 7, x, w, out, 8, 1e-6, None), (x, w, out), 7)
    direct = launch.Plan([rec, rec], device_index=0)
    wrapped = launch.Plan([rec], device_index=0, direct=False)
    assert direct.via == "C launch function" and wrapped.via == "launcher object"
    for plan in (direct, wrapped):
        plan._stream = lambda dev: 11
    x2, w2, out2 = torch.randn(4, 8), torch.randn(8), torch.empty(4, 8)
    direct((x2, w2, out2))
    assert len(lc.seen) == 2 and lc.seen[0] == lc.seen[1]
    wrapped((x2, w2, out2))
    assert len(lc.seen) == 3 and lc.seen[2] == lc.seen[0]
    ptrs = (x2.data_ptr(), w2.data_ptr(), out2.data_ptr(), 8, 1e-6, None)
    assert ptrs in (lc.seen[0][-6:], lc.seen[0][-1])  # spread (3.6) or one tuple (3.9)


@pytest.mark.parametrize("change", ["scratch", "profile", "gsan", "no_launch", "unknown_wrapper"])
def test_launchers_that_are_not_known_layouts_are_called_through_the_wrapper(change):
    lc = Launcher39()
    if change == "scratch":
        lc.global_scratch_size = 128
    elif change == "profile":
        lc.profile_scratch_size = 64
    elif change == "gsan":
        lc.gsan_enabled = True
    elif change == "no_launch":
        lc.launch = None
    else:
        class Other(Launcher39):
            def __call__(self, *a):  # forwards in an order forge has not read
                self.launch(*reversed(a))
        lc = Other()
    assert launch.c_layout(lc) is None
    ck = FakeCK()
    x, out = torch.randn(4, 8), torch.empty(4, 8)
    rec = launch.check_call(ck, lc, _call(ck, 7, x, out, 8), (x, out), 7)
    assert launch.Plan([rec], device_index=0).via == "launcher object"


def test_installed_triton_has_a_known_launcher_layout():
    """triton 3.6 forwards *args, 3.9 packs a tuple; a release that changes the forwarding fails here in CI
    first (at run time the wrapper is called instead, so users only lose the saving)."""
    import triton
    from triton.backends.nvidia.driver import CudaLauncher

    expected = "args" if triton.__version__.startswith("3.6") else "tuple"
    assert launch.wrapper_layout(CudaLauncher) == expected


def test_build_falls_back_to_the_wrapper_when_the_direct_replay_fails(monkeypatch):
    """A C function that rejects the direct arguments (TypeError) or computes something else: the
    launcher objects are replayed; both failing refuses the plan with both reasons."""
    x, out = torch.randn(4, 8), torch.empty(4, 8)
    ck = FakeCK()

    class Picky(Launcher36):
        def __init__(self, direct_ok: bool, wrapper_ok: bool):
            super().__init__()
            self.direct_ok, self.wrapper_ok, self.via_wrapper = direct_ok, wrapper_ok, False

            def c_launch(*a):
                ok = self.wrapper_ok if self.via_wrapper else self.direct_ok
                if not ok:
                    raise TypeError("function takes exactly 13 arguments")
                # the "kernel": doubles its input, or triples it when the direct arguments mislead it
                self.dst.copy_(self.src * (2 if self.via_wrapper or self.direct_ok != "wrong" else 3))
            self.launch = c_launch

        def __call__(self, gridX, gridY, gridZ, stream, function, *args):  # Launcher36's, noting the caller
            self.via_wrapper = True
            global_scratch = profile_scratch = None
            self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl,
                        global_scratch, profile_scratch, *args)
            self.via_wrapper = False

    def run_case(direct_ok, wrapper_ok):
        lc = Picky(direct_ok, wrapper_ok)
        rec = launch.check_call(ck, lc, _call(ck, 7, x, out, 8), (x, out), 7)
        monkeypatch.setattr(launch, "record", lambda run_once, inputs, o, dev: (run_once(o), [rec])[1])
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
        monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 7, raising=False)
        first = x * 2
        outs = []

        def alloc():
            outs.append(torch.zeros(4, 8))
            lc.dst, lc.src = outs[-1], x
            return outs[-1]
        return launch.build(lambda o: o.copy_(x * 2), alloc, (x,), first, 0)

    assert run_case(True, True).via == "C launch function"
    assert run_case(False, True).via == "launcher object"
    assert run_case("wrong", True).via == "launcher object"
    with pytest.raises(launch.Refused, match="C launch function: function takes.*launcher object: function takes"):
        run_case(False, False)
