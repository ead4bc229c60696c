"""Issue 15: big shapes never crash a search.

- Bounded oracles: every built-in op's float64 oracle, evaluated in chunks under a small chunk budget,
  equals the whole oracle up to float64 rounding, and its largest float64 allocation (other than the
  result) stays within the budget; compare() over chunks says exactly what the whole comparison said.
- The memory model and admission control, with fake free-memory numbers.
- Workers give memory back; timing sets are sized by the free memory.
- Out of memory is an outcome (tests/fault_ops/starved.py raises torch.OutOfMemoryError or MemoryError
  where its attributes say): a candidate's is its status oom and the search decides; forge's own (the
  float64 oracle, the eager baseline) is exit 3 naming the footprint, the free memory and what to do,
  never exit 1; a manifest with such an entry finishes the others; forge bench records it per contestant.
"""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from forge import codegen, opkit, ops
from forge.cache import Cache
from forge.errors import EnvironmentProblem, ExitCode
from forge.loader import write_source
from forge.opkit import Candidate, Tolerance
from forge.spec import KernelSpec, TensorSpec
from forge.tuner import engine, memory, timing, validate
from forge.tuner.status import Status

GiB = 2**30


# -- bounded oracles ----------------------------------------------------------------------------------
@pytest.fixture
def chunk_budget(monkeypatch):
    """set(n): every oracle chunk may take n bytes of float64 working set (None: unbounded, one chunk)."""

    def set_budget(n: int | None) -> None:
        monkeypatch.setattr(opkit, "ORACLE_MIN_CHUNK_BYTES", 0 if n is not None else 1 << 62)
        monkeypatch.setattr(opkit, "ORACLE_MAX_CHUNK_BYTES", n if n is not None else 1 << 62)

    return set_budget


# (problem shape, attrs) per op: tails, leading dims, a single column, GQA and causal with Sq != Skv.
ROWS = [((3, 37), {}), ((2, 3, 33), {}), ((7, 1), {}), ((5, 300), {})]
CASES = {
    "softmax": ROWS, "log_softmax": ROWS, "layer_norm": ROWS + [((2, 3, 5, 7), {"dims": 2})],
    "rmsnorm": ROWS + [((2, 3, 5, 7), {"dims": 3}), ((2, 5, 3, 7), {"dim": -3}), ((3, 37), {"form": "fused"}),
                       ((3, 37), {"form": "hf"})],
    "silu_mul": ROWS + [((3, 37), {"form": "formula"})],
    "add_norm": ROWS + [((3, 37), {"norm": "layer_norm", "eps": 1e-5}), ((5, 300), {"form": "fused"})],
    "gelu": ROWS + [((4, 33), {"approximate": "tanh"}), ((4, 33), {"approximate": "tanh", "form": "formula"})],
    "pointwise": ROWS + [((4, 33), {"expr": "add(x0,mul(x1,2.0))", "input_shapes": "c;33"}),
                         ((3, 37), {"expr": "where(gt(x0,0.0),x0,mul(tanh(x1),0.01))"})],
    "reduce": ROWS + [((5, 30), {"kind": "mean"}), ((2, 3, 17), {"kind": "amax", "keepdim": True}),
                      ((6, 19), {"kind": "argmax"}), ((2, 3, 19), {"kind": "argmax", "keepdim": True})],
    "cross_entropy": [((6, 11), {}), ((37, 5), {"reduction": "sum"}), ((9, 7), {"reduction": "none"}),
                      ((8, 13), {"ignore_index": 3})],
    "matmul": [((5, 7, 9), {}), ((2, 5, 7, 9), {}), ((33, 17, 40), {})],
    "linear": [((5, 7, 9), {}), ((2, 5, 7, 9), {"weight": "kn", "bias": "linear", "activation": "gelu_tanh",
                                               "residual": True})],
    "swiglu": [((5, 7, 9), {}), ((2, 5, 7, 9), {})],
    "rope": [((2, 3, 5, 16), {}), ((1, 2, 7, 8), {})],
    "cat": [((3, 7), {}), ((2, 3, 9, 16), {"dim": 2, "sizes": "8,1"}), ((2, 3, 9, 16), {"dim": -2, "empty": 1})],
    "sdpa": [((1, 2, 5, 7, 16), {}), ((2, 4, 9, 13, 16), {"kv_heads": 2, "causal": True}),
             ((1, 2, 33, 17, 32), {"causal": True}), ((1, 1, 17, 33, 8), {"causal": True})],
}


def test_every_builtin_op_is_covered():
    assert sorted(CASES) == sorted(ops.available())


def _same(got, want) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    if not want.dtype.is_floating_point or want.dtype != torch.float64:
        assert torch.equal(got, want)  # integer or rounded to the output dtype: the same values
        return
    fin = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), fin) and torch.equal(got[~fin], want[~fin])
    # float64 rounding: the chunks sum in another order than the whole
    assert torch.allclose(got[fin], want[fin], rtol=1e-12, atol=1e-300)


@pytest.mark.parametrize("name", sorted(CASES))
def test_chunked_oracles_equal_the_whole_oracle(name, chunk_budget):
    mod = ops.get(name).module
    for shape, attrs in CASES[name]:
        for dtype in ("float32", "bfloat16", "float16"):
            spec = mod.make_spec(shape, dtype, "cpu", attrs)
            for dist in opkit.DISTRIBUTIONS:
                inputs = mod.make_inputs(spec, 5, dist)
                chunk_budget(None)
                want = mod.oracle(inputs, spec.attrs)
                for budget in (1, 300, 4096):  # one unit (row, element, block row) per chunk, then more
                    chunk_budget(budget)
                    _same(mod.oracle(inputs, spec.attrs), want)


class _Float64Allocations(TorchDispatchMode):
    """The bytes of every float64 tensor an op allocates: outputs on storage none of its arguments has
    (not a view, not an in-place result)."""

    def __init__(self):
        super().__init__()
        self.allocations: list[tuple[int, int]] = []  # (data_ptr, bytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {a.untyped_storage().data_ptr() for a in pytree.tree_leaves((args, kwargs))
                 if isinstance(a, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float64:
                st = t.untyped_storage()
                if st.data_ptr() not in given:
                    self.allocations.append((st.data_ptr(), st.nbytes()))
        return out


def _largest_float64_allocation(fn) -> int:
    """The largest float64 allocation `fn` makes, apart from the result it returns."""
    with torch.no_grad(), _Float64Allocations() as seen:
        result = fn()
    allocations = list(seen.allocations)
    st = result.untyped_storage()
    for i in range(len(allocations) - 1, -1, -1):  # the result's own allocation: the last one at its address
        if allocations[i] == (st.data_ptr(), st.nbytes()):
            del allocations[i]
            break
    return max((n for _, n in allocations), default=0)


# Shapes several chunks long at BOUND_BUDGET, whose one unit (a row, a block row and the head's k and v)
# fits in it.
BOUND_BUDGET = 32 << 10
BOUND_CASES = {
    "softmax": ((64, 96), {}), "log_softmax": ((64, 96), {}), "rmsnorm": ((64, 96), {}),
    "layer_norm": ((64, 96), {}), "gelu": ((64, 96), {}),
    "add_norm": ((64, 96), {"norm": "layer_norm"}), "silu_mul": ((64, 96), {}),
    "reduce": ((64, 96), {"kind": "argmax"}), "cross_entropy": ((64, 96), {}),
    "matmul": ((64, 96, 48), {}), "rope": ((2, 4, 32, 32), {}),
    "linear": ((64, 96, 48), {"bias": "linear", "residual": True}), "swiglu": ((64, 96, 48), {}),
    "sdpa": ((1, 2, 128, 96, 16), {"causal": True}),
    "pointwise": ((64, 96), {"expr": "add(x0,mul(x1,2.0))", "input_shapes": "c;96"}),
    "cat": ((2, 8, 64, 16), {"dim": 2, "sizes": "63,1"}),  # a copy: its exact oracle needs no float64
}


@pytest.mark.parametrize("name", sorted(BOUND_CASES))
def test_an_oracle_allocates_no_float64_tensor_beyond_its_chunk_budget(name, chunk_budget):
    """The bound: one chunk's float64 working set within opkit.oracle_budget (here BOUND_BUDGET), so no
    single float64 allocation but the (output-sized) result exceeds it; the whole oracle's do."""
    assert sorted(BOUND_CASES) == sorted(ops.available())
    mod = ops.get(name).module
    shape, attrs = BOUND_CASES[name]
    spec = mod.make_spec(shape, "bfloat16", "cpu", attrs)
    inputs = mod.make_inputs(spec, 0, "outliers")
    chunk_budget(None)
    whole = _largest_float64_allocation(lambda: mod.oracle(inputs, spec.attrs))
    if name == "cat":  # a copy is exact in its own dtype: no float64 at all, whatever the size
        assert whole == 0 and torch.equal(mod.oracle(inputs, spec.attrs), torch.cat(inputs, dim=2))
        return
    assert whole > BOUND_BUDGET, "the case must be larger than the budget to show anything"
    chunk_budget(BOUND_BUDGET)
    assert _largest_float64_allocation(lambda: mod.oracle(inputs, spec.attrs)) <= BOUND_BUDGET


def test_the_default_chunk_budget_is_the_inputs_size_within_limits():
    assert opkit.oracle_budget(0) == opkit.ORACLE_MIN_CHUNK_BYTES == 64 << 20
    assert opkit.oracle_budget(300 << 20) == 300 << 20
    assert opkit.oracle_budget(6 * GiB) == opkit.ORACLE_MAX_CHUNK_BYTES == GiB


def test_oracle_chunking_keeps_the_rows_its_broadcast_inputs_need():
    """rows: a weight of shape (N,) is passed whole; rope's (S, D) cos/sin keep x's last two dims."""
    seen = []

    def fn(part):
        seen.append(tuple(tuple(t.shape) for t in part))
        return part[0].double() * part[1].double()

    x, cos = torch.randn(2, 3, 4, 5), torch.randn(4, 5)
    out = opkit.oracle_in_chunks(fn, (x, cos), "rows", budget=1)
    assert seen == [((1, 4, 5), (4, 5))] * 6 and torch.equal(out, x.double() * cos.double())
    with pytest.raises(ValueError, match="unknown oracle chunking"):
        opkit.oracle_in_chunks(fn, (x, cos), "diagonal")
    with pytest.raises(ValueError, match="one shape"):
        opkit.oracle_in_chunks(fn, (x, cos), "elements", budget=1)


def test_a_bad_oracle_chunk_declaration_fails_at_load(tmp_path, monkeypatch, fault_ops):
    (tmp_path / "templates").mkdir()
    (tmp_path / "templates" / "starved.j2").write_text((fault_ops / "templates" / "starved.j2").read_text())
    src = (fault_ops / "starved.py").read_text().replace('NAME = "starved"', 'NAME = "chunky"')
    (tmp_path / "chunky.py").write_text(src + '\nORACLE_CHUNK = "diagonal"\n')
    monkeypatch.setenv("FORGE_OPS_PATH", str(tmp_path))
    with pytest.raises(TypeError, match="ORACLE_CHUNK='diagonal'; expected one of rows, elements, matmul"):
        ops.get("chunky")


# -- compare() in chunks says what the whole comparison said ------------------------------------------
def _whole_compare(out, ref, tol: Tolerance) -> str | None:
    """validate.compare before issue 15 (whole tensors), the reference for the chunked one."""
    if tuple(out.shape) != tuple(ref.shape):
        return f"shape {tuple(out.shape)} != expected {tuple(ref.shape)}"
    if not out.dtype.is_floating_point:
        r = ref.detach().to(device=out.device, dtype=out.dtype)
        wrong = out != r
        if wrong.any():
            idx = tuple(int(i) for i in wrong.nonzero()[0])
            return (f"{int(wrong.sum())} of {out.numel()} elements differ (integer output, exact match "
                    f"required; e.g. at {idx}: got {out[idx].item()}, expected {r[idx].item()})")
        return None
    o = out.detach().to(torch.float64)
    r = ref.detach().to(device=o.device, dtype=torch.float64)
    nan = torch.isnan(o)
    if nan.any():
        idx = tuple(int(i) for i in nan.nonzero()[0])
        return f"NaN in output ({int(nan.sum())} of {o.numel()} elements, first at {idx})"
    if torch.isnan(r).any():
        return "the oracle produced NaN: these inputs are outside the op's domain (a bug in the op file)"
    inf_mismatch = (torch.isinf(o) | torch.isinf(r)) & (o != r)
    if inf_mismatch.any():
        idx = tuple(int(i) for i in inf_mismatch.nonzero()[0])
        return f"infinity mismatch at {idx}: got {o[idx].item()}, expected {r[idx].item()}"
    finite = torch.isfinite(r)
    o, r = o[finite], r[finite]
    err = (o - r).abs()
    ref_norm = float(torch.linalg.vector_norm(r))
    rel = float(torch.linalg.vector_norm(o - r)) / max(ref_norm, 1e-300)
    if rel > tol.rel_norm:
        return f"relative error {rel:.3g} > {tol.rel_norm:g}"
    bound = tol.atol + tol.rtol * r.abs()
    bad = err > bound
    if bad.any():
        i = int(bad.nonzero()[0])
        return (f"{int(bad.sum())} elements outside atol={tol.atol:g} rtol={tol.rtol:g} "
                f"(worst |err| {float(err.max()):.3g}; e.g. got {o[i].item():.6g}, expected {r[i].item():.6g})")
    return None


def _compare_cases():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(6, 7, 11, generator=g, dtype=torch.float64)
    out = ref.float()
    tol = opkit.ROW_TOLERANCE["float32"]
    cases = [("pass", out, ref)]
    far = out.clone()
    far.view(-1)[100:] += 1.0
    cases.append(("rel-norm", far, ref))
    few = out.clone()
    few.view(-1)[[17, 200, 401]] += 1e-3  # outside rtol, inside the norm bound
    cases.append(("element-wise", few, ref))
    nan = out.clone()
    nan.view(-1)[[3, 300]] = float("nan")
    nan.view(-1)[5] = float("inf")  # an infinity mismatch too: NaN is named first
    cases.append(("nan", nan, ref))
    late = out.clone()
    late.view(-1)[400] = float("nan")  # NaN in a later chunk than the infinity mismatch
    late.view(-1)[2] = float("-inf")
    cases.append(("nan after inf", late, ref))
    ref_nan = ref.clone()
    ref_nan.view(-1)[250] = float("nan")
    cases.append(("oracle nan", out, ref_nan))
    ref_inf = ref.clone()
    ref_inf.view(-1)[[9, 99]] = float("inf")
    cases.append(("matched inf", ref_inf.float(), ref_inf))
    wrong_inf = ref_inf.float()
    wrong_inf.view(-1)[99] = float("-inf")
    cases.append(("inf mismatch", wrong_inf, ref_inf))
    cases.append(("bf16", ref.to(torch.bfloat16), ref))
    cases.append(("shape", out[:3], ref))
    cases.append(("0-d", torch.tensor(1.5), torch.tensor(1.5, dtype=torch.float64)))
    cases.append(("0-d off", torch.tensor(1.6), torch.tensor(1.5, dtype=torch.float64)))
    idx = torch.randint(0, 9, (5, 13), generator=g)
    cases.append(("indices", idx, idx.clone()))
    off = idx.clone()
    off.view(-1)[[7, 40]] += 1
    cases.append(("indices off", off, idx))
    return [(name, o, r, tol) for name, o, r in cases]


@pytest.mark.parametrize("chunk", [1, 5, 64, validate.COMPARE_CHUNK])
def test_compare_in_chunks_says_what_the_whole_comparison_said(chunk, monkeypatch):
    monkeypatch.setattr(validate, "COMPARE_CHUNK", chunk)
    for name, out, ref, tol in _compare_cases():
        want = _whole_compare(out, ref, tol)
        assert validate.compare(out, ref, tol) == want, name
        assert (want is None) == (name in ("pass", "matched inf", "0-d", "indices")), (name, want)


# -- the memory model and admission -------------------------------------------------------------------
def _spec(op: str, shape, dtype: str, attrs=None) -> tuple:
    mod = ops.get(op).module
    return mod, mod.make_spec(shape, dtype, "cuda", attrs)


def test_the_footprint_of_a_big_softmax():
    mod, spec = _spec("softmax", (4096, 393216), "float32")
    fp = memory.estimate(mod, spec)
    n = 4096 * 393216
    assert fp == memory.Footprint(inputs=4 * n, generate=memory.GENERATE_BYTES_PER_ELEMENT * n, output=4 * n,
                                  oracle_result=8 * n, oracle_chunk=GiB,
                                  compare=validate.COMPARE_CHUNK * validate.COMPARE_BYTES_PER_ELEMENT)
    # inputs + max(generate, output + oracle result + max(oracle chunk, compare)), 10% slack, scratch
    core = 4 * n + max(9 * n, 4 * n + 8 * n + GiB)
    assert fp.validation == int(core * 1.1) + memory.SCRATCH
    assert 27 * GiB < fp.validation < 28 * GiB  # was ~6 GiB inputs + ~90 GiB of float64 copies before
    assert fp.timing_set == 8 * n
    assert fp.timing(1) == 8 * n + memory.EAGER_TEMPORARIES * 4 * n + memory.SCRATCH
    assert "per validating worker" in fp.describe() and fp.to_dict()["validation"] == fp.validation


def test_the_footprint_takes_the_real_output_size_and_the_oracle_kind(fault_ops):
    mod, spec = _spec("matmul", (8192, 1024, 4096), "bfloat16")
    fp = memory.estimate(mod, spec)
    assert fp.inputs == 2 * (8192 * 4096 + 4096 * 1024)
    assert fp.output == 2 * 8192 * 1024 and fp.oracle_result == 8 * 8192 * 1024  # M x N, not A's size
    assert fp.oracle_chunk == opkit.oracle_budget(fp.inputs)
    mod, spec = _spec("sdpa", (1, 32, 8192, 8192, 128), "bfloat16", {"causal": True})
    fp = memory.estimate(mod, spec)
    assert fp.inputs == 3 * 32 * 8192 * 128 * 2 and fp.output == 32 * 8192 * 128 * 2
    assert fp.oracle_chunk == 192 << 20  # its own oracle is bounded: not the 16 GiB score tensor
    assert fp.validation < 2 * GiB
    mod, spec = _spec("cross_entropy", (8, 32000), "float16", {"reduction": "mean"})
    assert memory.estimate(mod, spec).output == 2  # a 0-d loss
    # An op on the whole default oracle (no ORACLE_CHUNK): float64 inputs and three outputs-worth.
    mod, spec = _spec("faulty", (1024, 1024), "float16")
    assert not memory.oracle_is_bounded(mod)
    assert memory.estimate(mod, spec).oracle_chunk == 8 * 2**20 + 3 * 8 * 2**20


@pytest.mark.parametrize(("footprint", "free", "workers", "lanes"), [
    (30 * GiB, 130 * GiB, 8, 3),  # 117 GiB at the headroom holds three
    (30 * GiB, 400 * GiB, 8, 8),  # never more than the pool
    (1 * GiB, 130 * GiB, 8, 8),
    (200 * GiB, 130 * GiB, 8, 1),  # needs most (or more than all) of the GPU: one at a time
    (100 * GiB, 130 * GiB, 8, 1),
    (30 * GiB, None, 8, 8),  # free memory unknown: the pool
    (30 * GiB, 0, 8, 1),
    (30 * GiB, 130 * GiB, 0, 1),  # at least one
])
def test_admission_by_free_memory(footprint, free, workers, lanes):
    assert memory.validation_lanes(footprint, free, workers) == lanes


@pytest.mark.parametrize(("set_bytes", "free", "want", "sets"), [
    (GiB, 10 * GiB, 256, 6),  # half the free memory after the first set: five more
    (GiB, 100 * GiB, 3, 3),  # the L2 rule wants three
    (12 * GiB, 10 * GiB, 256, 1),  # one set of GiBs: that one, never none
    (2**20, 10 * GiB, 256, 256),
    (GiB, None, 7, 7),
    (GiB, 0, 7, 1),
])
def test_timing_sets_by_free_memory(set_bytes, free, want, sets):
    assert memory.timing_sets(set_bytes, free, want) == sets


class _FakePool:
    def __init__(self, free, total=139 * GiB):
        self.reply = {"status": Status.OK, "free": free, "total": total}
        self.calls = 0

    def call(self, request, timeout):
        assert request == {"cmd": "memory"}
        self.calls += 1
        return self.reply


def test_admission_measures_before_each_batch_and_announces_a_cap():
    mod, spec = _spec("softmax", (4096, 393216), "float32")
    fp = memory.estimate(mod, spec)
    adm = engine.Admission(spec, fp, "cuda", None, 8)
    events = []
    pool = _FakePool(free=100 * GiB)
    assert adm.admit(pool, 60, lambda kind, **d: events.append((kind, d))) == 3
    assert adm.admit(pool, 60, lambda kind, **d: events.append((kind, d))) == 3  # announced once
    assert pool.calls == 2
    (kind, data), = events
    msg = data["message"]
    assert kind == "workers-capped" and msg.startswith("softmax 4096x393216 float32: validating on 3 of 8 workers")
    assert "per validating worker" in msg and "100.0 GiB of the GPU's memory (139.0 GiB) free" in msg
    pool.reply["free"] = 20 * GiB  # another process took the memory: one at a time, announced
    assert adm.admit(pool, 60, lambda kind, **d: events.append((kind, d))) == 1 and len(events) == 2
    adm.limit = 1
    pool.reply["free"] = 400 * GiB
    assert adm.admit(pool, 60, lambda kind, **d: None) == 1  # lowered after forge's own out-of-memory
    problem = adm.problem("validating a candidate", {"reason": "out of memory: CUDA out of memory"})
    assert isinstance(problem, EnvironmentProblem) and problem.exit_code == ExitCode.ENVIRONMENT
    text = str(problem)
    for needle in ("validating a candidate ran out of memory (out of memory: CUDA out of memory), not in a candidate",
                   "its inputs take 6.0 GiB per set", "400.0 GiB of the GPU's memory (139.0 GiB) free",
                   "1 of 8 worker(s) validating at once", "fewer --workers", "smaller shape"):
        assert needle in text, needle
    assert "forge's estimate: ~" in adm.note()


# -- workers give memory back; timing sets by free memory ---------------------------------------------
def _render(op_name: str, spec: KernelSpec, variant: str, tmp_path) -> str:
    op = ops.get(op_name)
    return str(write_source(codegen.render(op, spec, Candidate.make(variant, num_warps=1)), tmp_path))


def test_a_worker_gives_memory_back_between_specs_and_requests(tmp_path, monkeypatch, fault_ops):
    from forge.tuner.worker import Session

    given = []
    monkeypatch.setattr(memory, "give_back", lambda backend, collect=True: given.append(collect))
    spec = ops.get("starved").module.make_spec((4, 8), "float32", "cpu")
    s = Session("interpreter")
    assert s.setup({"op": "starved", "spec": spec.to_dict(), "seed": 0}) == {"status": Status.OK}
    assert given == [True] and s.large is False
    path = _render("starved", spec, "good", tmp_path)
    assert s.validate({"path": path})["status"] == Status.OK
    assert s.time({"paths": [path], "baseline": True, "reps": 1})["status"] == Status.OK
    assert s.bench is not None and s.modules
    s.give_back({"status": Status.OK})  # what the request loop does after each validate / time
    s.give_back({"status": Status.ERROR})
    assert given == [True, False, True]  # small spec: no collection unless something failed
    big = ops.get("starved").module.make_spec((8192, 8192), "float32", "cpu")
    s.setup({"op": "starved", "spec": big.to_dict(), "seed": 0})  # the timing sets and modules go
    assert s.bench is None and not s.modules and s.large is True and given[-1] is True
    reply = s.memory({"cmd": "memory"})
    assert reply["status"] == Status.OK and reply["free"] > 0 and reply["total"] >= reply["free"]


def test_timing_sets_are_sized_by_free_memory(monkeypatch):
    mod = ops.get("softmax").module
    spec = mod.make_spec((4, 8), "float32", "cpu")
    assert timing.Bench(mod, spec, "interpreter", 0).n_sets == 2
    monkeypatch.setattr(memory, "free_memory", lambda backend: (100, 2**30))
    assert timing.Bench(mod, spec, "interpreter", 0).n_sets == 1


# -- out of memory is an outcome ----------------------------------------------------------------------
@pytest.mark.parametrize("error", ["torch", "memory"])
def test_a_worker_says_whose_out_of_memory_it_was(tmp_path, fault_ops, error):
    from forge.tuner.worker import Session

    mod = ops.get("starved").module
    s = Session("interpreter")
    spec = mod.make_spec((4, 8), "float32", "cpu", {"error": error})
    s.setup({"op": "starved", "spec": spec.to_dict(), "seed": 0})
    reply = s.validate({"path": _render("starved", spec, "oom", tmp_path)})
    assert reply["status"] == Status.OOM and reply["stage"] == "candidate" and reply["poisoned"]
    assert "on purpose (the candidate)" in reply["reason"] or "the candidate, on purpose" in reply["reason"]
    spec = mod.make_spec((4, 8), "float32", "cpu", {"error": error, "starve": "oracle"})
    s.setup({"op": "starved", "spec": spec.to_dict(), "seed": 0})
    reply = s.validate({"path": _render("starved", spec, "good", tmp_path)})
    assert reply["status"] == Status.OOM and reply["stage"] == "validation" and "float64 oracle" in reply["reason"]
    spec = mod.make_spec((4, 8), "float32", "cpu", {"error": error, "starve": "baseline"})
    s.setup({"op": "starved", "spec": spec.to_dict(), "seed": 0})
    reply = s.time({"paths": [], "baseline": True, "reps": 1})
    assert reply["status"] == Status.OOM and reply["stage"] == "eager" and "eager baseline" in reply["reason"]
    path = _render("starved", spec, "oom", tmp_path)
    reply = s.time({"paths": [path], "reps": 1})  # a candidate's own, while being timed
    assert reply["status"] == Status.OOM and reply["stage"] == "candidate" and reply["failed"] == path


def _search(op: str, tmp_path, attrs=None, **opts):
    return engine.search(op, (4, 8), "float32", device="cpu", cache=Cache(tmp_path / "forge.db"), attrs=attrs,
                         options=engine.SearchOptions(**{"budget": 2, "workers": 1, "timeout": 60, **opts}))


@pytest.mark.parametrize("error", ["torch", "memory"])
def test_a_candidate_out_of_memory_is_its_status_and_the_search_decides(tmp_path, fault_ops, error):
    rep = _search("starved", tmp_path, {"error": error})
    by_variant = {c["variant"]: c for c in rep.candidates}
    assert {v: c["status"] for v, c in by_variant.items()} == {"good": "ok", "oom": "oom"}
    reason = by_variant["oom"]["reason"]
    assert "out of memory" in reason and "on purpose" in reason
    assert "forge's estimate: ~" in reason and "GiB" in reason and "worker(s) validating at once" in reason
    assert rep.decision in ("kernel", "eager") and Cache(tmp_path / "forge.db").get(rep.key) is not None
    assert rep.memory["validation_lanes"] == 1 and rep.memory["estimate"]["inputs"] == 4 * 8 * 4


def test_an_oracle_out_of_memory_is_exit_3_with_the_numbers_never_the_candidates(tmp_path, fault_ops):
    with engine.Pools() as pools:
        with pytest.raises(EnvironmentProblem) as exc:
            engine.search("starved", (4, 8), "float32", device="cpu", cache=Cache(tmp_path / "forge.db"),
                          attrs={"starve": "oracle", "error": "torch"}, pools=pools,
                          options=engine.SearchOptions(budget=2, workers=2, timeout=60))
        assert not pools._pools  # the failed search's workers were closed, not kept for the next entry
    text = str(exc.value)
    assert exc.value.exit_code == ExitCode.ENVIRONMENT
    for needle in ("starved 4x8 float32: validating a candidate (forge's inputs, float64 oracle or comparison) ran "
                   "out of memory", "the float64 oracle, on purpose", "not in a candidate",
                   "per validating worker", "of this host's memory", "free",
                   "1 of 2 worker(s) validating at once",  # retried one at a time before giving up
                   "fewer --workers", "smaller shape"):
        assert needle in text, needle
    assert Cache(tmp_path / "forge.db").entries() == []


def test_a_baseline_out_of_memory_is_exit_3_with_the_numbers(tmp_path, fault_ops):
    with pytest.raises(EnvironmentProblem) as exc:
        _search("starved", tmp_path, {"starve": "baseline", "error": "memory"})
    text = str(exc.value)
    assert "timing the eager baseline ran out of memory" in text and "out of memory on purpose" in text
    assert "its inputs take 0.0 GiB per set" in text and "fewer --workers" in text


@pytest.mark.parametrize(("starve", "error", "needle"), [
    ("oracle", "memory", "float64 oracle or comparison) ran out of memory"),
    ("baseline", "torch", "timing the eager baseline ran out of memory"),
])
def test_the_cli_exits_3_for_forges_own_out_of_memory(tmp_path, fault_ops, starve, error, needle):
    from typer.testing import CliRunner

    from forge_cli import cli

    res = CliRunner().invoke(cli.app, ["search", "starved", "--shape", "4x8", "--dtype", "float32", "--device", "cpu",
                                       "--budget", "1", "--workers", "1", "--cache", str(tmp_path / "f.db"),
                                       "--attr", f"starve={starve}", "--attr", f"error={error}"])
    assert res.exit_code == ExitCode.ENVIRONMENT, res.output
    text = " ".join(res.output.split())
    assert needle in text and "GiB" in text and "fewer --workers" in text and "Traceback" not in text


def test_a_manifest_with_one_entry_out_of_memory_finishes_the_others(tmp_path, fault_ops):
    from typer.testing import CliRunner

    from forge_cli import cli

    manifest = tmp_path / "forge.toml"
    manifest.write_text(textwrap.dedent("""
        [defaults]
        device = "cpu"
        dtype = "float32"
        budget = 1
        workers = 1
        timeout = 60

        [[op]]
        op = "softmax"
        shape = "4x8"

        [[op]]
        op = "starved"
        shape = "4x8"
        starve = "oracle"

        [[op]]
        op = "rmsnorm"
        shape = "4x8"
        """))
    res = CliRunner().invoke(cli.app, ["search", "--manifest", str(manifest), "--json",
                                       "--cache", str(tmp_path / "f.db")])
    assert res.exit_code == ExitCode.ENVIRONMENT, res.output
    report = json.loads(res.stdout[res.stdout.index("{"):])
    got = [(e["op"], e["status"], e["exit_code"]) for e in report["entries"]]
    assert got == [("softmax", "searched", 0), ("starved", "failed", 3), ("rmsnorm", "searched", 0)]
    assert "float64 oracle" in report["entries"][1]["error"] and report["failed"] == 1


# -- forge bench: out of memory per contestant ---------------------------------------------------------
def _contestants(calls):
    from forge.tuner.bench.run import ContestantResult

    out = []
    for name, call in calls.items():
        c = ContestantResult(name, name)
        c.call = call
        c.timing = lambda bench, call=call: (lambda i: call(bench.inputs[i]))
        out.append(c)
    return out


def test_bench_records_out_of_memory_per_contestant(fault_ops):
    from forge.tuner.bench import run as bench_run

    mod = ops.get("starved").module
    spec = mod.make_spec((4, 8), "float32", "cpu")

    def starving(inputs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 GiB (a contestant)")

    calls = {"eager": lambda inputs: mod.reference(inputs, spec.attrs), "fused": starving}
    cs = _contestants(calls)
    bench_run._validate(cs, mod, spec, 0, lambda: None, "interpreter")
    assert [c.status for c in cs] == [Status.PENDING, Status.OOM]  # eager goes on to be timed
    reason = cs[1].reason
    assert "a contestant" in reason and "forge estimates ~" in reason and "free on this host" in reason
    # forge's own oracle out of memory: no contestant is blamed for it, none is timed, the numbers are given
    starved = mod.make_spec((4, 8), "float32", "cpu", {"starve": "oracle", "error": "memory"})
    cs = _contestants(calls)
    bench_run._validate(cs, mod, starved, 0, lambda: None, "interpreter")
    assert [c.status for c in cs] == [Status.OOM, Status.OOM]
    assert all(c.reason.startswith("not validated, not timed: forge's validation inputs or float64 oracle ran out")
               for c in cs)
    # while being prepared for timing
    def hungry(inputs):
        raise MemoryError("out of memory on purpose")

    cs = _contestants({"eager": calls["eager"], "hungry": hungry})
    bench_run._time(cs, mod, spec, "interpreter", bench_run.BenchOptions(rounds=2), engine.SAMPLING["interpreter"])
    assert [c.status for c in cs] == [Status.OK, Status.OOM]
    assert "out of memory while being prepared for timing: MemoryError" in cs[1].reason


def test_bench_exits_3_when_forges_own_oracle_runs_out_of_memory(tmp_path, fault_ops, monkeypatch):
    """forge bench: nothing can be judged for a spec whose validation oracle runs out of memory: exit 3 with
    the numbers (never 1, never a silent 0); the other targets of the run are still benched."""
    from typer.testing import CliRunner

    from forge_cli import cli

    db = tmp_path / "forge.db"
    for op in ("starved", "softmax"):
        engine.search(op, (4, 8), "float32", device="cpu", cache=Cache(db),
                      options=engine.SearchOptions(budget=1, workers=1, timeout=60))
    common = ["--shape", "4x8", "--dtype", "float32", "--device", "cpu", "--rounds", "2", "--cache", str(db),
              "--skip", "compile", "--skip", "compile-max-autotune", "--skip", "liger"]
    ok = CliRunner().invoke(cli.app, ["bench", "starved", *common, "--json"])
    assert ok.exit_code == 0, ok.output
    mod = ops.get("starved").module

    def starving(inputs, attrs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 GiB (the oracle, on purpose)")

    monkeypatch.setattr(mod, "oracle", starving)
    res = CliRunner().invoke(cli.app, ["bench", "starved", *common, "--json"])
    assert res.exit_code == ExitCode.ENVIRONMENT, res.output
    doc = json.loads(res.stdout[res.stdout.index("{"):])
    (target,) = doc["targets"]
    assert doc["out_of_memory"] == 1 and "float64 oracle ran out of memory" in target["out_of_memory"]
    assert "forge estimates ~" in target["out_of_memory"] and "free on this host" in target["out_of_memory"]
    assert {c["status"] for c in target["contestants"] if c["status"] != "skipped"} == {"oom"}
    text = " ".join(res.stderr.split())
    assert "out of memory:" in text and "(the oracle, on purpose)" in text and "Traceback" not in text
    # a manifest of both: softmax is benched, and the run still exits 3 for starved
    manifest = tmp_path / "m.toml"
    manifest.write_text(textwrap.dedent("""
        [defaults]
        device = "cpu"
        dtype = "float32"

        [[op]]
        op = "starved"
        shape = "4x8"

        [[op]]
        op = "softmax"
        shape = "4x8"
        """))
    res = CliRunner().invoke(cli.app, ["bench", "--manifest", str(manifest), "--rounds", "2", "--cache", str(db),
                                       "--skip", "compile", "--skip", "compile-max-autotune", "--skip", "liger",
                                       "--json"])
    assert res.exit_code == ExitCode.ENVIRONMENT, res.output
    doc = json.loads(res.stdout[res.stdout.index("{"):])
    by_op = {t["op"]: t for t in doc["targets"]}
    assert by_op["softmax"]["out_of_memory"] is None
    assert any(c["status"] == "ok" and c["name"] == "eager" for c in by_op["softmax"]["contestants"])


def test_tensorspec_is_what_the_model_reads():
    spec = KernelSpec("softmax", (TensorSpec((3, 5), "bfloat16", device="cuda"),), {"dim": -1})
    fp = memory.estimate(ops.get("softmax").module, spec)
    assert fp.inputs == 30 and fp.output == 30 and fp.oracle_result == 120


def test_the_pool_keeps_the_largest_peak_any_worker_reports(tmp_path):
    """Issue 15's report: each validate/time reply carries its worker's peak (CUDA allocator reserved bytes
    since the spec's setup); the pool keeps the largest since reset_peak(), per search."""
    from multiprocessing import Pipe

    from forge.tuner.pool import Pool, Worker

    pool = Pool("interpreter", 2, {})
    ends = []
    for i in range(2):
        parent, child = Pipe()
        pool.workers.append(Worker(i, proc=None, conn=parent, log=None, ready=True))
        ends.append(child)
    for child, peak in zip(ends, (3 * GiB, 5 * GiB), strict=True):
        child.send({"status": Status.OK, "peak": peak})  # answered before asked: the pool reads it in map()
    pool.map([("a", {"cmd": "validate"}), ("b", {"cmd": "validate"})], timeout=10)
    assert pool.peak == 5 * GiB
    pool.reset_peak()
    ends[0].send({"status": Status.OK, "peak": None})  # off CUDA: no number, nothing recorded
    pool.map([("c", {"cmd": "time"})], timeout=10, lanes=1)
    assert pool.peak is None
    ends[0].send({"status": Status.OK, "peak": 1 * GiB})
    pool.map([("d", {"cmd": "time"})], timeout=10, lanes=1)
    assert pool.peak == 1 * GiB
    rep = _search("softmax", tmp_path)
    assert "peak_per_worker" in rep.memory and rep.memory["peak_per_worker"] is None  # CPU workers: no CUDA peak


def test_a_call_contestants_results_rotate_like_a_kernels_outputs():
    """Bench.call_fn holds a call's results in a ring of n_sets (released one set later), so an allocating
    contestant (eager, torch's op, torch.compile, Liger) writes rotating buffers as forge's kernels do into
    Bench.outputs; with one set nothing is held past the call."""
    mod = ops.get("softmax").module
    spec = mod.make_spec((4, 8), "float32", "cpu")
    bench = timing.Bench(mod, spec, "interpreter", 0)
    assert bench.n_sets == 2
    made = []

    def call(inputs):
        made.append(inputs[0] * 2)
        return made[-1]

    f = bench.call_fn(call)
    for k in range(5):
        f(k % bench.n_sets)
    assert len(f.held) == 2 and f.held[0] is made[4] and f.held[1] is made[3]
    base = bench.baseline_fn()
    base(1)
    torch.testing.assert_close(base.held[1], mod.reference(bench.inputs[1], spec.attrs))
    assert base.held[0] is None


def test_one_timing_set_holds_no_result(monkeypatch):
    mod = ops.get("softmax").module
    spec = mod.make_spec((4, 8), "float32", "cpu")
    monkeypatch.setattr(memory, "free_memory", lambda backend: (100, 2**30))
    bench = timing.Bench(mod, spec, "interpreter", 0)
    f = bench.call_fn(lambda inputs: inputs[0] + 1)
    f(0)
    assert bench.n_sets == 1 and f.held == []
