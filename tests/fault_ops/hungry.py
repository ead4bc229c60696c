"""A test-only op whose eager baseline runs out of memory (a real allocation failure: the reference asks
the allocator for 2^62 bytes), while its oracle and its one candidate are fine. A search must end with
exit 3 naming the memory, never exit 1. Loaded through FORGE_OPS_PATH=tests/fault_ops."""

from __future__ import annotations

from forge import opkit
from forge.spec import KernelSpec, TensorSpec

NAME = "hungry"
SUMMARY = "2 * x, with an eager baseline that cannot allocate"
TEMPLATES = {"good": "faulty.j2"}
DEFAULT_ATTRS: dict = {}


def make_spec(shape, dtype, device, attrs=None) -> KernelSpec:
    return KernelSpec(NAME, (TensorSpec(shape, dtype, device=device),), {})


def make_inputs(spec, seed, distribution="normal"):
    x = spec.inputs[0]
    return (opkit.random_tensor(x.shape, x.dtype, x.device, opkit.generator(seed, x.device), distribution),)


def reference(inputs, attrs):
    import torch

    torch.empty(2**62, dtype=torch.uint8, device=inputs[0].device)  # more than any machine has
    return 2 * inputs[0]


def oracle(inputs, attrs):
    return 2 * inputs[0].double()


def alloc_output(inputs, spec):
    import torch

    return torch.empty_like(inputs[0])


def run(module, inputs, out, attrs):
    module.launch(inputs[0], out)


def space(spec):
    return opkit.Space({"good": {"num_warps": [1]}}, valid=lambda c: True)


def default(spec):
    return opkit.Candidate.make("good", num_warps=1)


def render_context(spec, cand):
    _, n = opkit.rows_cols(spec)
    return {"variant": cand.variant, "BLOCK_N": opkit.next_pow2(n), "num_warps": cand.p["num_warps"]}


def bytes_moved(spec):
    return 2 * spec.inputs[0].nbytes


def flops(spec):
    return spec.inputs[0].numel
