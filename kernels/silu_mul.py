"""silu_mul: y = silu(a) * b = a * sigmoid(a) * b elementwise (the SwiGLU gate), a and b of one shape
(any shape, flattened: the problem shape is a.shape). Eager PyTorch runs two kernels and writes and
re-reads silu(a) (5 tensor passes); the fused kernel makes 3.

Not a row op: the search space is a flat elementwise one (see `space`), with two structural variants:
  flat        one BLOCK of contiguous elements per program, cdiv(numel, BLOCK) programs
  persistent  min(cdiv(numel, BLOCK), PROGRAMS_PER_SM x SMs) programs striding over the blocks
"""

from __future__ import annotations

from forge import opkit
from forge.spec import KernelSpec, TensorSpec

NAME = "silu_mul"
SUMMARY = "F.silu(a) * b (SwiGLU gate), elementwise over any shape"
TEMPLATES = {"flat": "silu_mul_flat.j2", "persistent": "silu_mul_persistent.j2"}
DEFAULT_ATTRS: dict = {}
# form="formula": the user's code writes the gate out, a * torch.sigmoid(a) * b (three eager kernels); the
# reference then runs it so, and F.silu(a) * b is one more candidate (forge/fused.py). Absent: F.silu(a) * b.
OPTIONAL_ATTRS = ("form",)

# Elementwise masking shapes for tests/test_templates.py: one element, odd sizes, leading dims that
# flatten, a power of two, and a long one whose last block holds one element.
TEST_SHAPES = [(1,), (7,), (3, 7), (2, 3, 33), (5, 300), (4096,), (1, 65537)]


def make_spec(shape: tuple[int, ...], dtype: str, device: str, attrs: dict | None = None) -> KernelSpec:
    a = {**DEFAULT_ATTRS, **(attrs or {})}
    if a.get("inplace"):
        raise ValueError("F.silu(a, inplace=True) also overwrites a with silu(a); the fused kernel leaves a as is")
    a.pop("inplace", None)
    form = a.pop("form", None)
    if a:
        raise ValueError(f"silu_mul takes only the attribute form, not {sorted(a)}")
    if form not in (None, "formula"):
        raise ValueError(f"form={form!r}: silu_mul knows form='formula' (a * sigmoid(a) * b) or no form "
                         "(F.silu(a) * b)")
    t = TensorSpec(shape, dtype, device=device)
    return KernelSpec(NAME, (t, t), {} if form is None else {"form": form})


def make_inputs(spec: KernelSpec, seed: int, distribution: str = "normal"):
    """a from `distribution` (it feeds the nonlinearity: saturation, exp overflow); b always N(0, 1).
    Both scaled would overflow fp16 (1e3 x 1e3 > 65504) and the oracle's finite value would never
    match the rounded inf; b enters linearly, so its scale tests nothing that N(0, 1) does not."""
    gen = opkit.generator(seed, spec.device)
    a, b = spec.inputs
    return (opkit.random_tensor(a.shape, a.dtype, a.device, gen, distribution),
            opkit.random_tensor(b.shape, b.dtype, b.device, gen, "normal"))


def reference(inputs, attrs):
    """The eager baseline as the user's code runs it: F.silu(a) * b as a SwiGLU MLP writes it (two kernels:
    silu, then the product), or with form="formula" a * torch.sigmoid(a) * b (three)."""
    import torch
    import torch.nn.functional as F

    a, b = inputs
    if attrs.get("form") == "formula":
        return a * torch.sigmoid(a) * b
    return F.silu(a) * b


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
    a, b = inputs
    module.launch(a.reshape(-1), b.reshape(-1), out.view(-1))


# The flat/persistent elementwise space (H200 measurements that chose it: forge/opkit.py).
space = opkit.elementwise_space
default = opkit.elementwise_default
test_candidates = opkit.elementwise_test_candidates


def render_context(spec: KernelSpec, cand: opkit.Candidate) -> dict:
    return opkit.elementwise_render_context(spec, cand, NAME)


def bytes_moved(spec: KernelSpec) -> int:
    return 3 * spec.inputs[0].nbytes


def flops(spec: KernelSpec) -> int:
    # exp, add, division (sigmoid), two multiplies.
    return 5 * spec.inputs[0].numel


# tolerance: the contract's default, opkit.ROW_TOLERANCE (forge/ops.py). Computed in fp32 from the
# rounded inputs: the output's rounding plus a few fp32 ulp (exp).


# -- recognising silu(a) * b in user code (forge/trace.py canonical forms) ------------------------
def _sigmoid_of(e: tuple) -> tuple | None:
    """The input whose sigmoid `e` is: torch.sigmoid(a) / a.sigmoid(), or 1 / (1 + exp(-a))."""
    if e[0] == "sigmoid" and e[1][0] == "input":
        return e[1]
    if e[0] == "recip" and e[1][0] == "add" and len(e[1]) == 3:
        terms = list(e[1][1:])
        ones = [t for t in terms if t[0] == "const" and t[1] == 1 and not isinstance(t[1], bool)]
        if len(ones) == 1:
            terms.remove(ones[0])
            t = terms[0]
            if t[0] == "exp" and t[1][0] == "neg" and t[1][1][0] == "input":
                return t[1][1]
    return None


def match(expr) -> tuple[list, dict] | None:
    """(input indices [a, b], attrs) for F.silu(a) * b, b * F.silu(a), a * torch.sigmoid(a) * b (any
    order; a / (1 + exp(-a)) is the same sigmoid). F.silu(a, inplace=True) * b is recognised and
    returned with inplace=True, so make_spec names the reason for running eager (the user's code
    overwrites a; the kernel would not)."""
    if expr[0] != "mul":
        return None
    factors = list(expr[1:])
    if len(factors) == 2:
        silus = [f for f in factors if f[0] == "silu" and f[1][0] == "input" and f[2][0] == "const"]
        if len(silus) != 1:
            return None
        factors.remove(silus[0])
        b = factors[0]
        if b[0] != "input":
            return None
        a, inplace = silus[0][1], silus[0][2][1]
        return [a[1], b[1]], ({"inplace": True} if inplace else {})
    if len(factors) == 3:
        for f in factors:
            a = _sigmoid_of(f)
            if a is None:
                continue
            rest = list(factors)
            rest.remove(f)
            if a not in rest:
                continue
            rest.remove(a)
            if rest[0][0] == "input":
                return [a[1], rest[0][1]], {"form": "formula"}
    return None
