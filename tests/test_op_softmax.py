"""softmax's "split" variant (a few long rows cut into column blocks, two kernels): where the space has it,
its values against the float64 oracle through the search's own gate at odd shapes, special values as torch
gives them, and the validator rejecting a broken combine. (Every variant also runs in tests/test_templates.py.)"""

from __future__ import annotations

import pytest
import torch

from forge import codegen, hardware, ops
from forge.loader import load_module, write_source
from forge.opkit import Candidate
from forge.spec import DTYPES
from forge.tuner.validate import check_candidate
from tests.conftest import DEVICE

SEED = 4_242
OP = ops.get("softmax")
MOD = OP.module
# The interpreter evaluates both sides of tl.where (-inf - -inf in masked lanes): only the chosen side counts.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _module(spec, cand, tmp_path, mutate=None):
    src = codegen.render(OP, spec, cand)
    if mutate is not None:
        assert mutate[0] in src, mutate[0]
        src = src.replace(mutate[0], mutate[1], 1)
    return load_module(write_source(src, tmp_path))


def _run(spec, module, x):
    y = MOD.alloc_output((x,), spec)
    y.fill_(float("nan"))
    MOD.run(module, (x,), y, spec.attrs)
    _sync()
    return y


def test_split_is_in_the_space_only_for_fewer_rows_than_sms_and_2_to_64_blocks():
    sms = hardware.GPU_SMS
    for m, n, expected in [(1, 32000, True), (16, 32000, True), (sms - 1, 4096, True), (sms, 32000, False),
                           (4096, 32000, False), (1, 256, False), (1, 300, True)]:
        spec = MOD.make_spec((m, n), "bfloat16", "cuda")
        pts = MOD.space(spec).points("split")
        assert bool(pts) == expected, (m, n, pts)
        for c in pts:
            blocks = -(-n // c.p["BLOCK_N"])
            assert 2 <= blocks <= MOD.SPLIT_MAX_BLOCKS
            assert c in MOD.space(spec)
    # 65537 columns: 1024-wide blocks would be 65, so only 2048 (33 blocks), 4096 and 8192 (9)
    spec = MOD.make_spec((1, 65537), "bfloat16", "cuda")
    assert {c.p["BLOCK_N"] for c in MOD.space(spec).points("split")} == {2048, 4096, 8192}
    # the interpreter's 4 SMs: 4 rows already fill them
    assert not MOD.space(MOD.make_spec((4, 32000), "float32", "cpu")).points("split")
    assert MOD.default(MOD.make_spec((1, 32000), "bfloat16", "cuda")).variant != "split"  # untuned: as before


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("shape", "block", "warps"), [((1, 1000), 256, 2), ((3, 5000), 1024, 4),
                                                      ((1, 65537), 8192, 8), ((2, 3, 700), 512, 1)])
def test_split_matches_the_oracle_through_the_search_gate(shape, block, warps, dtype, tmp_path):
    """Partial last blocks (1000 = 3 x 256 + 232; 65537: a last block of one column), rows flattened from
    leading dims, one warp holding a 512-wide block."""
    spec = MOD.make_spec(shape, dtype, DEVICE)
    cand = Candidate.make("split", BLOCK_N=block, num_warps=warps)
    reason = check_candidate(MOD, _module(spec, cand, tmp_path), spec, SEED, _sync)
    assert reason is None, reason


def test_special_values_are_torchs(tmp_path):
    """A block of -inf adds nothing, a row of -inf is NaN, +inf makes its row NaN, as torch.softmax gives."""
    spec = MOD.make_spec((4, 1000), "float32", DEVICE)
    module = _module(spec, Candidate.make("split", BLOCK_N=256, num_warps=2), tmp_path)
    x = torch.randn(4, 1000, generator=torch.Generator().manual_seed(3)) * 4
    x[0, :256] = -float("inf")  # a whole block
    x[1, :] = -float("inf")  # a whole row
    x[2, 700] = float("inf")
    x[3, ::3] = -float("inf")  # every block partly
    x = x.to(DEVICE)
    got = _run(spec, module, x).double().cpu()
    ref = torch.softmax(x.double(), -1).cpu()
    assert torch.equal(torch.isnan(got), torch.isnan(ref))
    assert torch.isnan(got[1]).all() and torch.isnan(got[2]).all()
    torch.testing.assert_close(got[[0, 3]], ref[[0, 3]], rtol=1e-5, atol=1e-7)
    assert torch.equal(got[0, :256], torch.zeros(256, dtype=torch.float64))


@pytest.mark.parametrize(("old", "new"), [
    ("ls * tl.exp(ms - m)", "ls"),  # block sums not rescaled to the row's max
    ("mask=k < SPLITS, other=-float(\"inf\")", "mask=k < 1, other=-float(\"inf\")"),  # the first block's max only
    ("tl.exp(x - m) / l", "tl.exp(x - m)"),  # not normalised
])
def test_validator_rejects_a_broken_combine(old, new, tmp_path):
    spec = MOD.make_spec((3, 1000), "float32", DEVICE)
    module = _module(spec, Candidate.make("split", BLOCK_N=256, num_warps=2), tmp_path, (old, new))
    assert check_candidate(MOD, module, spec, SEED, _sync) is not None
