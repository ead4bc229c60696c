"""softmax over the last dimension: y = exp(x - max(x)) / sum(exp(x - max(x))).

Variants: row ops' row, looped and multirow (forge/opkit.py), and "split" for a few long rows (fewer rows than
SMs): each row cut into column blocks, one program per (row, block), two kernels (templates/softmax_split.j2)."""

from __future__ import annotations

from forge import hardware, opkit
from forge.spec import KernelSpec

NAME = "softmax"
SUMMARY = "softmax(x, dim=-1)"
TEMPLATES = {"row": "softmax_row.j2", "looped": "softmax_looped.j2", "multirow": "softmax_multirow.j2",
             "split": "softmax_split.j2"}
DEFAULT_ATTRS = {"dim": -1}
# x may have any outer strides with its rows contiguous: the kernels take a row stride; run() views x
# as rows (a copy where no view exists).
STRIDED_INPUTS = (0,)
# The default oracle (float64 reference) runs on chunks of rows, its memory bounded (forge/ops.py).
ORACLE_CHUNK = "rows"


def make_spec(shape: tuple[int, ...], dtype: str, device: str, attrs: dict | None = None) -> KernelSpec:
    return opkit.last_dim_unary_spec(NAME, shape, dtype, device, attrs)


make_inputs = opkit.unary_inputs


def reference(inputs, attrs):
    import torch

    return torch.softmax(inputs[0], dim=-1)


def alloc_output(inputs, spec: KernelSpec):
    import torch

    x = inputs[0]  # contiguous whatever x's layout (run() views it as rows)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def run(module, inputs, out, attrs) -> None:
    # Defined here, not shared through opkit: `forge export` copies alloc_output/run into a module that
    # runs without forge.
    x = inputs[0]
    n = x.shape[-1]
    module.launch(x.reshape(-1, n), out.view(-1, n))


# No persistent variant (opkit.with_persistent_rows, rmsnorm's): softmax had one, with its eviction knob, and
# it never competed in a budget-50 search on an H100 (2026-12-06, screen p50 of each variant's best point;
# docs/notes.md stop 30): 8192x8192 bf16 row 90.77 us vs persistent 98.36, 32768x4096 row 178.9 vs 191.94.
#
# "split": issue 16's decode rows (1, 4 and 16 rows of 32000, bf16) were level with Liger (4.9-5.7 µs on an H100,
# run a, 2026-12-06), both one program per row: one SM pulls a whole 64 KB row, while a 4096-wide rmsnorm row takes
# 1.6 µs in all. Cut into blocks of BLOCK_N columns, a row's loads spread over as many SMs, for the price of a
# second launch and a second read of x (from L2). In the space only where rows are fewer than SMs, with 2 to
# SPLIT_MAX_BLOCKS blocks a row. Not yet measured on a GPU.
SPLIT = {"BLOCK_N": [256, 512, 1024, 2048, 4096, 8192], "num_warps": [1, 2, 4, 8, 16]}
SPLIT_MAX_BLOCKS = 64
# tests/test_templates.py renders every point at (64, 1000), where rows outnumber SMs: split's shapes
MID_EXTRA_SHAPES = {"cuda": [(16, 32000)], "cpu": [(2, 5000)]}


def space(spec: KernelSpec) -> opkit.Space:
    """The row ops' space, and "split" where rows are fewer than the SMs."""
    base = opkit.row_space(spec)
    m, n = opkit.rows_cols(spec)
    sms = hardware.GPU_SMS if spec.device == "cuda" else hardware.CPU_SMS

    def valid(c: opkit.Candidate) -> bool:
        if c.variant != "split":
            return base.valid(c)
        block, warps = c.p["BLOCK_N"], c.p["num_warps"]
        per_thread = block / (32 * warps)
        return (m < sms and 2 <= -(-n // block) <= SPLIT_MAX_BLOCKS
                and per_thread <= opkit.MAX_ELEMS_PER_THREAD and (warps == 1 or per_thread >= 1))

    return opkit.Space({**base.variants, "split": dict(SPLIT)}, valid)


default = opkit.row_default


def render_context(spec: KernelSpec, cand: opkit.Candidate) -> dict:
    ctx = opkit.row_render_context(spec, cand, NAME)
    if cand.variant == "split":
        ctx["BLOCK_N"] = cand.p["BLOCK_N"]  # a column block, not the whole row row_render_context gives
    return ctx


def bytes_moved(spec: KernelSpec) -> int:
    return 2 * spec.inputs[0].nbytes


def flops(spec: KernelSpec) -> int:
    return 5 * spec.inputs[0].numel


# -- recognising softmax in user code (forge/trace.py canonical forms) ----------------------------
def match(expr) -> tuple[list, dict] | None:
    """torch.softmax / F.softmax / x.softmax over the last dim (no dtype argument)."""
    if expr[0] == "softmax_last" and expr[1][0] == "input":
        return [expr[1][1]], {"dim": -1}
    return None
