"""A test-only op family whose variants fail in every way a real candidate can: the search must
record each failure with its reason and carry on. Loaded through FORGE_OPS_PATH=tests/fault_ops.

The op itself is y = 2 * x over a [M, N] tensor. It takes the contract's defaults for oracle,
tolerance and fill_missing (forge/ops.py), so the search below runs them in its worker processes.
"""

from __future__ import annotations

from forge import opkit
from forge.spec import KernelSpec, TensorSpec

NAME = "faulty"
SUMMARY = "2 * x, with deliberately broken variants"
# variant -> (template, the status the search must record for it)
EXPECTED = {
    "good": "ok",
    "syntax": "compile-error",   # the rendered module is not valid Python
    "raises": "error",           # the launcher raises
    "wrong": "mismatch",         # computes 2x + 1
    "nan": "mismatch",           # writes NaN
    "unwritten": "mismatch",     # leaves the last column unwritten (poisoned NaN stays)
    "hang": "timeout",           # never returns
    "exit": "crashed",           # os._exit(3) in the worker
    "segfault": "crashed",       # reads address 0
    "oom": "oom",                # runs out of memory (the worker is replaced)
    "oob": "cuda-error",         # illegal address on the GPU (cuda only)
}
# "flaky" is outside the space (EXPECTED): it validates, then raises once it has run FLAKY_AFTER times in
# one worker, i.e. while being timed (tests/test_screening.py renders it directly).
TEMPLATES = {v: "faulty.j2" for v in (*EXPECTED, "flaky")}
FLAKY_AFTER = 12
DEFAULT_ATTRS: dict = {}


def make_spec(shape, dtype, device, attrs=None) -> KernelSpec:
    return KernelSpec(NAME, (TensorSpec(shape, dtype, device=device),), {})


def make_inputs(spec, seed, distribution="normal"):
    x = spec.inputs[0]
    return (opkit.random_tensor(x.shape, x.dtype, x.device, opkit.generator(seed, x.device), distribution),)


def reference(inputs, attrs):
    return 2 * inputs[0]


def alloc_output(inputs, spec):
    import torch

    return torch.empty_like(inputs[0])


def run(module, inputs, out, attrs):
    module.launch(inputs[0], out)


def space(spec):
    on_gpu = spec.device == "cuda"
    return opkit.Space({v: {"num_warps": [1]} for v in EXPECTED},
                       valid=lambda c: on_gpu or c.variant != "oob")


def default(spec):
    return opkit.Candidate.make("good", num_warps=1)


def render_context(spec, cand):
    _, n = opkit.rows_cols(spec)
    return {"variant": cand.variant, "BLOCK_N": opkit.next_pow2(n), "num_warps": cand.p["num_warps"],
            "FLAKY_AFTER": FLAKY_AFTER}


def bytes_moved(spec):
    return 2 * spec.inputs[0].nbytes


def flops(spec):
    return spec.inputs[0].numel
