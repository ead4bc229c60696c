"""rmsnorm's Helion-style knobs (opkit.with_persistent_rows: the persistent variant, up to
rmsnorm.PERSISTENT_MAX_NUMEL elements; the looped variant's EVICT) through the interpreter against the float64
oracle: every ROWS value of the persistent grid at a shape whose programs loop, strided x, HF's rounding form,
trailing dims, and the rendered policies; and the space's rules (persistent only where programs loop and the
tensor is small enough; no eviction knob on it; knobs are numbers; softmax and layer_norm have no persistent
variant: measured on an H100, 2026-12-06, docs/notes.md stop 30)."""

from __future__ import annotations

import pytest
import torch

from forge import codegen, hardware, ops
from forge.key import params_problem, plain_param
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


def _looping_rows(cpu_rows: int) -> int:
    """Rows at which persistent programs loop on the test device: `cpu_rows` on the interpreter (4 SMs); on a GPU
    more blocks of 4 rows than 2 programs x its SMs (ROWS 4 and PROGRAMS_PER_SM 2 loop), a partial last block."""
    return cpu_rows if DEVICE == "cpu" else 2 * 4 * hardware.GPU_SMS + 3


def test_persistent_points_match_the_oracle(tmp_path, dtype="bfloat16"):
    """Every ROWS value and both ends of the grid, in bf16 (tests/test_templates.py runs both ends in every
    dtype; the interpreter takes ~0.7 s a kernel)."""
    spec = MOD.make_spec((_looping_rows(67), 100), dtype, DEVICE)
    pts = _persistent_points(spec)
    assert {c.p["ROWS"] for c in pts} == {1, 2, 4}
    assert all("EVICT" not in c.p for c in pts)  # the eviction knob did not pay (docs/notes.md stop 30)
    picked = list(dict.fromkeys([pts[0], pts[-1], *({c.p["ROWS"]: c for c in pts}.values())]))
    assert {c.p["ROWS"] for c in picked} == {1, 2, 4}
    for cand in picked:
        _check(spec, cand, tmp_path)


@pytest.mark.parametrize(("attrs", "shape"), [
    ({"strides": "160,1;c"}, (40, 100)),       # rows inside a wider buffer (NaN gaps)
    ({"form": "hf"}, (40, 100)),               # HF's LlamaRMSNorm: rounded before the weight
    ({"dims": 2}, (20, 4, 25)),                # two trailing dims, 100 values per row
])
def test_persistent_in_other_layouts_and_forms(attrs, shape, tmp_path):
    spec = MOD.make_spec((_looping_rows(shape[0]), *shape[1:]), "float16", DEVICE, dict(attrs))
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
    pers = codegen.render(OP, spec, Candidate.make("persistent", ROWS=2, num_warps=8, PROGRAMS_PER_SM=2,
                                                   num_stages=2))
    assert "eviction_policy" not in pers and "EVICT" not in pers  # no eviction knob on the persistent loads
    assert "tl.range(0, ITERS, num_stages=2)" in pers


def test_persistent_exists_only_where_programs_loop_and_its_knobs_are_numbers():
    sms = hardware.GPU_SMS
    # 3 x 132 rows: programs loop only with one row per block and 2 programs per SM
    pts = _persistent_points(MOD.make_spec((3 * sms, 4096), "bfloat16", "cuda"))
    assert pts and {(c.p["ROWS"], c.p["PROGRAMS_PER_SM"]) for c in pts} == {(1, 2)}
    assert not _persistent_points(MOD.make_spec((sms, 4096), "bfloat16", "cuda"))  # one block per program
    assert not _persistent_points(MOD.make_spec((16, 4096), "bfloat16", "cuda"))   # decode
    for c in MOD.space(MOD.make_spec((2048, 4096), "bfloat16", "cuda")).all_points():
        assert all(plain_param(v) for _, v in c.params), c.label  # params stay plain numbers (forge/key.py)
    # the interpreter has no pipelining: no num_stages > 1 there
    cpu = MOD.make_spec((67, 100), "float32", "cpu")
    assert all(c.p["num_stages"] == 1 for c in _persistent_points(cpu))


def test_persistent_exists_only_up_to_16m_elements():
    """Measured on an H100 (2026-12-06): the fastest point at 8M elements, 4-5% behind multirow at 64M and 128M
    (kernels/rmsnorm.py PERSISTENT_MAX_NUMEL)."""
    assert MOD.PERSISTENT_MAX_NUMEL == 16 * 2**20
    for dtype in ("float16", "bfloat16"):
        assert _persistent_points(MOD.make_spec((2048, 4096), dtype, "cuda"))  # 8M: it won there
    assert _persistent_points(MOD.make_spec((4096, 2048), "bfloat16", "cuda", {"form": "hf"}))
    assert _persistent_points(MOD.make_spec((4096, 4096), "bfloat16", "cuda"))  # 16M exactly: kept
    for shape, attrs in (((8192, 8192), {}), ((32768, 4096), {}), ((4097, 4096), {}),  # 64M, 128M, 16M + 4096
                         ((4, 1025, 4096), {}), ((4097, 64, 64), {"dims": 2})):     # rows x N counts, not x's dims
        spec = MOD.make_spec(shape, "bfloat16", "cuda", attrs)
        sp = MOD.space(spec)
        assert not _persistent_points(spec), shape
        assert {"row", "looped", "multirow"} <= {c.variant for c in sp.all_points()}  # the others stay
        # a cached persistent entry for such a spec is no longer a point of the space (forge/key.py)
        assert params_problem(OP, spec, "persistent",
                              {"ROWS": 2, "num_warps": 8, "PROGRAMS_PER_SM": 2, "num_stages": 2}) is not None


def test_the_persistent_grid_has_no_eviction_knob():
    spec = MOD.make_spec((2048, 4096), "bfloat16", "cuda")
    assert "EVICT" not in MOD.space(spec).variants["persistent"]
    assert MOD.space(spec).variants["looped"]["EVICT"] == [0, 1]  # looped keeps its own (it pays at large shapes)
    ok = {"ROWS": 2, "num_warps": 8, "PROGRAMS_PER_SM": 2, "num_stages": 2}
    assert params_problem(OP, spec, "persistent", ok) is None
    assert params_problem(OP, spec, "persistent", {**ok, "EVICT": 0}) is not None


@pytest.mark.parametrize("name", ["softmax", "layer_norm"])
def test_softmax_and_layer_norm_have_no_persistent_variant(name):
    """Measured on an H100 (2026-12-06): never competitive there (kernels/softmax.py, kernels/layer_norm.py)."""
    mod = ops.get(name).module
    assert "persistent" not in mod.TEMPLATES
    for shape in ((2048, 4096), (8192, 8192)):
        space = mod.space(mod.make_spec(shape, "bfloat16", "cuda"))
        assert "persistent" not in space.variants  # (softmax has "split", for fewer rows than SMs only)
        assert {c.variant for c in space.all_points()} == {"row", "looped", "multirow"}


def test_the_default_is_unchanged_by_the_knobs():
    """The default candidate (what an untuned call or a budget of 1 runs) is the one it was before the knobs."""
    for shape, want in (((2048, 4096), "row"), ((4, 100000), "looped")):
        cand = MOD.default(MOD.make_spec(shape, "bfloat16", "cuda"))
        assert cand.variant == want and cand.p.get("EVICT", 0) == 0
        assert cand in MOD.space(MOD.make_spec(shape, "bfloat16", "cuda"))
