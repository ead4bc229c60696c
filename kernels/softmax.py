"""softmax over the last dimension: y = exp(x - max(x)) / sum(exp(x - max(x)))."""

from __future__ import annotations

from forge import opkit
from forge.spec import KernelSpec

NAME = "softmax"
SUMMARY = "softmax(x, dim=-1)"
TEMPLATES = {"row": "softmax_row.j2", "looped": "softmax_looped.j2", "multirow": "softmax_multirow.j2"}
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
space = opkit.row_space
default = opkit.row_default


def render_context(spec: KernelSpec, cand: opkit.Candidate) -> dict:
    return opkit.row_render_context(spec, cand, NAME)


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
