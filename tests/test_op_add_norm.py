"""add_norm (issue 14): h = x + r and rmsnorm / layer_norm of h in one kernel writing (y, h) stacked.

Every variant at odd shapes against the float64 oracle, h bit-equal to eager's x + r; the matcher on
Llama's and GPT-2's residual patterns through forge/regions.py (the multi-use add kept inside the region,
an extra output); and a hand-written 2-layer pre-norm block through the TorchDynamo backend with real
kernels (acceptance forced: the interpreter never beats eager), then the guarded fallback."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from forge import backend as fb
from forge import codegen, ops
from forge.loader import load_module, write_source
from forge.opkit import Candidate
from forge.regions import find_regions
from forge.trace import TraceGraph
from forge.tuner import stats
from forge.tuner.validate import compare
from tests.conftest import HAS_CUDA, search_only

OP = ops.get("add_norm")
MOD = OP.module
cpu_only = pytest.mark.skipif(HAS_CUDA, reason="the interpreter path (CPU tensors)")

CANDS = [Candidate.make("row", num_warps=1), Candidate.make("multirow", ROWS=4, num_warps=1),
         Candidate.make("looped", BLOCK_N=256, num_warps=2, num_stages=1)]


def _run(spec, cand, inputs, tmp_path):
    module = load_module(write_source(codegen.render(OP, spec, cand), tmp_path))
    out = MOD.alloc_output(inputs, spec)
    MOD.run(module, inputs, out, spec.attrs)
    return out


@cpu_only
@pytest.mark.parametrize("norm", ["rmsnorm", "layer_norm"])
@pytest.mark.parametrize("shape", [(1, 33), (7, 33), (2, 3, 33), (2, 700)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_variant_matches_the_oracle_and_h_is_eagers(norm, shape, dtype, tmp_path):
    spec = MOD.make_spec(shape, dtype, "cpu", {"norm": norm, "eps": 1e-5})
    inputs = MOD.make_inputs(spec, 7)
    want = MOD.oracle(inputs, spec.attrs)
    assert want.shape == (2, *shape) and want.dtype == torch.float64
    for cand in CANDS:
        if not MOD.space(spec).valid(cand):  # looped needs a row longer than its block
            continue
        got = _run(spec, cand, inputs, tmp_path)
        assert got.shape == (2, *shape)
        assert torch.equal(got[1], inputs[0] + inputs[1]), cand  # h exactly, bf16's rounding included
        assert compare(got, want, MOD.tolerance(dtype)) is None, cand
    # The eager reference writes the same (2, ...) layout and computes the same y (eager's fp32 layer_norm
    # on rows far from zero is less exact than the kernels: the tuner's oracle is float64, not eager).
    ref = MOD.reference(inputs, spec.attrs)
    assert torch.equal(ref[1], inputs[0] + inputs[1])
    torch.testing.assert_close(ref[0].double(), want[0], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("norm", ["rmsnorm", "layer_norm"])
def test_every_launch_passes_only_inputs_and_the_output(norm, tmp_path):
    """forge/launch.py replays a kernel through Triton's C launch function only where every tensor argument is
    an input or the output (it refused add_norm's separate y and h views on the H200: the slower JIT path
    for every call). The kernels get the (2, ...) output whole and find h at its second half."""
    spec = MOD.make_spec((5, 300), "float32", "cpu", {"norm": norm})
    inputs = MOD.make_inputs(spec, 3)
    for cand in CANDS:
        module = load_module(write_source(codegen.render(OP, spec, cand), tmp_path))
        jit = next(v for v in vars(module).values() if type(v).__name__ in ("JITFunction", "InterpretedFunction"))
        seen: list = []

        class Spy:
            def __init__(self, jit, seen):
                self.jit, self.seen = jit, seen

            def __getitem__(self, grid):
                def call(*args, **kwargs):
                    self.seen.extend(a for a in args if isinstance(a, torch.Tensor))
                    return self.jit[grid](*args, **kwargs)
                return call

        setattr(module, jit.fn.__name__ if hasattr(jit, "fn") else jit.__name__, Spy(jit, seen))
        out = MOD.alloc_output(inputs, spec)
        MOD.run(module, inputs, out, spec.attrs)
        pool = {t.data_ptr() for t in (*inputs, out)}
        assert seen and all(t.data_ptr() in pool for t in seen), cand
        assert compare(out, MOD.oracle(inputs, spec.attrs), MOD.tolerance("float32")) is None, cand


@cpu_only
def test_a_kernel_that_writes_unrounded_or_no_h_is_caught(tmp_path):
    spec = MOD.make_spec((5, 64), "float16", "cpu", {})
    inputs = MOD.make_inputs(spec, 3)
    want = MOD.oracle(inputs, spec.attrs)
    src = codegen.render(OP, spec, CANDS[0])
    # the norm of x alone (the residual forgotten in y): validation fails
    bad = load_module(write_source(src.replace("    x = h.to(tl.float32)\n", ""), tmp_path / "a"))
    out = MOD.alloc_output(inputs, spec)
    MOD.run(bad, inputs, out, spec.attrs)
    assert compare(out, want, MOD.tolerance("float16")) is not None


def test_spec_attrs_and_refusals():
    spec = MOD.make_spec((4, 40), "float16", "cpu", {"norm": "layer_norm", "eps": 1})
    assert [t.shape for t in spec.inputs] == [(4, 40), (4, 40), (40,), (40,)]
    assert spec.attrs == {"norm": "layer_norm", "eps": 1.0}
    assert len(MOD.make_spec((4, 40), "float16", "cpu").inputs) == 3
    for bad in ({"norm": "softmax"}, {"dims": 2}, {"norm": "layer_norm", "form": "fused"}, {"eps": float("nan")}):
        with pytest.raises(ValueError):
            MOD.make_spec((4, 40), "float16", "cpu", bad)


# -- matching -----------------------------------------------------------------------------------------
def llama_block(x, a, b, w):
    h = x + a
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    return y, h + b


def gpt2_block(x, a, b, w, bias):
    h = x + a
    return F.layer_norm(h, (33,), w, bias, 1e-5), h + b


def no_residual_reuse(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def _regions(fn, *args):
    return find_regions(TraceGraph(fn, args, {}), "cpu")[0]


def test_the_llama_and_gpt2_residual_patterns_are_add_norm_with_h_as_extra_output():
    x, a, b = (torch.randn(7, 33) for _ in range(3))
    w, bias = torch.randn(33), torch.randn(33)
    (r,) = [r for r in _regions(llama_block, x, a, b, w) if r.op == "add_norm"]
    assert r.attrs == {"norm": "rmsnorm", "eps": 1e-6} and r.unsupported is None
    assert [leaf.name for leaf in r.leaves] == ["x", "a", "w"] and [e.name for e in r.extra_outputs] == ["add"]
    (r,) = [r for r in _regions(gpt2_block, x, a, b, w, bias) if r.op == "add_norm"]
    assert r.attrs == {"norm": "layer_norm", "eps": 1e-5} and [e.name for e in r.extra_outputs] == ["add"]
    # A norm of a plain input stays the norm family.
    assert [r.op for r in _regions(no_residual_reuse, x, w)] == ["rmsnorm"]


def test_the_matcher_refuses_what_its_kernel_does_not_compute():
    i = ("input",)
    add = ("add", (*i, 0), (*i, 1))
    rms = ("mul", add, (*i, 2), ("rsqrt", ("add", ("const", 1e-6), ("mean_last", ("mul", add, add)))))
    assert MOD.match(rms) == ([0, 1, 2], {"norm": "rmsnorm", "eps": 1e-6})
    # the weight is h itself; h over several dims; two different adds
    assert MOD.match(("mul", add, add, rms[3])) is None
    assert MOD.match(("layer_norm", add, ("const", (3, 33)), (*i, 2), (*i, 3), ("const", 1e-5))) is None
    other = ("add", (*i, 0), (*i, 3))
    assert MOD.match(("mul", other, (*i, 2), rms[3])) is None
    assert MOD.match(("layer_norm", add, ("const", (33,)), ("const", None), ("const", None), ("const", 1e-5))) \
        == ([0, 1, None, None], {"norm": "layer_norm", "eps": 1e-5})


# -- through the TorchDynamo backend --------------------------------------------------------------
class Block(torch.nn.Module):
    """Two pre-norm residual layers (Llama's rmsnorm formula, then GPT-2's nn.LayerNorm)."""

    def __init__(self, d: int = 32):
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(torch.rand(d) + 0.5)
        self.ln = torch.nn.LayerNorm(d)
        with torch.no_grad():
            self.ln.weight.add_(torch.rand(d))
            self.ln.bias.add_(torch.randn(d) * 0.1)
        self.f1, self.f2 = torch.nn.Linear(d, d), torch.nn.Linear(d, d)

    def forward(self, x):
        h = x + torch.tanh(x)
        y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w
        h2 = h + torch.sigmoid(self.f1(y))
        y2 = self.ln(h2)
        return torch.relu(self.f2(y2)) + h2


@cpu_only
@pytest.mark.slow
def test_backend_swaps_add_norm_kernels_and_falls_back_on_another_shape(tmp_path, monkeypatch):
    monkeypatch.setattr(stats, "accepts", lambda *a, **k: True)  # the interpreter never beats eager
    search_only(monkeypatch, "add_norm")  # the linears and pointwise chains run as written
    model = Block().eval()
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        ref = model(x)
    be = fb.Backend(miss="search", budget=1, cache=tmp_path / "cache", interpreter=True)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=be)
    with torch.no_grad():
        compiled(x)
        got = compiled(x)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    swapped = [r for r in be.explain().regions if r.op == "add_norm"]
    assert [(r.uses, r.attrs["norm"]) for r in swapped] == [("kernel", "rmsnorm"), ("kernel", "layer_norm")], swapped
    calls = [c for c in be.kernel_calls if c.__name__ == "forge_add_norm"]
    # the first call plans (and runs the captured graph); the second runs both kernels, unguarded
    assert len(calls) == 2 and all(c.calls == 1 and c.fallbacks == 0 for c in calls)
    # Another shape at the guarded call: the region's own nodes, both values, exactly eager's.
    call = calls[0]
    x2 = torch.randn(3, 32)
    a2 = torch.tanh(x2)
    y, h = call(x2, a2, model.w.detach())
    assert call.fallbacks == 1 and torch.equal(h, x2 + a2)
    assert torch.equal(y, h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * model.w.detach())
    s = call.stacked(x2, a2, model.w.detach())  # the inductor form: stacked on the fallback path too
    assert s.shape == (2, 3, 32) and torch.equal(s[0], y) and torch.equal(s[1], h)
    torch._dynamo.reset()


@cpu_only
@pytest.mark.parametrize("shape", [(1, 33), (7, 33), (2, 700)])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_form_hf_rounds_before_the_weight_in_every_variant(shape, dtype, tmp_path):
    """Hugging Face's half-precision LlamaRMSNorm after the residual add: y = w * (h.float() * rstd).to(dtype)
    (two roundings). The reference is HF's spelling exactly; every variant matches the oracle, h exactly."""
    spec = MOD.make_spec(shape, dtype, "cpu", {"norm": "rmsnorm", "eps": 1e-6, "form": "hf", "hf_dtype": dtype})
    assert spec.attrs == {"norm": "rmsnorm", "eps": 1e-6, "form": "hf"}  # the note is not part of the spec
    inputs = MOD.make_inputs(spec, 3)
    x, r, w = inputs
    h = x + r
    hf = h.float()
    want_y = w * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype)
    ref = MOD.reference(inputs, spec.attrs)
    assert torch.equal(ref[0], want_y) and torch.equal(ref[1], h)
    oracle = MOD.oracle(inputs, spec.attrs)
    for cand in CANDS:
        if not MOD.space(spec).valid(cand):
            continue
        source = codegen.render(OP, spec, cand)
        assert ".to(tl.float32) * w" in source
        got = _run(spec, cand, inputs, tmp_path)
        assert torch.equal(got[1], h) and compare(got, oracle, MOD.tolerance(dtype)) is None, cand
        if dtype == "float16":  # the interpreter rounds fp16 as torch does (bf16: it truncates)
            assert torch.equal(got[0], want_y), cand
    assert MOD.make_spec(shape, "float32", "cpu", {"norm": "rmsnorm", "form": "hf"}).attrs == {
        "norm": "rmsnorm", "eps": 1e-6}  # in float32 HF's casts are no-ops: the plain formula
    with pytest.raises(ValueError, match="form='hf'"):
        MOD.make_spec(shape, dtype, "cpu", {"norm": "layer_norm", "form": "hf"})
    with pytest.raises(ValueError, match="cast to bfloat16, not to x's dtype"):
        MOD.fill_missing([x.half(), r.half(), w.half()], {"norm": "rmsnorm", "form": "hf", "hf_dtype": "bfloat16"})


@cpu_only
@pytest.mark.slow
def test_a_half_precision_hf_llama_runs_add_norm_kernels_through_the_backend(tmp_path, monkeypatch):
    """bf16 tiny HF Llama: the residual stream is add_norm of form "hf" (4 regions) and the first norm rmsnorm
    "hf"; searched (acceptance forced) and swapped in, the logits stay within bf16 tolerance of eager, and
    every norm kernel ran unguarded."""
    transformers = pytest.importorskip("transformers")
    from tests.test_trace_capture import LLAMA_CFG, _ids

    monkeypatch.setattr(stats, "accepts", lambda *a, **k: True)
    search_only(monkeypatch, "add_norm", "rmsnorm")  # linear, rope, sdpa, silu_mul: run as written
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA_CFG, attn_implementation="sdpa"))
    model = model.eval().to(torch.bfloat16)
    ids = _ids()
    with torch.no_grad():
        ref = model(ids).logits.float()
    be = fb.Backend(miss="search", budget=1, cache=tmp_path / "cache", interpreter=True)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, backend=be)
        with torch.no_grad():
            compiled(ids)
            got = compiled(ids).logits.float()
    finally:
        torch._dynamo.reset()
    norms = [r for r in be.explain().regions if r.op in ("add_norm", "rmsnorm")]
    assert sorted((r.op, r.uses, r.attrs.get("form")) for r in norms) == sorted(
        [("add_norm", "kernel", "hf")] * 4 + [("rmsnorm", "kernel", "hf")]), norms
    calls = [c for c in be.kernel_calls if c.__name__ in ("forge_add_norm", "forge_rmsnorm")]
    assert len(calls) == 5 and all(c.calls >= 1 and c.fallbacks == 0 for c in calls)
    assert not [r for r in be.explain().regions if r.uses == "kernel" and r.op not in ("add_norm", "rmsnorm")]
    err = float((got - ref).norm() / ref.norm())
    assert err < 2e-2, err  # bf16: the norms' fp32 sums add in another order; 0.007 measured (rest eager)


@pytest.mark.parametrize(("attrs", "dtype"), [({"norm": "rmsnorm"}, "float32"), ({"norm": "rmsnorm"}, "bfloat16"),
                                              ({"norm": "rmsnorm", "form": "hf"}, "bfloat16"),
                                              ({"norm": "rmsnorm", "form": "fused"}, "float16"),
                                              ({"norm": "layer_norm", "eps": 1e-5}, "float32")])
def test_the_natural_spelling_bench_compiles_computes_the_reference(attrs, dtype):
    """forge bench compiles reference_parts ((y, h), as users write it) for torch.compile: the out= spelling
    of `reference` made Inductor copy (2x its device time on the H200). Same values, bit for bit."""
    spec = MOD.make_spec((6, 40), dtype, "cpu", attrs)
    inputs = MOD.make_inputs(spec, 2)
    y, h = MOD.reference_parts(inputs, spec.attrs)
    assert torch.equal(torch.stack((y, h)), MOD.reference(inputs, spec.attrs))
