"""Backend(cudagraphs=True): each captured graph replayed whole from a CUDA graph (forge/cudagraph.py).

CPU tier: the replay rule with a fake capture that behaves as a CUDA graph does (the launches recorded once,
each replay recomputing into the same output buffers from the same input buffers); the GPU tier runs the
real capture (tests/test_gpu.py)."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx

from forge import backend as fb
from forge.cudagraph import GraphedRun, mutated_inputs
from forge.errors import UsageError


def fake_capture(fn, args, device_index):
    fn(*args)
    fn(*args)  # the warm-up runs, as the real capture's
    out = fn(*args)
    outs = out if isinstance(out, (tuple, list)) else (out,)

    def replay():
        res = fn(*args)
        for o, r in zip(outs, res if isinstance(res, (tuple, list)) else (res,), strict=True):
            o.copy_(r)

    return replay, out


def model(x, w, b, scale):
    return (torch.relu(x @ w + b) * scale, x.sum())


def graphed(run=model, mutated=(), first=None, capture=fake_capture):
    return GraphedRun(run, set(mutated), capture=capture, first_args=first, require_cuda=False)


def _args(seed, w, b, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, 8, generator=g), w, b, scale


def test_replays_copy_moving_inputs_read_pinned_ones_in_place_and_return_copies():
    w, b = torch.randn(8, 3), torch.randn(3)
    run = graphed(first=_args(0, w, b))
    outs = []
    for seed in range(1, 6):
        a = _args(seed, w, b)
        got = run(*a)
        want = model(*a)
        assert all(torch.equal(g, e) for g, e in zip(got, want, strict=True)), seed
        outs.append((got, want))
    assert (run.captures, run.replays, run.calls) == (1, 5, 5), run.describe()
    # call 1 was the planning call (first_args): call 2 of the graph captured, every later call replayed
    assert all(torch.equal(g[0], e[0]) for g, e in outs)  # earlier outputs were not overwritten by later replays
    w.add_(1.0)  # a pinned input changed in place (same storage): the graph reads it in place
    a = _args(9, w, b)
    assert torch.equal(run(*a)[0], model(*a)[0]) and run.replays == 6


def test_a_pinned_input_that_moves_runs_without_the_graph_then_captures_again():
    w, b = torch.randn(8, 3), torch.randn(3)
    run = graphed(first=_args(0, w, b))
    run(*_args(1, w, b))
    w2 = w.clone() + 1  # another storage
    a = _args(2, w2, b)
    assert torch.equal(run(*a)[0], model(*a)[0])
    assert run.moved == 1 and run.captures == 1
    for seed in (3, 4):
        a = _args(seed, w2, b)
        assert torch.equal(run(*a)[0], model(*a)[0])
    assert run.captures == 2 and "1 run without it" in run.describe()


def test_a_changed_non_tensor_input_is_not_replayed():
    w, b = torch.randn(8, 3), torch.randn(3)
    run = graphed(first=_args(0, w, b))
    run(*_args(1, w, b))
    a = _args(2, w, b, scale=3.0)
    assert torch.equal(run(*a)[0], model(*a)[0]) and run.moved == 1


def test_capture_failure_and_in_place_writes_are_reasons_not_errors():
    def broken(fn, args, device_index):
        raise RuntimeError("operation not permitted when stream is capturing\nmore")

    w, b = torch.randn(8, 3), torch.randn(3)
    run = graphed(first=_args(0, w, b), capture=broken)
    for seed in (1, 2, 3):
        a = _args(seed, w, b)
        assert torch.equal(run(*a)[0], model(*a)[0])
    assert run.replays == 0 and "capture failed: operation not permitted" in run.describe()
    run = graphed(mutated={1}, first=_args(0, w, b))
    a = _args(1, w, b)
    assert torch.equal(run(*a)[0], model(*a)[0]) and "writes in place" in run.describe() and run.captures == 0


def test_cpu_inputs_are_never_captured_with_the_real_capture():
    w, b = torch.randn(8, 3), torch.randn(3)
    run = GraphedRun(model, set(), first_args=_args(0, w, b))
    a = _args(1, w, b)
    assert torch.equal(run(*a)[0], model(*a)[0]) and run.describe() == "not replayed: a CPU tensor input"


def test_mutated_inputs_finds_writes_through_views_setitem_and_out():
    def f(x, y, z, u, v, t):
        x.add_(1)
        y.view(-1)[0] = 3.0
        torch.mul(z, 2, out=u)
        t += v
        return x + v

    got = []

    def capture(gm, example_inputs):
        got.append(gm)
        return gm.forward

    torch._dynamo.reset()
    try:  # the graph TorchDynamo hands a backend (setitem is operator.setitem there)
        torch.compile(f, backend=capture, fullgraph=True)(*(torch.zeros(4) for _ in range(6)))
    finally:
        torch._dynamo.reset()
    (gm,) = got
    assert any(n.target is operator.setitem for n in gm.graph.nodes)
    # placeholders in the order Dynamo lifts them (x, y, z, u, t, v): t, written by +=, is placeholder 4
    assert [n.name for n in gm.graph.nodes if n.op == "placeholder"][4] == "l_t_"
    assert mutated_inputs(gm) == {0, 1, 3, 4}
    assert mutated_inputs(fx.symbolic_trace(lambda x, y: (x * 2, y.sum()))) == set()


def test_backend_option_is_checked_and_cpu_graphs_are_left_alone():
    with pytest.raises(UsageError, match="cudagraphs"):
        fb.Backend(cudagraphs="yes")
    be = fb.Backend(miss="eager", cudagraphs=True)
    torch._dynamo.reset()
    try:
        f = torch.compile(lambda x: torch.softmax(x, -1) * 2, backend=be, dynamic=False)
        x = torch.randn(3, 5)
        f(x)
        assert torch.equal(f(x), torch.softmax(x, -1) * 2)
    finally:
        torch._dynamo.reset()
    assert be.graphed == [] and be.explain().cudagraphs == ()
