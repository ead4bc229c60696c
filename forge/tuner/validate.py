"""Correctness gate: a candidate is timed only after it matches the float64 oracle on fresh seeded
inputs from several distributions, with its output poisoned (NaN) beforehand so that any element it
fails to write is caught. NaN never passes."""

from __future__ import annotations

from forge.opkit import DISTRIBUTIONS, Tolerance


class CandidateRaised(Exception):
    """The candidate's own code (its launch or kernel) raised; `__cause__` holds the original."""


def run_candidate(opmod, module, inputs, out, attrs, sync) -> None:
    """Run the candidate once. Anything it raises is the candidate's failure, not forge's."""
    try:
        opmod.run(module, inputs, out, attrs)
        sync()
    except Exception as exc:  # noqa: BLE001 - candidate code may raise anything; we classify it
        raise CandidateRaised(str(exc)) from exc


def compare(out, ref, tol: Tolerance) -> str | None:
    """None if `out` matches `ref` within `tol`, else a one-line reason."""
    import torch

    if tuple(out.shape) != tuple(ref.shape):
        return f"shape {tuple(out.shape)} != expected {tuple(ref.shape)}"
    if not out.dtype.is_floating_point:  # indices (argmax): exact, no tolerance
        r = ref.detach().to(device=out.device, dtype=out.dtype)
        wrong = out != r
        if wrong.any():
            idx = tuple(int(i) for i in wrong.nonzero()[0])
            return (f"{int(wrong.sum())} of {out.numel()} elements differ (integer output, exact match "
                    f"required; e.g. at {idx}: got {out[idx].item()}, expected {r[idx].item()})")
        return None
    # Compared on the device that produced them: copying 100M+ elements to the host took seconds.
    o = out.detach().to(torch.float64)
    r = ref.detach().to(device=o.device, dtype=torch.float64)
    nan = torch.isnan(o)
    if nan.any():
        idx = tuple(int(i) for i in nan.nonzero()[0])
        return f"NaN in output ({int(nan.sum())} of {o.numel()} elements, first at {idx})"
    # Infinities must match exactly (e.g. an op whose true result overflows); finite values by tolerance.
    if torch.isnan(r).any():
        return "the oracle produced NaN: these inputs are outside the op's domain (a bug in the op file)"
    inf_mismatch = (torch.isinf(o) | torch.isinf(r)) & (o != r)  # +inf vs -inf is a mismatch too
    if inf_mismatch.any():
        idx = tuple(int(i) for i in inf_mismatch.nonzero()[0])
        return f"infinity mismatch at {idx}: got {o[idx].item()}, expected {r[idx].item()}"
    finite = torch.isfinite(r)
    o, r = o[finite], r[finite]
    err = (o - r).abs()
    ref_norm = float(torch.linalg.vector_norm(r))
    rel = float(torch.linalg.vector_norm(o - r)) / max(ref_norm, 1e-300)
    if rel > tol.rel_norm:
        return f"relative error {rel:.3g} > {tol.rel_norm:g}"
    bound = tol.atol + tol.rtol * r.abs()
    bad = err > bound
    if bad.any():
        i = int(bad.nonzero()[0])
        return (f"{int(bad.sum())} elements outside atol={tol.atol:g} rtol={tol.rtol:g} "
                f"(worst |err| {float(err.max()):.3g}; e.g. got {o[i].item():.6g}, expected {r[i].item():.6g})")
    return None


def poison(out) -> None:
    """Fill an output buffer with values no correct kernel leaves there: NaN, or the most negative
    integer for index outputs (an index is never negative)."""
    import torch

    if out.dtype.is_floating_point:
        out.fill_(float("nan"))
    else:
        out.fill_(torch.iinfo(out.dtype).min)


def check_candidate(opmod, module, spec, seed: int, sync) -> str | None:
    """Run `module` on every distribution; return None if all pass, else the first failure's reason.

    The candidate's exceptions arrive as CandidateRaised; forge's own (inputs, oracle) propagate."""
    import torch

    # An op whose error grows with the problem (matmul: with K) gives a spec-exact tolerance.
    tol = opmod.tolerance_for(spec) if hasattr(opmod, "tolerance_for") else opmod.tolerance(spec.dtype)
    for i, dist in enumerate(DISTRIBUTIONS):
        inputs = opmod.make_inputs(spec, seed + 1000 * i, dist)
        out = opmod.alloc_output(inputs, spec)
        poison(out)
        run_candidate(opmod, module, inputs, out, spec.attrs, sync)
        with torch.no_grad():
            ref = opmod.oracle(inputs, spec.attrs)
        reason = compare(out, ref, tol)
        if reason is not None:
            return f"{dist} inputs: {reason}"
    return None
