"""Torch's own fused op per op family: a candidate of every search and a decision the runtime serves.

Issue 14: the decision for a spec is the fastest correct of (1) the user's code as written (the op's
`reference`, which follows the spelling the matcher saw: the attribute `form`), (2) torch's single fused
op computing the same thing (this table; validated against the float64 oracle like any candidate) and
(3) forge's kernels. Where torch's op wins, the cache says decision "torch": the shim and the TorchDynamo
backend then run that op in place of the user's formula (MinGPT's eight-kernel tanh-GELU becomes one
F.gelu call), and `forge bench` times it as forge's contestant.

`same_as_eager(attrs)` says when a spec's reference already is this call (timing it again would only
measure noise: it is not a candidate then, and bench reports it "same as eager"). Every op in kernels/ has
an entry, a Fused or the reason there is none (tests/test_bench_cmd.py checks it).

Runtime layer (docs/adr/0002-layers.md): the shim calls these at run time; the tuner's search and bench
read the same table. Each `fn(inputs, attrs)` takes the op's inputs in the op's order (what `reference`
takes) and returns a new tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# The candidate (variant) name of torch's op in a search and in a cache entry's candidates.
TORCH_OP_VARIANT = "torch"


@dataclass(frozen=True)
class Fused:
    label: str
    fn: Callable[[tuple, dict], Any]
    same_as_eager: Callable[[dict], bool] = lambda attrs: False
    # Where torch's best call depends on the spec's attributes (linear: cuBLASLt's bias + activation epilogue
    # where it applies): the Fused for these attrs. The label names the call, and a cached "torch" decision
    # is served only by the call whose label it recorded (forge/shim.py).
    for_attrs: Callable[[dict], Fused] | None = None
    # Where the call differs from eager only for some shapes or layouts (matmul: operands with misaligned rows,
    # copied into aligned ones first; elsewhere it is torch.matmul itself): whether it does for a spec.
    differs_for: Callable[[Any], bool] | None = None

    def pick(self, attrs: dict) -> Fused:
        return self.for_attrs(attrs) if self.for_attrs is not None else self

    def is_eager_call(self, attrs: dict, spec=None) -> bool:
        """Whether the spec's eager reference already is this call (then it is no candidate, and bench reports
        it "same as eager"): by the attributes, and for a Fused with differs_for, by the spec."""
        if self.same_as_eager(attrs):
            return True
        return spec is not None and self.differs_for is not None and not self.differs_for(spec)


def _always(attrs: dict) -> bool:
    """The op's reference is this call for every spec."""
    return True


def _f():
    import torch.nn.functional as F

    return F


def _torch():
    import torch

    return torch


def _reduce(inputs, attrs):
    torch = _torch()
    fn = {"sum": torch.sum, "mean": torch.mean, "amax": torch.amax, "amin": torch.amin, "argmax": torch.argmax,
          "argmin": torch.argmin}[attrs["kind"]]
    return fn(inputs[0], dim=attrs.get("dim", -1), keepdim=attrs["keepdim"])


def _sdpa(inputs, attrs):
    q, k, v = inputs
    kwargs = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
    return _f().scaled_dot_product_attention(q, k, v, is_causal=attrs["causal"], scale=attrs["scale"], **kwargs)


# Storage rows and the output's N padded to 128 bytes, Inductor's padding_alignment_bytes. cuBLAS picks an
# align1 kernel when an operand's or the output's rows are not 16-byte aligned: GPT-2's lm_head (N = 50257)
# took 4.4 ms in eager, 3.5 ms with the weight copied transposed and its rows padded but the output's rows
# still odd (h200-models-2026-12-04-g.json's cache), and 0.57 ms of cuBLAS + a 47 µs padded weight copy
# under Inductor (h200-models-2026-12-04-c.json's compile profile).
_PAD_BYTES = 128


def _pad_to(n: int, elem: int) -> int:
    per = max(1, _PAD_BYTES // elem)
    return -(-n // per) * per


def _other_order(w, n_dim: int | None = None, n_to: int | None = None):
    """w (2-D) stored in the other order (w.t() row-major) with its storage rows padded to _PAD_BYTES; with
    n_dim/n_to, dim n_dim extended to n_to with zeros. A view of w's shape (or the extended one)."""
    import torch

    shape = list(w.shape)
    if n_dim is not None:
        shape[n_dim] = n_to
    rows, cols = shape[1], shape[0]  # the storage of the result's transpose: rows x cols, row-major
    buf = torch.empty((rows, _pad_to(cols, w.element_size())), dtype=w.dtype, device=w.device)[:, :cols]
    view = buf.t()
    if n_dim is not None and n_to > w.shape[n_dim]:
        view.narrow(n_dim, w.shape[n_dim], n_to - w.shape[n_dim]).zero_()
    view.narrow(0, 0, w.shape[0]).narrow(1, 0, w.shape[1]).copy_(w)
    return view


def _matmul_aligned(inputs, attrs):
    """torch.matmul (cuBLAS) on copies of the operands whose rows are not 16-byte aligned, as Inductor's pad_mm
    makes them: K and N padded to 16 bytes with zeros (the GEMM's shape grows by less than 16 bytes a row), the
    copies' storage rows to _PAD_BYTES, each copy one constant-pad kernel; the output's first N columns copied
    out contiguous where N was padded. On the H100, 8205x2949x5921 bf16 took 2144 µs in eager (cuBLAS's
    align-1 kernels) and 476 µs under torch.compile (bench/results/h100-peers-gemm-padded-bench-2026-12-06.json);
    this call, when it padded K and N to 128 bytes (5952, 3008) with an empty buffer, a zero fill and a strided
    copy per operand, 604 µs (h100-peers-tma-bench-2026-12-07.json), where Inductor's log of the same call showed
    cuBLAS on mm(8208x5928, 5928x2952). A non-contiguous operand (a layout whose stride is misaligned:
    kernels/matmul.py misaligned) is copied too; aligned contiguous ones are used as they are."""
    torch = _torch()
    pad = torch.nn.functional.pad
    a, b = inputs
    k, n, e = a.shape[-1], b.shape[-1], a.element_size()
    per16 = max(1, 16 // e)
    kp, np_ = -(-k // per16) * per16, -(-n // per16) * per16
    if kp != k:  # A's K tail zero (B's rows past K are zero too: their products add nothing)
        a = pad(a, (0, _pad_to(kp, e) - k))[..., :kp]
    elif not a.is_contiguous():
        a = a.contiguous()
    if kp != k or np_ != n:  # B's columns past N are zero: the output's extra columns are never kept
        b = pad(b, (0, _pad_to(np_, e) - n, 0, kp - k))[..., :np_]
    elif not b.is_contiguous():
        b = b.contiguous()
    out = torch.matmul(a, b)
    return out[..., :n].contiguous() if np_ != n else out


def _matmul_misaligned(spec) -> bool:
    from forge import ops

    return ops.get("matmul").module.misaligned(spec)


def _linear_other_layout(inputs, attrs):
    """The user's calls (F.linear / addmm, then the epilogue as written: kernels/linear.py reference) on the
    weight copied into the other storage order with aligned rows (_other_order): the same values, cuBLAS
    then picks its kernel for that layout. Where the output's rows would not be 16-byte aligned (an odd N),
    the weight and bias are extended with zero columns to an aligned N, the epilogue (elementwise) runs on
    the wide result, and its first N columns are copied out contiguous (the residual added there): the
    output is eager's layout. The copies are part of every call, so the search's timing includes them;
    where the layout does not matter the candidate loses."""
    import torch

    from forge import ops

    ref = ops.get("linear").module.reference
    x, w = inputs[0], inputs[1]
    nk = attrs["weight"] == "nk"
    n = w.shape[0] if nk else w.shape[1]
    if (n * w.element_size()) % 16 == 0:
        return ref((x, _other_order(w), *inputs[2:]), attrs)
    n_pad = _pad_to(n, w.element_size())
    has_b = attrs.get("bias", "none") != "none"
    parts = [x, _other_order(w, 0 if nk else 1, n_pad)]
    if has_b:
        b = inputs[2]
        parts.append(torch.nn.functional.pad(b, (0, n_pad - b.shape[-1])) if b.shape[-1] == n else b)
    y = ref(tuple(parts), {**attrs, "residual": False})[..., :n]
    return y + inputs[2 + has_b] if attrs.get("residual") else y.contiguous()


def _linear_act_epilogue(inputs, attrs):
    """torch._addmm_activation: cuBLASLt's GEMM with the bias and relu or tanh-GELU applied to the fp32
    accumulator (its RELU_BIAS / GELU_BIAS epilogues; where cuBLASLt cannot take the call, torch's CUDA code
    runs addmm then relu_ or gelu_(approximate="tanh"): the same function), on x's rows flattened and viewed
    back; the residual added after it. On CUDA only: torch's CPU _addmm_activation applies the erf GELU, so
    there the same function is spelled as addmm, then F.gelu(approximate="tanh"). That cuBLASLt's
    GELU is the tanh one is checked on the GPU (tests/test_gpu.py) in fp32 and bf16."""
    import torch

    x, w = inputs[0], inputs[1]
    k = x.shape[-1]
    wt = w.t() if attrs["weight"] == "nk" else w
    gelu = attrs["activation"] == "gelu_tanh"
    if x.is_cuda or not gelu:
        y = torch._addmm_activation(inputs[2], x.reshape(-1, k), wt, use_gelu=gelu)
    else:
        y = torch.nn.functional.gelu(torch.addmm(inputs[2], x.reshape(-1, k), wt), approximate="tanh")
    y = y.view(*x.shape[:-1], wt.shape[1])
    return y + inputs[3] if attrs.get("residual") else y


def _linear_epilogue_fits(attrs: dict) -> bool:
    """cuBLASLt's epilogue computes act(x @ W^T + b): a bias (F.linear's or added after) and relu or the tanh
    GELU, no scale in between (a residual comes after the activation: added separately)."""
    return (attrs.get("bias", "none") != "none" and attrs.get("activation") in ("relu", "gelu_tanh")
            and "scale" not in attrs)


_LINEAR_EPILOGUE = Fused("torch._addmm_activation (cuBLASLt bias + activation epilogue)", _linear_act_epilogue)


def _trailing(x, attrs: dict) -> tuple:
    """The normalized trailing shape of a norm spec (attribute dims: how many trailing dims, default 1)."""
    return tuple(x.shape[x.dim() - int(attrs.get("dims", 1)):])


def _rms_norm(inputs, attrs):
    x, w = inputs
    return _f().rms_norm(x, _trailing(x, attrs), w, attrs["eps"])


def _rms_norm_is_eager(attrs: dict) -> bool:
    # F.rms_norm normalizes trailing dims only: over one other dim (attribute dim, NCHW's C) it is no
    # candidate, as where the user called it (form="fused") and it already is the baseline.
    return attrs.get("form") == "fused" or attrs.get("dim", -1) != -1


FUSED: dict[str, Fused | str] = {
    # rmsnorm's reference is the formula as users write it (5 kernels in eager) unless the user called
    # F.rms_norm / nn.RMSNorm themselves (form="fused").
    "rmsnorm": Fused("F.rms_norm", _rms_norm, same_as_eager=_rms_norm_is_eager),
    "softmax": Fused("torch.softmax", lambda i, a: _torch().softmax(i[0], -1), same_as_eager=_always),
    "log_softmax": Fused("F.log_softmax", lambda i, a: _f().log_softmax(i[0], -1), same_as_eager=_always),
    "layer_norm": Fused("F.layer_norm", lambda i, a: _f().layer_norm(i[0], _trailing(i[0], a), i[1], i[2], a["eps"]),
                        same_as_eager=_always),
    # gelu's reference is F.gelu unless the matcher saw the written-out erf or tanh formula (form="formula").
    "gelu": Fused("F.gelu", lambda i, a: _f().gelu(i[0], approximate=a["approximate"]),
                  same_as_eager=lambda a: a.get("form") != "formula"),
    # torch has no fused silu-and-multiply: F.silu(a) * b (two kernels) is the best torch spelling; it is
    # a candidate where the user wrote a * sigmoid(a) * b (form="formula", three or four kernels).
    "silu_mul": Fused("F.silu(a) * b", lambda i, a: _f().silu(i[0]) * i[1],
                      same_as_eager=lambda a: a.get("form") != "formula"),
    # the user's call unless it passed the causal rule as a mask tensor or repeated k/v first (form "mask" /
    # "repeat", kernels/sdpa.py): then F.sdpa(is_causal=..., enable_gqa) on the unrepeated q, k, v is a candidate
    # (torch can use its flash backend, and reads k/v once per group)
    "sdpa": Fused("F.scaled_dot_product_attention", _sdpa,
                  same_as_eager=lambda attrs: attrs.get("form") not in ("mask", "repeat")),
    # torch.matmul is the user's call; where an operand's rows are misaligned, torch.matmul on aligned copies is
    # a candidate (Inductor's pad_mm)
    "matmul": Fused("torch.matmul on copies with 16-byte aligned rows (Inductor's pad_mm)", _matmul_aligned,
                    differs_for=_matmul_misaligned),
    "cross_entropy": Fused("F.cross_entropy", lambda i, a: _f().cross_entropy(
        i[0], i[1], ignore_index=a["ignore_index"], reduction=a["reduction"]), same_as_eager=_always),
    "reduce": Fused("torch.sum / mean / amax / argmax", _reduce, same_as_eager=_always),
    "rope": "torch has no fused rotary-embedding op",
    "add_norm": "torch has no fused residual-add-and-norm op (the reference: torch.add, then the norm's kernels)",
    # A bias with relu or the tanh GELU: cuBLASLt's epilogue (torch._addmm_activation). Otherwise torch has no
    # GEMM with a fused epilogue beyond F.linear's bias: the candidate is the user's own calls on the weight
    # in the other storage order (cuBLAS's kernel choice depends on it).
    "linear": Fused("F.linear / addmm on the weight transposed in memory, rows padded to 128 B", _linear_other_layout,
                    for_attrs=lambda a: _LINEAR_EPILOGUE if _linear_epilogue_fits(a) else FUSED["linear"]),
    "swiglu": "torch has no fused SwiGLU op (the reference: two F.linear, then F.silu(g) * u)",
    "pointwise": "torch has no single op for an arbitrary elementwise chain (torch.compile generates one: a bench "
                 "contestant)",
    "cat": "the user's torch.cat is torch's op itself (the baseline)",
}


def get(op: str, attrs: dict | None = None) -> Fused | str:
    """The op's fused torch op (for a spec with these attributes, where given), or why there is none."""
    f = FUSED.get(op, f"no fused torch op is listed for {op} (forge/fused.py)")
    return f.pick(attrs) if attrs is not None and isinstance(f, Fused) else f


def candidate(op: str, attrs: dict, spec=None) -> Fused | None:
    """The fused op as a search candidate for a spec with these attributes: None when there is none or
    when the spec's eager reference already is that call (Fused.is_eager_call: by the spec too, where given)."""
    f = get(op, attrs)
    if isinstance(f, str) or f.is_eager_call(attrs, spec):
        return None
    return f


def timed_other_call(candidates: list, f: Fused) -> str | None:
    """Why a cached "torch" decision may not be served by `f`: the torch-op candidate its search timed (its
    candidates' summaries) had another label, i.e. another call (forge/fused.py changed since). None where it
    is f's call or no label was recorded."""
    for c in candidates or ():
        if isinstance(c, dict) and c.get("variant") == TORCH_OP_VARIANT and c.get("label"):
            if c["label"] != f.label:
                return (f"the cached decision is the torch op {c['label']!r}, but this forge's torch op for these "
                        f"attributes is {f.label!r}")
            return None
    return None
