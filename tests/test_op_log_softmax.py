"""log_softmax over the last dim: the dim attribute, every spelling the shim recognises
(F.log_softmax, torch.log_softmax, x.log_softmax, nn.LogSoftmax as the root or a submodule), fallbacks
with reasons, the validator rejecting broken kernels, and an end-to-end decorated call after a tiny
interpreter search.

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

SEED = 8_765
cpu_only = pytest.mark.skipif(HAS_CUDA, reason="exercises the interpreter path (CPU tensors)")

OP = ops.get("log_softmax")
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


# --- the spec and numerics ---------------------------------------------------------------------------


@pytest.mark.parametrize("dim", [-1, 2, "-1"])
def test_dim_attribute_is_normalised(dim):
    """Every spelling of the last dim is one cache key."""
    spec = MOD.make_spec((2, 3, 50), "float32", "cpu", {"dim": dim})
    assert spec.attrs == {"dim": -1}
    assert spec.hash() == MOD.make_spec((2, 3, 50), "float32", "cpu").hash()


@pytest.mark.parametrize(("attrs", "needle"), [
    ({"dim": 0}, "last dimension only, not dim=0"),
    ({"dim": 1}, "last dimension only, not dim=1"),
    ({"dtype": "float32"}, "takes attributes ['dim'], not ['dtype']"),
])
def test_make_spec_refuses_with_a_reason(attrs, needle):
    with pytest.raises(ValueError) as info:
        MOD.make_spec((2, 3, 50), "float32", "cpu", attrs)
    assert needle in str(info.value)


@pytest.mark.parametrize("cand", CANDS, ids=lambda c: c.variant)
@pytest.mark.parametrize("dim", [-1, 2])
def test_dim_values_match_the_oracle(cand, dim, tmp_path):
    spec = MOD.make_spec((5, 1, 300), "float32", DEVICE, {"dim": dim})
    assert check_candidate(MOD, _kernel(spec, cand, tmp_path), spec, SEED, _sync) is None


# --- the validator is not vacuous ---------------------------------------------------------------------


def _replace_once(old: str, new: str):
    def mutate(src: str) -> str:
        assert src.count(old) == 1, f"expected exactly one {old!r} in the rendered source"
        return src.replace(old, new)
    return mutate


def test_unmutated_kernels_pass(tmp_path):
    """The control for the negative tests below: the same spec and candidates, unmutated."""
    spec = MOD.make_spec((5, 300), "float32", DEVICE)
    for cand in CANDS:
        assert check_candidate(MOD, _kernel(spec, cand, tmp_path), spec, SEED, _sync) is None, cand.label


@pytest.mark.parametrize(("cand", "old", "new"), [
    (CANDS[0], "tl.log(", "tl.log2("),  # the wrong logarithm
    (CANDS[1], "((x - row_max) - log_sum)", "(x - row_max)"),  # never normalised
    (CANDS[1], "s * tl.exp(m - m_new) + tl.exp(x - m_new)", "s + tl.exp(x - m_new)"),  # no rescaling
    (CANDS[2], "y = z - tl.log(", "y = x - tl.log("),  # forgets the max it took out of the sum
], ids=["row-log2", "looped-not-normalised", "looped-no-rescale", "multirow-max-dropped"])
def test_validator_rejects_broken_kernels(cand, old, new, tmp_path):
    spec = MOD.make_spec((5, 300), "float32", DEVICE)
    module = _kernel(spec, cand, tmp_path, _replace_once(old, new))
    reason = check_candidate(MOD, module, spec, SEED, _sync)
    assert reason is not None
    assert reason.startswith("normal inputs: "), reason


# --- recognising it in user code ----------------------------------------------------------------------

X = torch.randn(6, 40)


def lsm_functional(x):
    return F.log_softmax(x, -1)


def lsm_keyword(x):
    return F.log_softmax(x, dim=-1)


def lsm_torch(x):
    return torch.log_softmax(x, -1)


def lsm_method(x):
    return x.log_softmax(-1)


def lsm_dim1(x):
    return x.log_softmax(dim=1)


def lsm_dim0(x):
    return F.log_softmax(x, dim=0)


def lsm_dtype(x):
    return torch.log_softmax(x, -1, dtype=torch.float64)


def sm_functional(x):
    return F.softmax(x, -1)


class Head(nn.Module):
    """nn.LogSoftmax as a submodule: a leaf fx does not trace into."""

    def __init__(self, dim=-1):
        super().__init__()
        self.out = nn.LogSoftmax(dim=dim)

    def forward(self, x):
        return self.out(x)


def _assert_matches(fn):
    assert MOD.match(canonical(fn, (X,), {}).expr) == ([0], {"dim": -1})
    e = forge.explain(forge.optimize(fn, interpreter=True), X)
    assert (e.op, e.uses, e.reason) == ("log_softmax", "eager", "cache miss: would search")


@cpu_only
@pytest.mark.parametrize("fn", [lsm_functional, lsm_keyword, lsm_torch, lsm_method, lsm_dim1, Head()],
                         ids=["F", "F-keyword", "torch", "method", "dim1", "submodule"])
def test_spellings_match_log_softmax(fn):
    _assert_matches(fn)


# nn.LogSoftmax as the *root* module: its forward calls F.log_softmax(input, self.dim, _stacklevel=5),
# and forge/trace.py only folds softmax/log_softmax calls whose _stacklevel is the default 3 (it only
# picks the stack level of a deprecation warning). Strict: passes once trace.py drops that condition.
@cpu_only
@pytest.mark.parametrize("dim", [-1, 1])
def test_nn_logsoftmax_as_the_root_module(dim):
    _assert_matches(nn.LogSoftmax(dim=dim))


# torch.log_softmax(x, dim, dtype) and x.log_softmax(dim, dtype) take dtype as the third positional
# argument; forge/trace.py checks only a dtype keyword, so it folds them to ("log_softmax_last", x) and
# a kernel would return x's dtype where eager returns float64. Strict: passes once trace.py refuses a
# positional dtype.
@cpu_only
@pytest.mark.parametrize("fn", [lambda x: torch.log_softmax(x, -1, torch.float64),
                                lambda x: x.log_softmax(-1, torch.float64)], ids=["torch", "method"])
def test_positional_dtype_is_not_matched(fn):
    assert MOD.match(canonical(fn, (X,), {}).expr) is None


@cpu_only
def test_softmax_is_still_softmax():
    """The two families do not claim each other's spelling."""
    assert MOD.match(canonical(sm_functional, (X,), {}).expr) is None
    assert ops.get("softmax").module.match(canonical(lsm_functional, (X,), {}).expr) is None
    assert forge.explain(forge.optimize(sm_functional, interpreter=True), X).op == "softmax"


@cpu_only
@pytest.mark.parametrize("fn", [lsm_dim0, lsm_dtype, Head(dim=0)], ids=["dim0", "dtype", "submodule-dim0"])
def test_unsupported_calls_fall_back_naming_log_softmax(fn):
    f = forge.optimize(fn, interpreter=True, warn=False)
    e = forge.explain(f, X)
    # the reason shows the call it did not match: log_softmax(...) or module LogSoftmax
    assert e.uses == "eager" and "no op family matches" in e.reason
    assert "logsoftmax" in e.reason.lower().replace("_", ""), e.reason
    assert torch.equal(f(X), fn(X))


# --- end to end ---------------------------------------------------------------------------------------


@cpu_only
@pytest.mark.slow
def test_decorated_call_equals_eager_after_a_search(monkeypatch):
    # On the interpreter eager always wins; force acceptance to exercise the kernel path.
    monkeypatch.setattr(stats, "accepts", lambda *a, **k: True)
    searches = []
    real = engine.search
    monkeypatch.setattr(engine, "search", lambda *a, **k: searches.append(a[:3]) or real(*a, **k))
    x = torch.randn(2, 7, 300) * 4
    f = forge.optimize(lsm_functional, budget=2, interpreter=True)
    y = f(x)
    assert searches == [("log_softmax", (2, 7, 300), "float32")]
    e = forge.explain(f, x)
    assert e.uses == "kernel" and e.op == "log_softmax" and e.variant in ("row", "looped", "multirow")
    assert compare(y, torch.log_softmax(x.double(), -1), MOD.tolerance("float32")) is None
    assert torch.allclose(y, lsm_functional(x), rtol=1e-4, atol=1e-5)
    # nn.LogSoftmax(dim=2) on the same shape is the same spec: a cache hit, no search.
    monkeypatch.setattr(engine, "search", lambda *a, **k: pytest.fail("cache hit must not search"))
    g = forge.optimize(Head(dim=2), interpreter=True)
    assert forge.explain(g, x).uses == "kernel"
    assert torch.allclose(g(x), lsm_functional(x), rtol=1e-4, atol=1e-5)
