"""The runtime shim on the CPU interpreter: spelling matching, fallbacks with reasons, cache hits
without search, FORGE_SEARCH=0, integrity checks, forge.load, thread-safe first call."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import threading
import time
import warnings

import pytest
import torch
import torch.nn.functional as F

import forge
from forge.cache import Cache
from forge.tuner import engine, stats
from tests.conftest import HAS_CUDA, ROOT

pytestmark = pytest.mark.skipif(HAS_CUDA, reason="exercises the interpreter path (CPU tensors)")


def rms_seed(x, weight, eps=1e-6):
    return x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + eps) * weight


def rms_noweight(x, eps=1e-6):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rms_functional(x, w):
    return F.rms_norm(x, (x.shape[-1],), w, 1e-5)


def rms_reordered(x, w):
    return w * (torch.rsqrt(1e-5 + (x**2).mean(dim=[-1], keepdim=True)) * x)


def sm_torch(x):
    return torch.softmax(x, -1)


def sm_functional(x):
    return F.softmax(x, dim=-1)


def sm_method(x):
    return x.softmax(-1)


def sm_dim1(x):
    return torch.softmax(x, dim=1)


def cumsum_rows(x):
    return torch.cumsum(x, -1)


def sm_dim0(x):
    return torch.softmax(x, dim=0)


def poly(x):
    return x * x + 1


def mean_rows(x, w, eps=1e-6):
    return x * torch.rsqrt(torch.mean(x * x, dim=0, keepdim=True) + eps) * w


def data_dependent(x):
    if x.sum() > 0:
        return x.softmax(-1)
    return x


X = torch.randn(6, 40)
W = torch.randn(40)


@pytest.mark.parametrize("fn,args,op", [
    (rms_seed, (X, W), "rmsnorm"), (rms_noweight, (X,), "rmsnorm"), (rms_functional, (X, W), "rmsnorm"),
    (rms_reordered, (X, W), "rmsnorm"), (sm_torch, (X,), "softmax"), (sm_functional, (X,), "softmax"),
    (sm_method, (X,), "softmax"), (sm_dim1, (X,), "softmax"), (poly, (X,), "pointwise"),
])
def test_spellings_match_their_family(fn, args, op):
    e = forge.explain(forge.optimize(fn, interpreter=True), *args)
    assert e.op == op and e.uses == "eager" and e.reason == "cache miss: would search"


@pytest.mark.parametrize("fn,args,needle", [
    (cumsum_rows, (X,), "no op family matches"), (sm_dim0, (X,), "no op family matches"),
    # rmsnorm over dim 0 (issue 14's any dims) with a (40,) weight that broadcasts over the other dim: refused
    (mean_rows, (X, W), "do not fit rmsnorm's kernel"),
    (data_dependent, (X,), "cannot trace"),
])
def test_non_matches_fall_back_with_a_reason(fn, args, needle):
    f = forge.optimize(fn, interpreter=True, warn=False)
    e = forge.explain(f, *args)
    assert e.uses == "eager" and needle in e.reason
    assert torch.equal(f(*args), fn(*args))


def test_cpu_tensors_need_interpreter_opt_in(monkeypatch):
    monkeypatch.delenv("FORGE_INTERPRETER", raising=False)
    e = forge.explain(rms_seed, X, W)
    assert e.uses == "eager" and "without the interpreter opted in" in e.reason


def test_fallback_reasons_for_grad_noncontiguous_and_dtype():
    f = forge.optimize(rms_seed, interpreter=True, warn=False)
    assert "require grad" in forge.explain(f, X.clone().requires_grad_(), W).reason
    assert "last dimension must be contiguous" in forge.explain(f, torch.randn(40, 6).t(), torch.randn(40)).reason
    assert "dtype" in forge.explain(f, X, W.double()).reason
    assert "dtype" in forge.explain(f, X.half(), W).reason


def test_autocast_runs_eager_with_eagers_dtypes():
    """Under autocast eager's ops pick their own dtypes (matmul in the autocast dtype); forge's kernels
    compute in their inputs' dtype, so autocast on is eager, and a separate signature from autocast off."""
    def mm(a, b):
        return a @ b

    a, b = torch.randn(8, 16), torch.randn(16, 4)
    f = forge.optimize(mm, interpreter=True, warn=False)
    assert forge.explain(f, a, b).reason == "cache miss: would search"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        e = forge.explain(f, a, b)
        y, ref = f(a, b), mm(a, b)
    assert e.uses == "eager" and "autocast is enabled" in e.reason and e.op == "matmul"
    assert y.dtype == ref.dtype == torch.bfloat16 and torch.equal(y, ref)
    assert forge.explain(f, a, b).reason == "cache miss: would search"


def test_search_off_never_searches_and_warns_once(monkeypatch):
    monkeypatch.setenv("FORGE_SEARCH", "0")
    monkeypatch.setattr(engine, "search", lambda *a, **k: pytest.fail("FORGE_SEARCH=0 must not search"))
    f = forge.optimize(rms_seed, interpreter=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a, b = f(X, W), f(X, W)
    assert torch.equal(a, rms_seed(X, W)) and torch.equal(b, a)
    assert len([w for w in caught if "forge" in str(w.message)]) == 1
    assert "searching is off" in forge.explain(f, X, W).reason
    g = forge.optimize(rms_seed, interpreter=True, search=False, warn=False)
    monkeypatch.delenv("FORGE_SEARCH")
    assert "searching is off" in forge.explain(g, X, W).reason and torch.equal(g(X, W), a)


def _count_searches(monkeypatch) -> list:
    calls = []
    real = engine.search

    def counting(*a, **k):
        calls.append(a[:3])
        return real(*a, **k)

    monkeypatch.setattr(engine, "search", counting)
    return calls


@pytest.mark.slow
def test_kernel_path_search_then_hits_without_search(monkeypatch):
    # On the interpreter eager always wins; force acceptance to exercise the kernel path.
    monkeypatch.setattr(stats, "accepts", lambda *a, **k: True)
    calls = _count_searches(monkeypatch)
    f = forge.optimize(rms_noweight, budget=2, interpreter=True)
    x = torch.randn(7, 300)
    y = f(x)
    assert len(calls) == 1
    ref = rms_noweight(x.double())
    assert torch.allclose(y.double(), ref, rtol=1e-4, atol=1e-5)
    e = forge.explain(f, x)
    assert e.uses == "kernel" and e.op == "rmsnorm" and e.variant in ("row", "looped", "multirow")
    y2 = f(x)
    assert len(calls) == 1 and torch.equal(y, y2)
    # A new decorated function, same signature: a cache hit, no search.
    g = forge.optimize(rms_seed, budget=2, interpreter=True)
    monkeypatch.setattr(engine, "search", lambda *a, **k: pytest.fail("cache hit must not search"))
    w = torch.ones(300)
    assert forge.explain(g, x, w).uses == "kernel"
    assert torch.allclose(g(x, w).double(), ref, rtol=1e-4, atol=1e-5)
    # forge.load gives the same kernel without a decorator.
    k = forge.load("rmsnorm", (7, 300), "float32", device="cpu")
    assert torch.allclose(k(x, w).double(), ref, rtol=1e-4, atol=1e-5)
    with pytest.raises(LookupError, match="not tuned"):
        forge.load("rmsnorm", (8, 300), "float32", device="cpu")


@pytest.mark.slow
def test_cached_eager_and_tampered_entries_fall_back(monkeypatch):
    monkeypatch.setattr(stats, "accepts", lambda *a, **k: False)
    f = forge.optimize(sm_method, budget=1, interpreter=True, warn=False)
    x = torch.randn(3, 50)
    assert torch.equal(f(x), sm_method(x))
    assert "cached decision is eager" in forge.explain(f, x).reason

    monkeypatch.setattr(stats, "accepts", lambda *a, **k: True)
    g = forge.optimize(sm_method, budget=1, interpreter=True, warn=False)
    x = torch.randn(4, 50)
    g(x)
    db = Cache(os.path.join(os.environ["FORGE_CACHE_DIR"], "forge.db"))
    key = forge.explain(g, x).key
    entry = db.get(key)
    assert entry.decision == "kernel"
    # Source edited behind the hash: never loaded.
    raw = sqlite3.connect(db.path)  # edited behind forge's back, sha256 left as it was
    raw.execute("UPDATE entries SET source = source || '# tampered' WHERE key = ?", (key,))
    raw.commit()
    raw.close()
    fresh = forge.optimize(sm_method, interpreter=True, warn=False)  # nothing bound yet
    assert "does not match its sha256" in forge.explain(fresh, x).reason
    # Environment recorded differently (e.g. an imported entry from another torch): a miss.
    db.put(entry.__class__(**{**entry.__dict__, "env": {**entry.env, "torch": "0.0.0"}}))
    e = forge.explain(forge.optimize(sm_method, interpreter=True, warn=False), x)
    assert "another environment (torch)" in e.reason


def test_first_call_is_thread_safe(monkeypatch):
    calls = []

    def slow_search(*a, **k):
        calls.append(1)
        time.sleep(0.3)

    monkeypatch.setattr(engine, "search", slow_search)
    f = forge.optimize(sm_torch, interpreter=True, warn=False)
    x = torch.randn(5, 9)
    results = [None] * 4

    def run(i):
        results[i] = f(x)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert all(torch.equal(r, sm_torch(x)) for r in results)


def test_import_is_light():
    code = ("import sys, time; import torch; t = time.perf_counter(); import forge; "
            "dt = time.perf_counter() - t; "
            "bad = [m for m in ('typer', 'rich', 'jinja2', 'forge.tuner.engine', 'triton') if m in sys.modules]; "
            "print(dt, bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout.split()
    assert float(out[0]) < 0.3 and out[1] == "[]"


# --- nn.Module support ---------------------------------------------------------------------------


class Block(torch.nn.Module):
    """A user module whose forward is an rmsnorm written out, reading its own parameter."""

    def __init__(self, n: int):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.randn(n))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.scale


def test_modules_match_with_their_parameters_as_inputs():
    m = torch.nn.RMSNorm(40, eps=1e-5)
    f = forge.optimize(m, interpreter=True, warn=False)
    with torch.no_grad():
        e = forge.explain(f, X)
        assert e.op == "rmsnorm" and e.reason == "cache miss: would search"
        assert torch.equal(f(X), m(X))
    # Parameters require grad: with grad enabled, eager (forge kernels are forward-only).
    assert "require grad" in forge.explain(f, X).reason
    b = Block(40)
    with torch.no_grad():
        assert forge.explain(forge.optimize(b, interpreter=True), X).op == "rmsnorm"
        # Decorating the bound forward of an instance works too (its class's forward is traced).
        b.forward = forge.optimize(b.forward, interpreter=True, warn=False)
        assert forge.explain(b.forward, X).op == "rmsnorm"
        assert torch.equal(b(X), Block.forward(b, X))


@pytest.mark.slow
def test_module_kernel_reads_current_parameters(monkeypatch):
    monkeypatch.setattr(stats, "accepts", lambda *a, **k: True)
    b = Block(300)
    f = forge.optimize(b, budget=2, interpreter=True)
    x = torch.randn(7, 300)
    with torch.no_grad():
        y = f(x)
        assert forge.explain(f, x).uses == "kernel"
        assert torch.allclose(y, b(x), rtol=1e-4, atol=1e-5)
        b.scale.mul_(2)  # in place (an optimizer step)
        assert torch.allclose(f(x), b(x), rtol=1e-4, atol=1e-5)
        b.scale = torch.nn.Parameter(torch.randn(300))  # reassigned (load_state_dict(assign=True))
        assert torch.allclose(f(x), b(x), rtol=1e-4, atol=1e-5)
        f.search = False
        b.half()  # dtype changed: a new signature, decided afresh (never the float32 kernel)
        xh = x.half()
        assert "cache miss" in forge.explain(f, xh).reason
        assert torch.equal(f(xh), b(xh))


W_GLOBAL = torch.rand(40) + 0.5


def rms_reads_global(x):
    return F.rms_norm(x, (x.shape[-1],), W_GLOBAL, 1e-5)


def rms_tensor_default(x, w=W_GLOBAL):
    return F.rms_norm(x, (x.shape[-1],), w, 1e-5)


def test_tensors_from_globals_are_never_baked_into_a_binding():
    """Rebinding the global later must change the result, as in eager: such functions run eager."""
    global W_GLOBAL
    f = forge.optimize(rms_reads_global, interpreter=True, warn=False)
    e = forge.explain(f, X)
    assert e.uses == "eager" and "not its arguments" in e.reason
    before = f(X)
    old, W_GLOBAL = W_GLOBAL, torch.rand(40) + 2.0
    try:
        assert not torch.equal(f(X), before) and torch.equal(f(X), rms_reads_global(X))
    finally:
        W_GLOBAL = old


def test_tensor_defaults_fall_back_safely():
    """fx cannot trace a tensor default (today: eager, 'cannot trace'); the call path binds defaults
    like the trace would (the general path), so a future trace of it could not pick the wrong tensor."""
    f = forge.optimize(rms_tensor_default, interpreter=True, warn=False)
    assert f._tensor_defaults
    e = forge.explain(f, X)
    assert e.uses == "eager" and "cannot trace" in e.reason
    assert torch.equal(f(X), rms_tensor_default(X))
    assert torch.equal(f(X, W_GLOBAL * 2), rms_tensor_default(X, W_GLOBAL * 2))


EPS_GLOBAL = 1e-6


def rms_global_eps(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS_GLOBAL)


@pytest.mark.slow
def test_scalar_globals_and_module_attributes_are_part_of_the_signature(monkeypatch):
    """fx bakes a global EPS or a module's eps into the trace: changing them must re-decide, never reuse."""
    global EPS_GLOBAL
    monkeypatch.setattr(stats, "accepts", lambda *a, **k: True)
    x = torch.randn(3, 300) * 1e-3  # small values: eps matters
    f = forge.optimize(rms_global_eps, budget=1, interpreter=True, warn=False)
    y1 = f(x)
    assert forge.explain(f, x).uses == "kernel"
    EPS_GLOBAL = 1e-2
    try:
        f.search = False
        y2 = f(x)  # a new signature: cache miss with search off -> eager with the new eps
        assert torch.allclose(y2, rms_global_eps(x), rtol=1e-4, atol=1e-6)
        assert not torch.allclose(y1, y2, rtol=1e-2)
    finally:
        EPS_GLOBAL = 1e-6
    assert torch.equal(f(x), y1)  # back to the first signature: the bound kernel again
    m = torch.nn.LayerNorm(300)
    g = forge.optimize(m, interpreter=True, search=False, warn=False)
    with torch.no_grad():
        a = g(x)
        m.eps = 1e-1
        b = g(x)
        assert torch.allclose(b, m(x), rtol=1e-4, atol=1e-5) and not torch.allclose(a, b, rtol=1e-2)


def test_a_binding_keeps_only_the_inputs_it_made():
    """The first call's tensors are not held by the binding (only rmsnorm's made-up weight of ones)."""
    import weakref

    from forge.shim import _Binding

    x = torch.randn(4, 8)
    b = _Binding(None, None, None, [0, None], (x, torch.ones(8)), {})
    ref = weakref.ref(x)
    del x
    assert ref() is None
    assert b.slots[0] == (0, None) and torch.equal(b.slots[1][1], torch.ones(8))
