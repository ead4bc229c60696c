"""gelu: y = x * Phi(x) elementwise (approximate="none", through erf) or its tanh approximation
(approximate="tanh"), over a tensor of any shape (flattened: the problem shape is x.shape).

Not a row op: the search space is a flat elementwise one (see `space`), with two structural variants:
  flat        one BLOCK of contiguous elements per program, cdiv(numel, BLOCK) programs
  persistent  min(cdiv(numel, BLOCK), PROGRAMS_PER_SM x SMs) programs striding over the blocks
"""

from __future__ import annotations

import math

from forge import formulas, opkit
from forge.spec import KernelSpec, TensorSpec

NAME = "gelu"
SUMMARY = "F.gelu(x, approximate='none' | 'tanh'), elementwise over any shape"
TEMPLATES = {"flat": "gelu_flat.j2", "persistent": "gelu_persistent.j2"}
DEFAULT_ATTRS = {"approximate": "none"}
MODES = ("none", "tanh")
# form="formula": the user's code writes gelu out (0.5 * x * (1 + erf(x / sqrt(2))) or the tanh formula,
# five to eight eager kernels); the reference, the search's baseline, then runs that formula as written
# and torch's F.gelu is one more candidate (forge/fused.py). Absent: the user calls F.gelu / nn.GELU.
OPTIONAL_ATTRS = ("form",)
FORMS = ("formula",)

# Elementwise masking shapes for tests/test_templates.py: one element, odd sizes, leading dims that
# flatten, a power of two, and a long one whose last block holds one element.
TEST_SHAPES = [(1,), (7,), (3, 7), (2, 3, 33), (5, 300), (4096,), (1, 65537)]


def make_spec(shape: tuple[int, ...], dtype: str, device: str, attrs: dict | None = None) -> KernelSpec:
    a = {**DEFAULT_ATTRS, **(attrs or {})}
    unknown = set(a) - set(DEFAULT_ATTRS) - set(OPTIONAL_ATTRS)
    if unknown:
        raise ValueError(f"gelu takes attributes {sorted(DEFAULT_ATTRS) + list(OPTIONAL_ATTRS)}, not {sorted(unknown)}")
    mode = str(a["approximate"]).lower()
    if mode not in MODES:
        raise ValueError(f"approximate={a['approximate']!r} is not supported (only 'none' or 'tanh')")
    out = {"approximate": mode}
    if "form" in a:
        if a["form"] not in FORMS:
            raise ValueError(f"form={a['form']!r}: gelu knows form='formula' (the formula written out) or no form "
                             "(F.gelu)")
        out["form"] = a["form"]
    return KernelSpec(NAME, (TensorSpec(shape, dtype, device=device),), out)


def make_inputs(spec: KernelSpec, seed: int, distribution: str = "normal"):
    x = spec.inputs[0]
    return (opkit.random_tensor(x.shape, x.dtype, x.device, opkit.generator(seed, x.device), distribution),)


def reference(inputs, attrs):
    """The eager baseline, as the user's code runs it: PyTorch's fused gelu kernel (one read, one write), or
    with form="formula" the formula written out (erf: 5 eager kernels; tanh, as MinGPT / GPT-2's gelu_new
    write it: 8)."""
    import torch
    import torch.nn.functional as F

    x = inputs[0]
    if attrs.get("form") != "formula":
        return F.gelu(x, approximate=attrs["approximate"])
    if attrs["approximate"] == "tanh":
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def oracle(inputs, attrs):
    """The exact result (float64) rounded once to the output dtype: the best any kernel can return.
    Unrounded, a tiny fp16 result in the subnormal range (spacing 6e-8) is off by up to tens of percent
    in every kernel, so a one- or two-element tensor would fail the relative-norm check by chance.
    Elementwise, so evaluated on chunks of the flattened inputs (opkit.oracle_in_chunks): its float64
    working set stays bounded, and the result is in the output dtype."""
    dtype = inputs[0].dtype
    return opkit.oracle_in_chunks(lambda part: reference(tuple(t.double() for t in part), attrs).to(dtype),
                                  inputs, "elements")


def alloc_output(inputs, spec: KernelSpec):
    import torch

    return torch.empty_like(inputs[0])


def run(module, inputs, out, attrs) -> None:
    module.launch(inputs[0].reshape(-1), out.view(-1))


# The flat/persistent elementwise space (H200 measurements that chose it: forge/opkit.py).
space = opkit.elementwise_space
default = opkit.elementwise_default
test_candidates = opkit.elementwise_test_candidates


def render_context(spec: KernelSpec, cand: opkit.Candidate) -> dict:
    ctx = opkit.elementwise_render_context(spec, cand, NAME)
    ctx["APPROXIMATE"] = spec.attrs["approximate"]
    return ctx


def bytes_moved(spec: KernelSpec) -> int:
    return 2 * spec.inputs[0].nbytes


def flops(spec: KernelSpec) -> int:
    # erf (a polynomial, ~10 ops in libdevice) or x^3, exp and a division, plus the scaling.
    return 14 * spec.inputs[0].numel


# tolerance: the contract's default, opkit.ROW_TOLERANCE (forge/ops.py). The kernels compute in fp32
# from the rounded input: the error is the output's rounding plus a few fp32 ulp (erf, exp), inside the
# row ops' bounds in every dtype.


# -- recognising gelu in user code (forge/trace.py canonical forms): forge/formulas.py owns the rule ---------
def match(expr) -> tuple[list, dict] | None:
    """F.gelu(x[, approximate]), nn.GELU([approximate]) and the written-out erf and tanh formulas
    (form="formula"): forge/formulas.py match_gelu."""
    return formulas.match_gelu(expr)
