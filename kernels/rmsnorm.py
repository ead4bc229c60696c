"""rmsnorm: y = x * rsqrt(mean(x², -1) + eps) * w over the last dimension."""

from __future__ import annotations

from forge.spec import KernelSpec, TensorSpec
from forge_cli import opkit

NAME = "rmsnorm"
SUMMARY = "x * rsqrt(mean(x^2, -1) + eps) * w"
TEMPLATES = {"row": "rmsnorm_row.j2", "looped": "rmsnorm_looped.j2", "multirow": "rmsnorm_multirow.j2"}
DEFAULT_ATTRS = {"eps": 1e-6}


def make_spec(shape: tuple[int, ...], dtype: str, device: str, attrs: dict | None = None) -> KernelSpec:
    a = {**DEFAULT_ATTRS, **(attrs or {})}
    unknown = set(a) - set(DEFAULT_ATTRS)
    if unknown:
        raise ValueError(f"rmsnorm takes attributes {sorted(DEFAULT_ATTRS)}, not {sorted(unknown)}")
    a["eps"] = float(a["eps"])
    return KernelSpec(NAME, (TensorSpec(shape, dtype, device=device), TensorSpec((shape[-1],), dtype,
                                                                                 device=device)), a)


def make_inputs(spec: KernelSpec, seed: int, distribution: str = "normal"):
    gen = opkit.generator(seed, spec.device)
    x, w = spec.inputs
    # The weight is drawn around 1 but not equal to it, so a kernel that ignores w fails validation.
    return (opkit.random_tensor(x.shape, x.dtype, x.device, gen, distribution),
            opkit.random_tensor(w.shape, w.dtype, w.device, gen, "normal", base=0.0) * 0.5 + 1.0)


def reference(inputs, attrs):
    """The eager baseline, as a user writes it (computes in the input dtype)."""
    import torch

    x, w = inputs
    return x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + attrs["eps"]) * w


def oracle(inputs, attrs):
    """The correctness oracle: the same formula in float64."""
    return reference(tuple(t.double() for t in inputs), attrs)


def alloc_output(inputs, spec: KernelSpec):
    import torch

    return torch.empty_like(inputs[0])


def run(module, inputs, out, attrs) -> None:
    x, w = inputs
    n = x.shape[-1]
    module.launch(x.reshape(-1, n), w, out.view(-1, n), attrs["eps"])


space = opkit.row_space
default = opkit.row_default


def render_context(spec: KernelSpec, cand: opkit.Candidate) -> dict:
    return opkit.row_render_context(spec, cand, NAME)


def bytes_moved(spec: KernelSpec) -> int:
    x, w = spec.inputs
    return 2 * x.nbytes + w.nbytes


def flops(spec: KernelSpec) -> int:
    return 4 * spec.inputs[0].numel


def tolerance(dtype: str) -> opkit.Tolerance:
    return opkit.ROW_TOLERANCE[dtype]
