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
            if isinstance(o, torch.Tensor):  # a graph's outputs may hold None (split_tail's head)
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


class FakeClock:
    """latency(thunk) for GraphedRun(auto=True): runs the thunk and reports the next scripted seconds, for a
    replay where the thunk replayed the fake graph (capture() wraps its replay to say so), else for a call as
    captured."""

    def __init__(self, run_s, replay_s):
        self.run_s, self.replay_s = list(run_s), list(replay_s)
        self.in_replay = False

    def capture(self, fn, args, device_index):
        replay, out = fake_capture(fn, args, device_index)

        def flagged():
            self.in_replay = True
            replay()
        return flagged, out

    def __call__(self, thunk):
        self.in_replay = False
        out = thunk()
        return out, (self.replay_s if self.in_replay else self.run_s).pop(0)


def auto_run(clock, w, b, held=(0, 100), reserved=None):
    seq = iter([held, *([(held[0] + 1, held[1])] * 99)]) if reserved is None else iter(reserved)
    return GraphedRun(model, set(), capture=clock.capture, first_args=_args(0, w, b), require_cuda=False,
                      auto=True, latency=clock, reserved=lambda: next(seq))


def test_auto_times_the_calls_then_the_replays_and_keeps_a_graph_that_pays():
    from forge import cudagraph as cg

    w, b = torch.randn(8, 3), torch.randn(3)
    n = cg.AUTO_SAMPLES
    clock = FakeClock(run_s=[2.5e-3, 2.4e-3, 2.6e-3][:n], replay_s=[1.9e-3, 1.8e-3, 2.0e-3][:n])
    run = auto_run(clock, w, b)
    for seed in range(1, 2 * n + 4):
        a = _args(seed, w, b)
        assert all(torch.equal(g, e) for g, e in zip(run(*a), model(*a), strict=True)), seed
    # the graph's calls 2..n+1 (seeds 1..n) ran as captured and timed, the next captured and replayed once
    # (untimed), the n after it were timed replays, then the verdict: every later call replays
    assert run.captures == 1 and len(run.run_s) == n and len(run.replay_s) == n and run.reason is None
    assert run.replays == (2 * n + 3) - n and not clock.run_s and not clock.replay_s
    assert "auto: kept, best replay 1.800 ms per call, best run as captured 2.400 ms" in run.describe()


def test_auto_releases_a_graph_whose_replays_are_not_faster_and_runs_as_captured_after():
    from forge import cudagraph as cg

    w, b = torch.randn(8, 3), torch.randn(3)
    n = cg.AUTO_SAMPLES
    # best replay 1.96 ms against best run 2.00: 0.98x, inside the 0.97 margin: not worth the graph
    clock = FakeClock(run_s=[2.0e-3] * n, replay_s=[1.96e-3] * n)
    run = auto_run(clock, w, b)
    for seed in range(1, 2 * n + 6):
        a = _args(seed, w, b)
        assert all(torch.equal(g, e) for g, e in zip(run(*a), model(*a), strict=True)), seed
    # the capture's own replay and the n timed ones; none after the verdict
    assert run.captures == 1 and run.replays == n + 1 and run._replay is None and run._static == []
    assert run.describe().startswith("not replayed: auto: released, not 1.03x faster: best replay 1.960 ms")


def test_auto_releases_a_graph_whose_pool_is_too_large():
    from forge import cudagraph as cg

    w, b = torch.randn(8, 3), torch.randn(3)
    clock = FakeClock(run_s=[5e-3] * cg.AUTO_SAMPLES, replay_s=[])
    total = 1000 * 2**20
    grown = int(cg.AUTO_MAX_POOL_SHARE * total) + 2**20  # just over the share
    run = auto_run(clock, w, b, reserved=[(0, total), (grown, total)])
    for seed in range(1, cg.AUTO_SAMPLES + 4):
        a = _args(seed, w, b)
        assert torch.equal(run(*a)[0], model(*a)[0]), seed
    assert run.captures == 1 and run.replays == 0 and run._replay is None
    assert "auto: released, its capture holds 101 MiB, more than 10% of the device's memory" in run.describe()


def test_auto_copies_an_input_that_moved_during_the_timed_calls():
    """An input that moved on a timed call and came back by the capture is still copied on every replay."""
    from forge import cudagraph as cg

    w, b = torch.randn(8, 3), torch.randn(3)
    n = cg.AUTO_SAMPLES
    clock = FakeClock(run_s=[2e-3] * n, replay_s=[1e-3] * n)
    run = auto_run(clock, w, b)
    w2 = w.clone()
    run(*_args(1, w2, b))  # w moved on the first timed call
    for seed in range(2, 2 * n + 3):
        a = _args(seed, w, b)
        assert torch.equal(run(*a)[0], model(*a)[0]), seed
    assert run.captures == 1 and 1 in run._moving
    w.add_(1.0)  # copied, not read in place: the replay sees the new values through the copy
    a = _args(50, w, b)
    assert torch.equal(run(*a)[0], model(*a)[0])


def _lm(x, w_head, w):
    """A tiny "model": hidden states, then a last GEMM (the logits) as its largest output."""
    h = torch.relu(x @ w)
    return (h.sum(), torch.nn.functional.linear(h, w_head), h * 2)


def test_split_tail_runs_the_last_gemm_after_the_graph_on_its_static_inputs():
    from forge.cudagraph import split_tail

    gm = fx.symbolic_trace(_lm)
    x, wh, w = torch.randn(4, 8), torch.randn(16, 8), torch.randn(8, 8)
    outs = gm(x, wh, w)
    tail = split_tail(gm, outs, is_region=lambda t: False, min_bytes=4 * 16 * 4)  # the logits: 256 bytes
    assert tail is not None
    head, finish, no_clone = tail
    raw = head(x, wh, w)
    # the head returns None for the logits, then the GEMM's two argument nodes (h and w_head)
    assert raw[1] is None and len(raw) == 5 and no_clone == {3, 4} and finish.taken == [1]
    assert raw[4] is wh and torch.equal(raw[3], torch.relu(x @ w))
    got = finish(raw)
    assert len(got) == 3 and all(torch.equal(a, b) for a, b in zip(got, _lm(x, wh, w), strict=True))
    assert not any(n.target is torch.nn.functional.linear for n in head.graph.nodes)
    # an output under the size limit, or one something else reads too, stays in the graph
    assert split_tail(gm, outs, is_region=lambda t: False, min_bytes=4 * 16 * 4 + 1) is None

    def reads_logits(x, wh, w):
        y = torch.nn.functional.linear(torch.relu(x @ w), wh)
        return (y, y.sum())
    g2 = fx.symbolic_trace(reads_logits)
    assert split_tail(g2, g2(x, wh, w), is_region=lambda t: False, min_bytes=1) is None


def test_split_tail_takes_forge_region_calls_and_keeps_literal_arguments():
    from forge.cudagraph import split_tail

    class Region:  # stands for the backend's _RegionCall
        __name__ = "forge_linear"

        def __call__(self, h, w, scale):
            return torch.nn.functional.linear(h, w) * scale

    region = Region()
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    h = g.call_function(torch.relu, (x,))
    y = g.call_function(region, (h, w, 0.5))
    g.output((y,))
    gm = fx.GraphModule(torch.nn.Module(), g)
    xv, wv = torch.randn(4, 8), torch.randn(16, 8)
    assert split_tail(gm, gm(xv, wv), is_region=lambda t: False, min_bytes=1) is None  # not a region: stays
    head, finish, no_clone = split_tail(gm, gm(xv, wv), is_region=lambda t: t is region, min_bytes=1)
    assert torch.equal(finish(head(xv, wv))[0], region(torch.relu(xv), wv, 0.5)) and no_clone == {1, 2}


def test_no_clone_outputs_are_the_replays_buffers_and_the_rest_are_copies():
    """What split_tail's finish reads right after a replay is handed out as the replay left it; the other
    outputs are copies a later replay cannot change."""
    from forge.cudagraph import split_tail

    gm = fx.symbolic_trace(_lm)
    w, wh = torch.randn(8, 8), torch.randn(16, 8)
    x0 = torch.randn(4, 8)
    head, finish, no_clone = split_tail(gm, gm(x0, wh, w), is_region=lambda t: False, min_bytes=1)
    run = GraphedRun(head.forward, set(), capture=fake_capture, first_args=(x0, wh, w), require_cuda=False,
                     no_clone=no_clone, after="output(s) [1] computed after each replay (not copied out)")
    results, raws = [], []
    for seed in range(1, 5):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
        raw = run(x, wh, w)
        raws.append(raw)
        results.append((finish(raw), _lm(x, wh, w)))
    assert run.captures == 1 and run.replays == 4  # first_args was call 1: every call here replayed
    assert raws[-1][3] is raws[-2][3]  # h: the static buffer itself on every replay
    assert raws[-1][0] is not raws[-2][0] and raws[-1][2] is not raws[-2][2]  # copies
    for got, want in results:  # earlier results (logits computed after their replay) unchanged by later ones
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert "output(s) [1] computed after each replay (not copied out)" in run.describe()


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
    assert fb.Backend(cudagraphs="auto").cudagraphs == "auto"
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


def test_split_tail_keeps_an_in_place_write_in_the_head():
    """split_tail's clean-up after taking the last GEMM out must not drop `h.mul_(2.0)` (an in-place method whose
    return value nothing reads: fx's own dead-code pass counts it pure)."""
    from forge.cudagraph import split_tail

    def scaled(x, wh, w):
        h = torch.relu(x @ w)
        h.mul_(2.0)
        return (h.sum(), torch.nn.functional.linear(h, wh))

    gm = fx.symbolic_trace(scaled)
    x, wh, w = torch.randn(4, 8), torch.randn(16, 8), torch.randn(8, 8)
    head, finish, _ = split_tail(gm, gm(x, wh, w), is_region=lambda t: False, min_bytes=1)
    assert any(n.target == "mul_" for n in head.graph.nodes)
    for got, want in zip(finish(head(x, wh, w)), scaled(x, wh, w), strict=True):
        assert torch.equal(got, want)


def test_mutated_inputs_reads_the_one_in_place_rule():
    """forge/fold.py written_by: an inplace=True keyword writes into its input too (the rule of its own that
    mutated_inputs had missed it); requires_grad_ writes no values."""
    g = fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    g.call_function(torch.nn.functional.relu, (x,), {"inplace": True})
    g.call_method("requires_grad_", (y,))
    g.output(y)
    assert mutated_inputs(fx.GraphModule(torch.nn.Module(), g)) == {0}
