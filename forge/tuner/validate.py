"""Correctness gate: a candidate is timed only after it matches the float64 oracle on fresh seeded
inputs from several distributions, with its output poisoned (NaN) beforehand so that any element it
fails to write is caught. NaN never passes."""

from __future__ import annotations

import math

from forge.fused import TORCH_OP_VARIANT  # noqa: F401 - re-exported: the engine's torch-op candidate
from forge.opkit import DISTRIBUTIONS, Tolerance


class CandidateRaised(Exception):
    """The candidate's own code (its launch or kernel) raised; `__cause__` holds the original."""


# The "path" of the torch-op candidate (forge/fused.py): not a rendered file; workers run torch's fused op
# for it, validated and timed like any candidate.
TORCH_OP_PATH = "<torch op>"


def run_call(call, inputs, sync):
    """Run a candidate given as a call (inputs -> a new tensor: torch's fused op) once; its exceptions are
    the candidate's failure."""
    try:
        out = call(inputs)
        sync()
    except Exception as exc:  # noqa: BLE001 - torch's op may raise anything for a spec it cannot take
        raise CandidateRaised(str(exc)) from exc
    return out


def run_candidate(opmod, module, inputs, out, attrs, sync) -> None:
    """Run the candidate once. Anything it raises is the candidate's failure, not forge's."""
    try:
        opmod.run(module, inputs, out, attrs)
        sync()
    except Exception as exc:  # noqa: BLE001 - candidate code may raise anything; we classify it
        raise CandidateRaised(str(exc)) from exc


# Elements compare() takes at once: its float64 copies, differences, bounds and masks of one chunk take
# ~COMPARE_BYTES_PER_ELEMENT each, ~0.5 GiB per chunk, whatever the size of the output.
COMPARE_CHUNK = 1 << 23
COMPARE_BYTES_PER_ELEMENT = 64


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    idx = []
    for size in reversed(shape):
        idx.append(flat % size)
        flat //= size
    return tuple(reversed(idx))


def compare(out, ref, tol: Tolerance) -> str | None:
    """None if `out` matches `ref` within `tol`, else a one-line reason.

    Chunk by chunk over the flattened tensors (COMPARE_CHUNK elements), on the device that produced them
    (copying 100M+ elements to the host took seconds), so its float64 temporaries stay bounded; the
    verdict and the message are those of the whole tensors: NaN in the output first, then NaN in the
    reference, then mismatched infinities, then the norm-wise and element-wise bounds over the finite
    reference values."""
    import torch

    if tuple(out.shape) != tuple(ref.shape):
        return f"shape {tuple(out.shape)} != expected {tuple(ref.shape)}"
    shape = tuple(out.shape)
    numel = out.numel()
    out_flat, ref_flat = out.detach().reshape(-1), ref.detach().reshape(-1)
    chunks = range(0, numel, COMPARE_CHUNK)
    if not out.dtype.is_floating_point:  # indices (argmax): exact, no tolerance
        n_wrong, first = 0, None
        for s in chunks:
            o = out_flat[s:s + COMPARE_CHUNK]
            r = ref_flat[s:s + COMPARE_CHUNK].to(device=o.device, dtype=o.dtype)
            wrong = o != r
            k = int(wrong.sum())
            if k and first is None:
                i = int(wrong.nonzero()[0])
                first = (_unravel(s + i, shape), o[i].item(), r[i].item())
            n_wrong += k
        if first is not None:
            idx, got, want = first
            return (f"{n_wrong} of {numel} elements differ (integer output, exact match "
                    f"required; e.g. at {idx}: got {got}, expected {want})")
        return None
    n_nan, first_nan, ref_nan, inf_bad = 0, None, False, None
    diff_sq = ref_sq = 0.0
    n_bad, worst, first_bad = 0, 0.0, None
    for s in chunks:
        o = out_flat[s:s + COMPARE_CHUNK].to(torch.float64)
        r = ref_flat[s:s + COMPARE_CHUNK].to(device=o.device, dtype=torch.float64)
        nan = torch.isnan(o)
        k = int(nan.sum())
        if k and first_nan is None:
            first_nan = s + int(nan.nonzero()[0])
        n_nan += k
        if n_nan or ref_nan:
            continue  # the verdict is decided; only the output's NaN count still grows
        if torch.isnan(r).any():
            ref_nan = True
            continue
        if inf_bad is not None:
            continue
        # Infinities must match exactly (e.g. an op whose true result overflows); finite values by tolerance.
        inf_mismatch = (torch.isinf(o) | torch.isinf(r)) & (o != r)  # +inf vs -inf is a mismatch too
        if inf_mismatch.any():
            i = int(inf_mismatch.nonzero()[0])
            inf_bad = (s + i, o[i].item(), r[i].item())
            continue
        finite = torch.isfinite(r)
        o, r = o[finite], r[finite]
        err = (o - r).abs()
        diff_sq += float(torch.sum(err * err))
        ref_sq += float(torch.sum(r * r))
        bad = err > tol.atol + tol.rtol * r.abs()
        k = int(bad.sum())
        if k and first_bad is None:
            i = int(bad.nonzero()[0])
            first_bad = (o[i].item(), r[i].item())
        n_bad += k
        if err.numel():
            worst = max(worst, float(err.max()))
        del o, r, nan, err, bad, finite
    if n_nan:
        return f"NaN in output ({n_nan} of {numel} elements, first at {_unravel(first_nan, shape)})"
    if ref_nan:
        return "the oracle produced NaN: these inputs are outside the op's domain (a bug in the op file)"
    if inf_bad is not None:
        i, got, want = inf_bad
        return f"infinity mismatch at {_unravel(i, shape)}: got {got}, expected {want}"
    rel = math.sqrt(diff_sq) / max(math.sqrt(ref_sq), 1e-300)
    if rel > tol.rel_norm:
        return f"relative error {rel:.3g} > {tol.rel_norm:g}"
    if n_bad:
        got, want = first_bad
        return (f"{n_bad} elements outside atol={tol.atol:g} rtol={tol.rtol:g} "
                f"(worst |err| {worst:.3g}; e.g. got {got:.6g}, expected {want:.6g})")
    return None


def poison(out) -> None:
    """Fill an output buffer with values no correct kernel leaves there: NaN, or the most negative
    integer for index outputs (an index is never negative)."""
    import torch

    if out.dtype.is_floating_point:
        out.fill_(float("nan"))
    else:
        out.fill_(torch.iinfo(out.dtype).min)


def check_candidate(opmod, module, spec, seed: int, sync, call=None) -> str | None:
    """Run `module` (or `call`: inputs -> a new tensor, for torch's fused op) on every distribution; return
    None if all pass, else the first failure's reason.

    The candidate's exceptions arrive as CandidateRaised; forge's own (inputs, oracle) propagate."""
    import torch

    # An op whose error grows with the problem (matmul: with K) gives a spec-exact tolerance.
    tol = opmod.tolerance_for(spec) if hasattr(opmod, "tolerance_for") else opmod.tolerance(spec.dtype)
    for i, dist in enumerate(DISTRIBUTIONS):
        inputs = opmod.make_inputs(spec, seed + 1000 * i, dist)
        if call is None:
            out = opmod.alloc_output(inputs, spec)
            poison(out)
            run_candidate(opmod, module, inputs, out, spec.attrs, sync)
        else:
            out = run_call(call, inputs, sync)
        with torch.no_grad():
            ref = opmod.oracle(inputs, spec.attrs)
        reason = compare(out, ref, tol)
        # Freed before the next distribution's inputs are made: one distribution's tensors at a time.
        del inputs, out, ref
        if reason is not None:
            return f"{dist} inputs: {reason}"
    return None
