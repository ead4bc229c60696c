"""rmsnorm: y = x * rsqrt(mean(x², dims) + eps) * w over the last dimension, several trailing dimensions
(attribute dims = k: F.rms_norm(x, (H, W), w), w of shape (H, W)) or one other dimension (attribute
dim = d < -1: over C of an NCHW x, w of shape (C, 1, 1), as the user's w.view(1, C, 1, 1) broadcasts).

Trailing dims run the row variants on x.reshape(-1, prod(shape[-k:])) (the rows are contiguous); one
non-last dim runs the "strided" variant on contiguous x viewed as (outer, R, inner)."""

from __future__ import annotations

from forge import formulas, opkit
from forge.spec import KernelSpec, TensorSpec

NAME = "rmsnorm"
SUMMARY = "x * rsqrt(mean(x^2, -1) + eps) * w"
TEMPLATES = {"row": "rmsnorm_row.j2", "looped": "rmsnorm_looped.j2", "multirow": "rmsnorm_multirow.j2",
             "persistent": "rmsnorm_persistent.j2", "strided": "rmsnorm_strided.j2"}
DEFAULT_ATTRS = {"eps": 1e-6}
# Optional attributes, in the spec (and so the key) only where they differ from these: every spec over
# the last dim is what it always was. "weight_view" is the matcher's note, never in a spec: the shape
# the user's expression gives the weight (w.view(1, C, 1, 1)), for fill_missing to check.
SHAPE_ATTRS = {"dims": 1, "dim": -1}
_NOTES = ("weight_view", "hf_dtype")
# form="fused": the user's code calls F.rms_norm / nn.RMSNorm (torch's fused op); the reference, the search's
# baseline, then is that call. form="hf": Hugging Face's LlamaRMSNorm in half precision, which rounds twice
# (weight * (x.float() * rstd).to(dtype)); the reference runs it so and the kernels compute it so (their
# round_before_weight), so a swapped region gives the module's own values. Absent: the formula as users
# write it (5 eager kernels), with F.rms_norm one more candidate (forge/fused.py).
FORMS = ("fused", "hf")
OPTIONAL_ATTRS = ("form", *SHAPE_ATTRS)  # manifests may name them (forge trace --write-manifest writes them)
FILL_MISSING_ATTRS = True  # the weight's shape depends on dims/dim (forge/ops.py)
VARIANT_ATTRS = {"strided": {"dim": -2}}
# x may have any outer strides with its rows contiguous: the kernels take a row stride; run() views x
# as rows (a copy where no view exists). The weight stays contiguous.
STRIDED_INPUTS = (0,)
# The default oracle (float64 reference) runs on chunks of rows, its memory bounded (forge/ops.py).
ORACLE_CHUNK = "rows"


def make_spec(shape: tuple[int, ...], dtype: str, device: str, attrs: dict | None = None) -> KernelSpec:
    a = {**DEFAULT_ATTRS, **(attrs or {})}
    for note in _NOTES:
        a.pop(note, None)
    unknown = set(a) - set(DEFAULT_ATTRS) - set(SHAPE_ATTRS) - set(OPTIONAL_ATTRS)
    if unknown:
        raise ValueError(f"rmsnorm takes attributes {sorted(DEFAULT_ATTRS)}, not {sorted(unknown)}")
    if a.get("form", "fused") not in FORMS:
        raise ValueError(f"form={a['form']!r}: rmsnorm knows form='fused' (F.rms_norm / nn.RMSNorm), 'hf' (Hugging "
                         "Face's half-precision LlamaRMSNorm) or no form (the formula)")
    if a.get("form") == "hf" and dtype not in ("float16", "bfloat16"):
        a.pop("form")  # in float32 HF's casts are no-ops: the plain formula, one spec and key
    a["eps"] = float(a["eps"])
    shape = tuple(shape)
    dims = a.pop("dims", 1)
    if isinstance(dims, bool) or not isinstance(dims, int) or not 1 <= dims <= len(shape):
        raise ValueError(f"dims={dims!r}: the number of trailing dims normalized, 1 to {len(shape)}")
    dim = opkit.normalize_dim(a.pop("dim", -1), len(shape), "rmsnorm")
    if dim != -1 and dims != 1:
        raise ValueError(f"rmsnorm normalizes over trailing dims or one dim, not both (dims={dims}, dim={dim})")
    if dims != 1:
        a["dims"] = dims
    if dim != -1:
        a["dim"] = dim
    w = opkit.trailing_shape(shape, a)
    return KernelSpec(NAME, (TensorSpec(shape, dtype, device=device), TensorSpec(w, dtype, device=device)), a)


def strided_problem(spec: KernelSpec) -> str | None:
    """Over a non-last dim x must be contiguous (the strided variant indexes it as (outer, R, inner))."""
    if "dim" in spec.attrs:
        return f"rmsnorm over dim={spec.attrs['dim']} takes a contiguous x only"
    return None


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
    if attrs.get("form") == "hf":  # Hugging Face's LlamaRMSNorm: float32 normalisation, rounded, times w
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + attrs["eps"])).to(x.dtype)
    if attrs.get("form") == "fused":  # the user calls torch's op
        import torch.nn.functional as F

        return F.rms_norm(x, tuple(x.shape[x.dim() - attrs.get("dims", 1):]), w, attrs["eps"])
    dim = attrs.get("dim", -1)
    if "dims" in attrs:
        dim = tuple(range(-attrs["dims"], 0))
    return x * torch.rsqrt(torch.mean(x * x, dim=dim, keepdim=True) + attrs["eps"]) * w


def alloc_output(inputs, spec: KernelSpec):
    import torch

    x = inputs[0]  # contiguous whatever x's layout (run() views it as rows)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def run(module, inputs, out, attrs) -> None:
    x, w = inputs
    if "dim" in attrs:  # contiguous x (strided_problem): (outer, R, inner) is a view
        d = x.dim() + attrs["dim"]
        outer, inner = x.shape[:d].numel(), x.shape[d + 1:].numel()
        module.launch(x.view(outer, x.shape[d], inner), w.reshape(-1), out.view(outer, x.shape[d], inner),
                      attrs["eps"])
        return
    n = w.numel()  # the normalized trailing dims, flattened (w has their shape)
    module.launch(x.reshape(-1, n), w.reshape(-1), out.view(-1, n), attrs["eps"])


# The persistent variant and its knobs: opkit.with_persistent_rows, only on tensors of at most
# PERSISTENT_MAX_NUMEL elements. Measured on an H100 (budget-50 search, 2026-12-06, screen p50 of each variant's
# best point; bench/results/h100-knobs-search-2026-12-06.json, docs/notes.md stop 30): at 8M elements it was
# the fastest point (2048x4096 fp16: persistent 12.94 us, F.rms_norm 13.16, multirow 13.19, row 13.29; bf16:
# 13.04 vs row 13.29) or within 1.5% (4096x2048 bf16 form="hf": multirow 13.15, persistent 13.35); at 64M and
# 128M it lost (8192x8192: multirow 88.21 vs persistent 92.6, 5%; 32768x4096: multirow 177.06 vs 184.7, 4%).
# Decode shapes (1, 4, 16 rows) have no persistent points (their programs do not loop).
PERSISTENT_MAX_NUMEL = 16 * 2**20
# The looped variant's own knob: EVICT=1 loads x with "evict_last" in the first pass (the row stays in L2 for
# the second) and "evict_first" in the second, as Inductor's looped reductions do. Measured on the same H100
# search (time at EVICT=1 / EVICT=0 of looped points differing only in EVICT): it pays at large shapes
# (8192x8192: 0.88-0.98; 32768x4096: 0.76-1.0).
LOOPED_EVICT = [0, 1]
# The shape tests/test_templates.py renders every point of: enough rows that persistent programs loop.
MID_SHAPE = (4096, 1000)


def space(spec: KernelSpec) -> opkit.Space:
    dim = spec.attrs.get("dim", -1)
    if dim != -1:
        return opkit.strided_space(spec, dim)
    sp = opkit.with_persistent_rows(spec, opkit.row_space(spec), max_numel=PERSISTENT_MAX_NUMEL)
    return opkit.Space({**sp.variants, "looped": {**sp.variants["looped"], "EVICT": LOOPED_EVICT}}, sp.valid)


def default(spec: KernelSpec) -> opkit.Candidate:
    dim = spec.attrs.get("dim", -1)
    if dim != -1:
        return opkit.strided_default(spec, dim)
    cand = opkit.row_default(spec)
    if cand.variant == "looped":  # the knob off: the looped kernel as it always ran
        cand = opkit.Candidate.make("looped", **cand.p, EVICT=0)
    return cand


def render_context(spec: KernelSpec, cand: opkit.Candidate) -> dict:
    if cand.variant == opkit.STRIDED_VARIANT:
        ctx = opkit.strided_render_context(spec, cand, NAME)
    else:
        ctx = opkit.row_render_context(spec, cand, NAME)
        ctx.setdefault("EVICT", 0)  # a looped candidate without the knob (tests' hand-picked ones): no policy
    # form="hf": the normalised value rounded to the output dtype before the weight multiplies it (as HF's
    # half-precision LlamaRMSNorm); every other spec renders as before (tests/test_golden.py)
    return {**ctx, "round_before_weight": spec.attrs.get("form") == "hf"}


def oracle(inputs, attrs):
    """The float64 reference, evaluated on chunks of independent rows (opkit.oracle_in_chunks). Over
    several trailing dims or one other dim the problem is first viewed as what the kernels compute
    (rows of prod(trailing) values; (outer, R, inner) with w as (R, 1)): the same values, and chunks
    that never cut a normalized group."""
    x, w = inputs
    if "dim" in attrs:
        d = x.dim() + attrs["dim"]
        x3 = x.reshape(x.shape[:d].numel(), x.shape[d], x.shape[d + 1:].numel())
        out = opkit.float64_oracle(reference, (x3, w.reshape(-1, 1)), {"eps": attrs["eps"], "dim": -2}, "rows")
        return out.reshape(x.shape)
    if "dims" in attrs:
        n = w.numel()
        out = opkit.float64_oracle(reference, (x.reshape(-1, n), w.reshape(n)), {"eps": attrs["eps"]}, "rows")
        return out.reshape(x.shape)
    return opkit.float64_oracle(reference, inputs, attrs, ORACLE_CHUNK)


def bytes_moved(spec: KernelSpec) -> int:
    x, w = spec.inputs
    return 2 * x.nbytes + w.nbytes


def flops(spec: KernelSpec) -> int:
    return 4 * spec.inputs[0].numel


# -- recognising rmsnorm in user code (forge/trace.py canonical forms): forge/formulas.py owns the rule ------
def match(expr) -> tuple[list, dict] | None:
    """F.rms_norm / nn.RMSNorm (form="fused") and the formula over the last dim, several trailing dims or one
    other dim: forge/formulas.py match_rmsnorm."""
    return formulas.match_rmsnorm(expr)


def _squeezed(shape) -> tuple:
    """shape without its leading ones (at least one dim kept): two weights equal so broadcast alike."""
    shape = tuple(shape)
    while len(shape) > 1 and shape[0] == 1:
        shape = shape[1:]
    return shape


def fill_missing(inputs: list, attrs: dict | None = None):
    """rmsnorm without a weight is rmsnorm with w = 1 (same kernel, exact: x * r * 1.0 == x * r).

    A weight is given the spec's shape (opkit.trailing_shape: the normalized dims, or (C, 1, 1) over dim
    -3) when the shape the expression uses it in (its own, or the matcher's weight_view) broadcasts
    against x exactly as that does: equal but for leading ones, and no more dims than x (else eager's
    result would grow). Any other weight is left as it is, and the spec's shape check refuses it."""
    import torch

    x, w = inputs
    attrs = attrs or {}
    hf_dtype = attrs.get("hf_dtype")
    if hf_dtype is not None and str(x.dtype).removeprefix("torch.") != hf_dtype:
        raise ValueError(f"the normalised value is cast to {hf_dtype}, not to x's dtype {x.dtype}: another "
                         "computation than rmsnorm's")
    want = opkit.trailing_shape(tuple(x.shape), attrs)
    if w is None:
        return (x, torch.ones(want, dtype=x.dtype, device=x.device))
    seen = attrs.get("weight_view") or tuple(w.shape)
    if (tuple(w.shape) != want and len(seen) <= x.dim() and _squeezed(seen) == _squeezed(want)
            and w.numel() == torch.Size(want).numel() and w.is_contiguous()):
        w = w.view(want)  # a view (a contiguous w's values, in the order the expression reads them)
    return (x, w)
