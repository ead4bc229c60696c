"""The reduce op family: every kind and keepdim through every variant against the oracle, argmax's
first-index tie rule (and NaN/-inf rows) against eager torch, the validator catching broken kernels,
the spellings the shim recognises, fallbacks with reasons, and a decorated call after a search."""

from __future__ import annotations

import pytest
import torch

import forge
from forge import codegen, ops
from forge.loader import load_module, write_source
from forge.opkit import Candidate
from forge.tuner import engine, stats
from forge.tuner.validate import check_candidate, compare
from tests.conftest import DEVICE, HAS_CUDA

SEED = 4242
KINDS = ("sum", "mean", "amax", "argmax")
cpu_only = pytest.mark.skipif(HAS_CUDA, reason="exercises the interpreter path (CPU tensors)")


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _op():
    return ops.get("reduce")


def _module(spec, cand, tmp_path, mutate=None):
    src = codegen.render(_op(), spec, cand)
    if mutate is not None:
        src = mutate(src)
    return load_module(write_source(src, tmp_path))


def _run(module, spec, x):
    op = _op().module
    out = op.alloc_output((x,), spec)
    op.run(module, (x,), out, spec.attrs)
    _sync()
    return out


def _candidates(n: int) -> list[Candidate]:
    """One of each variant; the looped block leaves a partial last block (and, for 300, lanes
    that see columns of several blocks, so lane order differs from column order)."""
    block = 128 if n > 128 else 4
    return [Candidate.make("row", num_warps=4),
            Candidate.make("looped", BLOCK_N=block, num_warps=4, num_stages=1),
            Candidate.make("multirow", ROWS=4, num_warps=4)]


# --- every kind x keepdim x variant against the oracle ---------------------------------------------

@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_and_keepdim_matches_the_oracle(kind, keepdim, dtype, tmp_path):
    op = _op()
    for shape in [(5, 300), (2, 3, 7)]:
        spec = op.module.make_spec(shape, dtype, DEVICE, {"kind": kind, "keepdim": keepdim})
        assert spec.attrs == {"kind": kind, "keepdim": keepdim, "dim": -1}
        for cand in _candidates(shape[-1]):
            module = _module(spec, cand, tmp_path)
            assert check_candidate(op.module, module, spec, SEED, _sync) is None, (shape, cand.label)
            # and the output has the shape and dtype eager torch gives
            x = op.module.make_inputs(spec, SEED, "normal")[0]
            out = _run(module, spec, x)
            ref = op.module.reference((x,), spec.attrs)
            assert out.shape == ref.shape and out.dtype == ref.dtype


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("kind", KINDS)
def test_long_row_looped_every_kind(kind, tmp_path):
    """65537 columns: 17 blocks of 4096, the last holding one column; fp16 "large" sums overflow to
    inf in both the kernel and the oracle (see make_inputs), which compare() requires to agree."""
    op = _op()
    spec = op.module.make_spec((1, 65537), "float16", DEVICE, {"kind": kind, "keepdim": True})
    cand = Candidate.make("looped", BLOCK_N=4096, num_warps=8, num_stages=1)
    assert check_candidate(op.module, _module(spec, cand, tmp_path), spec, SEED, _sync) is None


def test_fp16_large_sum_really_overflows_and_the_oracle_agrees():
    """Guards the comment in make_inputs: the case is exercised, and the oracle is inf there too."""
    op = _op().module
    spec = op.make_spec((32, 65537), "float16", DEVICE, {"kind": "sum"})
    x = op.make_inputs(spec, SEED, "large")[0]
    exact = x.double().sum(-1)
    over = exact.abs() >= 65520  # rounds past fp16's largest finite value (65504)
    assert 4 <= int(over.sum()) < 32  # row sums have sd ~2.6e5: most, not all, overflow
    ref = op.oracle((x,), spec.attrs)
    assert torch.equal(torch.isinf(ref), over) and torch.equal(ref.sign(), exact.sign())
    assert torch.equal(ref, x.cpu().float().sum(-1).half().to(ref.device))  # an fp32 sum rounded once


def test_sum_inputs_make_fp32_accumulation_exact():
    """On make_inputs' grid any summation order gives the exact sum in fp32."""
    op = _op().module
    for dist in ("normal", "large", "tiny", "outliers"):
        spec = op.make_spec((4, 4099), "bfloat16", DEVICE, {"kind": "sum"})
        x = op.make_inputs(spec, 7, dist)[0]
        assert (x != 0).all()
        exact = x.double().sum(-1)
        forward = x.float().cumsum(-1)[:, -1].double()
        backward = x.float().flip(-1).cumsum(-1)[:, -1].double()
        assert torch.equal(forward, exact) and torch.equal(backward, exact), dist


def test_argmax_inputs_have_ties():
    op = _op().module
    spec = op.make_spec((64, 33), "float32", DEVICE, {"kind": "argmax"})
    for dist in ("normal", "large", "tiny"):
        x = op.make_inputs(spec, 3, dist)[0]
        ties = (x == x.amax(-1, keepdim=True)).sum(-1)
        assert (ties > 1).sum() >= 8, dist  # many rows hold their maximum more than once


# --- argmax tie rule, NaN and -inf rows, against eager torch ---------------------------------------

def _tie_rows(n: int, dtype) -> torch.Tensor:
    """Rows whose maximum appears several times, placed so that lane order differs from column order
    in the looped variant (BLOCK_N=128: column 140 is lane 12, column 20 is lane 20)."""
    rows = torch.randn(8, n, generator=torch.Generator().manual_seed(1)) - 5.0
    rows[0, [140, 20, 299]] = 3.0           # first maximum at 20, a lower lane holds 140
    rows[1, :] = 1.5                          # all equal -> 0
    rows[2, [n - 1, n - 2]] = 2.0             # maximum only at the end
    rows[3, [0, 128, 256]] = 4.0              # the same lane in three blocks
    rows[4, 10] = -0.0                        # -0.0 == 0.0: the first of them wins
    rows[4, 11] = 0.0
    rows[5, :] = float("-inf")                # all -inf -> 0
    rows[6, [30, 200]] = float("inf")         # +inf ties
    rows[7, [4, 5]] = 1.0001                  # 1.0002 at 6 wins in fp32; in fp16/bf16 all three
    rows[7, 6] = 1.0002                       # round to 1.0, and 4 wins
    return rows.to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("variant", ["row", "looped", "multirow"])
def test_argmax_takes_the_first_maximum_like_torch(variant, dtype, tmp_path):
    op = _op()
    x = _tie_rows(300, dtype)
    name = str(dtype).removeprefix("torch.")
    spec = op.module.make_spec(tuple(x.shape), name, DEVICE, {"kind": "argmax"})
    cand = {c.variant: c for c in _candidates(300)}[variant]
    out = _run(_module(spec, cand, tmp_path), spec, x)
    expected = x.cpu().argmax(-1)
    assert out.cpu().tolist() == expected.tolist()
    assert out[0].item() == 20 and out[1].item() == 0 and out[5].item() == 0
    assert torch.equal(out, op.module.oracle((x,), spec.attrs))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("variant", ["row", "looped", "multirow"])
def test_nan_rows_propagate_like_torch(variant, tmp_path):
    """torch: amax of a row with NaN is NaN, argmax the index of the first NaN."""
    op = _op()
    x = torch.randn(3, 300, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    x[0, [200, 150]] = float("nan")
    x[1, 299] = float("nan")
    cand = {c.variant: c for c in _candidates(300)}[variant]
    for kind in ("amax", "argmax"):
        spec = op.module.make_spec(tuple(x.shape), "float32", DEVICE, {"kind": kind})
        out = _run(_module(spec, cand, tmp_path), spec, x).cpu()
        eager = op.module.reference((x.cpu(),), spec.attrs)
        if kind == "amax":
            assert out.isnan().tolist() == eager.isnan().tolist() == [True, True, False]
            assert out[2] == eager[2]
        else:
            assert out.tolist() == eager.tolist() == [150, 299, int(x[2].argmax())]


# --- the validator is not vacuous -------------------------------------------------------------------

def _replace_once(old: str, new: str):
    def mutate(src: str) -> str:
        assert src.count(old) == 1, f"expected exactly one {old!r} in the rendered source"
        return src.replace(old, new)
    return mutate


@pytest.mark.parametrize("variant,old,new", [
    # last maximal index instead of the first: only ties tell them apart
    ("row", "tl.min(tl.where(x == row_max, cols, BLOCK_N), axis=0)",
     "tl.max(tl.where(x == row_max, cols, -1), axis=0)"),
    # the smallest lane holding the maximum instead of the smallest column
    ("looped", "tl.min(tl.where(best == row_max, best_col, N), axis=0)",
     "tl.sum(tl.where(lanes == tl.argmax(best, axis=0, tie_break_left=True), best_col, 0), axis=0)"),
])
def test_validator_rejects_wrong_tie_rule(variant, old, new, tmp_path):
    op = _op()
    spec = op.module.make_spec((5, 300), "float16", DEVICE, {"kind": "argmax"})
    cand = {c.variant: c for c in _candidates(300)}[variant]
    reason = check_candidate(op.module, _module(spec, cand, tmp_path, _replace_once(old, new)), spec, SEED, _sync)
    assert reason is not None and "integer output, exact match required" in reason, reason


@pytest.mark.parametrize("kind,old,new", [
    ("mean", "/ N", "/ (N + 1)"),                               # wrong divisor, 0.3% off
    ("sum", "other=0.0", "other=1.0"),                         # padding lanes counted
    ("amax", "row_max = tl.max(x, axis=0)", "row_max = tl.max(x, axis=0) * 0.999"),
])
def test_validator_rejects_broken_reductions(kind, old, new, tmp_path):
    op = _op()
    spec = op.module.make_spec((5, 300), "float32", DEVICE, {"kind": kind})
    module = _module(spec, Candidate.make("row", num_warps=4), tmp_path, _replace_once(old, new))
    reason = check_candidate(op.module, module, spec, SEED, _sync)
    assert reason is not None and reason.startswith("normal inputs: "), reason
    # control: unmutated, the same check passes
    assert check_candidate(op.module, _module(spec, Candidate.make("row", num_warps=4), tmp_path), spec, SEED,
                           _sync) is None


def test_compare_is_exact_for_indices():
    assert compare(torch.tensor([1, 2]), torch.tensor([1, 2]), _op().module.tolerance("float32")) is None
    assert "exact match" in compare(torch.tensor([1, 2]), torch.tensor([1, 3]), _op().module.tolerance("float32"))


# --- spec attributes ---------------------------------------------------------------------------------

def test_make_spec_normalises_and_refuses():
    mk = _op().module.make_spec
    assert mk((4, 8), "float16", "cpu", {"kind": "ArgMax", "keepdim": "true"}).attrs == {
        "kind": "argmax", "keepdim": True, "dim": -1}
    assert mk((4, 8), "float16", "cpu", {"dim": 1}).attrs["dim"] == -1
    assert mk((4, 8), "float16", "cpu", {"dtype": "float16"}).attrs == {"kind": "sum", "keepdim": False, "dim": -1}
    assert mk((4, 8), "float16", "cpu", {"dim": 0}).attrs["dim"] == -2  # any one dim (tests/test_any_dims.py)
    for attrs, needle in [({"dim": 2}, "not one dimension"), ({"dim": None}, "all dimensions"),
                          ({"dim": ()}, "all dimensions"), ({"dim": (0, 1)}, "one dimension, not dim"),
                          ({"kind": "min"}, "kind must be one of"), ({"dtype": "float32"}, "dtype=float32"),
                          ({"keepdim": "maybe"}, "keepdim"), ({"eps": 1.0}, r"not \['eps'\]")]:
        with pytest.raises(ValueError, match=needle):
            mk((4, 8), "float16", "cpu", attrs)


def test_output_shapes():
    op = _op().module
    for shape, keepdim, want in [((4, 8), False, (4,)), ((4, 8), True, (4, 1)), ((8,), False, ()),
                                 ((2, 3, 8), True, (2, 3, 1))]:
        spec = op.make_spec(shape, "float32", "cpu", {"keepdim": keepdim, "kind": "argmax"})
        out = op.alloc_output((torch.zeros(shape),), spec)
        assert tuple(out.shape) == want and out.dtype == torch.int64


# --- the shim: spellings, fallbacks, a decorated call after a search --------------------------------

X = torch.randn(6, 40)

SPELLINGS = [
    (lambda x: x.sum(-1), {"kind": "sum", "keepdim": False}),
    (lambda x: torch.sum(x, dim=-1, keepdim=True), {"kind": "sum", "keepdim": True}),
    (lambda x: x.sum(dim=[1]), {"kind": "sum", "keepdim": False}),
    (lambda x: x.sum(-1, dtype=x.dtype), {"kind": "sum", "keepdim": False}),
    (lambda x: x.mean(-1), {"kind": "mean", "keepdim": False}),
    (lambda x: x.mean(-1, keepdim=True), {"kind": "mean", "keepdim": True}),   # traced as mean_last
    (lambda x: torch.mean(x, 1), {"kind": "mean", "keepdim": False}),
    (lambda x: x.amax(-1), {"kind": "amax", "keepdim": False}),
    (lambda x: torch.amax(x, -1), {"kind": "amax", "keepdim": False}),
    (lambda x: torch.amax(x, dim=-1, keepdim=True), {"kind": "amax", "keepdim": True}),
    (lambda x: x.argmax(-1), {"kind": "argmax", "keepdim": False}),
    (lambda x: torch.argmax(x, dim=-1), {"kind": "argmax", "keepdim": False}),
    (lambda x: torch.argmax(x, -1, True), {"kind": "argmax", "keepdim": True}),
]


@cpu_only
@pytest.mark.parametrize("i", range(len(SPELLINGS)))
def test_spellings_match_reduce(i):
    fn, attrs = SPELLINGS[i]
    e = forge.explain(forge.optimize(fn, interpreter=True), X)
    assert e.op == "reduce" and e.uses == "eager" and e.reason == "cache miss: would search"
    # the cache key is the spec's: the same kind and keepdim give the same key, whatever the spelling
    same = [j for j, (_, a) in enumerate(SPELLINGS) if a == attrs]
    keys = {forge.explain(forge.optimize(SPELLINGS[j][0], interpreter=True), X).key for j in same}
    assert keys == {e.key}


@cpu_only
def test_kinds_have_distinct_cache_keys():
    keys = {forge.explain(forge.optimize(fn, interpreter=True), X).key for fn, _ in SPELLINGS}
    assert len(keys) == len({tuple(sorted(a.items())) for _, a in SPELLINGS})


@cpu_only
@pytest.mark.parametrize("fn,needle", [
    (lambda x: x.sum(-1, dtype=torch.float64), "reduce does not support this call: dtype=float64"),
    (lambda x: x.mean(-1, dtype=torch.float64), "dtype=float64"),
    (lambda x: x.sum((0, 1)), "one dimension, not dim=(-2, -1)"),
    (lambda x: x.sum(), "all dimensions"),
    (lambda x: x.argmax(), "all dimensions"),
    (lambda x: x.amax(), "all dimensions"),
    (lambda x: x.max(-1).values, "no op family matches"),
    (lambda x: x.sum(-1) * 2, "no op family matches"),
])
def test_unsupported_calls_fall_back_with_a_reason(fn, needle):
    f = forge.optimize(fn, interpreter=True, warn=False)
    e = forge.explain(f, X)
    assert e.uses == "eager" and needle in e.reason, e.reason
    # the value as written (not searched: a first call searches the regions Dynamo finds, seconds a case here)
    assert torch.equal(forge.optimize(fn, interpreter=True, warn=False, search=False)(X), fn(X))


@cpu_only
@pytest.mark.slow
def test_decorated_call_equals_eager_after_a_search(monkeypatch):
    """argmax: int64 outputs through the shim, exact, ties included (float outputs go through the same
    path in tests/test_shim.py)."""
    # On the interpreter eager always wins; force acceptance to exercise the kernel path.
    monkeypatch.setattr(stats, "accepts", lambda *a, **k: True)
    searches = []
    real = engine.search
    monkeypatch.setattr(engine, "search", lambda *a, **k: searches.append(a) or real(*a, **k))

    def fn(x):
        return torch.argmax(x, dim=-1, keepdim=True)

    f = forge.optimize(fn, budget=2, interpreter=True)
    x = torch.randn(7, 300)
    x = torch.round(x * 2) / 2  # ties: many rows hold their maximum twice
    y = f(x)
    assert len(searches) == 1
    e = forge.explain(f, x)
    assert e.uses == "kernel" and e.op == "reduce", e.reason
    assert y.dtype == torch.int64 and y.shape == (7, 1) and torch.equal(y, fn(x))
    assert ((x == x.amax(-1, keepdim=True)).sum(-1) > 1).any()  # the ties were really there
    # a second call: no new search, same result
    assert torch.equal(f(x), y) and len(searches) == 1
