"""cat (kernels/cat.py): torch.cat along one dim, strided inputs, the KV cache's update. Every candidate against
the float64 oracle (exact: a copy) at odd shapes, several inputs, every dim, transposed-view inputs; the spec's
rules; the matcher on the spellings transformers' DynamicLayer uses (an empty torch.tensor([]) past, then a
real one); the backend swapping the kernel in and falling back on another layout."""

from __future__ import annotations

import pytest
import torch

from forge import backend as fb
from forge import codegen, ops
from forge.loader import load_module, write_source
from forge.regions import find_regions
from forge.tuner import stats
from tests.conftest import HAS_CUDA, dynamo_graph, search_only

OP = ops.get("cat")
MOD = OP.module
cpu_only = pytest.mark.skipif(HAS_CUDA, reason="the interpreter path (CPU tensors)")


def _run(spec, cand, inputs, tmp_path):
    module = load_module(write_source(codegen.render(OP, spec, cand), tmp_path))
    out = MOD.alloc_output(inputs, spec)
    MOD.run(module, inputs, out, spec.attrs)
    return out


CASES = [  # (output shape, attrs, strides of the inputs or None)
    ((7,), {"dim": 0, "sizes": "3,4"}, None),
    ((3, 7), {"dim": 1, "sizes": "3,1,3"}, None),
    ((5, 300), {"dim": 0, "sizes": "2,3"}, None),
    ((1, 4100), {"dim": -1, "sizes": "4099,1"}, None),
    ((2, 3, 9, 16), {"dim": 2, "sizes": "8,1"}, None),  # the decode step: the past, then one new position
    ((2, 3, 9, 16), {"dim": 2, "empty": 1}, None),  # the prefill: an empty past, the new keys
    # the new keys as transformers has them: a transposed view of (B, S, H, D) (GPT-2's, out of a fused qkv:
    # row stride 3 * H * D)
    ((2, 3, 9, 16), {"dim": 2, "empty": 1}, "1296,16,144,1"),
    ((2, 3, 9, 16), {"dim": 2, "sizes": "8,1"}, "384,16,48,1;48,16,16,1"),
    ((2, 5, 33), {"dim": 1, "sizes": "2,3"}, "33,66,1;99,33,1"),  # any order of strides
    ((4, 6), {"dim": 0, "sizes": "1,3"}, "1,4;1,4"),  # a transposed input: the last dim strided
]


@cpu_only
@pytest.mark.parametrize(("shape", "attrs", "strides"), CASES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_every_candidate_copies_exactly(shape, attrs, strides, dtype, tmp_path):
    a = dict(attrs) if strides is None else {**attrs, "strides": strides}
    spec = MOD.make_spec(shape, dtype, "cpu", a)
    inputs = MOD.make_inputs(spec, 3)
    if strides is not None:
        assert any(not t.is_contiguous() for t in inputs)
    want = MOD.reference(inputs, spec.attrs)
    assert tuple(want.shape) == tuple(shape)
    assert torch.equal(want, torch.cat([t.double() for t in inputs], spec.attrs["dim"]).to(want.dtype))
    pts = MOD.space(spec).points("rows")
    assert pts  # every shape has a valid tile
    cands = [*MOD.test_candidates(spec), MOD.default(spec), *pts[:: max(1, len(pts) // 4)]]
    for cand in dict.fromkeys(cands):
        got = _run(spec, cand, inputs, tmp_path)
        assert got.is_contiguous() and torch.equal(got, want), (cand, shape, attrs, strides)


def test_spec_rules():
    spec = MOD.make_spec((2, 4, 9, 16), "bfloat16", "cpu", {"dim": -2, "sizes": "8,1"})
    assert spec.attrs == {"dim": 2, "sizes": "8,1"}
    assert [t.shape for t in spec.inputs] == [(2, 4, 8, 16), (2, 4, 1, 16)]
    assert MOD.problem_shape(spec) == (2, 4, 9, 16)
    # the defaults: one input, the output's shape (a copy); "empty" is absent when 0 (keys unchanged)
    assert MOD.make_spec((3, 5), "float32", "cpu").attrs == {"dim": 1, "sizes": "5"}
    assert MOD.make_spec((3, 5), "float32", "cpu", {"empty": 2}).attrs == {"dim": 1, "sizes": "5", "empty": 2}
    # the matcher's note on the empties' dtype is checked, then dropped
    assert MOD.make_spec((3, 5), "float16", "cpu", {"empty": 1, "empty_dtype": "float16"}).attrs["empty"] == 1
    bad = [({"sizes": "2,2"}, "add up to 4"), ({"sizes": "5,0"}, "positive integer"), ({"sizes": "a"}, "positive"),
           ({"dim": 2}, "not a dim"), ({"dim": True}, "not a dim"),
           ({"empty": -1}, "empty"), ({"empty": 1, "empty_dtype": "float32"}, "promotes"), ({"kind": 1}, "kind")]
    for attrs, why in bad:
        with pytest.raises(ValueError, match=why):
            MOD.make_spec((3, 5), "float16", "cpu", attrs)
    # a very long last dim: no tile leaves more column tiles than CUDA's grid y limit
    wide = MOD.make_spec((2, 1 << 21), "float16", "cuda")
    pts = MOD.space(wide).points("rows")
    assert pts and all(-(-(1 << 21) // c.p["BLOCK_C"]) <= 65535 for c in pts) and MOD.default(wide) in pts
    assert len(MOD.make_spec((3, 5), "float16", "cpu", {"sizes": ",".join(["1"] * 5)}).inputs) == 5
    with pytest.raises(ValueError, match="at most 8"):
        MOD.make_spec((3, 9), "float16", "cpu", {"sizes": ",".join(["1"] * 9)})
    with pytest.raises(ValueError, match="int64"):
        MOD.make_spec((3, 5), "int64", "cpu")
    # problem(): what the tensors show
    attrs = {"dim": -2}
    assert MOD.problem([torch.zeros(2, 4, 8, 16), torch.zeros(2, 4, 1, 16)], attrs) == (2, 4, 9, 16)
    assert attrs == {"dim": 2, "sizes": "8,1"}
    for ts, why in [([torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.float16)], "one dtype"),
                    ([torch.zeros(2, 3), torch.zeros(3, 3)], "do not concatenate"),
                    ([torch.zeros(0), torch.zeros(2, 3)], "empty input")]:
        with pytest.raises(ValueError, match=why):
            MOD.problem(ts, {"dim": 1})


def prefill(qkv):
    """transformers' DynamicLayer on a prefill: the cache starts as an empty tensor, k a transposed view."""
    b, s, _ = qkv.shape
    k = qkv.view(b, s, 3, 4, 8)[:, :, 1].transpose(1, 2)
    past = torch.tensor([], dtype=qkv.dtype, device=qkv.device)
    return torch.cat([past, k], dim=-2) * 2.0


def decode(past, new):
    return torch.cat([past, new], dim=-2)


def doubled(x):
    return torch.cat([x, x], dim=-1)  # one tensor twice: not a cat region (rope's halves are rope's)


def promoted(x):
    return torch.cat([torch.tensor([], dtype=torch.float32), x], dim=-2)


def test_matcher_takes_the_kv_cache_spellings():
    (r,) = [r for r in find_regions(dynamo_graph(prefill, torch.randn(2, 5, 96)), "cpu")[0] if r.op == "cat"]
    assert (r.shape, r.attrs, r.unsupported) == ((2, 4, 5, 8), {"dim": 2, "sizes": "5", "empty": 1,
                                                                "strides": "480,8,96,1"}, None)
    assert len(r.leaves) == 1  # the empty tensor is no region input: a constant inside the region
    (r,) = [r for r in find_regions(dynamo_graph(decode, torch.randn(2, 4, 6, 8), torch.randn(2, 4, 1, 8)),
                                    "cpu")[0] if r.op == "cat"]
    assert (r.shape, r.attrs, r.unsupported) == ((2, 4, 7, 8), {"dim": 2, "sizes": "6,1"}, None)
    assert not [r for r in find_regions(dynamo_graph(doubled, torch.randn(3, 4)), "cpu")[0] if r.op == "cat"]
    # an empty float32 past with half keys: torch.cat promotes the result, the kernel would not
    regions, _ = find_regions(dynamo_graph(promoted, torch.randn(2, 3, 4, dtype=torch.float16)), "cpu")
    (r,) = [r for r in regions if r.op == "cat"]
    assert "promotes" in r.unsupported


class KV(torch.nn.Module):
    """A projection, its keys as a transposed view concatenated onto an empty cache, then used."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)

    def forward(self, x):
        b, s, _ = x.shape
        k = self.qkv(x).view(b, s, 3, 2, 8)[:, :, 1].transpose(1, 2)
        keys = torch.cat([torch.tensor([], dtype=x.dtype, device=x.device), k], dim=-2)
        return keys, keys.sum(-1)


@cpu_only
@pytest.mark.slow
def test_backend_swaps_the_cat_kernel_and_falls_back_on_another_layout(tmp_path, monkeypatch):
    monkeypatch.setattr(stats, "accepts", lambda *a, **k: True)  # the interpreter never beats eager
    search_only(monkeypatch, "cat")  # the projection runs as written
    model = KV().eval()
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        ref = model(x)
    be = fb.Backend(miss="search", budget=1, cache=tmp_path / "cache", interpreter=True)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=be)
    with torch.no_grad():
        compiled(x)
        got = compiled(x)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])  # a copy: exactly eager's
    assert got[0].is_contiguous()
    (r,) = [r for r in be.explain().regions if r.op == "cat"]
    assert r.uses == "kernel" and r.attrs["empty"] == 1, r
    (call,) = [c for c in be.kernel_calls if c.__name__ == "forge_cat"]
    assert call.calls == 1 and call.fallbacks == 0
    # another layout at the guarded call (a contiguous k): the region's own nodes, exactly torch.cat's
    k2 = torch.randn(2, 2, 5, 8)
    out = call(k2)
    assert call.fallbacks == 1 and torch.equal(out, k2)
    torch._dynamo.reset()
