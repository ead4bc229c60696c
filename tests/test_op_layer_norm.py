"""layer_norm: attributes and missing weight/bias against the float64 oracle, every spelling the shim
recognises (F.layer_norm, torch.layer_norm, nn.LayerNorm as the root or a submodule), fallbacks
with reasons, the validator rejecting broken kernels (a naive variance among them), and an
end-to-end decorated call after a tiny interpreter search.

Template coverage at odd shapes x dtypes is automatic in tests/test_templates.py."""

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
from forge.tuner import engine, stats
from forge.tuner.validate import check_candidate, compare
from tests.conftest import DEVICE, HAS_CUDA

SEED = 4_321
cpu_only = pytest.mark.skipif(HAS_CUDA, reason="exercises the interpreter path (CPU tensors)")

OP = ops.get("layer_norm")
MOD = OP.module


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _kernel(spec, cand: Candidate, tmp_path, mutate=None):
    src = codegen.render(OP, spec, cand)
    if mutate is not None:
        src = mutate(src)
    return load_module(write_source(src, tmp_path))


# Masking candidates at N=300: a partial last column block (looped, 128) and a partial last group
# of rows (multirow, 4 rows of M=5).
CANDS = [Candidate.make("row", num_warps=4),
         Candidate.make("looped", BLOCK_N=128, num_warps=4, num_stages=1),
         Candidate.make("multirow", ROWS=4, num_warps=4)]


# --- the spec --------------------------------------------------------------------------------------


def test_make_spec_inputs_and_normalised_attrs():
    spec = MOD.make_spec((2, 3, 40), "float16", "cpu", {"eps": 1})
    assert [(t.shape, t.dtype) for t in spec.inputs] == [((2, 3, 40), "float16"), ((40,), "float16"),
                                                        ((40,), "float16")]
    assert spec.attrs == {"eps": 1.0} and isinstance(spec.attrs["eps"], float)
    assert MOD.make_spec((4, 40), "float32", "cpu").attrs == {"eps": 1e-5}
    # normalized_shape = (N,) is what the shape already says: accepted, and not part of the cache key.
    assert MOD.make_spec((4, 40), "float32", "cpu", {"normalized_shape": [40]}).attrs == {"eps": 1e-5}


@pytest.mark.parametrize(("attrs", "needle"), [
    ({"normalized_shape": (5, 40)}, "normalized_shape=(5, 40) is not supported"),
    ({"normalized_shape": (39,)}, "normalized_shape=(39,) is not supported"),
    ({"eps": float("nan")}, "eps must be a finite number"),
    ({"eps": "small"}, "eps must be a finite number"),
    ({"elementwise_affine": False}, "takes attributes ['eps'], not ['elementwise_affine']"),
])
def test_make_spec_refuses_with_a_reason(attrs, needle):
    with pytest.raises(ValueError) as info:
        MOD.make_spec((4, 40), "float32", "cpu", attrs)
    assert needle in str(info.value)


def test_space_caps_whole_row_points_at_32_values_per_thread():
    """x, w and b of a whole row live in registers: 64 fp32 values of each per thread would spill."""
    spec = MOD.make_spec((64, 8192), "float16", "cuda")
    points = list(MOD.space(spec).all_points())
    whole = [c for c in points if c.variant != "looped"]
    assert whole and all(c.p.get("ROWS", 1) * 8192 / (32 * c.p["num_warps"]) <= 32 for c in whole)
    assert Candidate.make("row", num_warps=4) not in MOD.space(spec)  # 64 per thread: rmsnorm allows it
    assert Candidate.make("row", num_warps=8) in MOD.space(spec)
    assert {c.variant for c in points} == {"row", "looped", "multirow"}


def test_test_data_rows_sit_far_from_zero():
    """The offsets that make a naive variance fail (see test_validator_rejects_naive_variance)."""
    spec = MOD.make_spec((64, 50), "float32", "cpu")
    x, w, b = MOD.make_inputs(spec, SEED, "normal")
    means = x.mean(-1)
    assert means.abs().max() > 70 and means.abs().min() < 15  # uniform in +-100 spreads: far and near
    assert 0.5 < float(x.std(-1).mean()) < 1.5
    assert not torch.equal(w, torch.ones_like(w)) and not torch.equal(b, torch.zeros_like(b))


# --- numerics ------------------------------------------------------------------------------------


@pytest.mark.parametrize("eps", [1e-5, 1e-3, 0.5])
@pytest.mark.parametrize("cand", CANDS, ids=lambda c: c.variant)
def test_eps_values_match_the_oracle(eps, cand, tmp_path):
    spec = MOD.make_spec((5, 300), "float32", DEVICE, {"eps": eps})
    assert check_candidate(MOD, _kernel(spec, cand, tmp_path), spec, SEED, _sync) is None


def test_eps_reaches_the_kernel(tmp_path):
    """Run with eps=0.5 but checked against eps=1e-5: must fail, so eps is not ignored or baked in."""
    spec = MOD.make_spec((5, 300), "float32", DEVICE, {"eps": 0.5})
    module = _kernel(spec, CANDS[0], tmp_path)
    wrong = MOD.make_spec((5, 300), "float32", DEVICE, {"eps": 1e-5})
    x, w, b = MOD.make_inputs(wrong, SEED, "normal")
    out = torch.empty_like(x)
    MOD.run(module, (x, w, b), out, spec.attrs)
    assert compare(out, MOD.oracle((x, w, b), wrong.attrs), MOD.tolerance("float32")) is not None
    assert compare(out, MOD.oracle((x, w, b), spec.attrs), MOD.tolerance("float32")) is None


@pytest.mark.parametrize("missing", ["weight", "bias", "both"])
@pytest.mark.parametrize("cand", CANDS, ids=lambda c: c.variant)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_missing_weight_or_bias_is_filled_exactly(missing, cand, dtype, tmp_path):
    spec = MOD.make_spec((5, 300), dtype, DEVICE)
    x, w, b = MOD.make_inputs(spec, SEED, "normal")
    w = None if missing in ("weight", "both") else w
    b = None if missing in ("bias", "both") else b
    filled = MOD.fill_missing([x, w, b])
    if w is None:
        assert torch.equal(filled[1], torch.ones(300, dtype=x.dtype, device=x.device))
    if b is None:
        assert torch.equal(filled[2], torch.zeros(300, dtype=x.dtype, device=x.device))
    out = torch.full_like(x, float("nan"))
    MOD.run(_kernel(spec, cand, tmp_path), filled, out, spec.attrs)
    # the user's call, without the missing tensors, in float64
    ref = F.layer_norm(x.double(), (300,), None if w is None else w.double(), None if b is None else b.double(),
                       1e-5)
    assert compare(out, ref, MOD.tolerance(dtype)) is None


@pytest.mark.parametrize("cand", [CANDS[0], CANDS[2]], ids=lambda c: c.variant)
def test_w_and_b_are_loaded_before_the_reductions_only_in_a_one_wave_grid(cand, tmp_path):
    """kernels/layer_norm.py EARLY_WB_MAX_WAVES: with x where the grid is one wave of programs (decode rows,
    where the loads' latency would follow the reductions), after the reductions where there are many waves
    (8192x8192, where w and b live through the reductions cost registers); both orders against the oracle."""
    from forge import hardware

    def early(shape, device):
        src = codegen.render(OP, MOD.make_spec(shape, "bfloat16", device), cand)
        return "w = w.to(tl.float32)" in src

    assert early((16, 4096), "cuda") and early((hardware.GPU_SMS * cand.p.get("ROWS", 1), 4096), "cuda")
    assert not early((hardware.GPU_SMS * cand.p.get("ROWS", 1) + 1, 4096), "cuda")
    assert not early((8192, 8192), "cuda")
    rows = hardware.CPU_SMS * cand.p.get("ROWS", 1)
    assert early((rows, 300), "cpu") and not early((rows + 1, 300), "cpu")
    for m in (rows, rows + 1):  # both orders run, at a partial row group and at a full one
        spec = MOD.make_spec((m, 300), "bfloat16", DEVICE)
        assert check_candidate(MOD, _kernel(spec, cand, tmp_path), spec, SEED, _sync) is None


# --- the validator is not vacuous ---------------------------------------------------------------------


def _replace_once(old: str, new: str):
    def mutate(src: str) -> str:
        assert src.count(old) == 1, f"expected exactly one {old!r} in the rendered source"
        return src.replace(old, new)
    return mutate


def test_unmutated_kernels_pass(tmp_path):
    """The control for the negative tests below: same specs and candidates, unmutated."""
    for shape in [(5, 300), (3, 4096)]:
        spec = MOD.make_spec(shape, "float32", DEVICE)
        for cand in CANDS:
            assert check_candidate(MOD, _kernel(spec, cand, tmp_path), spec, SEED, _sync) is None, cand.label


@pytest.mark.parametrize("shape", [(5, 300), (3, 4096)])
def test_validator_rejects_naive_variance(shape, tmp_path):
    """E[x^2] - E[x]^2 in fp32 cancels on rows whose mean is far from zero (the test data's offsets)."""
    spec = MOD.make_spec(shape, "float32", DEVICE)
    naive = "tl.sum(x * x, axis=0) / N - (tl.sum(x, axis=0) / N) * (tl.sum(x, axis=0) / N)"
    module = _kernel(spec, CANDS[0], tmp_path, _replace_once("tl.sum(d * d, axis=0) / N - c * c", naive))
    reason = check_candidate(MOD, module, spec, SEED, _sync)
    assert reason is not None
    assert reason.startswith("normal inputs: "), reason


@pytest.mark.parametrize(("cand", "old", "new"), [
    (CANDS[0], "* rstd * w + b)", "* rstd * w)"),  # ignores the bias
    (CANDS[1], "* rstd * w + b)", "* rstd + b)"),  # ignores the weight
    (CANDS[1], "/ N + eps)", "/ (N - 1) + eps)"),  # unbiased variance (torch.var's default)
    (CANDS[2], "tl.sum(d * d, axis=1) / N", "tl.sum(d * d, axis=1) / BLOCK_N"),  # the padded width
], ids=["row-no-bias", "looped-no-weight", "looped-unbiased-var", "multirow-padded-divisor"])
def test_validator_rejects_broken_kernels(cand, old, new, tmp_path):
    spec = MOD.make_spec((5, 300), "float32", DEVICE)
    module = _kernel(spec, cand, tmp_path, _replace_once(old, new))
    reason = check_candidate(MOD, module, spec, SEED, _sync)
    assert reason is not None
    assert reason.startswith("normal inputs: "), reason


# --- recognising it in user code -----------------------------------------------------------------------

N = 40
X = torch.randn(6, N)
W = torch.randn(N)
B = torch.randn(N)


def ln_full(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b, 1e-6)


def ln_keywords(x, w, b):
    return F.layer_norm(x, normalized_shape=x.shape[-1:], bias=b, weight=w, eps=1e-6)


def ln_torch(x, w, b):
    return torch.layer_norm(x, [x.shape[-1]], w, b)


def ln_weight_only(x, w):
    return F.layer_norm(x, (x.shape[-1],), w)


def ln_bias_only(x, b):
    return F.layer_norm(x, (x.shape[-1],), None, b)


def ln_plain(x):
    return F.layer_norm(x, x.shape[-1:])


def ln_last_two(x):
    return F.layer_norm(x, x.shape[-2:])


class Block(nn.Module):
    """nn.LayerNorm as a submodule: a leaf fx does not trace into."""

    def __init__(self, **kw):
        super().__init__()
        self.norm = nn.LayerNorm(N, **kw)

    def forward(self, x):
        return self.norm(x)


def _explained(fn, *args):
    return forge.explain(forge.optimize(fn, interpreter=True), *args)


@cpu_only
@pytest.mark.parametrize(("fn", "args", "indices", "eps"), [
    (ln_full, (X, W, B), [0, 1, 2], 1e-6),
    (ln_keywords, (X, W, B), [0, 1, 2], 1e-6),
    (ln_torch, (X, W, B), [0, 1, 2], 1e-5),
    (ln_weight_only, (X, W), [0, 1, None], 1e-5),
    (ln_bias_only, (X, B), [0, None, 1], 1e-5),
    (ln_plain, (X,), [0, None, None], 1e-5),
], ids=lambda v: getattr(v, "__name__", None))
def test_functional_spellings(fn, args, indices, eps):
    assert MOD.match(canonical(fn, args, {}).expr) == (indices, {"eps": eps})
    e = _explained(fn, *args)
    assert (e.op, e.uses, e.reason) == ("layer_norm", "eager", "cache miss: would search")


@cpu_only
@pytest.mark.parametrize("kw", [{}, {"eps": 1e-6}, {"elementwise_affine": False}, {"bias": False}],
                         ids=["default", "eps", "no-affine", "no-bias"])
@pytest.mark.parametrize("as_root", [True, False], ids=["root", "submodule"])
def test_nn_layernorm_module(kw, as_root):
    module = nn.LayerNorm(N, **kw) if as_root else Block(**kw)
    traced = canonical(module, (X,), {})
    indices, attrs = MOD.match(traced.expr)
    assert attrs == {"eps": kw.get("eps", 1e-5)}
    affine = kw.get("elementwise_affine", True)
    # x, then the module's parameters as inputs; what the module lacks is filled in
    assert indices == [0, 1 if affine else None, 2 if affine and kw.get("bias", True) else None]
    with torch.no_grad():  # its parameters require grad; forge kernels are forward-only
        e = _explained(module, X)
    assert (e.op, e.uses, e.reason) == ("layer_norm", "eager", "cache miss: would search")


@cpu_only
def test_several_trailing_dims_are_taken():
    for fn in (ln_last_two, nn.LayerNorm((6, N))):
        f = forge.optimize(fn, interpreter=True, warn=False)
        with torch.no_grad():
            e = forge.explain(f, X)
            assert torch.equal(f(X), fn(X))
        assert e.uses == "eager" and e.op == "layer_norm"
        assert e.reason == "cache miss: would search"  # several trailing dims: taken (tests/test_any_dims.py)


@cpu_only
def test_other_norms_are_not_layer_norm():
    """rms_norm and a computed weight are not this family (a computed weight is no input to bind)."""
    assert MOD.match(canonical(lambda x, w: F.rms_norm(x, (N,), w), (X, W), {}).expr) is None
    assert MOD.match(canonical(lambda x, w: F.layer_norm(x, (N,), w * 2), (X, W), {}).expr) is None
    e = _explained(lambda x, w: F.layer_norm(x, (N,), w * 2), X, W)
    assert e.uses == "eager" and "no op family matches" in e.reason


# --- end to end ---------------------------------------------------------------------------------------


@cpu_only
@pytest.mark.slow
def test_decorated_call_equals_eager_after_a_search(monkeypatch):
    # On the interpreter eager always wins; force acceptance to exercise the kernel path.
    monkeypatch.setattr(stats, "accepts", lambda *a, **k: True)
    searches = []
    real = engine.search
    monkeypatch.setattr(engine, "search", lambda *a, **k: searches.append(a[:3]) or real(*a, **k))
    x = torch.randn(7, 300) * 3 + 20
    w, b = torch.randn(300), torch.randn(300)
    f = forge.optimize(ln_full, budget=2, interpreter=True)
    y = f(x, w, b)
    assert searches == [("layer_norm", (7, 300), "float32")]
    e = forge.explain(f, x, w, b)
    assert e.uses == "kernel" and e.op == "layer_norm" and e.variant in ("row", "looped", "multirow")
    tol = MOD.tolerance("float32")
    assert compare(y, F.layer_norm(x.double(), (300,), w.double(), b.double(), 1e-6), tol) is None
    assert torch.allclose(y, ln_full(x, w, b), rtol=1e-4, atol=1e-5)
    # nn.LayerNorm(300, eps=1e-6) has the same spec: a cache hit, no search, its own parameters used.
    monkeypatch.setattr(engine, "search", lambda *a, **k: pytest.fail("cache hit must not search"))
    ln = nn.LayerNorm(300, eps=1e-6)
    with torch.no_grad():
        ln.weight.copy_(w * 2)
        ln.bias.copy_(b - 1)
    g = forge.optimize(ln, interpreter=True)
    with torch.no_grad():
        assert forge.explain(g, x).uses == "kernel"
        assert torch.allclose(g(x), ln(x), rtol=1e-4, atol=1e-5)
