"""Every template variant of every built-in op, rendered, loaded and run in-process against the float64
oracle (through the same correctness gate the search uses), on shapes chosen to exercise masking:
odd and non-power-of-two rows, a single column, a very long row, leading dimensions that flatten,
and parameters that leave a partial last block (looped) or a partial last group of rows (multirow).

Without CUDA the kernels run in the Triton interpreter (tests/conftest.py), so row counts stay tiny.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

from forge import codegen, opkit, ops
from forge.loader import load_module, write_source
from forge.opkit import ROW_VARIANTS, Candidate, next_pow2, rows_cols
from forge.spec import DTYPES
from forge.tuner.validate import check_candidate
from tests.conftest import DEVICE

SEED = 20_240


def _builtin_op_names() -> list[str]:
    """The ops shipped with forge (FORGE_OPS_PATH, e.g. the deliberately broken test ops, left out)."""
    saved = os.environ.pop("FORGE_OPS_PATH", None)
    try:
        return sorted(ops.available())
    finally:
        if saved is not None:
            os.environ["FORGE_OPS_PATH"] = saved


OP_NAMES = _builtin_op_names()
# Very long rows: a power of two (every block full) and one past it (a last block of one element).
LONG_ROWS = [(2, 65536), (1, 65537)]
SHAPES = [(1, 1), (1, 7), (3, 7), (5, 300), (1, 4096), (7, 1), (2, 3, 33), *LONG_ROWS]


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _m_n(shape: tuple[int, ...]) -> tuple[int, int]:
    m = 1
    for s in shape[:-1]:
        m *= s
    return m, shape[-1]


def looped_block(n: int) -> int:
    """A power-of-two column block below N that leaves a partial last block whenever N is not a power
    of two (7 -> 4, 33 -> 32, 300 -> 128), capped at 4096 for very long rows."""
    block = max(1, next_pow2(n) // 2)
    if n > 64:
        block = next_pow2(n) // 4
    return min(block, 4096)


def multirow_rows(m: int) -> int:
    """The smallest power of two >= 4 that does not divide M, so the last program has masked rows."""
    rows = 4
    while m % rows == 0:
        rows *= 2
    return rows


def row_candidates(variant: str, shape: tuple[int, ...]) -> list[Candidate]:
    m, n = _m_n(shape)
    if variant == "row":
        return [Candidate.make("row", num_warps=1), Candidate.make("row", num_warps=4)]
    if variant == "looped":
        stages = 2 if DEVICE == "cuda" else 1  # the interpreter has no pipelining
        out = [Candidate.make("looped", BLOCK_N=looped_block(n), num_warps=4, num_stages=stages)]
        if n <= 300:
            # Outside space() (there a block is always narrower than the row), but the templates
            # handle it: lanes that only ever see masked columns (softmax's `seen` guard).
            out.append(Candidate.make("looped", BLOCK_N=2 * next_pow2(n), num_warps=1, num_stages=1))
        return out
    assert variant == "multirow"
    return [Candidate.make("multirow", ROWS=multirow_rows(m), num_warps=4)]


# Shapes some variants need besides SHAPES, run for those variants only: rmsnorm's persistent variant
# (opkit.with_persistent_rows) exists only where programs loop over row blocks (more blocks than
# PROGRAMS_PER_SM x the interpreter's 4 SMs): 67 rows (a partial last block of 4 rows) of 100 columns (a partial
# column block). tests/test_row_knobs.py runs every ROWS value there.
EXTRA_SHAPES = {"rmsnorm": [(67, 100)]}
EXTRA_VARIANTS = ("persistent",)


def shapes_for(op_name: str) -> list[tuple[int, ...]]:
    """Row ops run on SHAPES; an op whose problem shape means something else (matmul's MxNxK,
    attention's BxHxSxD) lists its own masking shapes as TEST_SHAPES in its kernels/<op>.py."""
    return list(getattr(ops.get(op_name).module, "TEST_SHAPES", SHAPES))


def candidates_for(op_name: str, shape: tuple[int, ...]) -> list[Candidate]:
    """The op's own `test_candidates(spec)` if it has one; else hand-picked masking candidates for the
    row variants and, for any other variant, both ends of that variant's valid grid at this shape (so a
    new op is covered without editing this file)."""
    op = ops.get(op_name)
    out: list[Candidate] = []
    if hasattr(op.module, "test_candidates"):
        return list(op.module.test_candidates(op.module.make_spec(shape, "float32", DEVICE)))
    for variant in op.module.TEMPLATES:
        if variant in getattr(op.module, "VARIANT_ATTRS", {}):  # run under its attributes (ATTR_CASES)
            continue
        if variant in ROW_VARIANTS:
            out.extend(row_candidates(variant, shape))
        else:
            spec = op.module.make_spec(shape, "float32", DEVICE)
            pts = op.module.space(spec).points(variant)
            out.extend(dict.fromkeys([pts[0], pts[-1]]) if pts else [])
    return out


def _cases():
    cases = []
    for op_name in OP_NAMES:
        runs = [(shape, candidates_for(op_name, shape)) for shape in shapes_for(op_name)]
        runs += [(shape, [c for c in candidates_for(op_name, shape) if c.variant in EXTRA_VARIANTS])
                 for shape in EXTRA_SHAPES.get(op_name, [])]
        for shape, cands in runs:
            for cand in cands:
                for dtype in DTYPES:
                    sid = "x".join(map(str, shape))
                    cases.append(pytest.param(op_name, shape, dtype, cand,
                                              id=f"{op_name}-{cand.label}-{sid}-{dtype}"))
    return cases


CASES = _cases()

# Variants only specs with some attributes reach (an op's VARIANT_ATTRS: the "strided" variants over a
# non-last dim): run on their own masking shapes, as (outer, R, inner) for dim=-2: a reduced dim of 1, 7,
# 300 and 1000 (partial last R blocks), an inner of 1, 33 (a partial last tile), a single outer.
ATTR_SHAPES = [(1, 1), (1, 7), (7, 1), (3, 7, 33), (2, 300, 3), (1, 1000, 2)]


def attr_candidates(op_name: str, variant: str, shape: tuple[int, ...]) -> list[Candidate]:
    """Blocks that leave a partial last block of R and of inner, and one that holds all of R (up to 64)."""
    spec = ops.get(op_name).module.make_spec(shape, "float32", DEVICE, ops.get(op_name).module.VARIANT_ATTRS[variant])
    _, r, inner = opkit.outer_r_inner(spec.inputs[0].shape, spec.attrs["dim"])
    return [Candidate.make(variant, BLOCK_R=looped_block(r), BLOCK_I=looped_block(inner), num_warps=1),
            Candidate.make(variant, BLOCK_R=min(64, next_pow2(r)), BLOCK_I=min(16, next_pow2(inner)), num_warps=2)]


def _attr_cases():
    cases = []
    for op_name in OP_NAMES:
        for variant, attrs in getattr(ops.get(op_name).module, "VARIANT_ATTRS", {}).items():
            for shape in ATTR_SHAPES:
                for cand in attr_candidates(op_name, variant, shape):
                    for dtype in DTYPES:
                        sid = "x".join(map(str, shape))
                        cases.append(pytest.param(op_name, shape, dtype, cand, attrs,
                                                  id=f"{op_name}-{cand.label}-{sid}-{dtype}"))
    return cases


ATTR_CASES = _attr_cases()


def _load(op, spec, cand, tmp_path, mutate=None):
    src = codegen.render(op, spec, cand)
    if mutate is not None:
        src = mutate(src)
    return load_module(write_source(src, tmp_path))


# The interpreter evaluates both sides of tl.where, e.g. -inf - -inf in a masked softmax lane; the
# guarded result is what is checked (NaN never passes the validator).
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize(("op_name", "shape", "dtype", "cand"), CASES)
def test_variant_matches_oracle(op_name, shape, dtype, cand, tmp_path):
    op = ops.get(op_name)
    spec = op.module.make_spec(shape, dtype, DEVICE)
    module = _load(op, spec, cand, tmp_path)
    reason = check_candidate(op.module, module, spec, SEED, _sync)
    assert reason is None, f"{cand.label} on {shape} {dtype}: {reason}"


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize(("op_name", "shape", "dtype", "cand", "attrs"), ATTR_CASES)
def test_attr_variant_matches_oracle(op_name, shape, dtype, cand, attrs, tmp_path):
    op = ops.get(op_name)
    spec = op.module.make_spec(shape, dtype, DEVICE, dict(attrs))
    module = _load(op, spec, cand, tmp_path)
    reason = check_candidate(op.module, module, spec, SEED, _sync)
    assert reason is None, f"{cand.label} on {shape} {dtype} {attrs}: {reason}"


def test_every_variant_of_every_op_is_run():
    assert {"rmsnorm", "softmax"} <= set(OP_NAMES)
    for op_name in OP_NAMES:
        covered = {c.values[3].variant for c in [*CASES, *ATTR_CASES] if c.values[0] == op_name}
        assert covered == set(ops.get(op_name).module.TEMPLATES), op_name
        # all three dtypes are run on every shape
        first = shapes_for(op_name)[0]
        assert {c.values[2] for c in CASES if c.values[0] == op_name and c.values[1] == first} == set(DTYPES)


@pytest.mark.parametrize("shape", SHAPES)
def test_chosen_candidates_exercise_masking(shape):
    """Guards the choices above: a partial last column block and a partial last group of rows."""
    m, n = _m_n(shape)
    block = looped_block(n)
    assert block & (block - 1) == 0  # tl.arange needs a power of two
    if n > 1:
        assert block < n
    if n & (n - 1):  # N not a power of two: the last block is partial
        assert n % block != 0
    rows = multirow_rows(m)
    assert m % rows != 0
    assert rows & (rows - 1) == 0


def test_helpers_agree_with_opkit():
    assert rows_cols(ops.get("rmsnorm").module.make_spec((2, 3, 33), "float32", "cpu")) == (6, 33)
    assert [looped_block(n) for n in (1, 7, 33, 300, 4096, 65536, 65537)] == [1, 4, 32, 128, 1024, 4096, 4096]
    assert [multirow_rows(m) for m in (1, 3, 4, 5, 6, 8, 16)] == [4, 4, 8, 4, 4, 16, 32]


# --- the validator is not vacuous -----------------------------------------------------------------


def _replace_once(old: str, new: str):
    def mutate(src: str) -> str:
        assert src.count(old) == 1, f"expected exactly one {old!r} in the rendered source"
        return src.replace(old, new)
    return mutate


@pytest.mark.parametrize("variant", ["row", "looped", "multirow"])
def test_validator_rejects_kernel_that_ignores_the_weight(variant, tmp_path):
    op = ops.get("rmsnorm")
    spec = op.module.make_spec((3, 300), "float32", DEVICE)
    cand = row_candidates(variant, (3, 300))[0]
    old = "x * rstd[:, None] * w[None, :]" if variant == "multirow" else "x * rstd * w"
    new = "x * rstd[:, None]" if variant == "multirow" else "x * rstd"
    module = _load(op, spec, cand, tmp_path, _replace_once(old, new))
    reason = check_candidate(op.module, module, spec, SEED, _sync)
    assert reason is not None
    assert reason.startswith("normal inputs: relative error"), reason


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_validator_rejects_wrong_mean_divisor(dtype, tmp_path):
    """/ (N + 1) changes rstd by sqrt(301/300) ~ 0.17%: beyond both fp32's and fp16's tolerance."""
    op = ops.get("rmsnorm")
    spec = op.module.make_spec((3, 300), dtype, DEVICE)
    module = _load(op, spec, Candidate.make("row", num_warps=4), tmp_path, _replace_once("/ N", "/ (N + 1)"))
    reason = check_candidate(op.module, module, spec, SEED, _sync)
    assert reason is not None
    assert reason.startswith("normal inputs: "), reason
    assert "relative error" in reason or "elements outside" in reason, reason


def test_validator_catches_unwritten_elements(tmp_path):
    """A store mask that skips the last column leaves the NaN poison there: the reason says where."""
    op = ops.get("rmsnorm")
    m, n = 3, 7
    spec = op.module.make_spec((m, n), "float32", DEVICE)

    def mutate(src: str) -> str:
        lines = src.splitlines(keepends=True)
        store = [i for i, line in enumerate(lines) if "tl.store(" in line]
        assert len(store) == 1 and "mask=mask)" in lines[store[0]]
        lines[store[0]] = lines[store[0]].replace("mask=mask)", "mask=cols < N - 1)")
        return "".join(lines)

    module = _load(op, spec, Candidate.make("row", num_warps=1), tmp_path, mutate)
    reason = check_candidate(op.module, module, spec, SEED, _sync)
    assert reason == f"normal inputs: NaN in output ({m} of {m * n} elements, first at (0, {n - 1}))"


def test_unmutated_source_passes_the_same_check(tmp_path):
    """The control for the negative tests above: the same spec and candidate, unmutated, pass."""
    op = ops.get("rmsnorm")
    spec = op.module.make_spec((3, 300), "float32", DEVICE)
    module = _load(op, spec, Candidate.make("row", num_warps=4), tmp_path)
    assert check_candidate(op.module, module, spec, SEED, _sync) is None


# --- defaults and spaces ----------------------------------------------------------------------------

DEFAULT_NS = [1, 2, 7, 33, 100, 1000, 4096, 8191, 16384, 16385, 32768, 65536, 70000]


@pytest.mark.parametrize("op_name", OP_NAMES)
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_default_is_in_space(op_name, device):
    mod = ops.get(op_name).module
    checked = 0
    shapes = [(*lead, n) for n in DEFAULT_NS for lead in [(1,), (3,), (4096,), (2, 5)]]
    for shape in [*shapes, *getattr(mod, "TEST_SHAPES", [])]:
        for dtype in DTYPES:
            try:
                spec = mod.make_spec(shape, dtype, device)
            except ValueError:  # a shape this op does not take (cross_entropy: 2-D logits only)
                continue
            default = mod.default(spec)
            assert default in mod.space(spec), (spec.shape, dtype, device, default.label)
            assert default.variant in mod.TEMPLATES
            checked += 1
    assert checked >= 3 * len(DTYPES)


@pytest.mark.parametrize("op_name", OP_NAMES)
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_every_point_of_a_mid_space_renders(op_name, device):
    op = ops.get(op_name)
    # MID_SHAPE: an op whose problem shape is not rows x columns names its own (matmul: M, N, K).
    spec = op.module.make_spec(getattr(op.module, "MID_SHAPE", (64, 1000)), "float16", device)
    specs = [(spec, cand) for cand in op.module.space(spec).all_points()]
    # variants only some attributes reach (VARIANT_ATTRS), at (64, 1000) under those attributes
    for attrs in getattr(op.module, "VARIANT_ATTRS", {}).values():
        other = op.module.make_spec(getattr(op.module, "MID_SHAPE", (64, 1000)), "float16", device, dict(attrs))
        specs += [(other, cand) for cand in op.module.space(other).all_points()]
    # variants only some layouts reach (matmul's padded: misaligned rows), at MID_EXTRA_SHAPES: those only
    for shape in getattr(op.module, "MID_EXTRA_SHAPES", {}).get(device, []):
        other = op.module.make_spec(shape, "float16", device)
        seen = {c.variant for _, c in specs}
        specs += [(other, cand) for cand in op.module.space(other).all_points() if cand.variant not in seen]
    points = [cand for _, cand in specs]
    assert {c.variant for c in points} == set(op.module.TEMPLATES)
    sources = set()
    for spec, cand in specs:
        src = codegen.render(op, spec, cand)
        compile(src, f"<{cand.label}>", "exec")  # valid Python
        assert f"forge_{op_name}_{cand.variant}" in src
        for key, value in cand.params:
            assert re.search(rf"\b{key}={value}\b", src), (cand.label, key)
        if cand.variant in ("row", "multirow"):  # whole-row variants of the row ops
            assert "BLOCK_N=1024" in src  # whole row: next_pow2(1000)
        sources.add(src)
    assert len(sources) == len(points)  # every point renders to a distinct kernel


def test_render_rejects_unknown_variant():
    op = ops.get("rmsnorm")
    spec = op.module.make_spec((4, 8), "float32", "cpu")
    with pytest.raises(ValueError, match="no variant 'tiled'"):
        codegen.render(op, spec, Candidate.make("tiled", num_warps=4))
