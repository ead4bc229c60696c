"""forge/fold.py: the backend's plan-time simplification of the code around its regions (constant folding of
literal-only values, inference dropout removed), through torch.compile(backend=forge) on CPU, and the cases
where a value must not be folded (written in place, directly or through a view; returned; random; too big)."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from forge import backend as fb  # noqa: E402
from forge import fold  # noqa: E402


def _compiled(fn):
    torch._dynamo.reset()
    be = fb.Backend(miss="eager", interpreter=True)
    return torch.compile(fn, backend=be, dynamic=False), be


def _masked(x):
    # HF's causal mask, built from aranges on every call, and an inference dropout
    i = torch.arange(x.shape[-1], device="cpu")
    mask = (i.view(1, -1) <= i.view(-1, 1)).unsqueeze(0).expand(x.shape[0], -1, -1)
    y = F.dropout(x, 0.1, False, False)
    return torch.where(mask, y, torch.zeros((), dtype=x.dtype, device="cpu")) * 2.0


def test_a_literal_only_mask_is_computed_once_and_dropout_is_gone():
    f, be = _compiled(_masked)
    x1, x2 = torch.randn(3, 7, 7), torch.randn(3, 7, 7)
    torch.testing.assert_close(f(x1), _masked(x1))
    (index, folded, dropped), = be.simplified
    assert folded == 2 and dropped == 1  # the mask and the zeros() scalar
    # later calls never compute the mask again: no arange, no comparison runs (the profiler's op list; patching
    # torch.arange instead would make Dynamo compile the function again)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = f(x2)
    ran = {e.name for e in prof.events()}
    assert "aten::where" in ran and not ran & {"aten::arange", "aten::le", "aten::dropout"}, sorted(ran)
    torch.testing.assert_close(got, _masked(x2))


def test_a_tensor_made_on_torch_defaults_is_recomputed():
    """torch.ones(3) takes torch's default dtype and device at call time: not folded. An arange of integers
    with a device is int64 whatever the default dtype: folded."""
    def fn(x):
        return x + torch.ones(x.shape[-1]) + torch.arange(x.shape[-1], device="cpu")

    f, be = _compiled(fn)
    x = torch.randn(2, 5)
    torch.testing.assert_close(f(x), fn(x))
    assert be.simplified == [(0, 1, 0)]  # the arange only


def test_training_dropout_stays():
    def fn(x):
        return F.dropout(x, 0.5, True, False) + 1

    f, be = _compiled(fn)
    torch.manual_seed(0)
    out = f(torch.ones(64, 64))
    assert be.simplified == [(0, 0, 0)]
    assert (out == 1).any() and (out == 3).any()  # elements dropped and elements scaled: dropout ran


def _in_place(x):
    acc = torch.zeros(x.shape[-1], dtype=torch.float32, device="cpu")
    acc.add_(x.sum(0))  # a literal-only value written in place: folding it would accumulate across calls
    return acc * 1.0


def _through_view(x):
    acc = torch.zeros(4, dtype=torch.float32, device="cpu")
    v = acc.view(2, 2)
    v.mul_(x.sum())
    return acc + 0.0


def _item_assigned(x):
    m = torch.ones(4, 4, dtype=torch.float32, device="cpu")
    m[0] = x[0]  # operator.setitem in Dynamo's graph
    return m * 1.0


def _augmented(x):
    m = torch.zeros(4, dtype=torch.float32, device="cpu")
    m += x.sum(0)  # an in-place operator
    return m * 1.0


def _returned(x):
    return x + 1, torch.arange(4, device="cpu")


def _random(x):
    return x + torch.rand(x.shape)


@pytest.mark.parametrize("fn", [_in_place, _through_view, _item_assigned, _augmented, _returned, _random],
                         ids=lambda f: f.__name__)
def test_values_that_must_not_be_folded_are_computed_each_call(fn):
    f, be = _compiled(fn)
    x = torch.randn(4, 4)
    torch.manual_seed(1)
    first = f(x)
    torch.manual_seed(1)
    again = f(x)
    torch.manual_seed(1)
    ref = fn(x)
    assert all(i == 0 for _, i, _ in be.simplified)  # nothing folded
    for a, b, r in zip(*(o if isinstance(o, tuple) else (o,) for o in (first, again, ref)), strict=True):
        torch.testing.assert_close(a, r)
        torch.testing.assert_close(b, r)  # the second call is not the first one's state carried over
    if fn is _returned:
        assert first[1].data_ptr() != again[1].data_ptr()  # a fresh tensor per call: the caller may write it


def test_a_value_over_the_byte_budget_is_recomputed(monkeypatch):
    monkeypatch.setattr(fold, "FOLD_BYTES", 16)
    f, be = _compiled(_masked)
    x = torch.randn(3, 7, 7)
    torch.testing.assert_close(f(x), _masked(x))
    torch.testing.assert_close(f(x), _masked(x))
    assert be.simplified == [(0, 1, 1)]  # the 49-byte mask is over 16 bytes: the 4-byte zero and dropout went


def test_hf_gpt2_through_the_backend_folds_its_mask_and_drops_its_dropouts():
    transformers = pytest.importorskip("transformers")
    from tests.test_trace_capture import GPT2_CFG

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2_CFG, attn_implementation="sdpa")).eval()
    ids = torch.randint(0, GPT2_CFG["vocab_size"], (2, 16))
    f, be = _compiled(model)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        f(input_ids=ids)
        got = f(input_ids=ids).logits
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    folded = sum(s[1] for s in be.simplified)
    dropped = sum(s[2] for s in be.simplified)
    layers = GPT2_CFG.get("n_layer", 2)
    assert folded >= 1 and dropped >= 2 * layers, be.simplified


def _written_then_read(x):
    """An in-place method whose return value nothing reads (as `t.mul_(k)` always is), beside a folded mask."""
    mask = torch.ones(x.shape[-1], x.shape[-1], dtype=torch.bool, device="cpu").tril()
    t = x.clone()
    t.mul_(1.5)
    t[:, 0] = 7.0
    t += 1.0
    return torch.where(mask, t, x) + x


def test_in_place_writes_whose_result_is_unused_survive_the_rewrite():
    """fold.simplify erased dead nodes with fx's eliminate_dead_code, which counts every call_method pure: once
    anything was folded it dropped `t.mul_(1.5)` (found by tests/test_backend_programs.py) and the value was
    wrong from the second call on."""
    f, be = _compiled(_written_then_read)
    for _ in range(3):
        x = torch.randn(5, 5)
        torch.testing.assert_close(f(x), _written_then_read(x), rtol=0, atol=0)
    assert be.simplified == [(0, 1, 0)]  # the mask was folded, so the rewrite (and its clean-up) ran


def test_dead_code_elimination_keeps_writes_and_impure_calls():
    import operator

    import torch.fx as fx

    g = fx.Graph()
    x = g.placeholder("x")
    t = g.call_method("clone", (x,))
    g.call_method("mul_", (t, 2.0))  # result unused: a write into t
    g.call_function(operator.setitem, (t, 0, 1.0))
    g.call_function(operator.iadd, (t, 1.0))
    g.call_function(torch.rand, (3,))  # random: fx counts it impure (the RNG state moves)
    dead = g.call_method("view", (x, -1))
    g.call_function(torch.relu, (dead,))  # a pure chain nothing reads: both go
    g.output(t)
    gm = fx.GraphModule(torch.nn.Module(), g)
    assert fold.eliminate_dead_code(gm.graph) == 2
    gm.recompile()
    names = [n.target if isinstance(n.target, str) else n.target.__name__ for n in gm.graph.nodes]
    assert names == ["x", "clone", "mul_", "setitem", "iadd", "rand", "output"]
    x0 = torch.zeros(2)
    assert torch.equal(gm(x0), torch.tensor([2.0, 1.0]))  # t[0] = 1, then += 1 (the * 2 of zeros kept too)
