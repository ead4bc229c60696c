"""The forge backend on random programs (hypothesis): straight-line functions built from the pieces models are
made of (elementwise chains, GEMMs, softmax and norms forge matches as regions, views, masks built from
aranges, inference dropout, in-place writes into fresh tensors, into constants and into an input) run through
torch.compile(backend=forge) on CPU, three calls with fresh inputs each, against the same function run eagerly.

With miss="eager" and an empty cache every region runs its own nodes, so the backend's plan (region matching
and splitting, fold.simplify's constant folding and dropout removal, the guards) must not change a single bit:
the values are compared exactly. After each call the caller writes into everything it got back, so a folded
constant that was handed out, or any state carried between calls, would show on the next call."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import linecache  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from forge import backend as fb  # noqa: E402

# Every value is (2, 5, 5) float32, so any piece takes any earlier value. {a} and {b} are earlier values, {v}
# the new one; pieces of more than one statement use {t} for a temporary.
PIECES = (
    "{v} = {a} + {b}",
    "{v} = {a} * {b} - 0.5",
    "{v} = torch.tanh({a} @ {b})",  # a GEMM (bounded: chains of them stay finite)
    "{v} = F.gelu({a}, approximate='tanh')",
    "{v} = {a} * torch.sigmoid({a})",  # swish: a pointwise region
    "{v} = torch.softmax({a}, dim=-1)",  # a softmax region
    "{v} = {a} * torch.rsqrt({a}.pow(2).mean(-1, keepdim=True) + 1e-6)",  # rmsnorm's spelling
    "{v} = F.layer_norm({a}, (5,))",
    "{v} = {a}.transpose(-1, -2)",
    "{v} = {a}.reshape(2, 25).view(2, 5, 5)",
    "{v} = {a}.sum(-1, keepdim=True) + {b}",
    "{v} = torch.cat([{a}, {b}], dim=-1)[..., 3:8]",
    # masks and constants from literals alone: fold.simplify computes them once
    "{v} = torch.where(torch.ones(5, 5, dtype=torch.bool, device='cpu').tril(), {a}, torch.zeros((), device='cpu'))",
    "{v} = {a} + torch.arange(5, device='cpu').view(1, 1, 5).float()",
    "{v} = {a}.masked_fill(torch.arange(5, device='cpu').view(1, 5) > torch.arange(5, device='cpu').view(5, 1), "
    "-1e4)",
    "{v} = F.dropout({a}, 0.1, False, False)",
    # in-place writes: into a fresh tensor, into a literal-made one (never folded), through a view
    "{t} = {a}.clone(); {t}.mul_(1.5); {v} = {t} + {b}",
    "{t} = torch.zeros(5, 5, device='cpu'); {t}.add_({a}.sum()); {v} = {b} + {t}",
    "{t} = torch.ones(2, 5, 5, device='cpu'); {t}[:, 0] = {a}[:, 1]; {v} = {t} * {b}",
    "{t} = torch.arange(25, device='cpu').float().view(5, 5); {t}.transpose(0, 1).mul_(-1.0); {v} = {a} + {t}",
    "{v} = torch.arange(5, device='cpu').float().expand(2, 5, 5) * 1.0",  # literal-only, returned maybe
    # more of forge's families as models spell them
    "{v} = F.linear({a}, {b}[0], {b}[1, 0])",
    "{v} = F.scaled_dot_product_attention({a}.unsqueeze(1), {b}.unsqueeze(1), {a}.unsqueeze(1), is_causal=True)"
    ".squeeze(1)",
    "{v} = F.silu({a}) * {b}",
    "{t} = {a} + {b}; {v} = {t} * torch.rsqrt({t}.pow(2).mean(-1, keepdim=True) + 1e-6) + {t}",  # residual + norm
    "{v} = torch.log_softmax({a}, dim=-1)",
    "{v} = {a}.amax(-1, keepdim=True) + {b}",
    "{v} = F.layer_norm({a}, (5, 5))",
    "{v} = {a} @ {b}.transpose(-1, -2)",
    # a write between the nodes of one rmsnorm spelling: the mean of t before it, the product with t after it
    "{t} = {a}.clone(); {t}_s = {t}.pow(2).mean(-1, keepdim=True); {t}.mul_(2.0); "
    "{v} = {t} * torch.rsqrt({t}_s + 1e-6)",
    "{t} = {a}.clone(); {t}_s = torch.softmax({t}, -1); {t}.view(-1)[:7].mul_(-1.0); {v} = {t}_s * {t}",  # via a view
    "{t} = {a} * 1.0; {v} = torch.softmax({t}, -1); {v}.mul_(2.0)",  # a write into a region's output
    "{v} = {a} * (2.0 if float({b}.sum()) > 0 else -1.0)",  # data-dependent: a graph break, two graphs
)
WRITE_INPUT = "x.mul_(0.5)"  # an in-place write into the caller's tensor, as the first statement

_programs = st.tuples(
    st.lists(st.tuples(st.integers(0, len(PIECES) - 1), st.integers(0, 63), st.integers(0, 63)), min_size=1,
             max_size=7),
    st.integers(0, 63),  # which earlier value is returned beside the last one
    st.booleans(),  # whether the program writes into its input x first
)


def _source(program) -> str:
    steps, other, write_input = program
    names, lines = ["x", "y"], ["def f(x, y):"]
    if write_input:
        lines.append(f"    {WRITE_INPUT}")
    for k, (piece, ia, ib) in enumerate(steps):
        a, b = names[ia % len(names)], names[ib % len(names)]
        v = f"v{k}"
        lines.append("    " + PIECES[piece].format(v=v, a=a, b=b, t=f"t{k}"))
        names.append(v)
    lines.append(f"    return {names[-1]}, {names[other % len(names)]}")
    return "\n".join(lines) + "\n"


def _function(src: str, name: str):
    """f from src, with its source known to linecache (Dynamo reads it for messages)."""
    filename = f"<forge-program-{name}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    scope = {"torch": torch, "F": F}
    exec(compile(src, filename, "exec"), scope)
    return scope["f"]


def _check(program, tol: float):
    src = _source(program)
    f = _function(src, str(abs(hash(src))))
    torch._dynamo.reset()
    be = fb.Backend(miss="eager", interpreter=True)
    compiled = torch.compile(f, backend=be, dynamic=False)
    gen = torch.Generator().manual_seed(len(src))
    for call in range(3):
        x, y = torch.randn(2, 5, 5, generator=gen), torch.randn(2, 5, 5, generator=gen)
        xe, ye = x.clone(), y.clone()
        got, want = compiled(x, y), f(xe, ye)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=tol, atol=tol, equal_nan=True,
                                       msg=lambda m, c=call: f"call {c} of\n{src}\n{m}")
        torch.testing.assert_close(x, xe, rtol=tol, atol=tol, msg=lambda m: f"the input x after\n{src}\n{m}")
        for g in got:  # the caller owns what it got: writing into it must not reach a later call
            g.add_(1000.0)
    torch._dynamo.reset()
    return be


# ~0.2 s an example on the 2-core CPU machine (a Dynamo compile and three calls)
@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(_programs)
def test_a_random_program_through_the_backend_is_bit_for_bit_eager(program):
    """Every region a cache miss: each runs its own nodes, so not one bit may change."""
    _check(program, tol=0.0)


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(_programs)
def test_a_random_program_with_every_region_swapped_is_eager(program):
    """Every region the backend matches swapped for a stand-in kernel (the op family's own reference:
    tests/test_backend.py _fake_resolve), so the swap, its guards and the graph's clean-up run on every program;
    values within float32 rounding of the user's spelling."""
    from forge import shim
    from tests.test_backend import _fake_resolve

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(shim, "resolve", _fake_resolve([]))
        _check(program, tol=1e-4)


def test_the_swapped_programs_do_swap():
    """The stand-in kernels of the test above run (a softmax, an rmsnorm and the swish as a pointwise region here),
    and an in-place write beside them (a clone scaled by mul_) is kept."""
    from forge import shim
    from tests.test_backend import _fake_resolve

    calls: list = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(shim, "resolve", _fake_resolve(calls))
        be = _check(([(5, 0, 0), (6, 2, 0), (16, 3, 1), (4, 4, 0)], 0, True), tol=1e-4)
    assert sorted(set(calls)) == ["pointwise", "rmsnorm", "softmax"], calls
    assert len(be.kernel_calls) == 3


def test_the_program_generator_builds_what_it_says():
    src = _source(([(0, 0, 1), (16, 2, 0), (20, 0, 0)], 1, True))
    assert src == ("def f(x, y):\n"
                   "    x.mul_(0.5)\n"
                   "    v0 = x + y\n"
                   "    t1 = v0.clone(); t1.mul_(1.5); v1 = t1 + x\n"
                   "    v2 = torch.arange(5, device='cpu').float().expand(2, 5, 5) * 1.0\n"
                   "    return v2, y\n")
    f = _function(src, "generator")
    x, y = torch.randn(2, 5, 5), torch.randn(2, 5, 5)
    x0 = x.clone()
    out, same_y = f(x, y)
    assert same_y is y and torch.equal(x, x0 * 0.5)
    assert torch.equal(out, torch.arange(5).float().expand(2, 5, 5))
