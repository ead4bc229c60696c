"""Render a candidate's Triton source from its op's Jinja2 template.

StrictUndefined: a template that names a variable the op did not provide is a bug in forge, and
must fail loudly rather than render an empty string into kernel code.

Templates paste param values verbatim into Python source, so render() refuses any param value that is
not a plain int, bool or finite float (`type(v)` exactly: no str, no subclass): a string such as
"__import__('os').system(...) or 32" must never become kernel code. Whether the values are points of
the op's space is checked where entries are loaded (forge/key.py verify_entry), not here: tests render
candidates outside space() on purpose.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jinja2

from forge.key import plain_param
from forge.opkit import Candidate
from forge.ops import OpFamily
from forge.spec import KernelSpec


@functools.lru_cache(maxsize=32)
def _environment(template_dir: Path) -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(template_dir)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,  # noqa: S701 - we render Python source, not HTML
    )


def check_params(op: OpFamily, cand: Candidate) -> None:
    """ValueError naming the first param of `cand` whose value is not a plain number."""
    for name, value in cand.params:
        if not plain_param(value):
            shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
            raise ValueError(f"op {op.name} variant {cand.variant}: param {name}={shown} is a "
                             f"{type(value).__name__}, not a plain int, float or bool; refused (templates paste "
                             "param values into the kernel source)")


def render(op: OpFamily, spec: KernelSpec, cand: Candidate) -> str:
    if not isinstance(cand.variant, str) or cand.variant not in op.module.TEMPLATES:
        raise ValueError(f"op {op.name} has no variant {cand.variant!r}")
    check_params(op, cand)
    ctx = op.module.render_context(spec, cand)
    template = _environment(op.template_dir).get_template(op.module.TEMPLATES[cand.variant])
    header = (f"# forge candidate: op={op.name} variant={cand.variant} params={cand.p}\n"
              f"# spec: {spec.canonical()}\n")
    return header + template.render(**ctx)
