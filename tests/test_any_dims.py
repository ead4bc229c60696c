"""Issue 14, item 4: rmsnorm and layer_norm over several trailing dims, rmsnorm over one non-last dim, and
reductions (sum, mean, amax, amin, argmax, argmin) over any single dim: the specs and their keys, the
kernels against the float64 oracle at odd shapes, torch's tie and NaN rules, the matchers on the usual
spellings, and the refusals.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import forge
from forge import codegen, ops
from forge.loader import load_module, write_source
from forge.opkit import Candidate
from forge.trace import canonical
from forge.tuner.validate import check_candidate
from tests.conftest import DEVICE, HAS_CUDA

cpu_only = pytest.mark.skipif(HAS_CUDA, reason="exercises the interpreter path (CPU tensors)")
SEED = 14_4
RMS, LN, RED = (ops.get(n) for n in ("rmsnorm", "layer_norm", "reduce"))


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _module(op, spec, cand, tmp_path):
    return load_module(write_source(codegen.render(op, spec, cand), tmp_path))


def _check(op, shape, dtype, attrs, cand, tmp_path):
    spec = op.module.make_spec(shape, dtype, DEVICE, attrs)
    reason = check_candidate(op.module, _module(op, spec, cand, tmp_path), spec, SEED, _sync)
    assert reason is None, f"{op.name} {shape} {dtype} {attrs} {cand.label}: {reason}"


# --- specs and keys -----------------------------------------------------------------------------------


def test_specs_record_the_dims_and_keep_last_dim_specs_as_they_were():
    mk = RMS.module.make_spec
    assert mk((4, 8), "float16", "cpu").attrs == {"eps": 1e-6}
    assert mk((4, 8), "float16", "cpu", {"dims": 1, "dim": -1}).attrs == {"eps": 1e-6}
    s = mk((2, 3, 5, 7), "float16", "cpu", {"dim": 1})
    assert s.attrs == {"eps": 1e-6, "dim": -3} and s.inputs[1].shape == (3, 1, 1)
    s = mk((2, 3, 5, 7), "float16", "cpu", {"dims": 2})
    assert s.attrs == {"eps": 1e-6, "dims": 2} and s.inputs[1].shape == (5, 7)
    assert LN.module.make_spec((2, 3, 5), "float32", "cpu", {"normalized_shape": (3, 5)}).attrs == {
        "eps": 1e-5, "dims": 2}
    assert [t.shape for t in LN.module.make_spec((2, 3, 5), "float32", "cpu", {"dims": 3}).inputs] == [
        (2, 3, 5), (2, 3, 5), (2, 3, 5)]
    assert RED.module.make_spec((2, 3, 5), "float32", "cpu", {"dim": 1, "kind": "argmin"}).attrs == {
        "kind": "argmin", "keepdim": False, "dim": -2}
    # every variant of dims/dim is its own key
    from forge import key as keys
    ks = {keys.request("rmsnorm", (2, 3, 5, 7), "float16", "interpreter", a).key
          for a in ({}, {"dims": 2}, {"dims": 3}, {"dim": -3}, {"dim": -2})}
    assert len(ks) == 5


@pytest.mark.parametrize(("op", "attrs", "needle"), [
    ("rmsnorm", {"dims": 2, "dim": -3}, "trailing dims or one dim, not both"),
    ("rmsnorm", {"dims": 5}, "dims=5"),
    ("rmsnorm", {"dim": 4}, "dim=4 is not one dimension"),
    ("layer_norm", {"normalized_shape": (3, 7)}, "normalized_shape=(3, 7) is not supported"),
    ("reduce", {"dim": (0, 1)}, "one dimension, not dim=(0, 1)"),
    ("reduce", {"dim": None}, "not over all dimensions"),
    ("reduce", {"kind": "min"}, "kind must be one of"),
])
def test_refusals_name_the_reason(op, attrs, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        ops.get(op).module.make_spec((2, 3, 5, 7), "float32", "cpu", attrs)


def test_a_strided_x_over_a_non_last_dim_is_refused():
    # a row-strided x is fine over trailing dims, refused (with the reason) over a middle dim
    with pytest.raises(ValueError, match="takes a contiguous x only"):
        RMS.module.make_spec((4, 3, 8), "float32", "cpu", {"dim": -2, "strides": "48,8,1;c"})
    assert RMS.module.make_spec((4, 3, 8), "float32", "cpu", {"dims": 2, "strides": "48,8,1;c"}).attrs["strides"]
    with pytest.raises(ValueError, match="must be contiguous"):  # reduce takes contiguous x, any dim
        RED.module.make_spec((4, 3, 8), "float32", "cpu", {"dim": 0, "strides": "48,8,1"})


def test_strided_defaults_are_in_their_spaces():
    for shape in [(1, 1), (7, 1), (3, 7, 33), (8, 4096, 2), (2, 3, 70000), (1, 5, 2**24)]:
        for op, attrs in [(RMS, {"dim": -2}), (RED, {"dim": -2, "kind": "argmin"})]:
            spec = op.module.make_spec(shape, "bfloat16", "cuda", attrs)
            assert op.module.default(spec) in op.module.space(spec), (shape, op.name)
            assert {c.variant for c in op.module.space(spec).all_points()} == {"strided"}


# --- kernels against the oracle at odd shapes ---------------------------------------------------------

ROW = Candidate.make("row", num_warps=1)
LOOPED = Candidate.make("looped", BLOCK_N=256, num_warps=2, num_stages=1)
MULTI = Candidate.make("multirow", ROWS=4, num_warps=1)


@pytest.mark.parametrize(("op_name", "shape", "attrs", "cand", "dtype"), [
    ("rmsnorm", (3, 5, 7), {"dims": 2}, ROW, "float32"),
    ("rmsnorm", (1, 7, 1, 43), {"dims": 3}, LOOPED, "float16"),       # 301 columns: a partial block
    ("rmsnorm", (5, 1, 7), {"dims": 2}, MULTI, "bfloat16"),
    ("layer_norm", (2, 3, 5, 7), {"dims": 3}, ROW, "float32"),
    ("layer_norm", (1, 3, 101), {"dims": 2}, LOOPED, "float32"),
    ("layer_norm", (7, 1, 7), {"dims": 2}, MULTI, "float16"),
    ("reduce", (3, 9), {"kind": "amin"}, ROW, "float16"),
    ("reduce", (2, 300), {"kind": "argmin"}, Candidate.make("looped", BLOCK_N=64, num_warps=1, num_stages=1),
     "bfloat16"),
    ("reduce", (5, 7), {"kind": "argmin", "keepdim": True}, MULTI, "float32"),
])
def test_trailing_dims_and_min_kinds_match_the_oracle(op_name, shape, attrs, cand, dtype, tmp_path):
    _check(ops.get(op_name), shape, dtype, attrs, cand, tmp_path)


STRIDED = [Candidate.make("strided", BLOCK_R=4, BLOCK_I=16, num_warps=1),
           Candidate.make("strided", BLOCK_R=64, BLOCK_I=4, num_warps=2)]


@pytest.mark.parametrize("kind", ["sum", "mean", "amax", "amin", "argmax", "argmin"])
@pytest.mark.parametrize(("shape", "dim", "keepdim"), [
    ((7,), 0, False),                 # a 1-d x: outer = inner = 1
    ((2, 7, 1, 5), 1, True),          # NCHW-like, a dim of 1 after it
    ((1, 300, 3), -2, False),         # a single outer, a long reduced dim (partial last R block)
    ((3, 1, 33), 1, False),           # a reduced dim of 1
])
def test_reductions_over_any_dim_match_the_oracle(kind, shape, dim, keepdim, tmp_path):
    for i, cand in enumerate(STRIDED):
        dtype = ("float32", "bfloat16")[i]
        spec = RED.module.make_spec(shape, dtype, DEVICE, {"kind": kind, "dim": dim, "keepdim": keepdim})
        if spec.attrs["dim"] == -1:  # (7,) dim 0 is the last dim: the row variants
            cand = ROW
        reason = check_candidate(RED.module, _module(RED, spec, cand, tmp_path), spec, SEED, _sync)
        assert reason is None, f"{shape} {dim} {kind} {cand.label} {dtype}: {reason}"


@pytest.mark.parametrize(("shape", "dim"), [((2, 3, 5, 7), 1), ((1, 1000, 2), -2), ((4, 7), 0), ((3, 1, 5), 1)])
def test_rmsnorm_over_one_dim_matches_the_oracle(shape, dim, tmp_path):
    for cand, dtype in zip(STRIDED, ("float32", "float16"), strict=True):
        _check(RMS, shape, dtype, {"dim": dim}, cand, tmp_path)


def test_a_kernel_that_reduces_the_wrong_dim_fails_validation(tmp_path):
    """The control: the strided rmsnorm with the reduced values read at stride 1 (the last dim) fails."""
    spec = RMS.module.make_spec((2, 3, 5, 7), "float32", DEVICE, {"dim": 1})
    src = codegen.render(RMS, spec, STRIDED[0])
    assert src.count("r[:, None] * INNER") == 2
    bad = load_module(write_source(src.replace("r[:, None] * INNER", "r[:, None]"), tmp_path))
    assert check_candidate(RMS.module, bad, spec, SEED, _sync) is not None


# --- torch's tie and NaN rules --------------------------------------------------------------------------

def _run(spec, cand, x, tmp_path):
    module = _module(RED, spec, cand, tmp_path)
    out = RED.module.alloc_output((x,), spec)
    RED.module.run(module, (x,), out, spec.attrs)
    _sync()
    return out


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("kind", ["amax", "amin", "argmax", "argmin"])
def test_ties_nan_and_infinities_follow_torch(kind, tmp_path):
    nan, inf = float("nan"), float("inf")
    # rows (the reduced dim): ties of the extreme, NaN after / before an extreme, two NaNs, all -inf, all +inf
    rows = [[1.0, 3.0, 3.0, -2.0, 3.0], [2.0, nan, 5.0, -9.0, nan], [nan, 1.0, 1.0, nan, 0.5],
            [-inf, -inf, -inf, -inf, -inf], [inf, inf, inf, inf, inf], [-4.0, 7.0, -4.0, 7.0, -4.0]]
    x = torch.tensor(rows, device=DEVICE)
    want = getattr(torch, kind)(x, dim=-1)
    for cand in (ROW, Candidate.make("looped", BLOCK_N=2, num_warps=1, num_stages=1), MULTI):
        got = _run(RED.module.make_spec(tuple(x.shape), "float32", DEVICE, {"kind": kind}), cand, x, tmp_path)
        torch.testing.assert_close(got, want, equal_nan=True, msg=f"{kind} {cand.label}")
    # the same values down dim 1 of a (2, 5, 6) tensor: the strided variant, several R blocks
    xs = torch.stack([x.t(), -x.t()]).contiguous()
    want = getattr(torch, kind)(xs, dim=1)
    for cand in (Candidate.make("strided", BLOCK_R=2, BLOCK_I=4, num_warps=1), STRIDED[1]):
        got = _run(RED.module.make_spec(tuple(xs.shape), "float32", DEVICE, {"kind": kind, "dim": 1}), cand, xs,
                   tmp_path)
        torch.testing.assert_close(got, want, equal_nan=True, msg=f"{kind} {cand.label}")


# --- matchers -----------------------------------------------------------------------------------------

N_, C_, H_, W_ = 2, 3, 4, 5
X4 = torch.randn(N_, C_, H_, W_)
WC = torch.randn(C_)
WHW = torch.randn(H_, W_)


def _m(op, fn, *args):
    return op.module.match(canonical(fn, args, {}).expr)


def test_rmsnorm_matches_any_dims_spellings():
    def dim1(x, w):
        return x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + 1e-6) * w.view(1, C_, 1, 1)

    def dim1_index(x, w):
        return x * torch.rsqrt(x.pow(2).mean(dim=-3, keepdim=True) + 1e-6) * w[:, None, None]

    def trailing(x, w):
        return x * torch.rsqrt(x.pow(2).mean((-2, -1), keepdim=True) + 1e-5) * w

    assert _m(RMS, dim1, X4, WC) == ([0, 1], {"eps": 1e-6, "dim": -3, "weight_view": (1, C_, 1, 1)})
    assert _m(RMS, dim1_index, X4, WC) == ([0, 1], {"eps": 1e-6, "dim": -3, "weight_view": (C_, 1, 1)})
    assert _m(RMS, lambda x: x * torch.rsqrt((x * x).mean(1, keepdim=True) + 1e-6), X4) == (
        [0, None], {"eps": 1e-6, "dim": -3})
    assert _m(RMS, trailing, X4, WHW) == ([0, 1], {"eps": 1e-5, "dims": 2})
    # torch's op called by the user: form="fused" (its reference, the baseline, is that call; forge/fused.py)
    assert _m(RMS, lambda x, w: F.rms_norm(x, (H_, W_), w, 1e-5), X4, WHW) == (
        [0, 1], {"eps": 1e-5, "dims": 2, "form": "fused"})
    norm = nn.RMSNorm((C_, H_, W_), eps=1e-5)
    assert RMS.module.match(canonical(norm, (X4,), {}).expr) == ([0, 1], {"eps": 1e-5, "dims": 3, "form": "fused"})
    # a mean over dims that are not the trailing ones, or without keepdim, is not rmsnorm
    assert _m(RMS, lambda x: x * torch.rsqrt(x.pow(2).mean((1, 3), keepdim=True) + 1e-6), X4) is None
    assert _m(RMS, lambda x: x * torch.rsqrt(x.pow(2).mean(1) + 1e-6), X4[:, :1]) is None


def test_layer_norm_matches_several_trailing_dims():
    ln = nn.LayerNorm((C_, H_, W_))
    idx, attrs = LN.module.match(canonical(ln, (X4,), {}).expr)
    assert idx == [0, 1, 2] and attrs == {"eps": 1e-5, "normalized_shape": (C_, H_, W_)}
    spec = LN.module.make_spec(tuple(X4.shape), "float32", "cpu", attrs)
    assert spec.attrs == {"eps": 1e-5, "dims": 3}
    filled = LN.module.fill_missing([X4, None, None], attrs)
    assert [tuple(t.shape) for t in filled] == [tuple(X4.shape), (C_, H_, W_), (C_, H_, W_)]


@pytest.mark.parametrize(("fn", "attrs"), [
    (lambda x: x.sum(1), {"kind": "sum", "keepdim": False, "dim": -3}),
    (lambda x: torch.mean(x, dim=[2], keepdim=True), {"kind": "mean", "keepdim": True, "dim": -2}),
    (lambda x: x.amin(0), {"kind": "amin", "keepdim": False, "dim": -4}),
    (lambda x: torch.amin(x, -1, True), {"kind": "amin", "keepdim": True, "dim": -1}),
    (lambda x: x.argmin(1, keepdim=True), {"kind": "argmin", "keepdim": True, "dim": -3}),
    (lambda x: torch.argmax(x, dim=2), {"kind": "argmax", "keepdim": False, "dim": -2}),
])
def test_reduce_matches_any_dim(fn, attrs):
    idx, got = _m(RED, fn, X4)
    assert idx == [0] and got == attrs
    assert RED.module.make_spec(tuple(X4.shape), "float32", "cpu", got).attrs == attrs


# --- the shim: matched, keyed, and refused with reasons -------------------------------------------------

def _explain(fn, *args):
    return forge.explain(forge.optimize(fn, interpreter=True, warn=False), *args)


def _dim1(x, w):
    return x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + 1e-6) * w.view(1, -1, 1, 1)


@cpu_only
def test_the_shim_takes_the_new_spellings():
    e = _explain(_dim1, X4, WC)
    assert (e.op, e.uses, e.reason) == ("rmsnorm", "eager", "cache miss: would search")
    last = _explain(lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w, X4, torch.randn(W_))
    assert last.key != e.key
    with torch.no_grad():
        e = _explain(nn.LayerNorm((C_, H_, W_)), X4)
    assert (e.op, e.reason) == ("layer_norm", "cache miss: would search")
    e = _explain(lambda x: x.argmin(1), X4)
    assert (e.op, e.reason) == ("reduce", "cache miss: would search")


@cpu_only
def test_the_shim_refuses_what_the_kernels_do_not_compute():
    # a weight that broadcasts along the last dim is not a weight over dim 1 (C == W here)
    x = torch.randn(2, 4, 3, 4)
    e = _explain(lambda x, w: x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + 1e-6) * w, x, torch.randn(4))
    assert e.uses == "eager" and "do not fit rmsnorm's kernel" in e.reason
    # a view placing the weight elsewhere than the reduced dim
    e = _explain(lambda x, w: x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + 1e-6) * w.view(1, 1, 1, 4), x,
                 torch.randn(4))
    assert e.uses == "eager" and "do not fit rmsnorm's kernel" in e.reason
    # a strided x over a non-last dim
    xt = torch.randn(2, 3, 8)[:, :, :4]
    e = _explain(lambda x: x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + 1e-6), xt)
    assert e.uses == "eager" and "takes a contiguous x only" in e.reason
    e = _explain(lambda x: x.sum((0, 1)), X4)
    assert e.uses == "eager" and "one dimension, not dim=(-4, -3)" in e.reason


def test_fill_missing_gives_the_weight_the_spec_shape():
    attrs = {"eps": 1e-6, "dim": -3, "weight_view": (1, C_, 1, 1)}
    x, w = RMS.module.fill_missing([X4, WC], attrs)
    assert w.shape == (C_, 1, 1) and w.data_ptr() == WC.data_ptr()
    x, w = RMS.module.fill_missing([X4, None], {"eps": 1e-6, "dim": -3})
    assert w.shape == (C_, 1, 1) and bool((w == 1).all())
    # the same (C,) weight without the view broadcasts along the last dim: left as it is (refused)
    assert RMS.module.fill_missing([X4, WC], {"eps": 1e-6, "dim": -3})[1].shape == (C_,)
    assert RMS.module.fill_missing([X4, WHW.view(1, H_, W_)], {"eps": 1e-6, "dims": 2})[1].shape == (H_, W_)
