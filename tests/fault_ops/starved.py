"""A test-only op that runs out of memory where its attributes say, with the exception they say: in its
float64 oracle, in its eager baseline, or (variant "oom") in the candidate's own launch; raising
torch.OutOfMemoryError (what the CUDA caching allocator raises) or MemoryError (the host's). The op is
y = 2 * x. Loaded through FORGE_OPS_PATH=tests/fault_ops.

    starve = "none" | "oracle" | "baseline"   where forge's own work runs out of memory
    error = "torch" | "memory"                which exception every out-of-memory here raises

The "good" variant computes y; the "oom" variant raises the chosen exception from its launcher (the
candidate's own out-of-memory, an outcome of that candidate only)."""

from __future__ import annotations

from forge import opkit
from forge.spec import KernelSpec, TensorSpec

NAME = "starved"
SUMMARY = "2 * x, running out of memory where its attributes say"
TEMPLATES = {"good": "starved.j2", "oom": "starved.j2"}
DEFAULT_ATTRS = {"starve": "none", "error": "torch"}
STARVE = ("none", "oracle", "baseline")
ERRORS = ("torch", "memory")


def make_spec(shape, dtype, device, attrs=None) -> KernelSpec:
    a = {**DEFAULT_ATTRS, **(attrs or {})}
    if set(a) - set(DEFAULT_ATTRS) or a["starve"] not in STARVE or a["error"] not in ERRORS:
        raise ValueError(f"starved takes starve in {STARVE} and error in {ERRORS}, not {a}")
    return KernelSpec(NAME, (TensorSpec(shape, dtype, device=device),), a)


def make_inputs(spec, seed, distribution="normal"):
    x = spec.inputs[0]
    return (opkit.random_tensor(x.shape, x.dtype, x.device, opkit.generator(seed, x.device), distribution),)


def out_of_memory(kind: str, where: str) -> BaseException:
    import torch

    if kind == "torch":
        return torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 16.00 GiB ({where}, on purpose)")
    return MemoryError(f"out of memory on purpose ({where})")


def reference(inputs, attrs):
    if attrs["starve"] == "baseline":
        raise out_of_memory(attrs["error"], "the eager baseline")
    return 2 * inputs[0]


def oracle(inputs, attrs):
    if attrs["starve"] == "oracle":
        raise out_of_memory(attrs["error"], "the float64 oracle")
    return 2 * inputs[0].double()


def alloc_output(inputs, spec):
    import torch

    return torch.empty_like(inputs[0])


def run(module, inputs, out, attrs):
    module.launch(inputs[0], out, attrs["error"])


def space(spec):
    return opkit.Space({"good": {"num_warps": [1]}, "oom": {"num_warps": [1]}}, valid=lambda c: True)


def default(spec):
    return opkit.Candidate.make("good", num_warps=1)


def render_context(spec, cand):
    _, n = opkit.rows_cols(spec)
    return {"variant": cand.variant, "BLOCK_N": opkit.next_pow2(n), "num_warps": cand.p["num_warps"]}


def bytes_moved(spec):
    return 2 * spec.inputs[0].nbytes


def flops(spec):
    return spec.inputs[0].numel
