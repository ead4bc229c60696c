"""linear op family: every variant at odd shapes with each epilogue piece, both weight layouts (nn.Linear's
(N, K), Conv1D's (K, N)), strided x and W, against the float64 oracle; the validator catching a wrong
epilogue; the matcher on the spellings users write (forge.trace.canonical) and on regions of tiny HF
models (tests/test_trace_capture.py's configs); refusals with reasons.

Kernels run in the Triton interpreter on CPU (tests/conftest.py); shapes are tiny."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from forge import codegen, ops
from forge.loader import load_module, write_source
from forge.opkit import Candidate
from forge.trace import canonical
from forge.tuner.validate import check_candidate
from tests.conftest import DEVICE

OP = ops.get("linear")
MOD = OP.module
SEED = 4242
STAGES = 1


def tiled(bm=16, bn=16, bk=16, group=1) -> Candidate:
    return Candidate.make("tiled", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group, num_warps=4, num_stages=STAGES)


def splitk(split=2, bm=16, bn=16, bk=16) -> Candidate:
    return Candidate.make("splitk", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=4, num_stages=STAGES)


def _check(shape, dtype, attrs, cand, tmp_path, mutate=None):
    spec = MOD.make_spec(shape, dtype, DEVICE, attrs)
    src = codegen.render(OP, spec, cand)
    if mutate is not None:
        src = mutate(src)
    module = load_module(write_source(src, tmp_path))
    sync = torch.cuda.synchronize if DEVICE == "cuda" else (lambda: None)
    return check_candidate(MOD, module, spec, SEED, sync)


# Each epilogue piece at least once, both variants, both weight layouts, 2-D and 3-D x, M = 1, K tails.
CASES = [
    ((1, 5, 3), "float32", {}, splitk(4)),
    ((7, 5, 3), "float16", {"bias": "linear"}, tiled()),
    ((33, 17, 40), "float16", {"bias": "linear", "activation": "gelu", "scale": 0.5, "residual": True}, tiled(group=2)),
    ((2, 3, 17, 20), "bfloat16", {"weight": "kn", "bias": "linear", "activation": "gelu_tanh"}, tiled()),
    ((2, 3, 17, 20), "float32", {"weight": "kn", "bias": "linear", "activation": "gelu_tanh", "residual": True},
     splitk(2)),
    ((1, 17, 40), "float32", {"bias": "add", "activation": "silu", "residual": True}, splitk(2)),
    ((7, 5, 3), "float16", {"activation": "relu", "scale": -3.0}, splitk(4)),
    ((3, 20, 32), "bfloat16", {"bias": "add", "activation": "relu"}, tiled(bk=16)),  # EVEN_K: unmasked loop
    # strided: x column-major, W as w.t() of a (K, N) buffer; a 3-D x with a row stride gap
    ((7, 5, 3), "float16", {"activation": "silu", "strides": "1,7;1,5"}, tiled()),
    ((2, 3, 17, 20), "float32", {"bias": "linear", "strides": "96,32,1;c;c"}, splitk(2)),
]


@pytest.mark.parametrize(("shape", "dtype", "attrs", "cand"), CASES,
                         ids=[f"{'x'.join(map(str, c[0]))}-{c[1]}-{c[3].variant}-{i}" for i, c in enumerate(CASES)])
def test_variant_with_epilogue_matches_the_oracle(shape, dtype, attrs, cand, tmp_path):
    assert _check(shape, dtype, attrs, cand, tmp_path) is None


@pytest.mark.parametrize(("old", "new", "attrs", "cand"), [
    ("acc = acc * 0.5", "acc = acc * 0.25", {"bias": "linear", "scale": 0.5}, tiled()),
    ("acc += tl.load(RES", "acc -= tl.load(RES", {"residual": True}, splitk(2)),
    ("acc += tl.load(BIAS", "acc -= tl.load(BIAS", {"bias": "add", "activation": "gelu"}, tiled()),
    ("rk[None, :] * 7", "rk[None, :] * 1", {"activation": "relu", "strides": "1,7;c"}, tiled()),
])
def test_the_validator_catches_a_wrong_epilogue_or_stride(old, new, attrs, cand, tmp_path):
    def mutate(src):
        assert src.count(old) == 1, old
        return src.replace(old, new)
    shape = (7, 5, 3)
    assert _check(shape, "float32", attrs, cand, tmp_path) is None
    assert _check(shape, "float32", attrs, cand, tmp_path, mutate) is not None


def test_reference_is_the_users_calls_and_the_oracle_agrees():
    spec = MOD.make_spec((2, 3, 6, 5), "float32", "cpu", {"weight": "kn", "bias": "linear", "activation": "gelu_tanh",
                                                          "scale": 2.0, "residual": True})
    x, w, b, r = MOD.make_inputs(spec, 0)
    want = F.gelu(torch.addmm(b, x.view(-1, 5), w).view(2, 3, 6), approximate="tanh") * 2.0 + r
    torch.testing.assert_close(MOD.reference((x, w, b, r), spec.attrs), want)
    torch.testing.assert_close(MOD.oracle((x, w, b, r), spec.attrs).float(), want, rtol=1e-5, atol=1e-5)


def test_oracle_in_blocks_equals_the_whole():
    from forge import opkit

    spec = MOD.make_spec((9, 7, 5), "float32", "cpu", {"bias": "linear", "activation": "silu", "residual": True})
    inputs = MOD.make_inputs(spec, 1)
    whole = MOD.oracle(inputs, spec.attrs)
    x, w, b, r = inputs
    blocks = opkit.oracle_in_row_col_blocks(
        lambda r0, r1, c0, c1: MOD.reference((x[r0:r1].double(), w[c0:c1].double(), b[c0:c1].double(),
                                              r[r0:r1, c0:c1].double()), spec.attrs), 9, 7, 5, 0, budget=8 * 60)
    torch.testing.assert_close(blocks, whole, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("attrs", "why"), [
    ({"activation": "tanh"}, "activation='tanh'"),
    ({"bias": "yes"}, "bias='yes'"),
    ({"weight": "t"}, "weight='t'"),
    ({"scale": float("inf")}, "finite"),
    ({"residual": "maybe"}, "true or false"),
    ({"alpha": 2}, "alpha"),
])
def test_bad_attributes_are_refused_with_the_reason(attrs, why):
    with pytest.raises(ValueError, match=why):
        MOD.make_spec((4, 5, 6), "float16", "cpu", attrs)


def test_problem_refuses_what_the_kernels_do_not_take():
    x, w = torch.randn(2, 3, 4, 8), torch.randn(5, 8)
    with pytest.raises(ValueError, match="2-D or 3-D"):
        MOD.problem((x, w), {"weight": "nk"})
    with pytest.raises(ValueError, match="differ in K"):
        MOD.problem((torch.randn(3, 7), w), {"weight": "nk"})
    with pytest.raises(ValueError, match="broadcasting"):
        MOD.problem((torch.randn(3, 8), w, torch.randn(1, 5)), {"weight": "nk", "bias": "add"})
    # linear(x, w) + t: a (N,) t is a bias, an output-shaped t a residual
    attrs = {"weight": "nk", "bias": "add", "activation": "none", "residual": False}
    assert MOD.problem((torch.randn(3, 8), w, torch.randn(3, 5)), attrs) == (3, 5, 8)
    assert attrs["bias"] == "none" and attrs["residual"] is True


# --- the matcher -------------------------------------------------------------------------------------------
def f_linear(x, w, b):
    return F.linear(x, w, b)


def f_gelu_bias_add(x, w, b):
    return F.gelu(F.linear(x, w) + b)


def f_gelu_tanh_scale_res(x, w, b, r):
    return F.gelu(F.linear(x, w, b), approximate="tanh") * 0.5 + r


def f_silu_div(x, w):
    return F.silu(F.linear(x, w)) / 4


def f_relu(x, w, b):
    return torch.relu(F.linear(x, w, b))


def f_addmm(b, x, w):
    return torch.addmm(b, x, w)


def f_conv1d_gelu_new(x, w, b):
    h = torch.addmm(b, x.view(-1, x.size(-1)), w).view(x.size()[:-1] + (w.size(-1),))  # GPT-2's Conv1D
    return 0.5 * h * (1.0 + torch.tanh(0.7978845608028654 * (h + 0.044715 * torch.pow(h, 3.0))))


def f_sigmoid_silu(x, w, r):
    h = F.linear(x, w)
    return r + h * torch.sigmoid(h)


def f_bias_res_folded(x, w, b, r):
    return F.linear(x, w) + b + r  # one n-ary add: which is the bias is lost


def f_scale_inside(x, w):
    return F.gelu(F.linear(x, w) * 2.0)


def f_addmm_beta(b, x, w):
    return torch.addmm(b, x, w, beta=0.5)


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 6)
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(self.fc(x))


X, W, B, R = torch.randn(3, 8), torch.randn(6, 8), torch.randn(6), torch.randn(3, 6)


@pytest.mark.parametrize(("fn", "args", "indices", "attrs"), [
    (f_linear, (X, W, B), [0, 1, 2], {"weight": "nk", "bias": "linear", "activation": "none", "residual": False}),
    (f_gelu_bias_add, (X, W, B), [0, 1, 2], {"weight": "nk", "bias": "add", "activation": "gelu", "residual": False}),
    (f_gelu_tanh_scale_res, (X, W, B, R), [0, 1, 2, 3],
     {"weight": "nk", "bias": "linear", "activation": "gelu_tanh", "scale": 0.5, "residual": True}),
    (f_silu_div, (X, W), [0, 1], {"weight": "nk", "bias": "none", "activation": "silu", "scale": 0.25,
                                  "residual": False}),
    (f_relu, (X, W, B), [0, 1, 2], {"weight": "nk", "bias": "linear", "activation": "relu", "residual": False}),
    (f_addmm, (B, X, W.t().contiguous()), [1, 2, 0],
     {"weight": "kn", "bias": "linear", "activation": "none", "residual": False}),
    # the activation written out (x * sigmoid(x)) is recorded: the baseline runs it as the user's code does
    (f_sigmoid_silu, (X, W, R), [0, 1, 2], {"weight": "nk", "bias": "none", "activation": "silu", "residual": True,
                                            "form": "formula"}),
    (Mlp(), (X,), [0, 1, 2], {"weight": "nk", "bias": "linear", "activation": "relu", "residual": False}),
])
def test_matcher_recognises_the_spellings(fn, args, indices, attrs):
    traced = canonical(fn, args, {})
    got = MOD.match(traced.expr)
    assert got is not None, traced.expr
    assert got == (indices, attrs)
    # the reference on the picked inputs is what the function computes
    picked = [traced.tensors[i] for i in got[0]]
    spec_attrs = dict(got[1])
    MOD.problem(picked, spec_attrs)
    torch.testing.assert_close(MOD.reference(tuple(picked), spec_attrs), fn(*args), rtol=1e-5, atol=1e-5)


def test_matcher_recognises_gpt2s_conv1d_with_gelu_new():
    x, w, b = torch.randn(2, 3, 8), torch.randn(8, 6), torch.randn(6)
    traced = canonical(f_conv1d_gelu_new, (x, w, b), {})
    indices, attrs = MOD.match(traced.expr)
    assert attrs["activation"] == "gelu_tanh" and attrs["weight"] == "kn" and attrs[MOD.OUT_LEAD] == (2, 3)
    assert attrs["form"] == "formula"  # gelu_new is written out: the baseline runs its eight kernels too
    picked = [traced.tensors[i] for i in indices]
    assert MOD.problem(picked, attrs) == (2, 3, 6, 8) and MOD.OUT_LEAD not in attrs
    # the reference is the user's code exactly (same ops in the same order), not F.gelu's kernel
    assert torch.equal(MOD.reference(tuple(picked), attrs), f_conv1d_gelu_new(x, w, b))


@pytest.mark.parametrize(("fn", "args"), [
    (f_bias_res_folded, (X, W, B, R)),
    (f_scale_inside, (X, W)),
    (f_addmm_beta, (B, X, W.t().contiguous())),
])
def test_matcher_leaves_other_orders_to_eager(fn, args):
    assert MOD.match(canonical(fn, args, {}).expr) is None


# --- regions of tiny HF models -------------------------------------------------------------------------------


def test_regions_of_a_tiny_gpt2_and_bert():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    from tests.test_trace_capture import BERT_CFG, GPT2_CFG, _assert_region_computes_its_node, _by_op, _ids, _trace

    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2_CFG, attn_implementation="sdpa")).eval()
    result = _trace(gpt2, _ids())
    lin = _by_op(result)["linear"]
    # per layer: c_attn, c_proj, c_fc + gelu_new (tanh gelu), c_proj; then the tied lm_head. The residual adds
    # after c_proj feed the next layer_norm: they are add_norm regions (kernels/add_norm.py), not epilogues.
    acts = [(r.attrs["weight"], r.attrs["activation"], r.attrs["residual"]) for r in lin]
    assert acts == [("kn", "none", False), ("kn", "none", False), ("kn", "gelu_tanh", False), ("kn", "none", False)] \
        * 2 + [("nk", "none", False)]
    assert all(r.unsupported is None and len(r.shape) == 4 for r in lin)
    assert "gelu" not in _by_op(result)
    for r in lin:
        _assert_region_computes_its_node(result, r)

    bert = transformers.BertModel(transformers.BertConfig(**BERT_CFG, attn_implementation="sdpa")).eval()
    result = _trace(bert, _ids())
    lin = _by_op(result)["linear"]
    # BERT is post-norm, LayerNorm(dense(x) + input): the add goes with its norm (add_norm), not with the GEMM
    assert sum(r.attrs["activation"] == "gelu" for r in lin) == 2 and sum(r.attrs["residual"] for r in lin) == 0
    assert len(_by_op(result)["add_norm"]) == 4
    for r in lin:
        _assert_region_computes_its_node(result, r)


@pytest.mark.parametrize("attrs", [{"bias": "linear", "activation": "gelu_tanh", "form": "formula", "weight": "kn"},
                                   {"residual": True}, {"bias": "add", "residual": True, "activation": "relu"}])
def test_the_reference_traces_under_dynamo(attrs):
    """forge bench compiles the reference (torch.compile contestant): on the H200 Dynamo made `*rest` of
    `x, w, *rest = inputs` a tuple and .pop() failed for every linear row (torch 2.11, the GPU machine's; torch
    2.13 here traced the old code too). Dynamo only (backend="eager")."""
    spec = MOD.make_spec((5, 12, 8), "float32", "cpu", attrs)
    inputs = MOD.make_inputs(spec, 0)
    torch._dynamo.reset()
    try:
        got = torch.compile(MOD.reference, backend="eager", fullgraph=True)(tuple(inputs), dict(spec.attrs))
    finally:
        torch._dynamo.reset()
    assert torch.equal(got, MOD.reference(inputs, spec.attrs))
