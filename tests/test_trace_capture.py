"""`forge trace` captures with TorchDynamo: tiny Hugging Face Llama, GPT-2 and BERT built from configs
(never from a hub), graph breaks (several graphs, each matched), data-dependent control flow that
torch.fx cannot trace, distinct opaque values (silu(gate(x)) * up(x)), the canonical forms of
Dynamo graphs (linear, addmm, layout, casts) and the exact numerics of casts: HF's LlamaRMSNorm is
rmsnorm only where forge's kernel computes exactly what it does."""

from __future__ import annotations

import json
import os
import textwrap
from collections import Counter

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: nothing here may touch a hub
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from forge import codegen, ops  # noqa: E402
from forge.errors import UsageError  # noqa: E402
from forge.loader import load_module, write_source  # noqa: E402
from forge.trace import TraceGraph, Untraceable, canonical  # noqa: E402
from forge.tuner import manifest, tracetools  # noqa: E402
from forge_cli import cli  # noqa: E402
from tests.conftest import DEVICE  # noqa: E402

transformers = pytest.importorskip("transformers")
runner = CliRunner()

IDS_SHAPE = (2, 16)
LLAMA_CFG = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=1)
GPT2_CFG = dict(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=1)
BERT_CFG = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                max_position_embeddings=64)


def _llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**LLAMA_CFG, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(cfg).eval()


def _ids():
    return torch.randint(0, 128, IDS_SHAPE, generator=torch.Generator().manual_seed(1))


def _trace(fn, *args, device="cpu"):
    return tracetools.trace(tracetools.Target(fn, tuple(args), getattr(fn, "__name__", type(fn).__name__)), device)


def _by_op(result) -> dict:
    out: dict = {}
    for r in result.regions:
        out.setdefault(r.op, []).append(r)
    return out


def _counts(by: dict) -> Counter:
    """Regions per op, leaving out the rotary embedding's inv_freq @ positions: transformers 5.17 writes
    it as a matmul (a region), 5.24 as a broadcast product."""
    assert set(by) <= {"rmsnorm", "add_norm", "rope", "sdpa", "silu_mul", "layer_norm", "gelu", "matmul", "linear",
                       "swiglu", "cat"}, set(by)
    for r in by.get("cat", []):  # the KV cache's update: an empty past (torch.tensor([])) and the new k or v
        a = r["attrs"] if isinstance(r, dict) else r.attrs  # the CLI's JSON or a Region
        assert (a["dim"], a["empty"]) == (2, 1), r
        if not isinstance(r, dict):
            assert r.unsupported is None and len(r.leaves) == 1, r
    assert len(by.get("matmul", [])) <= 1
    return Counter({op: len(rs) for op, rs in by.items() if op != "matmul"})


def _assert_hf_causal_sdpa(r) -> None:
    """HF's causal attention: is_causal=True with no mask (transformers 5.24 on torch 2.13): tunable, on q, k,
    v as the strided views HF makes ((B, S, H, D) projections transposed); or an explicit causal mask tensor
    (transformers 5.17 on torch 2.11 builds one): recognised, with the reason the kernel cannot take it."""
    assert r.op == "sdpa" and r.attrs["scale"] == 0.25
    if r.attrs.get("attn_mask") == "tensor":
        assert r.unsupported and "attn_mask" in r.unsupported
    else:
        assert r.attrs["causal"] and r.unsupported is None and "strides" in r.attrs, r


def _assert_region_computes_its_node(result, r, rtol=1e-5, atol=1e-5):
    """The op family's eager reference on the region's leaves gives the node's recorded value: the
    region really is that op, with those inputs and attributes."""
    g = result.graphs[r.graph]
    leaves = [g.values[leaf] for leaf in r.leaves]
    fam = ops.get(r.op).module
    inputs = ops.fill_inputs(fam, [leaves[i] if i is not None else None for i in r.indices], r.attrs)
    want = g.values[r.root]
    with torch.no_grad():
        got = fam.reference(inputs, r.attrs)
    if r.extra_outputs:  # add_norm: one (2, ...) output, the root's value then the shared add's
        (extra,) = r.extra_outputs
        torch.testing.assert_close(got[1], g.values[extra], rtol=0, atol=0)
    if r.op == "add_norm":
        got = got[0]
    assert got.shape == want.shape and got.dtype == want.dtype, (r.label, got.shape, want.shape)
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


# -- Hugging Face models built from configs ----------------------------------------------------------
def test_llama_rmsnorm_silu_mul_rope_and_sdpa_regions():
    result = _trace(_llama(), _ids())
    assert len(result.graphs) == 1 and result.breaks == []
    by = _by_op(result)
    # linear: q, k, v, o_proj, down_proj per layer, and lm_head (tests/test_op_swiglu.py). Each residual add
    # feeds the next RMSNorm (through h.to(float32), a no-op in float32) and the next residual add: add_norm
    # (the add inside, h its extra output); the first layer's input_layernorm reads the embeddings: rmsnorm.
    assert _counts(by) == Counter(rmsnorm=1, add_norm=4, rope=4, sdpa=2, swiglu=2, linear=11, cat=4)
    assert [len(r.extra_outputs) for r in by["add_norm"]] == [1, 1, 1, 0]  # model.norm: h read by it only

    # RMSNorm (HF: weight * (x.float() * rsqrt(mean(x.float()**2) + eps)).to(dtype); in float32 every
    # cast is a no-op): matched with its weight, shape and dtype from the captured example values.
    norms = by["rmsnorm"] + by["add_norm"]
    assert all((r.shape, r.dtype, r.unsupported) == ((2, 16, 64), "float32", None) for r in norms)
    assert [r.attrs for r in by["rmsnorm"]] == [{"eps": 1e-6}]
    assert all(r.attrs == {"norm": "rmsnorm", "eps": 1e-6} for r in by["add_norm"])
    weights = sorted(name for r in norms for name in r.inputs if name.endswith("weight"))
    assert weights == sorted([f"model.layers.{i}.{n}.weight" for i in range(2)
                              for n in ("input_layernorm", "post_attention_layernorm")] + ["model.norm.weight"])
    # The MLP: silu(gate_proj(x)) * up_proj(x), one swiglu region on x and the two weights.
    mlp = by["swiglu"]
    assert all((r.shape, r.dtype, r.unsupported) == ((2, 16, 128, 64), "float32", None) for r in mlp)
    assert all(len(set(r.leaves)) == 3 for r in mlp)
    for r in norms + mlp:
        _assert_region_computes_its_node(result, r)

    # rope: q * cos + rotate_half(q) * sin with cos/sin (1, S, D) unsqueezed at dim 1 and q, k transposed
    # (B, S, H, D) projections: tunable in that layout (cos_batch 1, x's strides).
    layouts = {(2, 4, 16, 16): "1024,16,64,1;c;c", (2, 2, 16, 16): "512,16,32,1;c;c"}
    for r in by["rope"]:
        assert r.unsupported is None and r.dtype == "float32"
        assert r.attrs == {"cos_batch": 1, "strides": layouts[r.shape]}, r.attrs
        _assert_region_computes_its_node(result, r)
    # sdpa, HF's call: is_causal, scale and enable_gqa by keyword; q, k, v strided views of the projections.
    for r in by["sdpa"]:
        _assert_hf_causal_sdpa(r)
        if "attn_mask" not in r.attrs:  # GQA (4 query heads on 2 kv heads); q a transposed (B, S, H, D) view
            assert (r.shape, r.attrs["kv_heads"]) == ((2, 4, 16, 16, 16), 2)
            assert r.attrs["strides"].startswith("1024,16,64,1;")


def test_gpt2_layer_norms_and_gelu_new():
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2_CFG, attn_implementation="sdpa")).eval()
    result = _trace(model, _ids())
    by = _by_op(result)
    # linear per layer: c_attn, c_proj, c_fc + gelu_new, c_proj; and the lm_head. Each residual add feeds
    # the next layer_norm and the next residual add: add_norm (the add inside, h its extra output), so
    # c_proj no longer takes the residual as its epilogue. The first ln_1 reads the embeddings' sum wte + wpe
    # (through dropout, a no-op in eval): a broadcast add add_norm cannot take, so it is a plain layer_norm.
    assert _counts(by) == Counter(layer_norm=1, add_norm=4, linear=9, sdpa=2, cat=4)
    for r in by["add_norm"]:
        assert (r.shape, r.attrs, r.unsupported) == ((2, 16, 64), {"norm": "layer_norm", "eps": 1e-5}, None)
    # h is read again after every layer but the last (there ln_f is its only reader: no extra output)
    assert [len(r.extra_outputs) for r in by["add_norm"]] == [1, 1, 1, 0]
    for r in by["layer_norm"]:
        assert (r.shape, r.dtype, r.attrs, r.unsupported) == ((2, 16, 64), "float32", {"eps": 1e-5}, None)
        assert [n.rsplit(".", 1)[-1] for n in r.inputs[1:]] == ["weight", "bias"]
    # gelu_new: 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * torch.pow(x, 3.0)))), x = Conv1D's
    # addmm(bias, x, W) viewed back to (B, S, 4 * n_embd): one linear region with the tanh gelu, written out
    # (form="formula": the baseline runs gelu_new's eight kernels, as the model does)
    gelus = [r for r in by["linear"] if r.attrs["activation"] != "none"]
    assert [(r.shape, r.dtype, r.attrs, r.unsupported) for r in gelus] == [
        ((2, 16, 256, 64), "float32", {"weight": "kn", "bias": "linear", "activation": "gelu_tanh",
                                       "residual": False, "form": "formula"}, None)] * 2
    for r in by["layer_norm"] + by["linear"]:
        _assert_region_computes_its_node(result, r)
    for r in by["sdpa"]:
        _assert_hf_causal_sdpa(r)
        assert not r.attrs.get("enable_gqa") and r.attrs.get("kv_heads") in (None, 4)


def test_bert_layer_norms_and_gelu():
    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig(**BERT_CFG, attn_implementation="sdpa")).eval()
    result = _trace(model, _ids())
    by = _by_op(result)
    # linear per layer: query, key, value, attention output + residual, intermediate + gelu, output +
    # residual; and the pooler
    # post-norm: LayerNorm(dense(x) + input) is add_norm (its add single-use: no extra output), but for the
    # embeddings' LayerNorm
    assert _counts(by) == Counter(layer_norm=1, add_norm=4, linear=13, sdpa=2)
    assert all((r.shape, r.attrs, r.unsupported) == ((2, 16, 64), {"eps": 1e-12}, None) for r in by["layer_norm"])
    assert all((r.attrs, r.extra_outputs) == ({"norm": "layer_norm", "eps": 1e-12}, []) for r in by["add_norm"])
    assert [r.shape for r in by["linear"] if r.attrs["activation"] == "gelu"] == [(2, 16, 128, 64)] * 2
    for r in by["layer_norm"] + by["linear"]:
        _assert_region_computes_its_node(result, r)
    assert all(r.attrs["causal"] is False for r in by["sdpa"])


LLAMA_FILE = '''
import torch
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig({cfg}, attn_implementation="sdpa")).eval()


def forward(input_ids):
    return model(input_ids).logits


def get_inputs():
    return [torch.randint(0, 128, (2, 16))]
'''


@pytest.fixture
def llama_file(tmp_path):
    cfg = ", ".join(f"{k}={v!r}" for k, v in LLAMA_CFG.items())
    path = tmp_path / "llama_model.py"
    path.write_text(textwrap.dedent(LLAMA_FILE.format(cfg=cfg)))
    return path


def _cli_json(*args) -> dict:
    res = runner.invoke(cli.app, ["trace", *map(str, args), "--device", "cpu", "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_cli_traces_a_hf_model_file_function(llama_file, tmp_path):
    out = tmp_path / "forge.toml"
    doc = _cli_json(f"{llama_file}:forward", "--input", "2x16:int64", "--write-manifest", out, "--verify")
    assert [(g["index"], g["regions"]) for g in doc["graphs"]] == [(0, len(doc["regions"]))]
    assert doc["graph_breaks"] == {"count": 0, "reasons": []}
    by: dict = {}
    for r in doc["regions"]:
        by.setdefault(r["op"], []).append(r)
    # as test_llama_rmsnorm_silu_mul_rope_and_sdpa_regions: the residual adds and their norms are add_norm
    assert _counts(by) == Counter(rmsnorm=1, add_norm=4, rope=4, sdpa=2, swiglu=2, linear=11, cat=4)
    tunable = sorted({(r["op"], tuple(r["shape"]), r["dtype"]) for r in doc["regions"]
                      if r["tunable"] and r["op"] not in ("matmul", "linear")})
    # sdpa is tunable where HF calls it with is_causal (transformers 5.24); 5.17 passes a mask tensor
    causal_call = any(r["op"] == "sdpa" and "attn_mask" not in r["attrs"] for r in doc["regions"])
    assert tunable == [("add_norm", (2, 16, 64), "float32"), ("cat", (2, 2, 16, 16), "float32"),
                       ("rmsnorm", (2, 16, 64), "float32"),
                       ("rope", (2, 2, 16, 16), "float32"),
                       ("rope", (2, 4, 16, 16), "float32"),
                       *([("sdpa", (2, 4, 16, 16, 16), "float32")] if causal_call else []),
                       ("swiglu", (2, 16, 128, 64), "float32")]
    # the weights the function's global `model` holds, by name
    names = {n for r in doc["regions"] if r["op"] in ("rmsnorm", "add_norm") for n in r["inputs"]
             if n.endswith("weight")}
    assert names == {*(f"model.model.layers.{i}.{n}.weight" for i in range(2)
                       for n in ("input_layernorm", "post_attention_layernorm")), "model.model.norm.weight"}
    labels = [j.label for j in manifest.load(out, env={}).jobs if j.op not in ("matmul", "linear")]
    sdpa = [r["attrs"]["strides"] for r in doc["regions"] if r["op"] == "sdpa" and r["tunable"]][:1]
    assert labels == ["rmsnorm 2x16x64 float32 eps=1e-06",
                      "rope 2x4x16x16 float32 cos_batch=1 strides=1024,16,64,1;c;c",
                      "rope 2x2x16x16 float32 cos_batch=1 strides=512,16,32,1;c;c",
                      # k (rope's output, in its input's layout) and v (a view) into the empty cache: one spec
                      "cat 2x2x16x16 float32 dim=2 empty=1 sizes=16 strides=512,16,32,1",
                      *(f"sdpa 2x4x16x16x16 float32 causal=True kv_heads=2 scale=0.25 strides={st}" for st in sdpa),
                      "add_norm 2x16x64 float32 eps=1e-06 norm=rmsnorm",
                      "swiglu 2x16x128x64 float32"]
    v = doc["verify"]  # nothing cached: every region runs eager, the capture replays exactly
    assert v["ok"] and v["swapped"] == 0 and v["rel_error"] == 0.0 and v["graphs"] == 1


def test_cli_module_instance_in_half_precision(llama_file):
    """FILE.py:model names the nn.Module the file built; --dtype casts it. In float16 HF's RMSNorm rounds
    twice (the normalised x to float16, then the product with the weight): the whole module is rmsnorm with
    form="hf" (its kernels round so too), weight included, rooted at weight * (...); the residual adds with
    the norms after them are add_norm of form "hf" (through h.to(float32), an exact upcast here)."""
    doc = _cli_json(f"{llama_file}:model", "--dtype", "float16")
    norms = [r for r in doc["regions"] if r["op"] in ("rmsnorm", "add_norm")]
    assert Counter(r["op"] for r in norms) == Counter(rmsnorm=1, add_norm=4)
    assert {(tuple(r["shape"]), r["dtype"]) for r in norms} == {((2, 16, 64), "float16")}
    assert all(r["attrs"] == {"eps": 1e-6, "form": "hf", **({"norm": "rmsnorm"} if r["op"] == "add_norm" else {})}
               and r["tunable"] for r in norms)
    assert all(sum(name.endswith("weight") for name in r["inputs"]) == 1 for r in norms)


# -- graph breaks and control flow --------------------------------------------------------------------
class TwoNorms(nn.Module):
    def __init__(self, brk: str):
        super().__init__()
        self.brk = brk
        self.n1 = nn.LayerNorm(32)
        self.n2 = nn.LayerNorm(32)

    def forward(self, x):
        h = self.n1(x)
        if self.brk == "print":
            print("between the norms")
        else:
            torch._dynamo.graph_break()
        return F.gelu(self.n2(h * 2.0))


@pytest.mark.parametrize(("brk", "why"), [("print", "print"), ("graph_break", "graph_break()")])
def test_graph_break_gives_two_graphs_each_matched(brk, why, capsys):
    x = torch.randn(4, 32)
    result = _trace(TwoNorms(brk).eval(), x)
    assert len(result.graphs) == 2
    assert len(result.breaks) == 1 and why in result.breaks[0], result.breaks
    assert [(r.graph, r.op, r.shape) for r in result.regions] == [
        (0, "layer_norm", (4, 32)), (1, "layer_norm", (4, 32)), (1, "gelu", (4, 32))]
    assert [(u.graph, u.call) for u in result.unmatched] == [(1, "function mul")]
    for r in result.regions:
        _assert_region_computes_its_node(result, r)
    # --profile runs every graph: each region gets time
    p = tracetools.profile(result, iters=2)
    assert p["graphs"] == 2 and all(r.seconds > 0 for r in result.regions)


PROBLEM_WITH_PRINT = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.n1 = nn.LayerNorm(32)
        self.n2 = nn.LayerNorm(32)

    def forward(self, x):
        h = self.n1(x)
        print("between the norms")
        return F.gelu(self.n2(h * 2.0))


def get_inputs():
    return [torch.randn(4, 32)]
'''


class _FakeBinding:
    """A bound 'kernel' that is the op's eager reference (times `scale`)."""

    def __init__(self, op, indices, attrs, scale):
        self.spec = type("S", (), {"op": op.name})()
        self.fam, self.indices, self.attrs, self.scale = op.module, indices, attrs, scale

    def __call__(self, leaves):
        picked = [leaves[i] if i is not None else None for i in self.indices]
        return self.fam.reference(self.fam.fill_missing(picked), self.attrs) * self.scale


def _fake_resolve(scale: float):
    """forge.shim.resolve's stand-in for the backend: every tunable region 'has a kernel'."""
    from forge.shim import Explanation

    def resolve(op, picked, indices, attrs, tensors, **kw):
        return _FakeBinding(op, indices, attrs, scale), Explanation("kernel", "fake", op=op.name)

    return resolve


def test_cli_graph_breaks_json_and_verify_swaps_in_every_graph(tmp_path, monkeypatch):
    (tmp_path / "m.py").write_text(textwrap.dedent(PROBLEM_WITH_PRINT))
    doc = _cli_json(tmp_path / "m.py")  # the model's print goes to stderr: stdout is the JSON alone
    assert [g["regions"] for g in doc["graphs"]] == [1, 2] and doc["graph_breaks"]["count"] == 1
    assert [(r["graph"], r["op"]) for r in doc["regions"]] == [(0, "layer_norm"), (1, "layer_norm"), (1, "gelu")]
    res = runner.invoke(cli.app, ["trace", str(tmp_path / "m.py"), "--device", "cpu"])
    assert res.exit_code == 0 and "2 graph(s)" in res.stdout and "1 graph break(s)" in res.stdout, res.output

    import forge

    monkeypatch.setattr(forge.shim, "resolve", _fake_resolve(1.0))
    v = _cli_json(tmp_path / "m.py", "--verify")["verify"]
    assert v["ok"] and v["swapped"] == 3 and v["graphs"] == 2 and v["rel_error"] < 1e-6, v
    monkeypatch.setattr(forge.shim, "resolve", _fake_resolve(1.5))  # a wrong kernel in either graph is caught
    res = runner.invoke(cli.app, ["trace", str(tmp_path / "m.py"), "--device", "cpu", "--verify"])
    assert res.exit_code == 1 and "MISMATCH" in res.output


def branchy(x, w):
    if x.sum() > 0:
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    else:
        y = -x
    return torch.softmax(y, -1)


def test_data_dependent_control_flow_is_captured():
    x, w = torch.rand(4, 32) + 0.1, torch.rand(32) + 0.5
    with pytest.raises(Untraceable, match="torch.fx could not trace it"):
        TraceGraph(branchy, (x, w), {})
    result = _trace(branchy, x, w)
    assert len(result.graphs) == 2 and "Data-dependent branching" in result.breaks[0]
    assert [(r.graph, r.op, r.shape, r.unsupported) for r in result.regions if r.graph == 1] == [
        (1, "rmsnorm", (4, 32), None), (1, "softmax", (4, 32), None)]
    assert result.regions[0].op == "reduce" and "all dimensions" in result.regions[0].unsupported  # x.sum()
    for r in result.regions[1:]:
        _assert_region_computes_its_node(result, r)
    torch.testing.assert_close(result.graphs[1].output[0], branchy(x, w))


def test_capture_leaves_no_compiled_state_and_reports_failures():
    def f(x):
        return torch.softmax(x * 2.0, -1)

    result = _trace(f, torch.randn(3, 8))
    assert [r.op for r in result.regions] == ["softmax"]
    entries = getattr(torch._C._dynamo.eval_frame, "_debug_get_cache_entry_list", None)
    if entries is not None:
        assert entries(f.__code__) == []

    def broken(x):
        return x @ torch.ones(5, 5)

    with pytest.raises(UsageError, match="cannot trace: TorchDynamo could not capture it"):
        _trace(broken, torch.randn(3, 4))


# -- distinct opaque values ----------------------------------------------------------------------------
class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(32, 64, bias=False)
        self.up = nn.Linear(32, 64, bias=False)

    def forward(self, x):
        return F.silu(self.gate(x)) * self.up(x)


def test_silu_of_one_linear_times_another_is_swiglu():
    torch.manual_seed(0)
    model, x = Gated().eval(), torch.randn(4, 32)
    result = _trace(model, x)
    (r,) = result.regions
    assert (r.op, r.shape, r.unsupported) == ("swiglu", (4, 64, 32), None)
    xs, wg, wu = (result.graphs[0].values[r.leaves[i]] for i in r.indices)
    torch.testing.assert_close(xs, x)
    assert wg is model.gate.weight and wu is model.up.weight
    _assert_region_computes_its_node(result, r)
    # The fx path (the shim's trace) as well: the two Linear calls are two trees, not one opaque value.
    g = TraceGraph(model, (x,), {})
    regions, _ = tracetools.find_regions(g, "cpu")
    assert [x.op for x in regions] == ["swiglu"]
    expr = canonical(model, (x,), {}).expr
    silu = next(f for f in expr[1:] if f[0] == "silu")
    lin = next(f for f in expr[1:] if f[0] == "linear")
    assert silu[1][0] == "linear" and silu[1] != lin and silu[1][1] == lin[1]  # same x, different weights


def test_opaque_values_keep_their_identity():
    x = torch.randn(4, 8)

    def two(x):
        return torch.sigmoid(x.cumsum(-1)) * x.cumsum(0)

    def one(x):
        y = x.cumsum(-1)
        return torch.sigmoid(y) * y

    def once_twice(x):
        return torch.sigmoid(x.cumsum(-1)) * x.cumsum(-1)  # the same call twice: two values (two nodes)

    for fn, same in ((two, False), (one, True), (once_twice, False)):
        expr = canonical(fn, (x,), {}).expr
        sig = next(f for f in expr[1:] if f[0] == "sigmoid")
        other = next(f for f in expr[1:] if f[0] == "opaque")
        assert sig[1][0] == "opaque" and (sig[1] == other) is same, (fn.__name__, expr)


# -- canonical forms of Dynamo graphs --------------------------------------------------------------------
def _expr(fn, *args):
    return canonical(fn, args, {}).expr


def test_canonical_linear_addmm_layout_and_casts():
    x, w, b, w2 = torch.randn(4, 8), torch.randn(6, 8), torch.randn(6), torch.randn(8, 6)
    assert _expr(lambda x, w, b: F.linear(x, w, b), x, w, b) == ("linear", ("input", 0), ("input", 1), ("input", 2))
    assert _expr(lambda x, w: torch._C._nn.linear(x, w), x, w) == (
        "linear", ("input", 0), ("input", 1), ("const", None))
    assert _expr(lambda b, x, w: torch.addmm(b, x, w), b, x, w2) == (
        "addmm", ("input", 0), ("input", 1), ("input", 2), ("const", 1), ("const", 1))
    i0 = ("input", 0)
    # views: one form whatever the spelling; nested views are one; a view to x's own shape is x
    v = ("view", i0, ("const", (4, 1, 8)))
    assert _expr(lambda x: x.unsqueeze(1), x) == v
    assert _expr(lambda x: x.view(4, 1, 8), x) == v
    assert _expr(lambda x: x.reshape(2, 2, 8).reshape(4, 1, 8), x) == v
    assert _expr(lambda x: x[:, None], x) == v
    assert _expr(lambda x: x.view(32).view(4, 8), x) == i0
    assert _expr(lambda x: x[:, :], x) == i0
    # permutes: transpose, permute, t, composed; the identity is x
    p = ("permute", i0, ("const", (1, 0)))
    assert _expr(lambda x: x.transpose(0, 1), x) == p == _expr(lambda x: x.t(), x)
    assert _expr(lambda x: x.permute(1, 0), x) == p
    assert _expr(lambda x: x.t().t(), x) == i0
    y = torch.randn(2, 3, 4, 5)
    assert _expr(lambda y: y.transpose(1, 2).permute(0, 2, 3, 1), y) == (
        "permute", ("input", 0), ("const", (0, 1, 3, 2)))
    # contiguous of a non-contiguous value stays; of a contiguous one it is x; expand
    assert _expr(lambda x: x.t().contiguous(), x) == ("contiguous", p)
    assert _expr(lambda x: x.contiguous(), x) == i0
    assert _expr(lambda x: x[None].expand(3, 4, 8), x) == ("expand", ("view", i0, ("const", (1, 4, 8))),
                                                          ("const", (3, 4, 8)))
    # casts: by the result's dtype; no-ops fold; an exact widening round trip is x
    h = x.half()
    assert _expr(lambda x: x.float(), x) == i0
    assert _expr(lambda x: x.to(torch.float32), x) == i0
    assert _expr(lambda h: h.float(), h) == ("cast", i0, ("const", "float32"))
    assert _expr(lambda h: h.to(torch.float32).half(), h) == i0
    assert _expr(lambda h: h.float().bfloat16(), h) == ("cast", ("cast", i0, ("const", "float32")),
                                                        ("const", "bfloat16"))
    assert _expr(lambda x, h: x.type_as(h), x, h) == ("cast", i0, ("const", "float16"))
    # F.dropout in eval is x; GPT-2's torch.pow(x, 3.0) is x * x * x
    assert _expr(lambda x: F.dropout(x, 0.1, training=False), x) == i0
    assert _expr(lambda x: torch.pow(x, 3.0), x) == ("mul", i0, i0, i0)


def test_sdpa_keyword_spelling_of_hugging_face():
    q = torch.randn(1, 4, 8, 16)
    k = v = torch.randn(1, 2, 8, 16)
    expr = _expr(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, scale=0.25,
                                                               is_causal=True, enable_gqa=True), q, k, v)
    assert expr == ("sdpa", ("input", 0), ("input", 1), ("input", 2), ("const", None), ("const", 0.0),
                    ("const", True), ("const", 0.25), ("const", True))
    assert ops.get("sdpa").module.match(expr) == ([0, 1, 2], {"causal": True, "scale": 0.25, "enable_gqa": True})


# -- exact numerics: HF LlamaRMSNorm --------------------------------------------------------------------
def _rms_kernel(x, w, eps, tmp_path):
    """What forge's rmsnorm kernel (the default candidate, on the interpreter or the GPU) returns."""
    op = ops.get("rmsnorm")
    spec = op.module.make_spec(tuple(x.shape), str(x.dtype).removeprefix("torch."), DEVICE, {"eps": eps})
    module = load_module(write_source(codegen.render(op, spec, op.module.default(spec)), tmp_path))
    out = op.module.alloc_output((x, w), spec)
    op.module.run(module, (x.contiguous(), w.contiguous()), out, spec.attrs)
    return out


def _rounded(v32: torch.Tensor, dtype) -> torch.Tensor:
    """fp32 -> dtype as the kernel's store rounds. The Triton interpreter converts float32 to bfloat16
    by truncation (triton/runtime/interpreter.py, cast_impl); the GPU rounds to nearest even like torch."""
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        return (v32.contiguous().view(torch.int32) & ~0xFFFF).view(torch.float32).to(dtype)
    return v32.to(dtype)


class OneRounding(nn.Module):
    """The spelling forge's kernel computes exactly: float32 arithmetic, weight included, one rounding."""

    def __init__(self, n, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)


class RsqrtRounded(nn.Module):
    """A spelling the kernel cannot compute: the float32 rsqrt rounded to x's dtype, then products in it."""

    def __init__(self, n, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps).to(x.dtype) * self.weight


def _norm(cls, dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    m = (LlamaRMSNorm if cls is None else cls)(64, eps=1e-6)
    with torch.no_grad():
        m.weight.copy_(torch.randn(64) * 0.5 + 1.0)
    x = (torch.randn(2, 16, 64) * 3).to(DEVICE, dtype)
    return m.to(DEVICE, dtype).eval(), x


def _output_node(result):
    out = result.graphs[0].output_node()
    return out[0] if isinstance(out, tuple | list) else out


def test_hf_llama_rmsnorm_in_float32_is_rmsnorm_with_its_weight(tmp_path):
    m, x = _norm(None, torch.float32)
    result = _trace(m, x, device=DEVICE)
    (r,) = result.regions
    assert (r.op, r.shape, r.dtype, r.root) == ("rmsnorm", (2, 16, 64), "float32", _output_node(result))
    assert sorted(r.inputs) == ["l_hidden_states_", "weight"] and None not in r.indices
    with torch.no_grad():
        torch.testing.assert_close(_rms_kernel(x, m.weight, 1e-6, tmp_path), m(x), rtol=1e-5, atol=1e-6)


def _rms_kernel_hf(x, w, eps, tmp_path):
    """forge's rmsnorm kernel for form="hf" (the default candidate): rounds before the weight, as HF does."""
    op = ops.get("rmsnorm")
    spec = op.module.make_spec(tuple(x.shape), str(x.dtype).removeprefix("torch."), DEVICE, {"eps": eps, "form": "hf"})
    module = load_module(write_source(codegen.render(op, spec, op.module.default(spec)), tmp_path))
    out = op.module.alloc_output((x, w), spec)
    op.module.run(module, (x.contiguous(), w.contiguous()), out, spec.attrs)
    return out


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_hf_llama_rmsnorm_in_half_rounds_twice_and_is_rmsnorm_form_hf(dtype, tmp_path):
    """weight * (x.float() * rsqrt(...)).to(dtype) rounds twice: the whole module is rmsnorm with
    form="hf", whose kernels round the normalised value before the weight multiplies it, so the region
    swapped in gives the module's own values (bit for bit where the store rounds as torch does)."""
    m, x = _norm(None, dtype)
    result = _trace(m, x, device=DEVICE)
    (r,) = result.regions
    assert (r.op, r.shape, r.dtype, r.root) == ("rmsnorm", (2, 16, 64), str(dtype)[6:], _output_node(result))
    assert r.attrs == {"eps": 1e-6, "form": "hf"} and r.unsupported is None and result.unmatched == []
    assert sorted(r.inputs) == ["l_hidden_states_", "weight"] and None not in r.indices
    _assert_region_computes_its_node(result, r, rtol=0, atol=0)  # the reference is HF's spelling exactly
    w = m.weight.detach()
    got = _rms_kernel_hf(x, w, 1e-6, tmp_path)
    xf = x.float()
    normalised = _rounded(xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6), dtype)
    assert torch.equal(got, _rounded(w.float() * normalised.float(), dtype))  # two roundings, as the kernel does
    if dtype == torch.float16 or DEVICE == "cuda":
        with torch.no_grad():
            assert torch.equal(got, m(x))  # the module's own values
            # ... while the one-rounding kernel would not give them: why the form is recorded
            assert not torch.equal(_rms_kernel(x, w, 1e-6, tmp_path), m(x))


def test_a_cast_to_another_dtype_than_xs_is_not_form_hf():
    """The normalised value cast to bfloat16 while x is float16: not what rmsnorm's kernels compute."""
    x = torch.randn(4, 64, dtype=torch.float16)
    w = torch.randn(64, dtype=torch.bfloat16)

    def mixed(x, w):
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)

    result = _trace(mixed, x, w)
    assert all(r.op != "rmsnorm" or r.unsupported for r in result.regions), [r.label for r in result.regions]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_one_rounding_spelling_in_half_is_rmsnorm_exactly(dtype, tmp_path):
    m, x = _norm(OneRounding, dtype)
    result = _trace(m, x, device=DEVICE)
    (r,) = result.regions
    assert (r.op, r.dtype, r.root, r.unsupported) == ("rmsnorm", str(dtype)[6:], _output_node(result), None)
    assert sorted(r.inputs) == ["l_x_", "weight"] and None not in r.indices
    w = m.weight.detach()
    xf = x.float()
    want = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()
    got = _rms_kernel(x, w, 1e-6, tmp_path)
    assert torch.equal(got, _rounded(want, dtype))
    if dtype == torch.float16 or DEVICE == "cuda":
        with torch.no_grad():
            assert torch.equal(got, m(x))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_spelling_the_kernel_cannot_compute_is_not_rmsnorm(dtype):
    m, x = _norm(RsqrtRounded, dtype)
    result = _trace(m, x, device=DEVICE)
    assert "rmsnorm" not in [r.op for r in result.regions]
    # in float32 every cast is a no-op, and it is rmsnorm
    m32, x32 = _norm(RsqrtRounded, torch.float32)
    assert [r.op for r in _trace(m32, x32, device=DEVICE).regions] == ["rmsnorm"]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize(("shape", "attrs"), [((3, 37), {}), ((1, 300), {}), ((2, 5, 33), {"dims": 2}),
                                               ((2, 6, 3, 5), {"dim": -3})])
def test_every_rmsnorm_variant_of_form_hf_validates(shape, attrs, dtype, tmp_path):
    """form="hf" in every variant (row, looped, multirow; strided over a non-last dim) against the float64
    oracle of HF's spelling, and a candidate that ignores the rounding (the one-rounding render) too: the
    oracle does not tell them apart (one extra rounding is within the tolerance), the reference does."""
    from forge.tuner.validate import check_candidate

    op = ops.get("rmsnorm")
    spec = op.module.make_spec(shape, dtype, DEVICE, {"eps": 1e-6, "form": "hf", **attrs})
    assert spec.attrs["form"] == "hf"
    space, seen = op.module.space(spec), set()
    for variant in space.variants:
        points = space.points(variant)
        if not points:
            continue
        cand = points[0]
        seen.add(variant)
        source = codegen.render(op, spec, cand)
        assert ".to(tl.float32) * w" in source  # the rounding before the weight is rendered
        module = load_module(write_source(source, tmp_path))
        assert check_candidate(op.module, module, spec, 0, lambda: None) is None, cand
    # the shapes' spaces hold row and multirow (3x37), row and looped (1x300, 2x5x33 over 165 values), strided
    assert seen >= ({"strided"} if "dim" in attrs else {"row"}) and len(seen) >= (1 if "dim" in attrs else 2)
    plain = op.module.make_spec(shape, dtype, DEVICE, {"eps": 1e-6, **attrs})
    assert ".to(tl.float32) * w" not in codegen.render(op, plain, op.module.default(plain))
