"""Strided inputs (the layout issue, first part): the "strides" attribute, specs and keys that carry a
layout, validation on inputs in that layout (gaps poisoned with NaN), every variant of the row families
(rmsnorm, layer_norm, softmax, log_softmax) on strided x through the interpreter against the float64
oracle, the shim and `forge trace` taking strided x, and the refusals (a strided weight, a transposed
last dim, overlapping strides)."""

from __future__ import annotations

import re

import pytest
import torch

import forge
from forge import key as keys
from forge import opkit, ops
from forge.regions import find_regions
from forge.spec import same_layout
from forge.trace import TraceGraph
from forge.tuner import manifest, stats
from forge.tuner.validate import check_candidate
from tests.conftest import DEVICE
from tests.test_templates import _load, candidates_for

ROW_FAMILIES = ("rmsnorm", "layer_norm", "softmax", "log_softmax")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# -- the attribute ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "needle"), [
    ("100,1", "names 1 input(s); the op takes 2"),
    ("100,1;c;c", "names 3 input(s)"),
    ("100,x;c", "neither 'c' nor integers"),
    ("1,6;c", "last dimension must be contiguous"),
    ("20,1;c", "overlap"),
    ("-100,1;c", "overlap or are not positive"),
    ("c;2", "input 1 must be contiguous"),
    (7, "expected a string"),
])
def test_bad_strides_are_refused_with_the_reason(text, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        ops.get("rmsnorm").module.make_spec((6, 40), "float32", "cpu", {"eps": 1e-6, "strides": text})


def test_a_contiguous_layout_is_the_contiguous_spec_and_key():
    mod = ops.get("rmsnorm").module
    plain = mod.make_spec((6, 40), "float32", "cpu", {"eps": 1e-6})
    named = mod.make_spec((6, 40), "float32", "cpu", {"eps": 1e-6, "strides": "40,1;c"})
    assert named == plain and "strides" not in named.attrs
    strided = mod.make_spec((6, 40), "float32", "cpu", {"eps": 1e-6, "strides": "100,1;c"})
    assert strided.inputs[0].strides == (100, 1) and strided.attrs["strides"] == "100,1;c"
    assert strided.inputs[0].span_bytes == (5 * 100 + 40) * 4  # the span, gaps included (memory model)
    assert strided.inputs[0].nbytes == 6 * 40 * 4  # the elements (what a kernel moves: the roofline)
    k = [keys.locate(ops.get("rmsnorm"), s, "interpreter").key for s in (plain, strided)]
    assert k[0] != k[1]
    # A size-1 dim's stride does not matter: the same layout, the same spec.
    one = mod.make_spec((1, 40), "float32", "cpu", {"eps": 1e-6, "strides": "999,1;c"})
    assert one == mod.make_spec((1, 40), "float32", "cpu", {"eps": 1e-6})


def test_inputs_come_in_the_layout_with_poisoned_gaps():
    mod = ops.get("rmsnorm").module
    spec = mod.make_spec((6, 40), "float32", "cpu", {"eps": 1e-6, "strides": "100,1;c"})
    x, w = mod.make_inputs(spec, 3)
    x0, w0 = mod.make_inputs(mod.make_spec((6, 40), "float32", "cpu", {"eps": 1e-6}), 3)
    assert x.stride() == (100, 1) and torch.equal(x, x0) and torch.equal(w, w0) and w.is_contiguous()
    storage = torch.tensor([], dtype=x.dtype).set_(x.untyped_storage())
    assert storage.numel() == 5 * 100 + 40 and int(storage.isnan().sum()) == 5 * 60


# -- every variant on strided x, against the float64 oracle -----------------------------------------
def _strided_cases():
    cases = []
    for name in ROW_FAMILIES:
        for shape, strides in (((5, 33), (48, 1)), ((2, 3, 40), (200, 64, 1)), ((3, 2, 24), (24, 72, 1))):
            for cand in candidates_for(name, shape):
                sid = "x".join(map(str, shape))
                cases.append(pytest.param(name, shape, strides, cand, id=f"{name}-{cand.label}-{sid}-{strides}"))
    return cases


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize(("op_name", "shape", "strides", "cand"), _strided_cases())
def test_every_row_variant_on_strided_x_matches_the_oracle(op_name, shape, strides, cand, tmp_path):
    """Row strides (a slice of a wider buffer), uneven outer strides (run() copies to rows) and permuted
    outer dims (a transposed (S, B, D) buffer read as (B, S, D))."""
    op = ops.get(op_name)
    n_inputs = len(op.module.make_spec(shape, "float32", DEVICE).inputs)
    text = ";".join([",".join(map(str, strides))] + ["c"] * (n_inputs - 1))
    spec = op.module.make_spec(shape, "float32", DEVICE, {"strides": text})
    assert spec.inputs[0].strides == strides
    module = _load(op, spec, cand, tmp_path)
    reason = check_candidate(op.module, module, spec, 5, _sync)
    assert reason is None, f"{cand.label} on {shape} strides {strides}: {reason}"


def test_a_kernel_that_reads_the_gaps_is_caught(tmp_path):
    """A row kernel that assumed contiguous rows (row * N instead of the row stride) reads the NaN gaps."""
    op = ops.get("softmax")
    spec = op.module.make_spec((5, 33), "float32", DEVICE, {"strides": "48,1"})
    cand = op.module.default(spec)
    src = codegen_render(op, spec, cand).replace("x.stride(0)", "x.shape[1]")
    from forge.loader import load_module, write_source

    module = load_module(write_source(src, tmp_path))
    assert check_candidate(op.module, module, spec, 5, _sync) is not None


def codegen_render(op, spec, cand):
    from forge import codegen

    return codegen.render(op, spec, cand)


# -- the shim and forge trace ---------------------------------------------------------------------------
def rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


@pytest.mark.slow
def test_the_shim_tunes_and_runs_strided_x(monkeypatch):
    monkeypatch.setattr(stats, "accepts", lambda *a, **k: True)  # the interpreter never beats eager
    buf, w = torch.randn(6, 100), torch.randn(40)
    x = buf[:, 12:52]  # 48 bytes into each row: 16-byte aligned
    f = forge.optimize(rms, interpreter=True, budget=2, warn=False)
    y = f(x, w)
    e = forge.explain(f, x, w)
    assert e.uses == "kernel" and e.op == "rmsnorm", e
    torch.testing.assert_close(y.double(), rms(x.double(), w.double()), rtol=1e-5, atol=1e-6)
    assert y.is_contiguous()
    # The contiguous layout is another spec: not this kernel (a cache miss, searching off).
    g = forge.optimize(rms, interpreter=True, search=False, warn=False)
    assert forge.explain(g, x.contiguous(), w).reason.startswith("cache miss")
    assert forge.explain(g, x, w).uses == "kernel"


def test_the_shim_says_which_layouts_it_refuses():
    f = forge.optimize(rms, interpreter=True, search=False, warn=False)
    x = torch.randn(6, 40)
    assert "non-contiguous input 1" in forge.explain(f, x, torch.randn(80)[::2]).reason
    assert "last dimension must be contiguous" in forge.explain(f, torch.randn(40, 6).t(), torch.randn(40)).reason


def test_trace_regions_carry_the_layout_into_the_manifest(tmp_path):
    def model(buf, w):
        return torch.softmax(rms(buf[:, :, :32], w), -1)

    g = TraceGraph(model, (torch.randn(2, 3, 48), torch.randn(32)), {})
    regions, _ = find_regions(g, "cpu")
    by = {r.op: r for r in regions}
    assert by["rmsnorm"].attrs["strides"] == "144,48,1;c" and not by["rmsnorm"].unsupported
    assert "strides" not in by["softmax"].attrs  # rmsnorm's output is contiguous
    from forge.tuner import tracetools

    path = tmp_path / "m.toml"
    path.write_text(manifest.dumps(tracetools.manifest_entries(regions), {"device": "cpu"}))
    jobs = {j.op: j for j in manifest.load(path).jobs}
    assert jobs["rmsnorm"].attrs["strides"] == "144,48,1;c"
    spec = ops.get("rmsnorm").module.make_spec(jobs["rmsnorm"].shape, "float32", "cpu", jobs["rmsnorm"].attrs)
    assert spec.inputs[0].strides == (144, 48, 1)


def test_opkit_strides_text_round_trips():
    assert opkit.strides_text([((6, 40), (40, 1)), ((40,), (1,))]) is None
    assert opkit.strides_text([((6, 40), (100, 1)), ((40,), (1,))]) == "100,1;c"


def test_an_exported_strided_kernel_takes_its_layout_only(tmp_path):
    from forge.tuner import export
    from tests.test_export import _load as load_exported
    from tests.test_export import kernel_entry

    entry = kernel_entry("rmsnorm", (3, 40), attrs={"eps": 1e-6, "strides": "64,1;c"})
    path = export.export(entry, ops.get("rmsnorm"), tmp_path, name="rms_strided").path
    assert "x: float32 (3, 40), strides (64, 1), cpu" in path.read_text()
    mod = load_exported(path)
    buf, w = torch.randn(3, 64), torch.randn(40)
    x = buf[:, 8:48]
    torch.testing.assert_close(mod.rmsnorm(x, w).double(), rms(x.double(), w.double()), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=re.escape("x must have strides (64, 1) (the layout it was tuned for), "
                                                   "got (40, 1)")):
        mod.rmsnorm(x.contiguous(), w)


# -- attention on q/k/v views: Hugging Face's layout, a fused qkv buffer -----------------------------------
def _sdpa_layouts(b, hq, hkv, sq, skv, d):
    """(name, q strides, k strides, v strides): HF's (B, S, H, D) buffers read as (B, H, S, D), and q/k/v
    thirds of one fused (B, S, (Hq + 2 Hkv) * D) projection (GPT-2's c_attn split)."""
    hf_q, hf_kv = (sq * hq * d, d, hq * d, 1), (skv * hkv * d, d, hkv * d, 1)
    width = (hq + 2 * hkv) * d
    fused_q, fused_kv = (sq * width, d, width, 1), (skv * width, d, width, 1)
    return [("hf", hf_q, hf_kv, hf_kv), ("fused", fused_q, fused_kv, fused_kv),
            ("mixed", hf_q, (hkv * skv * d, skv * d, d, 1), hf_kv)]


def _sdpa_cases():
    cases = []
    for shape in ((2, 4, 2, 9, 9, 16), (1, 6, 2, 1, 13, 16), (1, 3, 3, 17, 7, 8)):
        for causal in (False, True):
            for name, qs, ks, vs in _sdpa_layouts(*shape):
                for cand in ops.get("sdpa").module.test_candidates(
                        ops.get("sdpa").module.make_spec((shape[0], shape[1], shape[3], shape[4], shape[5]),
                                                         "float32", DEVICE, {"kv_heads": shape[2]})):
                    if cand.variant == "split_kv" and causal:
                        continue  # split_kv is for non-causal attention (its space says so)
                    cases.append(pytest.param(shape, causal, qs, ks, vs, cand,
                                              id=f"{name}-{'causal' if causal else 'full'}-{cand.label}-{shape}"))
    return cases


@pytest.mark.parametrize(("shape", "causal", "qs", "ks", "vs", "cand"), _sdpa_cases())
def test_attention_on_strided_views_matches_the_oracle(shape, causal, qs, ks, vs, cand, tmp_path):
    b, hq, hkv, sq, skv, d = shape
    op = ops.get("sdpa")
    text = ";".join(",".join(map(str, s)) for s in (qs, ks, vs))
    spec = op.module.make_spec((b, hq, sq, skv, d), "float32", DEVICE,
                               {"causal": causal, "kv_heads": hkv, "strides": text})
    assert all(same_layout(t.shape, t.strides, want) for t, want in zip(spec.inputs, (qs, ks, vs), strict=True))
    reason = check_candidate(op.module, _load(op, spec, cand, tmp_path), spec, 5, _sync)
    assert reason is None, f"{cand.label} {shape} causal={causal} {text}: {reason}"


def test_contiguous_attention_renders_exactly_as_before():
    """The strided addressing is emitted only for strided specs: contiguous renders are unchanged
    (tests/golden/renders.json holds every one)."""
    from forge import codegen

    op = ops.get("sdpa")
    spec = op.module.make_spec((1, 2, 7, 9, 16), "float16", "cuda", {"kv_heads": 1})
    for cand in op.module.test_candidates(spec):
        src = codegen.render(op, spec, cand)
        assert not any(name in src for name in ("q_rows", "kv_h =", "o_offs", "h = bh %")), cand.label
        assert "kv_offs = cols[:, None] * D" in src


def hf_attention(x, wq, wk, wv):
    b, s, _ = x.shape
    q = (x @ wq).view(b, s, 4, 8).transpose(1, 2)
    k = (x @ wk).view(b, s, 2, 8).transpose(1, 2)
    v = (x @ wv).view(b, s, 2, 8).transpose(1, 2)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def test_hf_attention_regions_are_tunable_in_their_layout():
    x, wq, wk, wv = torch.randn(2, 5, 32), torch.randn(32, 32), torch.randn(32, 16), torch.randn(32, 16)
    g = TraceGraph(hf_attention, (x, wq, wk, wv), {})
    regions, _ = find_regions(g, "cpu")
    (r,) = [r for r in regions if r.op == "sdpa"]
    assert r.unsupported is None, r.unsupported
    assert r.attrs["strides"] == "160,8,32,1;80,8,16,1;80,8,16,1" and r.attrs["causal"] and r.attrs["kv_heads"] == 2


# -- rope in Hugging Face's layout: q/k transposed views, (1 or B, 1, S, D) tables --------------------------
def _rope_cases():
    cases = []
    for shape in ((2, 3, 5, 8), (1, 4, 1, 16), (2, 1, 9, 6)):
        b, h, s, d = shape
        for strided in (False, True, "split"):
            for cos_batch in (None, 1, b):
                if not strided and cos_batch is None:
                    continue  # the contiguous (S, D) case is tests/test_templates.py's
                attrs = {} if cos_batch is None else {"cos_batch": cos_batch}
                if strided is True:  # (B, S, H, D) read as (B, H, S, D): the output keeps these strides
                    attrs["strides"] = f"{s * h * d},{d},{h * d},1;c;c"
                elif strided == "split":  # q of a fused qkv projection (GPT-2's split): not dense, the output is
                    attrs["strides"] = f"{s * 3 * h * d},{d},{3 * h * d},1;c;c"  # dense in x's dim order
                spec = ops.get("rope").module.make_spec(shape, "float32", DEVICE, attrs)
                for cand in ops.get("rope").module.test_candidates(spec):
                    cases.append(pytest.param(shape, dict(attrs), cand,
                                              id=f"{cand.label}-{shape}-strided={strided}-cos_batch={cos_batch}"))
    return cases


@pytest.mark.parametrize(("shape", "attrs", "cand"), _rope_cases())
def test_rope_in_hf_layouts_matches_the_oracle(shape, attrs, cand, tmp_path):
    op = ops.get("rope")
    spec = op.module.make_spec(shape, "float32", DEVICE, attrs)
    reason = check_candidate(op.module, _load(op, spec, cand, tmp_path), spec, 5, _sync)
    assert reason is None, f"{cand.label} {shape} {attrs}: {reason}"


@pytest.mark.parametrize("layout", ["hf", "split", "contiguous"])
def test_rope_output_has_the_layout_eager_gives_it(layout):
    """rope's output takes the layout eager's formula gives (torch.empty_like(x)), so attention after it writes
    in q's (B, S, H, D) order and `o.transpose(1, 2).reshape(B, S, -1)` stays a view; every variant stores in it
    (the values are checked against the oracle in that layout by test_rope_in_hf_layouts_matches_the_oracle)."""
    mod = ops.get("rope").module
    b, h, s, d = 2, 3, 5, 8
    base = torch.randn(b, s, 3 * h * d)
    x = {"hf": base[..., : h * d].contiguous().view(b, s, h, d).transpose(1, 2),
         "split": base[..., : h * d].view(b, s, h, d).transpose(1, 2),
         "contiguous": torch.randn(b, h, s, d)}[layout]
    cos, sin = torch.randn(s, d), torch.randn(s, d)
    eager = mod.reference((x, cos, sin), {})
    strides = "c" if x.is_contiguous() else ",".join(map(str, x.stride()))
    spec = mod.make_spec((b, h, s, d), "float32", DEVICE, {"strides": f"{strides};c;c"} if strides != "c" else {})
    out = mod.alloc_output((x, cos, sin), spec)
    assert out.stride() == eager.stride() == mod.output_strides(spec)
    if layout != "contiguous":
        assert out.stride() != torch.empty(x.shape).stride()  # not contiguous: (B, S, H, D) order


def test_per_sequence_tables_leave_the_tile_variant_out():
    mod = ops.get("rope").module
    spec = mod.make_spec((2, 8, 64, 16), "float16", "cuda", {"cos_batch": 2})
    sp = mod.space(spec)
    assert not any(sp.valid(c) for c in sp.points("tile")) and any(sp.valid(c) for c in sp.points("rows"))
    assert [t.shape for t in spec.inputs] == [(2, 8, 64, 16), (2, 1, 64, 16), (2, 1, 64, 16)]


# -- matmul on operands in any layout: x @ w.t() (nn.Linear's weight), a transposed A, slices --------------
def _matmul_layouts(shape):
    """(name, A strides, B strides) for problem shape (M, N, K) or (Bt, M, N, K)."""
    if len(shape) == 3:
        m, n, k = shape
        return [("w.t()", None, (1, k)), ("a.t()", (1, m), None), ("both", (1, m), (1, k)),
                ("a slice", (k + 8, 1), None)]
    bt, m, n, k = shape
    return [("bmm w.t()", None, (n * k, 1, k)), ("bmm a.t()", (m * k, 1, m), None)]


def _matmul_cases():
    mod = ops.get("matmul").module
    cases = []
    for shape in ((7, 5, 3), (33, 17, 40), (2, 31, 20, 19), (1, 24, 70)):
        for name, sa, sb in _matmul_layouts(shape):
            text = ";".join("c" if s is None else ",".join(map(str, s)) for s in (sa, sb))
            for cand in mod.test_candidates(mod.make_spec(shape, "float32", DEVICE)):
                cases.append(pytest.param(shape, text, cand, id=f"{name}-{cand.label}-{shape}"))
    return cases


@pytest.mark.parametrize(("shape", "text", "cand"), _matmul_cases())
def test_matmul_on_strided_operands_matches_the_oracle(shape, text, cand, tmp_path):
    op = ops.get("matmul")
    spec = op.module.make_spec(shape, "float32", DEVICE, {"strides": text})
    # (a size-1 dim's stride does not matter: A.t() of one row is the contiguous layout)
    assert spec.attrs.get("strides") == opkit.strides_text(
        [(t.shape, tuple(int(v) for v in p.split(",")) if p != "c" else t.strides)
         for t, p in zip(spec.inputs, text.split(";"), strict=True)])
    reason = check_candidate(op.module, _load(op, spec, cand, tmp_path), spec, 5, _sync)
    assert reason is None, f"{cand.label} {shape} {text}: {reason}"


def linear_t(x, w):
    return x @ w.t()


@pytest.mark.slow
def test_the_shim_runs_x_at_w_t_as_a_kernel(monkeypatch):
    monkeypatch.setattr(stats, "accepts", lambda *a, **k: True)  # the interpreter never beats eager
    x, w = torch.randn(9, 24), torch.randn(20, 24)
    f = forge.optimize(linear_t, interpreter=True, budget=1, warn=False)
    y = f(x, w)
    # fx sees x @ permute(w): not one op family's expression as a whole; its region under TorchDynamo
    # (the matmul of x and the transposed view) is, and runs the kernel tuned for that layout.
    e = forge.explain(f, x, w)
    assert e.uses == "regions" and [(r.op, r.uses) for r in e.model.regions] == [("matmul", "kernel")], e
    assert e.model.regions[0].attrs["strides"] == "c;1,24"
    torch.testing.assert_close(y.double(), x.double() @ w.double().t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(f(x, w).double(), x.double() @ w.double().t(), rtol=1e-5, atol=1e-5)
    # the transposed weight is the spec's layout: a contiguous B is another spec
    g = forge.optimize(lambda a, b: a @ b, interpreter=True, search=False, warn=False)
    assert forge.explain(g, x, w.t().contiguous()).reason.startswith("cache miss")


def test_a_stale_layout_attribute_gives_way_to_the_tensors_own():
    """The backend resolves a region found on eager's strided view for a contiguous input (the kernel that
    feeds it writes contiguous outputs): the attribute follows the tensors, not the region's first sight."""
    op = ops.get("rmsnorm")
    x, w = torch.randn(6, 40), torch.randn(40)
    attrs, why = ops.strided_attrs(op, [x, w], {"eps": 1e-6, "strides": "100,1;c"})
    assert why is None and attrs == {"eps": 1e-6}
    attrs, why = ops.strided_attrs(op, [torch.randn(6, 100)[:, :40], w], {"eps": 1e-6, "strides": "64,1;c"})
    assert why is None and attrs == {"eps": 1e-6, "strides": "100,1;c"}
