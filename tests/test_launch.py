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
    (lambda ck, a: (*a[:9], [1, 2], *a[10:]), "not a tensor or a scalar"),
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
    assert a[9] is x2 and a[10] is w2 and a[11] is out2 and a[12] == 8


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
