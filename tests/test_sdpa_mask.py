"""sdpa with the causal rule passed as a mask tensor (form="mask"): transformers 5.17 under torch.compile
builds a boolean mask from aranges (kv_idx <= q_idx, viewed and expanded to (B, 1, Sq, Skv)), repeats k/v
per query head (repeat_kv) and calls F.sdpa(q, k, v, attn_mask=mask). forge/regions.py proves the mask a
graph constant (forge/trace.py TraceGraph.constant) and kernels/sdpa.py fold_constants folds it into
causal=True: the region is tunable, its baseline the masked call as written, torch's F.sdpa(is_causal=True)
a candidate. A mask that depends on an input, or is not the causal rule, stays refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from forge import fused, ops
from forge.regions import find_regions
from forge.trace import TraceGraph
from forge.tuner.validate import compare
from tests.conftest import dynamo_graph

MOD = ops.get("sdpa").module
B, HQ, HKV, S, D = 2, 4, 2, 7, 16


def _hf_mask(s: int, past: int = 0, window: int | None = None):
    """transformers 5.17's sdpa_mask under compile: aranges, compared, viewed, expanded."""
    q_idx = (past + torch.arange(s)).view(1, 1, s, 1)
    kv_idx = (0 + torch.arange(past + s)).view(1, 1, 1, past + s)
    mask = kv_idx <= q_idx
    if window is not None:
        mask = mask & (q_idx - kv_idx < window)
    return mask.expand(B, 1, s, past + s)


def _repeat_kv(x, n: int):
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n, s, d).reshape(b, h * n, s, d)


def hf_attention(q, k, v):
    mask = _hf_mask(q.shape[2])
    return F.scaled_dot_product_attention(q, _repeat_kv(k, HQ // HKV), _repeat_kv(v, HQ // HKV), attn_mask=mask,
                                          scale=0.25)


def two_layers(q, k, v):
    """The mask shared by two calls (a multi-use node: a region input, not inline)."""
    mask = _hf_mask(q.shape[2])
    kr, vr = _repeat_kv(k, HQ // HKV), _repeat_kv(v, HQ // HKV)
    o = F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask)
    return F.scaled_dot_product_attention(o, kr, vr, attn_mask=mask)


def sliding(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_hf_mask(q.shape[2], window=3))


def passed_in(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def decode_step(q, k, v):
    """One query over a cache of 6 + 1 keys: the rule lets it see every key (all True)."""
    mask = _hf_mask(1, past=k.shape[2] - 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _qkv(sq=S, skv=S, hkv=HKV):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(B, HQ, sq, D, generator=g), torch.randn(B, hkv, skv, D, generator=g),
            torch.randn(B, hkv, skv, D, generator=g))


def _sdpa_regions(fn, *args):
    """The sdpa regions of fn's graph as TorchDynamo captures it (static shapes: the aranges take ints; in a
    torch.fx trace of a function they read q.shape, a graph input, and the mask is not constant)."""
    regions, _ = find_regions(dynamo_graph(fn, *args), "cpu")
    return [r for r in regions if r.op == "sdpa"]


def test_hf_causal_mask_is_folded_into_causal():
    (r,) = _sdpa_regions(hf_attention, *_qkv())
    assert r.unsupported is None, r.unsupported
    # repeat_kv's copies are inside the region: grouped-query attention over the unrepeated k, v
    assert r.attrs["causal"] is True and r.attrs["form"] == "mask" and r.attrs["kv_heads"] == HKV, r.attrs
    assert "attn_mask" not in r.attrs and "mask_leaf" not in r.attrs
    assert r.shape == (B, HQ, S, S, D) and r.attrs["scale"] == 0.25


def test_a_shared_mask_is_folded_in_every_call():
    rs = _sdpa_regions(two_layers, *_qkv())
    assert len(rs) == 2 and all(r.unsupported is None and r.attrs["form"] == "mask" and r.attrs["causal"] for r in rs)


def flat_repeat(q, k, v):
    """A "repeat" of a tensor that is not (B, Hkv, S, D): the same view/expand/reshape chain over another
    layout is no grouped-query attention."""
    b, _, s, d = q.shape
    kr = k.reshape(b, HKV, 1, s, d).expand(b, HKV, HQ // HKV, s, d).reshape(b, HQ, s, d)
    vr = v.reshape(b, HKV, 1, s, d).expand(b, HKV, HQ // HKV, s, d).reshape(b, HQ, s, d)
    return F.scaled_dot_product_attention(q, kr, vr, is_causal=True)


def test_repeat_kv_is_grouped_query_attention_only_in_its_own_layout():
    q, k, v = _qkv()
    (r,) = _sdpa_regions(lambda q, k, v: F.scaled_dot_product_attention(
        q, _repeat_kv(k, 2), _repeat_kv(v, 2), is_causal=True), q, k, v)
    # the user's repeat is the baseline (form "repeat"); F.sdpa(enable_gqa) on the unrepeated k/v competes
    assert r.unsupported is None and r.attrs["kv_heads"] == HKV and r.attrs["form"] == "repeat", r.attrs
    assert fused.candidate("sdpa", r.attrs) is not None
    got = MOD.reference((q, k, v), r.attrs)
    assert torch.equal(got, F.scaled_dot_product_attention(q, _repeat_kv(k, 2), _repeat_kv(v, 2), is_causal=True,
                                                           scale=r.attrs["scale"]))
    assert compare(got, MOD.oracle((q, k, v), r.attrs), MOD.tolerance("float32")) is None
    assert [leaf.name for leaf in r.leaves[:3]] == ["l_q_", "l_k_", "l_v_"], r.leaves
    flat = (q, k.reshape(B, HKV * S * D), v.reshape(B, HKV * S * D))
    (r,) = _sdpa_regions(flat_repeat, *flat)
    assert r.unsupported is None and r.attrs["kv_heads"] == HQ, r.attrs  # the repeated tensors, as MHA


def test_a_mask_that_lets_one_query_see_every_key_is_no_mask():
    q, k, v = _qkv(sq=1, skv=7, hkv=HQ)
    (r,) = _sdpa_regions(decode_step, q, k, v)
    assert r.unsupported is None and r.attrs["causal"] is False and r.attrs["form"] == "mask", r.attrs


def test_a_mask_other_than_the_causal_rule_stays_refused():
    q, k, v = _qkv(hkv=HQ)
    (r,) = _sdpa_regions(sliding, q, k, v)
    assert r.unsupported and "attn_mask" in r.unsupported


def test_a_mask_from_an_input_is_not_folded_even_when_it_is_causal_now():
    q, k, v = _qkv(hkv=HQ)
    mask = torch.ones(S, S, dtype=torch.bool).tril()  # causal today; the next call may pass padding
    (r,) = _sdpa_regions(passed_in, q, k, v, mask)
    assert r.unsupported and "attn_mask" in r.unsupported


def test_constant_means_built_from_literals_only():
    def f(x, w):
        a = torch.arange(4).view(1, 4) <= torch.arange(4).view(4, 1)
        return a, a & (x > 0), torch.rand(4) > 0.5, w.sum(0) > 0

    g = dynamo_graph(f, torch.randn(4, 4), torch.nn.Parameter(torch.randn(4, 4)))
    out = g.output_node()
    assert g.constant(out[0])
    assert not g.constant(out[1])  # reads x
    assert not g.constant(out[2])  # random
    assert not g.constant(out[3])  # a parameter
    assert not any(g.constant(p) for p in g.placeholders)


def test_a_function_traced_by_fx_reads_the_mask_size_from_an_input():
    (r,) = [r for r in find_regions(TraceGraph(hf_attention, _qkv(), {}), "cpu")[0] if r.op == "sdpa"]
    assert r.unsupported and "attn_mask" in r.unsupported


@pytest.mark.parametrize(("sq", "skv", "causal"), [(7, 7, True), (1, 9, False), (5, 5, False), (3, 8, True)])
def test_the_masked_reference_is_the_causal_computation(sq, skv, causal):
    q, k, v = _qkv(sq, skv)
    attrs = MOD.make_spec((B, HQ, sq, skv, D), "float32", "cpu",
                          {"causal": causal, "kv_heads": HKV, "form": "mask"}).attrs
    assert attrs["form"] == "mask"
    got = MOD.reference((q, k, v), attrs)
    assert compare(got, MOD.oracle((q, k, v), attrs), MOD.tolerance("float32")) is None
    # the user's spelling: an explicit mask on repeated k/v, not is_causal (torch's flash backend cannot take it)
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                          attn_mask=torch.ones(sq, skv, dtype=torch.bool).tril() if causal else None,
                                          scale=attrs["scale"])
    torch.testing.assert_close(got, want)


def test_form_mask_makes_torchs_op_a_candidate_and_a_new_key():
    assert fused.candidate("sdpa", {"causal": True, "scale": 0.25, "kv_heads": 4}) is None
    assert fused.candidate("sdpa", {"causal": True, "scale": 0.25, "kv_heads": 4, "form": "mask"}) is not None
    plain = MOD.make_spec((B, HQ, S, S, D), "float32", "cpu", {"causal": True})
    masked = MOD.make_spec((B, HQ, S, S, D), "float32", "cpu", {"causal": True, "form": "mask"})
    assert "form" not in plain.attrs and masked.attrs["form"] == "mask" and plain != masked
    with pytest.raises(ValueError, match="form='mask'"):
        MOD.make_spec((B, HQ, S, S, D), "float32", "cpu", {"form": "padding"})
    with pytest.raises(ValueError, match="attn_mask"):
        MOD.make_spec((B, HQ, S, S, D), "float32", "cpu", {"attn_mask": "tensor", "mask_leaf": 3})


def test_the_backend_swaps_the_masked_call_for_a_kernel(tmp_path, monkeypatch):
    from forge.backend import Backend
    from forge.cache import Cache
    from forge.tuner import engine, stats

    monkeypatch.setattr(stats, "accepts", lambda *a, **k: True)  # the interpreter never beats eager
    q, k, v = _qkv()
    db = tmp_path / "forge.db"
    rep = engine.search("sdpa", (B, HQ, S, S, D), "float32", device="cpu", cache=Cache(db),
                        attrs={"causal": True, "scale": 0.25, "form": "mask", "kv_heads": HKV},
                        options=engine.SearchOptions(budget=1, workers=1, timeout=120))
    assert rep.decision == "kernel", rep.candidates
    want = hf_attention(q, k, v)
    be = Backend(miss="eager", cache=db, interpreter=True)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(hf_attention, backend=be, dynamic=False)
        compiled(q, k, v)
        got = compiled(q, k, v)
    finally:
        torch._dynamo.reset()
    (r,) = [r for r in be.explain().regions if r.op == "sdpa"]
    assert r.uses == "kernel" and r.attrs["form"] == "mask" and r.attrs["kv_heads"] == HKV, r
    # the first call planned the graph (its own nodes ran), the second ran the kernel
    assert [(c.calls, c.fallbacks) for c in be.kernel_calls] == [(1, 0)]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
