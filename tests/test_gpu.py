"""GPU tier: run on the H200 through the device tool (`pytest -m gpu`); skipped without CUDA."""

from __future__ import annotations

import contextlib

import pytest

from forge import launch
from forge.cache import Cache
from forge.tuner import engine
from tests.fault_ops.faulty import EXPECTED

pytestmark = pytest.mark.gpu


def test_search_rmsnorm_on_cuda_decides_and_caches(tmp_path):
    cache = Cache(tmp_path / "forge.db")
    opts = engine.SearchOptions(budget=8, timeout=120)
    rep = engine.search("rmsnorm", (2048, 4096), "float16", device="cuda", cache=cache, options=opts)
    assert rep.backend == "cuda" and not rep.cache_hit
    assert rep.env["gpu"] and rep.env["cc"] and rep.env["sm_count"] > 0
    assert [c["status"] for c in rep.candidates] == ["ok"] * 8
    assert rep.decision in ("kernel", "eager")
    assert 0 < rep.baseline.p20 <= rep.baseline.p50 <= rep.baseline.p80
    if rep.decision == "kernel":
        q = rep.winner["quantiles"]
        assert q["p80"] < rep.baseline.p20 / 1.03
    again = engine.search("rmsnorm", (2048, 4096), "float16", device="cuda", cache=cache, options=opts)
    assert again.cache_hit and again.key == rep.key and again.decision == rep.decision
    # issue 15: the most memory one worker held for this spec, at least its inputs and output
    peak = rep.memory["peak_per_worker"]
    assert isinstance(peak, int) and peak >= 2 * 2048 * 4096 * 2, rep.memory


def test_fault_injection_on_cuda_records_every_failure(tmp_path, fault_ops):
    cache = Cache(tmp_path / "forge.db")
    opts = engine.SearchOptions(budget=len(EXPECTED), timeout=20, workers=4)
    rep = engine.search("faulty", (64, 1000), "float32", device="cuda", cache=cache, options=opts)
    got = {c["variant"]: c["status"] for c in rep.candidates}
    assert got == EXPECTED, {v: (c["status"], c["reason"]) for v, c in
                             ((c["variant"], c) for c in rep.candidates)}
    assert rep.decision in ("kernel", "eager")


@pytest.mark.parametrize("op", ["rmsnorm", "softmax"])
def test_timing_is_stable_run_to_run(tmp_path, op):
    """Two forced searches of the same spec: the winner's p50 agrees within 5%."""
    cache = Cache(tmp_path / "forge.db")
    opts = engine.SearchOptions(budget=4, force=True, timeout=120)
    a = engine.search(op, (4096, 4096), "bfloat16", device="cuda", cache=cache, options=opts)
    b = engine.search(op, (4096, 4096), "bfloat16", device="cuda", cache=cache, options=opts)
    assert a.baseline.p50 == pytest.approx(b.baseline.p50, rel=0.05)


# --- the runtime shim on CUDA: compiled launch path, streams, modules, forge.load ------------------


def _rms(x, weight, eps=1e-6):
    import torch

    return x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + eps) * weight


@pytest.fixture
def tuned_rmsnorm(monkeypatch):
    """A cached rmsnorm kernel for (64, 4096) float16, accepted whatever the timing says."""
    from forge.tuner import stats

    monkeypatch.setattr(stats, "accepts", lambda *a, **k: True)
    engine.search("rmsnorm", (64, 4096), "float16", device="cuda", cache=Cache(_default_db()), attrs={"eps": 1e-6},
                  options=engine.SearchOptions(budget=4, timeout=120))


@contextlib.contextmanager
def _forge_compiled(fn, be):
    """torch.compile(fn) with the forge Backend `be`, between two Dynamo resets: no compiled entry of another
    test is reused, and none of this one leaks into the next."""
    import torch

    torch._dynamo.reset()
    try:
        yield torch.compile(fn, backend=be, dynamic=False)
    finally:
        torch._dynamo.reset()


def _default_db():
    from forge.cache import default_cache_path

    return default_cache_path()


def test_shim_compiled_launch_replays_the_jit_path_bit_for_bit(tuned_rmsnorm):
    import torch

    import forge

    f = forge.optimize(_rms, search=False)
    x = torch.randn(64, 4096, device="cuda", dtype=torch.float16)
    w = torch.randn(4096, device="cuda", dtype=torch.float16)
    y = f(x, w)
    e = forge.explain(f, x, w)
    # triton 3.6 and 3.9 have known launcher layouts: the C launch function is called directly
    assert e.uses == "kernel" and e.launch.startswith("compiled (C launch function)"), e
    binding = next(iter(f._bound.values()))[0]
    x2 = torch.randn_like(x)
    fast = f(x2, w)  # compiled path, new data
    fast_call, f._fast = f._fast, None
    plan, binding.plan = binding.plan, None
    slow = f(x2, w)  # JIT path
    binding.plan = launch.Plan(plan.launches, plan.device_index, direct=False)
    wrapped = f(x2, w)  # Triton's launcher objects
    binding.plan = plan
    direct = f(x2, w)  # the Python plan, C launch function
    f._fast = fast_call
    assert torch.equal(fast, slow) and torch.equal(wrapped, slow) and torch.equal(direct, slow)
    ref = _rms(x.double(), w.double())
    assert torch.allclose(y.double(), ref, rtol=2e-3, atol=1e-3)
    # On a side stream the launch goes to that stream (ordering with the producer of x3 is kept).
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        x3 = torch.randn_like(x) * 3
        y3 = f(x3, w)
    s.synchronize()
    assert torch.allclose(y3.double(), _rms(x3.double(), w.double()), rtol=2e-3, atol=1e-3)


def test_cpp_fast_path_launches_what_the_python_plan_does(tuned_rmsnorm):
    """forge/_fastcall.cpp on the GPU: made after the first call, bit-identical to the Python plan and the
    JIT path, on the current stream, and out of the way for any other signature or a launch hook."""
    import torch
    from triton import knobs

    import forge
    from forge import fastcall

    assert fastcall.module(wait=True) is not None, fastcall.error()
    f = forge.optimize(_rms, search=False)
    x = torch.randn(64, 4096, device="cuda", dtype=torch.float16)
    w = torch.randn(4096, device="cuda", dtype=torch.float16)
    f(x, w)
    assert f._fast is not None and f._fast[1] is False, forge.explain(f, x, w)  # a kernel's fast call
    assert forge.explain(f, x, w).launch.endswith("fast path: C++ (forge/_fastcall.cpp)")
    calls = []
    real = f._fast[0]

    def counting(*a):
        out = real(*a)
        calls.append(out is not None)
        return out
    f._fast = (counting, False)
    x2 = torch.randn_like(x) * 2
    fast = f(x2, w)
    f._fast = None
    python = f(x2, w)
    binding = next(iter(f._bound.values()))[0]
    plan, binding.plan = binding.plan, None
    jit = f(x2, w)
    binding.plan, f._fast = plan, (counting, False)
    assert calls == [True] and torch.equal(fast, python) and torch.equal(fast, jit)
    # on a side stream, ordered after the producer of its input
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        x3 = torch.randn_like(x) * 3
        y3 = f(x3, w)
    s.synchronize()
    assert calls[-1] is True
    assert torch.allclose(y3.double(), _rms(x3.double(), w.double()), rtol=2e-3, atol=1e-3)
    # another shape, or a launch hook installed: not the fast call's
    with pytest.warns(RuntimeWarning, match="runs eager"):
        assert torch.equal(f(x[:32], w), _rms(x[:32], w))  # (32, 4096) has no cached kernel: eager
    assert calls[-1] is False
    hook = []
    knobs.runtime.launch_enter_hook.add(hook.append)
    try:
        f(x2, w)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook.append)
    assert calls[-1] is False and hook  # the JIT path ran, and the hook saw it


def test_eager_signatures_on_cuda_get_the_cpp_eager_call():
    """A signature decided eager (here: no cached kernel, searching off) is served by the C++ eager call:
    the function runs once per call, with its own result, and another signature still takes the Python
    path."""
    import torch

    import forge
    from forge import fastcall

    assert fastcall.module(wait=True) is not None, fastcall.error()
    runs = []

    def cumsum_rows(x):  # no op family matches: eager
        runs.append(1)
        return x.cumsum(-1)

    f = forge.optimize(cumsum_rows, warn=False)
    x = torch.randn(8, 256, device="cuda")
    # The first call runs the function under TorchDynamo with the forge backend (a function that is not one
    # op: its regions), finds none and binds the signature eager; the next one takes the Python eager path,
    # which makes the C++ eager call for it.
    assert torch.equal(f(x), x.cumsum(-1))
    assert torch.equal(f(x), x.cumsum(-1))
    assert f._fast is not None and f._fast[1] is True, f._fast_off
    before = len(runs)
    y = torch.randn(8, 256, device="cuda")
    assert torch.equal(f(y), y.cumsum(-1)) and len(runs) == before + 1
    z = torch.randn(4, 256, device="cuda")
    assert torch.equal(f(z), z.cumsum(-1))


def test_shim_kernel_replays_inside_a_cuda_graph(tuned_rmsnorm):
    """A host-bound decode loop is captured in a CUDA graph; a bound forge kernel (warmed up first, as
    torch.compile's are) must be capturable: it launches on the capturing stream, allocates its output
    from the graph's pool, and each replay recomputes from the static input's new contents."""
    import torch

    import forge
    from forge import fastcall

    assert fastcall.module(wait=True) is not None, fastcall.error()
    f = forge.optimize(_rms, search=False)
    x = torch.randn(64, 4096, device="cuda", dtype=torch.float16)
    w = torch.randn(4096, device="cuda", dtype=torch.float16)
    f(x, w)  # first call: bind, JIT, record the launch plan (recording synchronizes: not capturable)
    assert "fast path: C++" in forge.explain(f, x, w).launch  # the graph captures the C++ path's launch
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        f(x, w)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = f(x, w)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.allclose(y.double(), _rms(x.double(), w.double()), rtol=2e-3, atol=1e-3)


def test_shim_module_and_load_on_cuda(tuned_rmsnorm):
    import torch

    import forge

    m = torch.nn.RMSNorm(4096, eps=1e-6, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        m.weight.normal_()
    # nn.RMSNorm is torch's fused op: its spec is form="fused" (the baseline F.rms_norm), another key than the
    # fixture's formula; tuned here the same way (any kernel accepted)
    engine.search("rmsnorm", (64, 4096), "float16", device="cuda", cache=Cache(_default_db()),
                  attrs={"eps": 1e-6, "form": "fused"}, options=engine.SearchOptions(budget=4, timeout=120))
    fm = forge.optimize(m, search=False)
    x = torch.randn(64, 4096, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        y = fm(x)
        e = forge.explain(fm, x)
    assert e.uses == "kernel" and e.op == "rmsnorm", e
    assert torch.allclose(y.double(), _rms(x.double(), m.weight.double()), rtol=2e-3, atol=1e-3)
    # With grad enabled the parameters require grad: eager, same values.
    assert "require grad" in forge.explain(fm, x).reason
    k = forge.load("rmsnorm", (64, 4096), "float16", eps=1e-6)
    w = m.weight.detach()
    assert torch.allclose(k(x, w).double(), _rms(x.double(), w.double()), rtol=2e-3, atol=1e-3)
    with pytest.raises(ValueError, match="takes"):
        k(x[:32], w)
    # Rows that are not contiguous (x.t()): eager, with the reason (rows with any row stride are taken).
    xt = torch.randn(4096, 64, device="cuda", dtype=torch.float16).t()
    f = forge.optimize(_rms, search=False, warn=False)
    assert "the last dimension must be contiguous" in forge.explain(f, xt, w).reason
    assert torch.equal(f(xt, w), _rms(xt, w))


def test_a_tensor_descriptor_kernel_gets_the_compiled_launch_plan(tmp_path):
    """linear's persistent variant (host-side TensorDescriptors; GPT-2's lm_head with an odd N) bound as the shim
    binds a cached kernel: after its first (JIT) call the launch plan is recorded and proved, later calls go
    through it (not the JIT) with the same bits as the JIT path on new inputs."""
    import torch

    from forge import codegen, opkit, ops, shim
    from forge.loader import load_module, write_source

    if not opkit.tma_available():
        pytest.skip("no TMA on this GPU / triton")
    op = ops.get("linear")
    spec = op.module.make_spec((2, 1024, 4001, 512), "bfloat16", "cuda", {"weight": "nk"})
    cand = op.module.default(spec)  # an odd N (4001): the persistent variant, as for GPT-2's lm_head
    assert cand.variant == "persistent", cand
    module = load_module(write_source(codegen.render(op, spec, cand), tmp_path))
    binding = shim._Binding(op.module, module, spec, [0, 1], (None, None), spec.attrs, device_index=0)
    x = torch.randn(2, 1024, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4001, 512, device="cuda", dtype=torch.bfloat16)
    first = binding([x, w])
    assert binding.launch is not None and binding.launch.startswith("compiled"), binding.launch
    torch.testing.assert_close(first.float(), x.float() @ w.float().t(), rtol=2e-2, atol=5e-1)
    x2 = torch.randn_like(x)
    planned = binding([x2, w])
    plan, binding.plan = binding.plan, None
    jit = binding([x2, w])
    binding.plan = plan
    assert launch.same_bits(planned, jit) and planned.data_ptr() != jit.data_ptr()


def test_backend_cudagraphs_runs_a_large_last_gemm_after_the_replay():
    """Backend(cudagraphs=True) on a model whose last op is a GEMM with a large output (the logits): the GEMM
    runs after each replay on the graph's static buffers instead of its output being copied out; every call's
    logits are eager's and stay as they were after later calls."""
    import torch

    from forge.backend import Backend

    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(1024, 1024, device="cuda", dtype=torch.bfloat16)
            self.head = torch.nn.Linear(1024, 32000, bias=False, device="cuda", dtype=torch.bfloat16)

        def forward(self, x):
            return self.head(torch.relu(self.proj(x)))  # (256, 32000) bf16: 16 MB of logits

    m = LM()
    be = Backend(miss="eager", cudagraphs=True, cache=_default_db())
    with _forge_compiled(m, be) as f:
        outs = []
        with torch.no_grad():
            for _ in range(5):
                x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16)
                outs.append((f(x), m(x)))
        (graphed,) = [g for _, g in be.graphed]
        assert graphed.replays >= 3 and "computed after each replay" in graphed.describe(), graphed.describe()
        for got, want in outs:
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_backend_cudagraphs_auto_keeps_a_host_bound_graph_and_releases_a_device_bound_one():
    """Backend(cudagraphs="auto") on real CUDA: 300 tiny ops (host-bound: the replay is far faster) keep their
    graph; one 8192^3 GEMM does not pay and is released (split_tail runs it after the replay, so the replay only
    adds the copies of its moving inputs into the graph's static buffers). Values are eager's on every call
    either way."""
    import torch

    from forge import cudagraph as cg
    from forge.backend import Backend

    def tiny(x):
        for i in range(300):
            x = x * 1.0001 + i * 1e-6
        return x

    def big(a, b):
        return a @ b

    for fn, make, kept in ((tiny, lambda: (torch.randn(64, device="cuda"),), True),
                           (big, lambda: (torch.randn(8192, 8192, device="cuda"),
                                          torch.randn(8192, 8192, device="cuda")), False)):
        be = Backend(miss="eager", cudagraphs="auto", cache=_default_db())
        with _forge_compiled(fn, be) as f:
            for _ in range(2 * cg.AUTO_SAMPLES + 4):
                args = make()
                torch.testing.assert_close(f(*args), fn(*args), rtol=1e-4, atol=1e-3)
            (graphed,) = [g for _, g in be.graphed]
            assert len(graphed.run_s) == cg.AUTO_SAMPLES and len(graphed.replay_s) == cg.AUTO_SAMPLES
            if kept:
                assert graphed.reason is None and "auto: kept" in graphed.describe(), graphed.describe()
            else:
                assert "auto: released" in graphed.describe(), graphed.describe()


def test_backend_cudagraphs_replays_the_whole_graph_with_a_forge_kernel_inside(tuned_rmsnorm):
    """Backend(cudagraphs=True): the graph with forge's rmsnorm kernel in it captured once and replayed; the
    values are eager's on new inputs, earlier outputs are not overwritten, a moved weight runs without the
    graph and captures again."""
    import torch

    from forge.backend import Backend

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4096, device="cuda", dtype=torch.float16))
            self.lin = torch.nn.Linear(4096, 4096, device="cuda", dtype=torch.float16)

        def forward(self, x):
            return self.lin(_rms(x, self.w)) + 1.0

    m = Block()
    be = Backend(miss="eager", cudagraphs=True, cache=_default_db())
    with _forge_compiled(m, be) as f:
        outs = []
        with torch.no_grad():
            for _ in range(5):
                x = torch.randn(64, 4096, device="cuda", dtype=torch.float16)
                outs.append((f(x), m(x)))
            rep = be.explain()
            assert rep.kernels == 1, rep
            (graphed,) = [g for _, g in be.graphed]
            assert graphed.captures == 1 and graphed.replays == 4, graphed.describe()
            for got, want in outs:
                torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
            m.w.data = m.w.data.clone()  # a parameter moved to another storage: not the captured one
            x = torch.randn(64, 4096, device="cuda", dtype=torch.float16)
            torch.testing.assert_close(f(x), m(x), rtol=2e-2, atol=2e-2)
            x = torch.randn(64, 4096, device="cuda", dtype=torch.float16)
            torch.testing.assert_close(f(x), m(x), rtol=2e-2, atol=2e-2)
            # the same graph saw the weight move (or Dynamo's guards made a new graph): either way not replayed
            # with the old storage
            assert graphed.moved == 1 or len(be.graphed) == 2, [g.describe() for _, g in be.graphed]
            assert "CUDA graph" in str(be.explain())


def test_backend_region_takes_the_cpp_fast_call_bit_for_bit(tuned_rmsnorm):
    """A region the backend swapped gets the C++ fast call (forge/_fastcall.cpp) once its binding has a
    compiled plan: the same bits as the Python plan path, a fresh output per call, and another shape
    (Dynamo recompiles, or the guard falls back) still right."""
    import torch

    from forge import fastcall
    from forge.backend import Backend

    assert fastcall.module(wait=True) is not None, fastcall.error()
    w = torch.randn(4096, device="cuda", dtype=torch.float16)
    be = Backend(miss="eager", cache=_default_db())
    with _forge_compiled(lambda x: _rms(x, w), be) as f:
        with torch.no_grad():
            x = torch.randn(64, 4096, device="cuda", dtype=torch.float16)
            for _ in range(4):
                f(x)
            (call,) = be.kernel_calls
            assert call.fast is not None, call.fast_reason
            before = call.fast
            calls = []

            def counting(*leaves):
                calls.append(leaves)
                return before(*leaves)
            call.fast = counting
            x2 = torch.randn(64, 4096, device="cuda", dtype=torch.float16)
            a, b = f(x2), f(x2)
            python = call.binding(list(calls[-1]))  # the Python plan path on the same leaves
            assert len(calls) == 2 and torch.equal(a, python) and torch.equal(b, python)
            assert a.data_ptr() != b.data_ptr()
            torch.testing.assert_close(a, _rms(x2, w), rtol=2e-2, atol=2e-2)
            x3 = torch.randn(32, 4096, device="cuda", dtype=torch.float16)
            torch.testing.assert_close(f(x3), _rms(x3, w), rtol=2e-2, atol=2e-2)


def test_trace_profile_on_cuda_attributes_device_time(tmp_path):
    """forge trace --profile on the GPU: device time per matched op, each kernel counted once."""
    import json
    import textwrap

    from typer.testing import CliRunner

    from forge_cli import cli

    (tmp_path / "m.py").write_text(textwrap.dedent('''
        import torch

        class Model(torch.nn.Module):
            def forward(self, x):
                return torch.softmax(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6), -1).cumsum(-1)

        def get_inputs():
            return [torch.randn(2048, 4096, dtype=torch.float16)]
    '''))
    res = CliRunner().invoke(cli.app, ["trace", str(tmp_path / "m.py"), "--device", "cuda", "--profile", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert [r["op"] for r in doc["regions"]] == ["rmsnorm", "softmax"]
    p = doc["profile"]
    assert p["clock"].startswith("device") and p["total_us"] > 0 and 0.3 < p["covered_fraction"] < 1
    assert all(r["us"] > 0 for r in doc["regions"]) and doc["unmatched"][0]["us"] > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cublaslt_gelu_epilogue_is_the_tanh_gelu(dtype):
    """forge/fused.py serves torch._addmm_activation(use_gelu=True) for act(x @ W^T + b) with the tanh GELU:
    on CUDA its values must be that function, not the erf GELU (torch's CPU kernel applies the erf one). The
    two differ by ~1.5e-4 around -1 (the same sign all around it), under bf16's resolution, so the test compares
    the mean signed error against each function over 2M outputs the bias puts there (rounding averages out)."""
    import torch

    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    m, n, k = 2048, 1024, 256
    x = (torch.randn(m, k, device="cuda") * 0.02).to(dt)
    w = torch.randn(n, k, device="cuda").to(dt)
    b = torch.full((n,), -1.0, device="cuda").to(dt)  # pre-activations around -1: tanh GELU - erf GELU < 0
    y = torch._addmm_activation(b, x, w.t(), use_gelu=True).double()
    pre = torch.addmm(b.double(), x.double(), w.double().t())
    tanh_err = (y - torch.nn.functional.gelu(pre, approximate="tanh")).mean().abs().item()
    erf_err = (y - torch.nn.functional.gelu(pre)).mean().abs().item()
    assert tanh_err * 3 < erf_err, (tanh_err, erf_err)


def test_a_call_contestant_writes_rotating_buffers_inside_the_timing_graph():
    """Inside the timing graph's capture the private pool reuses a block freed during the capture: a result
    dropped at once would make every launch of a sample write one L2-resident buffer. Bench.call_fn's ring
    keeps n_sets distinct output buffers alive, as forge's kernels write n_sets preallocated ones."""
    import torch

    from forge import ops
    from forge.tuner.timing import Bench

    mod = ops.get("rmsnorm").module
    spec = mod.make_spec((2048, 4096), "float16", "cuda", {})
    bench = Bench(mod, spec, "cuda", 0)
    assert bench.n_sets > 1
    f = bench.baseline_fn()
    sampler = bench.prepare(f)
    assert sampler() > 0
    ptrs = {t.data_ptr() for t in f.held}
    assert len(ptrs) == bench.n_sets  # distinct live buffers, none of them reused within the sample
    bench.sync()
    for i, out in enumerate(f.held):  # the replays' own outputs: slot i holds set i's result
        torch.testing.assert_close(out, mod.reference(bench.inputs[i], spec.attrs))
