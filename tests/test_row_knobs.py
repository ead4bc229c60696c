"""The row ops' Helion-style knobs (opkit.with_persistent_rows: the persistent variant of rmsnorm, softmax and
layer_norm, with its eviction-policy knob; rmsnorm's looped EVICT) through the interpreter against the float64
oracle: every persistent point the interpreter's space holds at a shape whose programs loop, strided x, HF's
rounding form, trailing dims, and the rendered policies; and the space's rules (persistent only where
programs loop; knobs are numbers)."""

from __future__ import annotations

import pytest
import torch

from forge import codegen, hardware, ops
from forge.key import plain_param
from forge.loader import load_module, write_source
from forge.opkit import Candidate
from forge.tuner.validate import check_candidate
from tests.conftest import DEVICE

OP = ops.get("rmsnorm")
MOD = OP.module


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _check(spec, cand, tmp_path) -> None:
    module = load_module(write_source(codegen.render(OP, spec, cand), tmp_path))
    reason = check_candidate(MOD, module, spec, 11, _sync)
    assert reason is None, f"{cand.label} on {spec.canonical()}: {reason}"


def _persistent_points(spec):
    return [c for c in MOD.space(spec).points("persistent")]


PERSISTENT_FAMILIES = ("rmsnorm", "softmax", "layer_norm")


@pytest.mark.parametrize("name", PERSISTENT_FAMILIES)
def test_persistent_points_match_the_oracle(name, tmp_path, dtype="bfloat16"):
    """Every (ROWS, EVICT) pair and both ends of the grid, in bf16 (tests/test_templates.py runs both ends in
    every dtype; the interpreter takes ~0.7 s a kernel: every point of the three families in two dtypes took
    90 s)."""
    op = ops.get(name)
    spec = op.module.make_spec((67, 100), dtype, DEVICE)
    pts = list(op.module.space(spec).points("persistent"))
    assert {c.p["ROWS"] for c in pts} == {1, 2, 4} and {c.p["EVICT"] for c in pts} == {0, 1}
    picked = list(dict.fromkeys([pts[0], pts[-1], *({(c.p["ROWS"], c.p["EVICT"]): c for c in pts}.values())]))
    assert {(c.p["ROWS"], c.p["EVICT"]) for c in picked} == {(r, e) for r in (1, 2, 4) for e in (0, 1)}
    for cand in picked:
        module = load_module(write_source(codegen.render(op, spec, cand), tmp_path))
        reason = check_candidate(op.module, module, spec, 11, _sync)
        assert reason is None, f"{name} {cand.label}: {reason}"


@pytest.mark.parametrize("name", ["softmax", "layer_norm"])
def test_persistent_on_strided_rows(name, tmp_path):
    op = ops.get(name)
    n_inputs = len(op.module.make_spec((40, 100), "float16", DEVICE).inputs)
    spec = op.module.make_spec((40, 100), "float16", DEVICE, {"strides": ";".join(["160,1"] + ["c"] * (n_inputs - 1))})
    pts = list(op.module.space(spec).points("persistent"))
    for cand in (pts[0], pts[-1]):
        module = load_module(write_source(codegen.render(op, spec, cand), tmp_path))
        assert check_candidate(op.module, module, spec, 11, _sync) is None, cand.label


@pytest.mark.parametrize(("attrs", "shape"), [
    ({"strides": "160,1;c"}, (40, 100)),       # rows inside a wider buffer (NaN gaps)
    ({"form": "hf"}, (40, 100)),               # HF's LlamaRMSNorm: rounded before the weight
    ({"dims": 2}, (20, 4, 25)),                # two trailing dims, 100 values per row
])
def test_persistent_in_other_layouts_and_forms(attrs, shape, tmp_path):
    spec = MOD.make_spec(shape, "float16", DEVICE, dict(attrs))
    pts = _persistent_points(spec)
    assert pts
    for cand in (pts[0], pts[-1]):
        _check(spec, cand, tmp_path)


@pytest.mark.parametrize("evict", [0, 1])
def test_looped_with_either_policy_matches_the_oracle(evict, tmp_path):
    spec = MOD.make_spec((3, 1000), "bfloat16", DEVICE)
    _check(spec, Candidate.make("looped", BLOCK_N=256, num_warps=4, num_stages=1, EVICT=evict), tmp_path)


def test_the_policies_are_rendered_where_the_knob_says():
    spec = MOD.make_spec((4096, 4096), "bfloat16", "cuda")
    looped = [codegen.render(OP, spec, Candidate.make("looped", BLOCK_N=1024, num_warps=8, num_stages=2, EVICT=e))
              for e in (0, 1)]
    assert "eviction_policy" not in looped[0]  # the knob off: the loads as they always were
    assert looped[1].count('eviction_policy="evict_last"') == 1  # the first pass keeps the row in L2
    assert looped[1].count('eviction_policy="evict_first"') == 1  # the second lets it go
    pers = [codegen.render(OP, spec, Candidate.make("persistent", ROWS=2, num_warps=8, PROGRAMS_PER_SM=2,
                                                    num_stages=2, EVICT=e)) for e in (0, 1)]
    assert 'eviction_policy="")' in pers[0] and 'eviction_policy="evict_first")' in pers[1]
    assert "tl.range(0, ITERS, num_stages=2)" in pers[0]


def test_persistent_exists_only_where_programs_loop_and_its_knobs_are_numbers():
    sms = hardware.GPU_SMS
    # 3 x 132 rows: programs loop only with one row per block and 2 programs per SM
    pts = _persistent_points(MOD.make_spec((3 * sms, 4096), "bfloat16", "cuda"))
    assert pts and {(c.p["ROWS"], c.p["PROGRAMS_PER_SM"]) for c in pts} == {(1, 2)}
    assert not _persistent_points(MOD.make_spec((sms, 4096), "bfloat16", "cuda"))  # one block per program
    assert not _persistent_points(MOD.make_spec((16, 4096), "bfloat16", "cuda"))   # decode
    for c in MOD.space(MOD.make_spec((8192, 8192), "bfloat16", "cuda")).all_points():
        assert all(plain_param(v) for _, v in c.params), c.label  # params stay plain numbers (forge/key.py)
    # the interpreter has no pipelining: no num_stages > 1 there
    cpu = MOD.make_spec((67, 100), "float32", "cpu")
    assert all(c.p["num_stages"] == 1 for c in _persistent_points(cpu))


def test_the_default_is_unchanged_by_the_knobs():
    """The default candidate (what an untuned call or a budget of 1 runs) is the one it was before the knobs."""
    for shape, want in (((2048, 4096), "row"), ((4, 100000), "looped")):
        cand = MOD.default(MOD.make_spec(shape, "bfloat16", "cuda"))
        assert cand.variant == want and cand.p.get("EVICT", 0) == 0
        assert cand in MOD.space(MOD.make_spec(shape, "bfloat16", "cuda"))
