"""Render a candidate's Triton source from its op's Jinja2 template.

StrictUndefined: a template that names a variable the op did not provide is a bug in forge, and
must fail loudly rather than render an empty string into kernel code.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jinja2

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


def render(op: OpFamily, spec: KernelSpec, cand: Candidate) -> str:
    if cand.variant not in op.module.TEMPLATES:
        raise ValueError(f"op {op.name} has no variant {cand.variant!r}")
    ctx = op.module.render_context(spec, cand)
    template = _environment(op.template_dir).get_template(op.module.TEMPLATES[cand.variant])
    header = (f"# forge candidate: op={op.name} variant={cand.variant} params={cand.p}\n"
              f"# spec: {spec.canonical()}\n")
    return header + template.render(**ctx)
