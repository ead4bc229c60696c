"""cross_entropy: every reduction and ignore_index case against the float64 oracle, long vocabularies,
torch's edge cases (all rows ignored, fp16 overflow), out-of-range targets under a bounds-checked
interpreter, the validator rejecting broken kernels, spellings and fallbacks in the shim, and an
end-to-end decorated call after a search on the interpreter."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import forge
from forge import codegen, ops
from forge.loader import load_module, write_source
from forge.opkit import Candidate
from forge.trace import canonical
from forge.tuner import engine, stats
from forge.tuner.validate import check_candidate, compare
from tests.conftest import DEVICE, HAS_CUDA

SEED = 31_337
OP = ops.get("cross_entropy")
CE = OP.module
cpu_only = pytest.mark.skipif(HAS_CUDA, reason="exercises the interpreter path (CPU tensors)")
# The interpreter evaluates both sides of tl.where; only the guarded result is checked.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _module(spec, cand, tmp_path, mutate=None):
    src = codegen.render(OP, spec, cand)
    if mutate is not None:
        src = mutate(src)
    return load_module(write_source(src, tmp_path))


def _cands(m: int, n: int) -> dict[str, Candidate]:
    """One candidate per variant that masks: a partial last column block (looped) and a partial last
    group of rows (multirow) whenever the shape allows."""
    block = max(1, min(1024, 1 << max(0, (n - 1).bit_length() - 2)))
    rows = next(r for r in (4, 8, 16, 32) if m % r)
    return {"row": Candidate.make("row", num_warps=4),
            "looped": Candidate.make("looped", BLOCK_N=block, num_warps=4, num_stages=1),
            "multirow": Candidate.make("multirow", ROWS=rows, num_warps=4)}


def _run(spec, module, logits, target):
    out = CE.alloc_output((logits, target), spec)
    out.fill_(float("nan"))
    CE.run(module, (logits, target), out, spec.attrs)
    _sync()
    return out


# --- numerics against the oracle ------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["row", "looped", "multirow"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_every_reduction_matches_oracle(variant, reduction, tmp_path):
    spec = CE.make_spec((5, 300), "float32", DEVICE, {"reduction": reduction})
    module = _module(spec, _cands(5, 300)[variant], tmp_path)
    assert check_candidate(CE, module, spec, SEED, _sync) is None


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_long_vocab_partial_last_block(dtype, reduction, tmp_path):
    """5000 = 4 * 1024 + 904: the looped kernel's last column block is partial."""
    spec = CE.make_spec((3, 5000), dtype, DEVICE, {"reduction": reduction})
    cand = Candidate.make("looped", BLOCK_N=1024, num_warps=4, num_stages=1)
    assert 5000 % cand.p["BLOCK_N"] != 0
    assert check_candidate(CE, _module(spec, cand, tmp_path), spec, SEED, _sync) is None


@pytest.mark.parametrize("ignore_index", [0, 7, 299, -1])
@pytest.mark.parametrize("variant", ["row", "looped", "multirow"])
def test_ignore_index_inside_and_outside_the_class_range(ignore_index, variant, tmp_path):
    spec = CE.make_spec((6, 300), "float16", DEVICE, {"ignore_index": ignore_index, "reduction": "none"})
    module = _module(spec, _cands(6, 300)[variant], tmp_path)
    assert check_candidate(CE, module, spec, SEED, _sync) is None
    logits, target = CE.make_inputs(spec, SEED, "normal")
    ignored = target == ignore_index
    assert 0 < int(ignored.sum()) < 6
    out = _run(spec, module, logits, target)
    assert torch.equal(out[ignored], torch.zeros_like(out[ignored]))  # exactly 0, as torch


@pytest.mark.parametrize("variant", ["row", "looped", "multirow"])
def test_mean_divides_by_the_non_ignored_rows(variant, tmp_path):
    m, n = 9, 40
    spec = CE.make_spec((m, n), "float32", DEVICE, {"reduction": "mean"})
    module = _module(spec, _cands(m, n)[variant], tmp_path)
    logits = torch.randn(m, n, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    target = torch.tensor([3, -100, 0, 39, -100, -100, 12, 5, -100], device=DEVICE)
    out = _run(spec, module, logits, target)
    per_row = F.cross_entropy(logits.double(), target, reduction="none")
    expected = per_row.sum() / 5  # 4 of 9 rows ignored
    assert math.isclose(out.item(), expected.item(), rel_tol=1e-5)
    assert math.isclose(out.item(), F.cross_entropy(logits, target).item(), rel_tol=1e-5)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_the_reduction_loops_over_batches_larger_than_its_block(reduction, monkeypatch, tmp_path):
    """The reduce kernel takes a batch in one block of up to REDUCE_BLOCK_MAX rows and loops past it: with the
    cap at 64, 133 rows are two full blocks and a partial one (ignored rows in each)."""
    monkeypatch.setattr(CE, "REDUCE_BLOCK_MAX", 64)
    m, n = 133, 12
    spec = CE.make_spec((m, n), "float32", DEVICE, {"reduction": reduction})
    src = codegen.render(OP, spec, _cands(m, n)["multirow"])
    assert "BLOCK=64, num_warps=1" in src
    module = _module(spec, _cands(m, n)["multirow"], tmp_path)
    gen = torch.Generator().manual_seed(7)
    logits = (torch.randn(m, n, generator=gen) * 3).to(DEVICE)
    target = torch.randint(0, n, (m,), generator=gen)
    target[::7] = -100  # rows 0, 7, ... 126: ignored in every block
    target = target.to(DEVICE)
    out = _run(spec, module, logits, target)
    expected = F.cross_entropy(logits.double(), target, reduction=reduction)
    assert math.isclose(out.item(), expected.item(), rel_tol=1e-5)
    small = CE.make_spec((40, n), "float32", DEVICE, {"reduction": reduction})
    assert "BLOCK=64, num_warps=1" in codegen.render(OP, small, _cands(40, n)["row"])  # next_pow2(40)
    monkeypatch.setattr(CE, "REDUCE_BLOCK_MAX", 8192)
    big = CE.make_spec((8192, 32000), "bfloat16", DEVICE, {"reduction": reduction})
    assert "BLOCK=8192, num_warps=32" in codegen.render(OP, big, CE.default(big))


@pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning")
@pytest.mark.parametrize("variant", ["row", "looped", "multirow"])
def test_all_ignored_matches_torch(variant, tmp_path):
    """torch: mean over no rows is 0/0 = NaN, sum is 0, none is zeros. make_inputs never builds this
    (the validator rejects NaN), so it is checked here, against torch itself."""
    m, n = 3, 50
    logits = torch.randn(m, n).to(DEVICE)
    target = torch.full((m,), -100, dtype=torch.int64, device=DEVICE)
    for reduction in ("mean", "sum", "none"):
        spec = CE.make_spec((m, n), "float32", DEVICE, {"reduction": reduction})
        out = _run(spec, _module(spec, _cands(m, n)[variant], tmp_path), logits, target)
        ref = F.cross_entropy(logits, target, reduction=reduction)
        assert out.shape == ref.shape
        if reduction == "mean":
            assert torch.isnan(ref) and torch.isnan(out)
        else:
            assert torch.equal(out, ref) and not out.isnan().any()


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_fp16_sum_overflows_to_inf_like_torch(tmp_path):
    """40 rows of loss ~3000 sum to ~1.2e5 > 65504: torch's fp16 result is inf, and so are the
    kernel's and the oracle's (the validator would otherwise reject every fp16 'sum' kernel at
    large M)."""
    m, n = 40, 3
    logits = torch.zeros(m, n, dtype=torch.float16, device=DEVICE)
    logits[:, 0] = -3000.0
    target = torch.zeros(m, dtype=torch.int64, device=DEVICE)
    spec = CE.make_spec((m, n), "float16", DEVICE, {"reduction": "sum"})
    out = _run(spec, _module(spec, _cands(m, n)["row"], tmp_path), logits, target)
    ref = CE.oracle((logits, target), spec.attrs)
    assert torch.isinf(out) and torch.isinf(ref) and out > 0
    assert compare(out, ref, CE.tolerance("float16")) is None
    assert F.cross_entropy(logits.float(), target, reduction="sum").item() > 65504


def test_extreme_logits_do_not_lose_the_target(tmp_path):
    """'large' inputs give rows where the target is the max by far (loss ~ 0) next to rows where it
    is far below it (loss ~ 1e5): the loss is (max - x[t]) + log(sum), so neither cancels."""
    m, n = 4, 700
    spec = CE.make_spec((m, n), "float32", DEVICE, {"reduction": "none"})
    logits = torch.randn(m, n, generator=torch.Generator().manual_seed(2)).to(DEVICE) * 1e5
    target = torch.tensor([int(logits[0].argmax()), int(logits[1].argmin()), 5, n - 1], device=DEVICE)
    ref = F.cross_entropy(logits.double(), target, reduction="none")
    assert ref[0].item() == 0.0 and ref[1].item() > 1e5
    for variant, cand in _cands(m, n).items():
        out = _run(spec, _module(spec, cand, tmp_path / variant), logits, target)
        assert compare(out, ref, CE.tolerance("float32")) is None, variant


# --- out-of-range targets: NaN, and no memory outside the tensors is touched --------------------


class _CheckedMemory:
    """Stands in for the interpreter's native memory module: every load and store must stay inside a
    tensor argument of the launch in progress. (The interpreter itself does not check: a stray load
    returns garbage or segfaults.) The check runs before the access, so a bad kernel fails here."""

    def __init__(self, real):
        self.real, self.ranges, self.violations = real, [], []

    def __getattr__(self, name):
        return getattr(self.real, name)

    def _check(self, what, ptrs, mask, itemsize):
        addrs = np.asarray(ptrs, dtype=np.uint64)[np.asarray(mask, dtype=bool)]
        ok = np.zeros(addrs.shape, dtype=bool)
        for lo, hi in self.ranges:
            ok |= (addrs >= lo) & (addrs + itemsize <= hi)
        if not ok.all():
            self.violations.append((what, int(addrs[~ok][0])))
            raise MemoryError(f"{what} outside every tensor argument at {int(addrs[~ok][0]):#x}")

    def load(self, ptrs, mask, other, dtype):
        self._check("load", ptrs, mask, np.dtype(dtype).itemsize)
        return self.real.load(ptrs, mask, other, dtype)

    def store(self, ptrs, value, mask):
        self._check("store", ptrs, mask, value.dtype.itemsize)
        return self.real.store(ptrs, value, mask)


@pytest.fixture
def checked_memory(monkeypatch):
    import triton.runtime.interpreter as interp

    mem = _CheckedMemory(interp._interpreter)
    monkeypatch.setattr(interp, "_interpreter", mem)
    real_call = interp.GridExecutor.__call__

    def call(self, *args, **kwargs):
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        mem.ranges = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors]
        return real_call(self, *args, **kwargs)

    monkeypatch.setattr(interp.GridExecutor, "__call__", call)
    return mem


BAD_TARGETS = [300, -1, 10**12, -(10**12), 2**62]


@cpu_only
@pytest.mark.parametrize("variant", ["row", "looped", "multirow"])
def test_out_of_range_targets_give_nan_and_stay_in_bounds(variant, checked_memory, tmp_path):
    m, n = 8, 300
    logits = torch.randn(m, n)
    good = torch.tensor([4, 299, -100])
    target = torch.cat([good, torch.tensor(BAD_TARGETS)])
    bad = torch.arange(m) >= len(good)
    for reduction in ("none", "sum", "mean"):
        spec = CE.make_spec((m, n), "float32", "cpu", {"reduction": reduction})
        out = _run(spec, _module(spec, _cands(m, n)[variant], tmp_path), logits, target)
        if reduction == "none":
            assert out[bad].isnan().all()
            ref = F.cross_entropy(logits.double()[~bad], target[~bad], reduction="none")
            assert compare(out[~bad], ref, CE.tolerance("float32")) is None
        else:  # the bug stays visible in the reduced loss
            assert out.isnan()
    assert checked_memory.violations == []


@cpu_only
def test_bounds_checker_catches_an_unmasked_target_load(checked_memory, tmp_path):
    """The control for the test above: the looped kernel without its range mask reads x[10**12]."""
    m, n = 2, 300
    spec = CE.make_spec((m, n), "float32", "cpu", {"reduction": "none"})
    old = "x_t = tl.load(x_row + t, mask=in_range, other=0.0)"
    module = _module(spec, _cands(m, n)["looped"], tmp_path, _replace_once(old, "x_t = tl.load(x_row + t)"))
    with pytest.raises(Exception, match="outside every tensor argument"):
        _run(spec, module, torch.randn(m, n), torch.tensor([1, 10**12]))
    assert checked_memory.violations and checked_memory.violations[0][0] == "load"


# --- the validator is not vacuous ---------------------------------------------------------------


def _replace_once(old: str, new: str):
    def mutate(src: str) -> str:
        assert src.count(old) == 1, f"expected exactly one {old!r} in the rendered source"
        return src.replace(old, new)
    return mutate


BROKEN = [
    # ignored rows not zeroed: their -100 target is out of range, so NaN
    ("row", "mean", "loss = tl.where(t == ignore_index, 0.0, loss)", "", "NaN in output"),
    # the mean divides by every row, not by the non-ignored ones
    ("multirow", "mean", "(mask & (t != ignore_index))", "mask", "relative error"),
    # the online sum is not rescaled when the running max grows
    ("looped", "none", "s * e + 1.0", "s + 1.0", ""),
    # log(sum) without the max subtracted back in
    ("row", "none", "loss = (row_max - x_t) + tl.log(sum_exp)", "loss = -x_t + tl.log(sum_exp)", ""),
]


@pytest.mark.parametrize(("variant", "reduction", "old", "new", "needle"), BROKEN)
def test_validator_rejects_broken_kernels(variant, reduction, old, new, needle, tmp_path):
    spec = CE.make_spec((7, 300), "float32", DEVICE, {"reduction": reduction})
    cand = _cands(7, 300)[variant]
    assert check_candidate(CE, _module(spec, cand, tmp_path / "ok"), spec, SEED, _sync) is None
    module = _module(spec, cand, tmp_path / "bad", _replace_once(old, new))
    reason = check_candidate(CE, module, spec, SEED, _sync)
    assert reason is not None and reason.startswith("normal inputs: "), reason
    assert needle in reason, reason


# --- spec, inputs, space -------------------------------------------------------------------------


def test_make_spec_normalises_and_validates():
    spec = CE.make_spec((4, 10), "bfloat16", "cpu", {"reduction": "SUM", "ignore_index": 3, "label_smoothing": 0.0,
                                                      "weight": None})
    assert spec.attrs == {"reduction": "sum", "ignore_index": 3}
    assert [(t.shape, t.dtype) for t in spec.inputs] == [((4, 10), "bfloat16"), ((4,), "int64")]
    assert CE.make_spec((4, 10), "float16", "cpu").attrs == {"reduction": "mean", "ignore_index": -100}
    for attrs, needle in [({"reduction": "batchmean"}, "reduction='batchmean'"), ({"ignore_index": 1.5}, "int"),
                          ({"ignore_index": True}, "int"), ({"eps": 1.0}, "not ['eps']"),
                          ({"weight": "tensor"}, "weight"), ({"label_smoothing": 0.1}, "label_smoothing=0.1"),
                          ({"size_average": False}, "size_average"), ({"reduce": True}, "reduce")]:
        with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("(", r"\(")):
            CE.make_spec((4, 10), "float32", "cpu", attrs)
    with pytest.raises(ValueError, match="only 2-D"):
        CE.make_spec((2, 5, 10), "float32", "cpu")
    with pytest.raises(ValueError, match="only 2-D"):
        CE.make_spec((10,), "float32", "cpu")
    with pytest.raises(ValueError, match="always NaN"):
        CE.make_spec((4, 1), "float32", "cpu", {"ignore_index": 0})
    assert CE.make_spec((4, 1), "float32", "cpu", {"ignore_index": 0, "reduction": "sum"}).attrs["ignore_index"] == 0


@pytest.mark.parametrize(("shape", "ignore_index"), [((1, 7), -100), ((2, 2), 1), ((64, 5), 0), ((300, 3), 2),
                                                     ((5, 1), -100)])
def test_make_inputs_targets(shape, ignore_index):
    m, v = shape
    spec = CE.make_spec(shape, "float16", "cpu", {"ignore_index": ignore_index})
    for seed in range(5):
        logits, target = CE.make_inputs(spec, seed, "normal")
        assert logits.dtype == torch.float16 and logits.shape == shape and bool((logits != 0).any())
        assert target.dtype == torch.int64 and target.shape == (m,)
        ignored = target == ignore_index
        assert not bool(ignored.all())  # "mean" is never 0/0
        if m >= 2:
            assert bool(ignored.any())  # the ignore path is always exercised
        valid = target[~ignored]
        assert bool(((valid >= 0) & (valid < v)).all())
        again = CE.make_inputs(spec, seed, "normal")
        assert torch.equal(again[0], logits) and torch.equal(again[1], target)
    if m >= 64:  # about a quarter of the rows are ignored
        assert 0.1 < float(ignored.float().mean()) < 0.45


@pytest.mark.parametrize(("shape", "variant"), [((2048, 128256), "looped"), ((8, 50257), "looped"),
                                                ((4096, 32000), "looped"), ((1, 4096), "row"), ((4096, 1000), "row")])
def test_default_and_space_for_realistic_shapes(shape, variant):
    spec = CE.make_spec(shape, "bfloat16", "cuda")
    space = CE.space(spec)
    assert CE.default(spec) in space and CE.default(spec).variant == variant
    if shape[1] > 65536:  # a whole 128k row in registers (128 fp32 per thread at 32 warps) would spill
        assert {c.variant for c in space.all_points()} == {"looped"}


# --- the shim: spellings, fallbacks, end to end --------------------------------------------------

L = torch.randn(6, 40)
# Valid under every ignore_index below (torch raises for a target that is neither a class nor ignored).
T = torch.tensor([1, 0, 5, 39, 7, 3])


def ce_plain(logits, target):
    return F.cross_entropy(logits, target)


def ce_sum(logits, target):
    return F.cross_entropy(logits, target, reduction="sum")


def ce_none_ignore(logits, target):
    return F.cross_entropy(logits, target, ignore_index=3, reduction="none")


def ce_positional(logits, target):
    return torch.nn.functional.cross_entropy(logits, target, None, None, 0, None, "sum")


class Model(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.loss = nn.CrossEntropyLoss(**kw)

    def forward(self, logits, target):
        return self.loss(logits, target)


SPELLINGS = [
    (ce_plain, {"reduction": "mean", "ignore_index": -100}),
    (ce_sum, {"reduction": "sum", "ignore_index": -100}),
    (ce_none_ignore, {"reduction": "none", "ignore_index": 3}),
    (ce_positional, {"reduction": "sum", "ignore_index": 0}),
    (nn.CrossEntropyLoss(), {"reduction": "mean", "ignore_index": -100}),
    (nn.CrossEntropyLoss(reduction="none", ignore_index=5), {"reduction": "none", "ignore_index": 5}),
    (Model(), {"reduction": "mean", "ignore_index": -100}),
    (Model(reduction="sum", ignore_index=1), {"reduction": "sum", "ignore_index": 1}),
]


@cpu_only
@pytest.mark.parametrize(("fn", "attrs"), SPELLINGS, ids=lambda v: type(v).__name__ if isinstance(v, nn.Module)
                         else getattr(v, "__name__", None))
def test_spellings_match_with_their_attrs(fn, attrs):
    e = forge.explain(forge.optimize(fn, interpreter=True), L, T)
    assert e.op == "cross_entropy" and e.uses == "eager" and e.reason == "cache miss: would search"
    indices, got = CE.match(canonical(fn, (L, T), {}).expr)
    assert indices == [0, 1] and got == attrs
    assert CE.make_spec(tuple(L.shape), "float32", "cpu", got).attrs == attrs


def _w_functional(logits, target, w):
    return F.cross_entropy(logits, target, weight=w)


def _smooth(logits, target):
    return F.cross_entropy(logits, target, label_smoothing=0.1)


def _size_average(logits, target):
    return F.cross_entropy(logits, target, size_average=False)


def _reduce(logits, target):
    return F.cross_entropy(logits, target, reduce=False)


def _any(logits, target):
    return F.cross_entropy(logits, target)


SOFT = torch.softmax(torch.randn(6, 40), -1)
UNSUPPORTED = [
    (_w_functional, (L, T, torch.rand(40)), "class weights (weight=)"),
    (nn.CrossEntropyLoss(weight=torch.rand(40)), (L, T), "class weights (weight=)"),
    (_smooth, (L, T), "label_smoothing=0.1"),
    (nn.CrossEntropyLoss(label_smoothing=0.2), (L, T), "label_smoothing=0.2"),
    (_size_average, (L, T), "size_average"),
    (_reduce, (L, T), "legacy reduce"),
    (_any, (L, SOFT), "soft (class-probability) targets"),
    (_any, (torch.randn(2, 40, 3), torch.randint(0, 40, (2, 3))), "logits with 3 dims"),
    (_any, (torch.randn(40), torch.tensor(3)), "logits with 1 dims"),
    (_any, (L, T.to(torch.uint8).clamp(0, 39)), "torch.uint8"),
]


@cpu_only
@pytest.mark.filterwarnings("ignore::UserWarning")  # torch's deprecation warning for size_average/reduce
@pytest.mark.parametrize(("fn", "args", "needle"), UNSUPPORTED)
def test_unsupported_arguments_fall_back_naming_them(fn, args, needle):
    f = forge.optimize(fn, interpreter=True, warn=False)
    e = forge.explain(f, *args)
    assert e.uses == "eager" and e.op == "cross_entropy", e.reason
    assert e.reason.startswith("cross_entropy does not support this call: ") and needle in e.reason, e.reason
    assert torch.equal(f(*args), fn(*args))


@cpu_only
@pytest.mark.slow
@pytest.mark.parametrize(("fn", "dtype"), [(ce_plain, torch.float32), (nn.CrossEntropyLoss(reduction="none"),
                                                                       torch.float16)])
def test_decorated_call_equals_eager_after_search(fn, dtype, monkeypatch):
    # On the interpreter eager always wins the timing; force acceptance to exercise the kernel path.
    monkeypatch.setattr(stats, "accepts", lambda *a, **k: True)
    calls = []
    real = engine.search
    monkeypatch.setattr(engine, "search", lambda *a, **k: calls.append(a) or real(*a, **k))
    f = forge.optimize(fn, budget=2, interpreter=True)
    logits = torch.randn(7, 300).to(dtype)
    target = torch.tensor([5, -100, 0, 299, 17, -100, 42])
    y = f(logits, target)
    assert len(calls) == 1
    e = forge.explain(f, logits, target)
    assert e.uses == "kernel" and e.op == "cross_entropy" and e.variant in CE.TEMPLATES
    eager = fn(logits, target)
    assert y.dtype == eager.dtype == dtype and y.shape == eager.shape
    ref = fn(logits.double(), target)
    assert compare(y, ref, CE.tolerance(str(dtype).removeprefix("torch."))) is None
    assert torch.allclose(y.double(), eager.double(), rtol=2e-3, atol=1e-5)
    y2 = f(logits, target)
    assert len(calls) == 1 and torch.equal(y, y2)
