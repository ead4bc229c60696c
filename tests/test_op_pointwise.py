"""The pointwise op family (generated elementwise chains): the expression text (parse, refusals), every
variant at odd shapes, broadcast and strided inputs against the float64 oracle, casts inside the chain,
random expressions against eager (hypothesis), the validator on a broken kernel, and the matcher on
traced code (swish, MinGPT's formula, specific families still winning)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import forge
from forge import codegen, ops
from forge.loader import load_module, write_source
from forge.opkit import Candidate
from forge.trace import canonical
from forge.tuner.validate import check_candidate
from tests.conftest import DEVICE, HAS_CUDA

SEED = 7
OP = ops.get("pointwise")
MOD = OP.module
cpu_only = pytest.mark.skipif(HAS_CUDA, reason="exercises the interpreter path (CPU tensors)")
SWISH = "mul(x0,sigmoid(x0))"
MINGPT = "mul(0.5,x0,add(1.0,tanh(mul(0.7978845608028654,add(x0,mul(0.044715,x0,x0,x0))))))"


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _load(spec, cand, tmp_path, mutate=None):
    src = codegen.render(OP, spec, cand)
    if mutate is not None:
        src = mutate(src)
    return load_module(write_source(src, tmp_path))


def _check(spec, tmp_path) -> list[str]:
    """Every test candidate of `spec` through the search's correctness gate: the failures."""
    out = []
    for cand in MOD.test_candidates(spec):
        reason = check_candidate(MOD, _load(spec, cand, tmp_path), spec, SEED, _sync)
        if reason is not None:
            out.append(f"{cand.label}: {reason}")
    return out


# --- the expression ----------------------------------------------------------------------------------
def test_parse_and_print_round_trip_exactly():
    text = "add(mul(0.1,x0),clamp(x1,-inf,6.0),pow(x0,-2.5),where(gt(x1,x0),1e-05,x1))"
    assert MOD.unparse(MOD.parse(text)) == text
    assert MOD.unparse(MOD.parse(" mul( x0 , 2 ) ")) == "mul(x0,2.0)"  # one spelling: the key's
    c = 0.7978845608028654
    assert MOD.parse(MOD.unparse(("mul", ("c", c), ("x", 0))))[1][1] == c  # repr is exact


@pytest.mark.parametrize(("expr", "needle"), [
    ("foo(x0)", "unknown function 'foo'"),
    ("exp(x0,x0)", "exp takes 1 operand(s), got 2"),
    ("add(x0)", "add takes 2 or more operand(s), got 1"),
    ("mul(x0,x2)", "inputs are numbered x0..x2, each used"),
    ("mul(x0", "is not closed"),
    ("mul(", "ends early"),
    ("mul(x0,x0))", "unexpected text after"),
    ("pow(x0,x0)", "operand 2 of pow must be a constant"),
    ("where(x0,x0,1.0)", "condition must be a comparison"),
    ("gt(x0,1.0)", "not a comparison"),
    ("add(gt(x0,1.0),x0)", "takes numbers, not the comparison"),
    ("exp(2.0)", "reads no input"),
    ("log(sub(x0,1.0))", "not >= 0"),
    ("clamp(x0,2.0,1.0)", "min 2.0 > max 1.0"),
    ("mul(x0,$)", "unexpected"),
    (7, "expected an expression"),
])
def test_bad_expressions_are_refused_with_the_reason(expr, needle):
    with pytest.raises(ValueError, match=None) as info:
        MOD.make_spec((3, 4), "float32", "cpu", {"expr": expr})
    assert needle in str(info.value), str(info.value)


def test_make_spec_dtypes_shapes_and_refusals():
    spec = MOD.make_spec((2, 5), "bfloat16", "cuda")
    assert spec.attrs == {"expr": SWISH} and [t.shape for t in spec.inputs] == [(2, 5)]
    bias = MOD.make_spec((4, 6), "float16", "cpu", {"expr": "add(x0,x1)", "input_shapes": "c;6"})
    assert [t.shape for t in bias.inputs] == [(4, 6), (6,)] and bias.attrs["input_shapes"] == "c;6"
    assert MOD.problem_shape(bias) == (4, 6) and MOD.output_of(bias) == ((4, 6), "float16")
    # an input_shapes attribute naming only full shapes is dropped: one spec, one key
    assert MOD.make_spec((4, 6), "float32", "cpu", {"expr": "add(x0,x1)", "input_shapes": "c;4,6"}).attrs == {
        "expr": "add(x0,x1)"}
    with pytest.raises(ValueError, match="do not broadcast"):
        MOD.make_spec((4, 6), "float32", "cpu", {"expr": "add(x0,x1)", "input_shapes": "c;5"})
    with pytest.raises(ValueError, match="not the problem shape"):
        MOD.make_spec((4, 6), "float32", "cpu", {"expr": "add(x0,x1)", "input_shapes": "6;1,6"})
    with pytest.raises(ValueError, match="names 1 input"):
        MOD.make_spec((4, 6), "float32", "cpu", {"expr": "add(x0,x1)", "input_shapes": "c"})
    with pytest.raises(ValueError, match="not supported"):
        MOD.make_spec((4, 6), "int64", "cpu")
    with pytest.raises(ValueError, match="at most 8"):
        MOD.make_spec((4,), "float32", "cpu", {"expr": f"add({','.join(f'x{i}' for i in range(9))})"})
    with pytest.raises(ValueError, match="takes attributes"):
        MOD.make_spec((4,), "float32", "cpu", {"approximate": "tanh"})
    # the output dtype is the root's (torch's promotion): a cast up of half inputs gives float32
    up = MOD.make_spec((4,), "float16", "cpu", {"expr": "mul(to_float32(x0),2.0)"})
    assert MOD.output_of(up)[1] == "float32"
    assert MOD.output_of(MOD.make_spec((4,), "float16", "cpu", {"expr": "add(to_bfloat16(x0),x0)"}))[1] == "float32"


# --- numerics: every variant against the float64 oracle ------------------------------------------------
EXPRS = [
    SWISH,
    MINGPT,
    "add(mul(x0,2.0),relu(x1),neg(x0))",
    "where(gt(x0,0.0),x0,mul(x0,0.01))",
    "add(leaky_relu(x0,0.2),hardswish(x1),clamp(x0,-1.0,1.0))",
    "mul(erf(mul(x0,0.7071067811865476)),exp(neg(abs(x1))),rsqrt(add(mul(x1,x1),1.0)))",
    "add(log(x0),sqrt(x0),pow(x0,2.5),pow(x0,-3.0),pow(x0,0.0))",
    "sub(div(x0,add(2.0,sigmoid(x1))),tanh(x1))",
]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 33), (2, 4099)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("expr", EXPRS)
def test_every_variant_matches_the_oracle(expr, shape, dtype, tmp_path):
    n = max(MOD.inputs_of(MOD.parse(expr))) + 1
    spec = MOD.make_spec(shape, dtype, DEVICE, {"expr": expr})
    assert len(spec.inputs) == n
    assert {c.variant for c in MOD.test_candidates(spec)} == {"flat", "persistent"}
    assert _check(spec, tmp_path) == []


@pytest.mark.parametrize(("shape", "shapes"), [
    ((5, 33), "c;33"),            # a bias over the last dim
    ((2, 3, 5, 8), "c;2,1,5,8"),  # a (B, 1, S, D) table
    ((4, 6), "4,1;1,6"),          # an outer sum: no input of the output's shape
    ((3, 7), "c;()"),             # a 0-d tensor
])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_broadcast_inputs_match_the_oracle(shape, shapes, dtype, tmp_path):
    spec = MOD.make_spec(shape, dtype, DEVICE, {"expr": "mul(add(x0,x1),sigmoid(x1))", "input_shapes": shapes})
    assert MOD.output_of(spec) == (shape, dtype)
    assert _check(spec, tmp_path) == []


@pytest.mark.parametrize(("shape", "strides"), [
    ((5, 33), "48,1;c"),        # rows of a wider buffer
    ((6, 5), "1,6;c"),          # a transposed input (x.t())
    ((2, 3, 8), "c;64,8,1"),    # the other input strided, outer gaps
])
def test_strided_inputs_match_the_oracle(shape, strides, tmp_path):
    spec = MOD.make_spec(shape, "float32", DEVICE, {"expr": "add(x0,mul(x1,3.0),exp(neg(abs(x0))))",
                                                    "strides": strides})
    assert spec.attrs["strides"] == strides
    assert not all(t.contiguous for t in spec.inputs)
    assert _check(spec, tmp_path) == []
    # a stride-0 broadcast (x.expand) is refused: the layout overlaps
    with pytest.raises(ValueError, match="overlap"):
        MOD.make_spec((4, 6), "float32", "cpu", {"expr": "add(x0,x1)", "strides": "c;0,1"})


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_cast_down_inside_the_chain_rounds_there(dtype, tmp_path):
    """(x * 3).half() * y computed in float32: the kernel rounds the product to fp16 where the user's
    cast does, so it equals the oracle (and differs from a kernel that skipped the rounding)."""
    expr = "mul(to_float16(mul(x0,3.0)),x1)"
    spec = MOD.make_spec((3, 333), dtype, DEVICE, {"expr": expr})
    assert MOD.output_of(spec)[1] == "float32" if dtype == "float32" else "float16"
    assert MOD.tolerance_for(spec) == MOD.tolerance("float16")  # the coarsest rounding in the chain
    assert _check(spec, tmp_path) == []
    cand = MOD.default(spec)
    src = codegen.render(OP, spec, cand)
    assert ".to(tl.float16).to(tl.float32)" in src
    if dtype == "float32":  # without the rounding, a float32 output is off by fp16's half ulp
        x = torch.tensor([1.0 + 2.0 ** -12, 1.1], device=DEVICE)
        y = torch.ones(2, device=DEVICE)
        spec = MOD.make_spec((2,), "float32", DEVICE, {"expr": expr})
        out = torch.empty(2, device=DEVICE)
        MOD.run(_load(spec, cand, tmp_path), (x, y), out, spec.attrs)
        assert torch.equal(out, ((x * 3.0).half() * y).float())
        broken = _load(spec, cand, tmp_path / "b", lambda s: s.replace(".to(tl.float16).to(tl.float32)", ""))
        MOD.run(broken, (x, y), out, spec.attrs)
        assert not torch.equal(out, ((x * 3.0).half() * y).float())


def test_reference_is_eager_op_by_op_and_oracle_is_float64():
    x = torch.randn(4, 5, dtype=torch.float16)
    attrs = {"expr": MINGPT}
    want = 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))
    assert torch.allclose(MOD.reference((x,), attrs).float(), want.float(), atol=2e-3)
    exact = F.gelu(x.double(), approximate="tanh").half()
    assert torch.equal(MOD.oracle((x,), attrs), exact) or torch.allclose(MOD.oracle((x,), attrs).double(),
                                                                          exact.double(), rtol=1e-3)
    assert MOD.oracle((x,), attrs).dtype == torch.float16


def test_oracle_in_chunks_equals_the_whole(monkeypatch):
    x, b = torch.randn(64, 8), torch.randn(8)
    attrs = {"expr": "mul(add(x0,x1),tanh(x1))"}
    whole = MOD.oracle((x, b), attrs)
    monkeypatch.setattr("forge.opkit.oracle_budget", lambda nbytes: 1024)  # 4 rows per chunk
    assert torch.equal(MOD.oracle((x, b), attrs), whole)


def test_validator_rejects_a_broken_kernel(tmp_path):
    spec = MOD.make_spec((3, 333), "float32", DEVICE, {"expr": "add(x0,mul(x1,2.0))", "input_shapes": "c;333"})
    cand = Candidate.make("flat", BLOCK=256, num_warps=2)
    ok = check_candidate(MOD, _load(spec, cand, tmp_path), spec, SEED, _sync)
    assert ok is None
    # reads the bias as if it had the output's shape
    reason = check_candidate(MOD, _load(spec, cand, tmp_path / "b", lambda s: s.replace("X1 + o1", "X1 + offs")),
                             spec, SEED, _sync)
    assert reason is not None


def test_space_default_and_work():
    big = MOD.make_spec((8192, 14336), "bfloat16", "cuda", {"expr": "add(x0,x1)", "input_shapes": "c;14336"})
    assert {c.variant for c in MOD.space(big).all_points()} == {"flat", "persistent"}
    assert MOD.default(big) in MOD.space(big)
    assert MOD.bytes_moved(big) == 2 * (2 * 8192 * 14336 + 14336)
    assert MOD.flops(big) == 8192 * 14336


# --- random expressions against eager ----------------------------------------------------------------
# Leaves: inputs and constants. Every log/sqrt/rsqrt/division takes an operand that is >= 1 or > 0 by
# construction (1 + exp(e), 1 + e * e), so the chains stay well-conditioned and in their domain: the
# kernel (fp32) then agrees with eager fp32 within a few ulp per op.
_UNARY = ["neg", "exp_neg_abs", "tanh", "sigmoid", "erf", "abs", "relu", "hardswish", "log1p_sq", "rsqrt1p",
          "clamp", "leaky"]


def _expressions(n_inputs: int):
    leaf = st.one_of(st.integers(0, n_inputs - 1).map(lambda i: ("x", i)),
                     st.sampled_from([0.5, -1.25, 2.0, 3.0]).map(lambda c: ("c", c)))

    def grow(kids):
        unary = st.tuples(st.sampled_from(_UNARY), kids).map(_unary)
        binary = st.tuples(st.sampled_from(["add", "mul", "sub", "div1p", "where"]), kids, kids).map(_binary)
        return st.one_of(unary, binary)

    return st.recursive(leaf, grow, max_leaves=6)


def _unary(t):
    fn, e = t
    if fn == "exp_neg_abs":
        return ("exp", ("neg", ("abs", e)))
    if fn == "log1p_sq":
        return ("log", ("add", ("c", 1.0), ("mul", e, e)))
    if fn == "rsqrt1p":
        return ("rsqrt", ("add", ("c", 1.0), ("abs", e)))
    if fn == "clamp":
        return ("clamp", e, ("c", -1.5), ("c", 2.0))
    if fn == "leaky":
        return ("leaky_relu", e, ("c", 0.1))
    return (fn, e)


def _binary(t):
    fn, a, b = t
    if fn == "div1p":
        return ("div", a, ("add", ("c", 1.0), ("exp", ("neg", ("abs", b)))))
    if fn == "where":
        return ("where", ("gt", a, b), a, b)
    return (fn, a, b)


@cpu_only
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(tree=_expressions(2), variant=st.sampled_from(["flat", "persistent"]))
def test_random_expressions_compile_and_equal_eager(tree, variant, tmp_path_factory):
    used = sorted(MOD.inputs_of(tree))
    if not used or MOD.count_ops(tree) < 1:
        return
    renumber = {old: new for new, old in enumerate(used)}

    def re_index(e):
        if e[0] == "x":
            return ("x", renumber[e[1]])
        if e[0] == "c":
            return e
        return (e[0], *(re_index(a) for a in e[1:]))

    text = MOD.unparse(re_index(tree))
    spec = MOD.make_spec((3, 37), "float32", "cpu", {"expr": text})
    gen = torch.Generator().manual_seed(3)
    inputs = tuple(torch.randn(3, 37, generator=gen) for _ in spec.inputs)
    cand = [c for c in MOD.test_candidates(spec) if c.variant == variant][0]
    module = _load(spec, cand, tmp_path_factory.mktemp("k"))
    out = MOD.alloc_output(inputs, spec)
    MOD.run(module, inputs, out, spec.attrs)
    eager = MOD.reference(inputs, spec.attrs)
    torch.testing.assert_close(out, eager, rtol=1e-4, atol=1e-5, msg=lambda m: f"{text}: {m}")


# --- recognising elementwise chains in user code -----------------------------------------------------
X = torch.randn(4, 24)
BIAS = torch.randn(24)


def swish(x):
    return x * torch.sigmoid(x)


def mingpt_gelu(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def mingpt_gelu_scaled(x, b):
    return mingpt_gelu(x) * b


def bias_relu(x, b):
    return F.relu(x + b) * 2.0


def leaky_where_clamp(x):
    return torch.where(x > 0, F.leaky_relu(x, 0.2), torch.clamp(x * 3, min=-1.0)) + F.hardtanh(x)


class ModulesChain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.relu6, self.hardswish, self.leaky = torch.nn.ReLU6(), torch.nn.Hardswish(), torch.nn.LeakyReLU(0.3)

    def forward(self, x):
        return self.relu6(self.hardswish(x) + 1) - self.leaky(x)


modules_chain = ModulesChain()


@cpu_only
@pytest.mark.parametrize(("fn", "args", "expr"), [
    (swish, (X,), SWISH),
    (bias_relu, (X, BIAS), "mul(2.0,relu(add(x0,x1)))"),
    (leaky_where_clamp, (X,),
     "add(clamp(x0,-1.0,1.0),where(gt(x0,0.0),leaky_relu(x0,0.2),clamp(mul(3.0,x0),-1.0,inf)))"),
    (modules_chain, (X,), "sub(clamp(add(1.0,hardswish(x0)),0.0,6.0),leaky_relu(x0,0.3))"),
], ids=lambda v: getattr(v, "__name__", None))
def test_traced_chains_match_pointwise(fn, args, expr):
    indices, attrs = MOD.match(canonical(fn, args, {}).expr)
    assert attrs == {"expr": expr} and indices == list(range(len(args)))
    e = forge.explain(forge.optimize(fn, interpreter=True), *args)
    assert e.op == "pointwise" and e.uses == "eager" and e.reason == "cache miss: would search"


@cpu_only
def test_mingpt_formula_is_gelu_and_compiles_as_pointwise_too(tmp_path):
    traced = canonical(mingpt_gelu, (X,), {})
    e = forge.explain(forge.optimize(mingpt_gelu, interpreter=True), X)
    assert e.op == "gelu"  # the specific family wins where it matches
    indices, attrs = MOD.match(traced.expr)  # as a chain, the pointwise family would take it too
    spec = MOD.make_spec((3, 33), "float32", DEVICE, attrs)
    assert _check(spec, tmp_path) == []
    # times another tensor it is no gelu: one pointwise kernel
    indices, attrs = MOD.match(canonical(mingpt_gelu_scaled, (X, BIAS), {}).expr)
    assert forge.explain(forge.optimize(mingpt_gelu_scaled, interpreter=True), X, BIAS).op == "pointwise"
    assert MOD.make_spec((4, 24), "float32", "cpu", {**attrs, "input_shapes": "c;24"}).attrs["input_shapes"] == "c;24"


def silu_gate(a, b):
    return a * torch.sigmoid(a) * b


def plain_gelu(x):
    return F.gelu(x)


def single_add(x, b):
    return x + b


def cast_only(x):
    return x.half()


def inplace_relu(x):
    return F.relu(x * 2, inplace=True) + 1


@cpu_only
@pytest.mark.parametrize(("fn", "args", "op"), [
    (silu_gate, (X, X + 1), "silu_mul"), (plain_gelu, (X,), "gelu"), (single_add, (X, BIAS), None),
    (cast_only, (X,), None), (inplace_relu, (X,), None),
], ids=lambda v: getattr(v, "__name__", None))
def test_specific_families_win_and_single_ops_are_left_to_eager(fn, args, op):
    e = forge.explain(forge.optimize(fn, interpreter=True, warn=False), *args)
    assert e.op == op, e.reason
    if op is None:
        assert MOD.match(canonical(fn, args, {}).expr) is None


@cpu_only
def test_the_shim_refuses_what_the_kernels_do_not_take():
    f = forge.optimize(bias_relu, interpreter=True, warn=False)
    assert "dtype" in forge.explain(f, X, BIAS.half()).reason
    assert "dtype" in forge.explain(f, X.double(), BIAS.double()).reason
    e = forge.explain(f, X, BIAS.expand(4, 24))  # stride 0: overlapping addresses
    assert e.op == "pointwise" and "overlap" in e.reason
    e = forge.explain(f, X.t().contiguous().t(), BIAS)  # a transposed x: taken (any order of strides)
    assert e.op == "pointwise" and e.reason == "cache miss: would search"


@cpu_only
def test_regions_of_a_captured_graph():
    """forge trace's regions: the chain after a linear is one pointwise region; the specific families'
    regions are what they were (rmsnorm on x, the gelu region)."""
    from forge.regions import find_regions
    from forge.trace import TraceGraph

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(24, 24)

        def forward(self, x, b):
            h = self.lin(x)
            y = torch.clamp(h * 0.5 + b, min=0.0) * torch.sigmoid(h)
            return F.gelu(y) + 1

    model = Model()
    with torch.no_grad():
        g = TraceGraph(model, (X, BIAS), {})
        regions, _ = find_regions(g, "cpu")
    ops_found = sorted(r.op for r in regions)
    assert "pointwise" in ops_found and "gelu" in ops_found, ops_found
    pw = next(r for r in regions if r.op == "pointwise")
    assert pw.unsupported is None and "clamp" in pw.attrs["expr"]
