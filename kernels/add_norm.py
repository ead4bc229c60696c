"""add_norm: h = x + r, then y = rmsnorm(h) or layer_norm(h) over the last dimension, in one kernel that
writes both (issue 14: the pre-norm transformer's residual stream, `h = h + attn_out; y = norm(h)`, where
eager writes h and the norm reads it back).

Attribute norm = "rmsnorm" | "layer_norm", with the norm's eps (and form="fused" where the user called
F.rms_norm). Inputs: x, r (one shape, contiguous), w (and b for layer_norm; absent ones are filled in as
rmsnorm.py / layer_norm.py do: w = 1, b = 0). ONE output of shape (2, *x.shape): y in [0], h in [1], so
the single-output contract (alloc_output, run, validation against the oracle, timing) holds unchanged;
forge/regions.py gives such a region the add node as an extra output, and forge/backend.py splits it.

h is (x + r) rounded to the dtype first, as eager's add (in fp32 and rounded once: the sum of two
fp16/bf16 values rounded through fp32 is the correctly rounded sum, since 24 >= 2p + 2), so it equals
eager's h bit for bit; the norm then runs on the rounded h in fp32 and y is rounded once."""

from __future__ import annotations

import functools
import math

from forge import formulas, opkit
from forge.spec import KernelSpec, TensorSpec

NAME = "add_norm"
SUMMARY = "h = x + r; y = rmsnorm(h) or layer_norm(h); out = (y, h)"
TEMPLATES = {"row": "add_norm_row.j2", "looped": "add_norm_looped.j2", "multirow": "add_norm_multirow.j2"}
NORMS = ("rmsnorm", "layer_norm")
DEFAULT_ATTRS = {"norm": "rmsnorm", "eps": 1e-6}
# form="fused": the user called F.rms_norm / nn.RMSNorm on h (rmsnorm only); absent: the written formula.
OPTIONAL_ATTRS = ("form",)
# forge/regions.py keeps a multi-use add inside this family's regions (cutting at its inputs instead) and
# gives the region that add as an extra output: h, read again by the next residual add, is the kernel's [1].
KEEP_MULTI_USE = ("add",)
FILL_MISSING_ATTRS = True  # how many inputs are filled in depends on the norm
# Whole-row variants hold x (= h), w and, for layer_norm, b in registers: layer_norm.py's cap. (x and r are live
# together at the start, with w and b loaded alongside in their own dtype, as many registers as d, w and b in
# fp32 later.)
MAX_ELEMS_PER_THREAD = 32
# Test data: rows far from zero for layer_norm (layer_norm.py's OFFSET_SPREADS says why).
OFFSET_SPREADS = {"float16": 30.0, "bfloat16": 100.0, "float32": 100.0}


def _norm(attrs: dict) -> str:
    return attrs.get("norm", DEFAULT_ATTRS["norm"])


def make_spec(shape: tuple[int, ...], dtype: str, device: str, attrs: dict | None = None) -> KernelSpec:
    a = {**DEFAULT_ATTRS, **(attrs or {})}
    a.pop("hf_dtype", None)  # the matcher's note (fill_missing checks it), not part of the spec
    unknown = set(a) - set(DEFAULT_ATTRS) - set(OPTIONAL_ATTRS)
    if unknown:
        raise ValueError(f"add_norm takes attributes {sorted(DEFAULT_ATTRS)} (and form), not {sorted(unknown)}")
    if a["norm"] not in NORMS:
        raise ValueError(f"norm={a['norm']!r}: add_norm fuses {' or '.join(NORMS)}")
    if "form" in a and (a["form"] not in ("fused", "hf") or a["norm"] != "rmsnorm"):
        raise ValueError(f"form={a['form']!r}: add_norm knows form='fused' (F.rms_norm) and 'hf' (Hugging Face's "
                         "half-precision LlamaRMSNorm, two roundings) for norm='rmsnorm' only")
    if a.get("form") == "hf" and dtype not in ("float16", "bfloat16"):
        a.pop("form")  # in float32 HF's casts are no-ops: the plain formula, one spec and key
    eps = a["eps"]
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not math.isfinite(eps):
        raise ValueError(f"eps must be a finite number, not {eps!r}")
    a["eps"] = float(eps)
    shape = tuple(shape)
    if not shape:
        raise ValueError("add_norm normalizes over the last dim: a 0-d x has none")
    x = TensorSpec(shape, dtype, device=device)
    vec = TensorSpec(shape[-1:], dtype, device=device)
    return KernelSpec(NAME, (x, x, vec, vec) if a["norm"] == "layer_norm" else (x, x, vec), a)


def make_inputs(spec: KernelSpec, seed: int, distribution: str = "normal"):
    import torch

    gen = opkit.generator(seed, spec.device)
    x, r, w = spec.inputs[:3]
    xt = opkit.random_tensor(x.shape, x.dtype, x.device, gen, distribution)
    rt = opkit.random_tensor(r.shape, r.dtype, r.device, gen, distribution)
    if _norm(spec.attrs) == "layer_norm":  # a per-row offset on the residual: h's rows sit far from zero
        u = torch.rand((*x.shape[:-1], 1), generator=gen, dtype=torch.float32, device=rt.device)
        scale = {"large": 1e3 if x.dtype == "float16" else 1e5, "tiny": 1e-4}.get(distribution, 1.0)
        rt = (rt.float() + (2.0 * u - 1.0) * OFFSET_SPREADS[x.dtype] * scale).to(rt.dtype)
    # w around 1 but not 1, b around 0 but not 0: a kernel that ignores either fails validation.
    wt = opkit.random_tensor(w.shape, w.dtype, w.device, gen, "normal") * 0.5 + 1.0
    if _norm(spec.attrs) == "rmsnorm":
        return xt, rt, wt
    return xt, rt, wt, opkit.random_tensor(w.shape, w.dtype, w.device, gen, "normal") * 0.5


@functools.cache
def _stats_dtype(device_type: str, dtype):
    """The dtype native_layer_norm gives its mean/rstd here (the out= buffers must have it)."""
    import torch

    x = torch.zeros((1, 2), dtype=dtype, device=device_type)
    return torch.native_layer_norm(x, [2], None, None, 1e-5)[1].dtype


def reference(inputs, attrs):
    """The eager baseline, as a user writes it, with the same eager kernels, into one (2, ...) buffer
    (out= variants, so the baseline pays nothing for the layout): torch.add into out[1], then the norm's
    kernels, the last writing out[0]. layer_norm: torch has no copy-free out= spelling: the out= variant
    of native_layer_norm is autogenerated (the functional kernel, then a copy into out0), so for layer_norm
    the baseline pays one extra read and write of y beyond F.layer_norm (about 2 of its 7 passes over
    x-sized memory); the rmsnorm baseline pays nothing extra."""
    import torch

    x, r, w = inputs[:3]
    out = torch.empty((2, *x.shape), dtype=x.dtype, device=x.device)
    h = torch.add(x, r, out=out[1])
    eps = attrs["eps"]
    if _norm(attrs) == "layer_norm":
        stats = _stats_dtype(x.device.type, x.dtype)
        torch.ops.aten.native_layer_norm.out(h, [x.shape[-1]], w, inputs[3], eps, out0=out[0],
                                             out1=torch.empty(0, dtype=stats, device=x.device),
                                             out2=torch.empty(0, dtype=stats, device=x.device))
    elif attrs.get("form") == "hf":  # HF's LlamaRMSNorm in half precision: rounded, then times w (in dtype)
        hf = h.float()
        torch.mul(w, (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype), out=out[0])
    elif attrs.get("form") == "fused":  # the user calls F.rms_norm: its one kernel, then the copy it needs
        out[0].copy_(torch.nn.functional.rms_norm(h, (x.shape[-1],), w, eps))
    else:
        torch.mul(h * torch.rsqrt(torch.mean(h * h, dim=-1, keepdim=True) + eps), w, out=out[0])
    return out


def reference_parts(inputs, attrs):
    """The user's code as written, returning (y, h) (forge bench compiles this for torch.compile and stacks
    the parts only to validate them: the out= spelling of `reference` makes Inductor functionalize and copy,
    2x the device time of its fused kernel on the H200, which would flatter forge)."""
    import torch

    x, r, w = inputs[:3]
    h = x + r
    eps = attrs["eps"]
    if _norm(attrs) == "layer_norm":
        return torch.nn.functional.layer_norm(h, (x.shape[-1],), w, inputs[3], eps), h
    if attrs.get("form") == "hf":
        hf = h.float()
        return w * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype), h
    if attrs.get("form") == "fused":
        return torch.nn.functional.rms_norm(h, (x.shape[-1],), w, eps), h
    return h * torch.rsqrt(torch.mean(h * h, dim=-1, keepdim=True) + eps) * w, h


def oracle(inputs, attrs):
    """float64, on chunks of rows: h = x + r rounded to the dtype (eager's h, exactly), y the norm of that
    h in float64 (with float64 w, b)."""
    x = inputs[0]
    n = x.shape[-1]
    rows = tuple(t.reshape(-1, n) for t in inputs[:2])

    def part(chunk):
        xc, rc, *wb = chunk
        h = (xc + rc).to(x.dtype).double()
        w = wb[0].double()
        if _norm(attrs) == "layer_norm":
            mean = h.mean(-1, keepdim=True)
            var = ((h - mean) ** 2).mean(-1, keepdim=True)
            y = (h - mean) / (var + attrs["eps"]).sqrt() * w + wb[1].double()
        else:
            y = h / (h * h).mean(-1, keepdim=True).add(attrs["eps"]).sqrt() * w
        import torch

        return torch.stack((y, h), dim=1)  # (rows, 2, n): chunks concatenate along the rows

    out = opkit.oracle_in_chunks(part, (*rows, *inputs[2:]), "rows")
    return out.transpose(0, 1).view(2, *x.shape)  # a view: the one float64 result, never copied


def alloc_output(inputs, spec: KernelSpec):
    import torch

    x = inputs[0]
    return torch.empty((2, *x.shape), dtype=x.dtype, device=x.device)


def run(module, inputs, out, attrs) -> None:
    x, r = inputs[:2]
    n = x.shape[-1]
    params = tuple(t.reshape(-1) for t in inputs[2:])  # w (rmsnorm); w, b (layer_norm)
    # out whole, (2, rows, n): the kernel writes y to its [0] and h to its [1] (at out.stride(0)), so every
    # tensor argument is an input or the output and forge/launch.py can replay it through the C launch path
    module.launch(x.reshape(-1, n), r.reshape(-1, n), *params, out.view(2, -1, n), attrs["eps"])


def space(spec: KernelSpec) -> opkit.Space:
    return opkit.capped_row_space(spec, MAX_ELEMS_PER_THREAD)


default = opkit.row_default  # <= 16 elements per thread: inside space()


def render_context(spec: KernelSpec, cand: opkit.Candidate) -> dict:
    ctx = opkit.row_render_context(spec, cand, NAME)
    ctx["LAYER"] = _norm(spec.attrs) == "layer_norm"
    # The interpreter truncates fp32 -> bf16 casts (the GPU rounds to nearest even): the CPU sources round
    # h first so that it is eager's x + r there too; CUDA sources are without it (their cast already rounds).
    ctx["ROUND_BF16"] = spec.inputs[0].dtype == "bfloat16" and spec.device != "cuda"
    # form="hf": the normalised value rounded to the output dtype before the weight multiplies it (HF's
    # half-precision LlamaRMSNorm); every other spec renders as before (tests/test_golden.py)
    ctx["round_before_weight"] = spec.attrs.get("form") == "hf"
    return ctx


def bytes_moved(spec: KernelSpec) -> int:
    x = spec.inputs[0]
    return 4 * x.nbytes + sum(t.nbytes for t in spec.inputs[2:])  # read x, r; write y, h


def flops(spec: KernelSpec) -> int:
    return (9 if _norm(spec.attrs) == "layer_norm" else 5) * spec.inputs[0].numel


# -- recognising add + norm in user code (forge/trace.py canonical forms) -----------------------
def _replace(e, old, new):
    if e == old:
        return new
    if isinstance(e, tuple) and e and isinstance(e[0], str) and e[0] not in ("const", "input"):
        return (e[0], *(_replace(a, old, new) for a in e[1:]))
    return e


def _adds(e, found: list) -> None:
    if not isinstance(e, tuple) or not e or not isinstance(e[0], str) or e[0] in ("const", "input"):
        return
    if e[0] == "add" and len(e) == 3 and all(a[0] == "input" for a in e[1:]) and e not in found:
        found.append(e)
    for a in e[1:]:
        _adds(a, found)


def _inputs(e, found: set) -> None:
    if isinstance(e, tuple) and e and e[0] == "input":
        found.add(e[1])
    elif isinstance(e, tuple) and e and isinstance(e[0], str) and e[0] != "const":
        for a in e[1:]:
            _inputs(a, found)


def match(expr) -> tuple[list, dict] | None:
    """(input indices [x, r, w or None(, b or None)], attrs) where `expr` is rmsnorm or layer_norm (over
    the last dim) of h = ("add", x, r), x and r leaves: the add is replaced by a fresh input and the norm's
    own matcher (kernels/rmsnorm.py, layer_norm.py) decides. forge/regions.py cuts the graph so that the
    add is inside the region (its inputs are leaves) where it is used again, by the next residual add."""
    adds: list = []
    _adds(expr, adds)
    if len(adds) != 1:
        return None
    add = adds[0]
    used: set = set()
    _inputs(expr, used)
    fresh = ("input", max(used) + 1)
    e = _replace(expr, add, fresh)
    other: set = set()
    _inputs(e, other)
    for norm in NORMS:
        res = (formulas.match_rmsnorm if norm == "rmsnorm" else formulas.match_layer_norm)(e)
        if res is None:
            continue
        picks, attrs = res
        # The norm's x must be h, its other inputs not h, and it must normalize the last dim only.
        if picks[0] != fresh[1] or fresh[1] in picks[1:]:
            return None
        extra = set(attrs) - {"eps", "form", "hf_dtype"}
        if extra:
            return None
        out = {"norm": norm, "eps": float(attrs["eps"])}
        if attrs.get("form") in ("fused", "hf"):
            out["form"] = attrs["form"]
        if "hf_dtype" in attrs:
            out["hf_dtype"] = attrs["hf_dtype"]
        return [add[1][1], add[2][1], *picks[1:]], out
    return None


def fill_missing(inputs: list, attrs: dict | None = None):
    """The norm's own fill (w = 1; layer_norm's b = 0) on h's shape: x stands in for h (same shape and dtype)."""
    import torch

    attrs = attrs or {}
    x, r, *params = inputs
    hf_dtype = attrs.get("hf_dtype")
    if hf_dtype is not None and str(x.dtype).removeprefix("torch.") != hf_dtype:
        raise ValueError(f"the normalised value is cast to {hf_dtype}, not to x's dtype {x.dtype}: another "
                         "computation than add_norm's")
    n = x.shape[-1:] if x.dim() else (1,)
    if _norm(attrs) == "layer_norm":
        w, b = (params + [None, None])[:2]
        w = torch.ones(n, dtype=x.dtype, device=x.device) if w is None else w
        b = torch.zeros(n, dtype=x.dtype, device=x.device) if b is None else b
        return (x, r, w, b)
    (w,) = (params + [None])[:1]
    return (x, r, torch.ones(n, dtype=x.dtype, device=x.device) if w is None else w)
