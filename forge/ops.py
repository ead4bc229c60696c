"""The op-family registry: every `kernels/<op>.py` (plus directories on $FORGE_OPS_PATH) is one op.

Op modules are loaded by file path under the name `forge_ops.<op>`, never as a top-level package
named `kernels` (that would shadow Hugging Face's `kernels`, an export target).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from forge import opkit
from forge.errors import UsageError, shown
from forge.spec import same_layout

_PKG = Path(__file__).resolve().parent

# The contract of an op module (kernels/<op>.py, or <dir>/<op>.py for a dir on $FORGE_OPS_PATH).
#
# Required: no default; a module that lacks one fails to load, naming what it lacks.
#   NAME                                    the op's name, equal to the file's stem
#   TEMPLATES                               variant -> template file name (in the templates dir)
#   DEFAULT_ATTRS                           the attributes a spec gets when the caller names none
#   make_spec(shape, dtype, device, attrs)  -> KernelSpec (ValueError, with the reason, for what it refuses)
#   make_inputs(spec, seed, distribution)   -> tuple of seeded test tensors
#   reference(inputs, attrs)                the eager baseline, as a user writes it
#   alloc_output(inputs, spec), run(module, inputs, out, attrs)
#                                           the launch glue; defined in the op file itself, never taken from
#                                           elsewhere: `forge export` copies both verbatim (with what they
#                                           use) into a module that runs without forge (forge/tuner/export.py)
#   space(spec) -> opkit.Space, default(spec) -> opkit.Candidate, render_context(spec, cand) -> dict
#   bytes_moved(spec), flops(spec)          the work one call does (forge/tuner/bench/roofline.py)
#
# Optional, with a default: _load installs the default on the module object when the op file does not
# define the name, so every caller reads op.module.<name> alike; an op file's own definition wins.
#   fill_missing(inputs) -> tuple           inputs the user's code left out, filled in (rmsnorm's weight of
#                                           ones); default: none left out, tuple(inputs). An op that sets
#                                           FILL_MISSING_ATTRS = True is called fill_missing(inputs, attrs)
#                                           with the matcher's attrs (fill_inputs below): the shape of what it
#                                           fills in, or of the weight it reshapes, depends on them (rmsnorm
#                                           over dim=1 of NCHW: a weight of shape (C, 1, 1))
#   oracle(inputs, attrs)                   the correctness reference; default: reference() run on float64
#                                           copies of the floating-point inputs (integer inputs, such as
#                                           class indices, as they are), chunk by chunk as ORACLE_CHUNK says.
#                                           Ops override it where that is not the best answer: rounded once
#                                           to the output dtype (gelu, silu_mul, reduce), inf where the output
#                                           dtype overflows (cross_entropy), written out apart from torch's
#                                           dispatch (sdpa); their own oracles bound their memory likewise
#
# Optional declarations, read where present:
#   ORACLE_CHUNK = "rows" | "elements" | "matmul"   how the default oracle may cut the inputs so that its
#                                            float64 working set stays bounded (opkit.oracle_in_chunks: rows
#                                            over the leading dims for row and broadcast ops, the flattened
#                                            elements for elementwise ops, blocks of A's rows x B's columns
#                                            for matmul). Absent: the reference runs on the whole inputs (an
#                                            op whose reference mixes rows, e.g. a mean over all of them)
#   tolerance(dtype) -> opkit.Tolerance     default: opkit.ROW_TOLERANCE[dtype] (the output's rounding plus
#                                           a few fp32 ulp)
#
# Optional hooks, used where present:
#   match(expr) -> ([input index or None, ...], attrs) | None   recognise the op in a trace (forge/trace.py forms)
#   GENERIC = True                           the matcher overlaps specific families' (pointwise: any elementwise
#                                            chain): tried after every other family (match_order)
#   problem(inputs, attrs) -> shape          the spec's problem shape when it is not inputs[0].shape (matmul
#                                            (M, N, K)); raises ValueError for layouts it does not take; may
#                                            complete `attrs` in place with what only the tensors show (sdpa's
#                                            kv_heads)
#   tolerance_for(spec) -> Tolerance         a spec-exact tolerance (matmul's grows with K)
#   problem_shape(spec) -> shape             the request shape make_spec rebuilds `spec` from, when it is not
#                                            inputs[0].shape (matmul, sdpa); forge.search(KernelSpec) uses it
#   TEST_SHAPES, MID_SHAPE, test_candidates(spec)   what tests/test_templates.py runs for this op
#   OPTIONAL_ATTRS = ("form", ...)          attributes a spec may carry beyond DEFAULT_ATTRS, absent by default (so
#                                            the keys of specs without them never change): "form" is the
#                                            spelling the matcher saw when it changes what the user's code runs
#                                            (gelu's written-out formula, F.rms_norm, a * sigmoid(a) * b); the
#                                            reference follows it, torch's fused op (forge/fused.py) competes
#   STRIDED_INPUTS = (0, ...)                the inputs the op's kernels take in a strided layout (last dim
#                                            contiguous, any outer strides: opkit.check_layout); run() must
#                                            handle them and alloc_output() return a contiguous output, or,
#                                            with OUTPUT_LIKE, the layout below. Absent: every input contiguous.
#   OUTPUT_LIKE = i                          alloc_output gives the output torch.empty_like(input i)'s layout
#                                            (rope: the layout eager's formula gives, so attention after it
#                                            writes in q's order); forge/backend.py lays out a swapped region's
#                                            output for the regions after it the same way (kernel_stride)
#   STRIDED_ANY_ORDER = True                 those inputs may be in any order of strides, the last dim too
#                                            (matmul's x @ w.t()), not only with the last dim contiguous
#   strided_problem(spec) -> str | None      why this spec (built without the layout) takes no strided
#                                            layout, e.g. a reduction over a non-last dim; None: it does
#   fold_constants(picked, attrs, constants) -> attrs   forge/regions.py: `constants` maps region inputs that
#                                            are graph constants (TraceGraph.constant) to their values; the op may
#                                            fold one into its attributes (sdpa: a boolean mask equal to the
#                                            causal rule becomes causal=True, form="mask")
#   reference_parts(inputs, attrs) -> tuple  a multi-output op's natural spelling returning its parts (add_norm's
#                                            (y, h)): forge bench compiles it for torch.compile and stacks the
#                                            parts only to validate them
#   KEEP_MULTI_USE = ("add", ...)            heads of multi-use nodes the op's regions keep inside (add_norm's
#                                            residual add), the node an extra output of the region
#   VARIANT_ATTRS = {variant: attrs}         a variant that is only in the space of specs with some attributes
#                                            (the "strided" variants: a non-last dim); tests/test_templates.py
#                                            and tests/test_golden.py render and run it under these
#
# The attribute "strides" (opkit.STRIDES) is forge's, not the op's: _load wraps make_spec so that it is
# taken out before the op's make_spec sees the attributes and applied to the spec's TensorSpecs after
# (kept in spec.attrs, so it is in the key, and only when some input is strided: a contiguous spec's key
# is what it always was), and make_inputs so that validation and timing run on inputs in that layout.
REQUIRED = ("NAME", "TEMPLATES", "DEFAULT_ATTRS", "make_spec", "make_inputs", "reference", "alloc_output",
            "run", "space", "default", "render_context", "bytes_moved", "flops")


def default_fill_missing(inputs) -> tuple:
    """The contract's default fill_missing: the op has no optional inputs."""
    return tuple(inputs)


def fill_inputs(mod: ModuleType, picked, attrs: dict) -> tuple:
    """mod.fill_missing on the matcher's picks, given the matcher's attrs where the op asks for them
    (FILL_MISSING_ATTRS); the shim and forge/regions.py call this, never fill_missing directly."""
    if getattr(mod, "FILL_MISSING_ATTRS", False):
        return tuple(mod.fill_missing(picked, attrs))
    return tuple(mod.fill_missing(picked))


def default_tolerance(dtype: str) -> opkit.Tolerance:
    """The contract's default tolerance: the row ops' bounds."""
    return opkit.ROW_TOLERANCE[dtype]


# The contract's default oracle; the kit owns it (an op's own oracle may call it on a reshaped view).
default_oracle = opkit.float64_oracle


def _bound_oracle(mod: ModuleType) -> Callable:
    def oracle(inputs, attrs):
        # looked up per call: a patched reference (or ORACLE_CHUNK) holds
        return default_oracle(mod.reference, inputs, attrs, getattr(mod, "ORACLE_CHUNK", None))

    oracle.__doc__ = default_oracle.__doc__
    return oracle


# name -> the default for a module that does not define it (made per module: the oracle needs its reference)
DEFAULTS: dict[str, Callable[[ModuleType], Callable]] = {
    "fill_missing": lambda mod: default_fill_missing,
    "oracle": _bound_oracle,
    "tolerance": lambda mod: default_tolerance,
}


def _builtin_dirs() -> tuple[Path, Path]:
    """(kernels dir, templates dir): inside the installed wheel, else the source tree."""
    installed = (_PKG / "_kernels", _PKG / "_templates")
    if installed[0].is_dir():
        return installed
    root = _PKG.parent
    return root / "kernels", root / "templates"


@dataclass(frozen=True)
class OpFamily:
    name: str
    module: ModuleType
    path: Path
    template_dir: Path

    def template_path(self, variant: str) -> Path:
        return self.template_dir / self.module.TEMPLATES[variant]

    def problem_shape(self, spec) -> tuple[int, ...]:
        """The shape a request names for `spec` (matmul's MxNxK, attention's BxHxSqxSkvxD), so that
        make_spec(problem_shape(spec), ...) rebuilds it; the first input's shape unless the op says."""
        own = getattr(self.module, "problem_shape", None)
        return tuple(own(spec)) if own is not None else tuple(spec.inputs[0].shape)

    @property
    def defaulted(self) -> frozenset[str]:
        """The optional names (DEFAULTS) this op takes the contract's default for."""
        return self.module._forge_defaults

    @functools.cached_property
    def template_hash(self) -> str:
        """sha256 over the op file and every template it uses: any edit makes new cache keys."""
        h = hashlib.sha256()
        h.update(self.path.read_bytes())
        for variant in sorted(self.module.TEMPLATES):
            h.update(variant.encode())
            h.update(self.template_path(variant).read_bytes())
        return h.hexdigest()


def _search_dirs() -> list[tuple[Path, Path]]:
    dirs = [_builtin_dirs()]
    for entry in filter(None, os.environ.get("FORGE_OPS_PATH", "").split(os.pathsep)):
        d = Path(entry)
        dirs.append((d, d / "templates"))
    return dirs


# _load's families by (op file, template dir): the same OpFamily (its template_hash computed once) while the
# module object and the files' stamps are unchanged. Every region of a model resolves its op through get():
# re-validating the templates and hashing the op file and templates again each time cost ~3 ms per region
# (cProfile of a 4-layer HF Llama's first call on the CPU: 0.18 s of 0.57 s in forge's planning).
_LOADED: dict[tuple[Path, Path], tuple[Any, tuple, OpFamily]] = {}


def _stamp(files: list[Path]) -> tuple:
    """(mtime_ns, size) of each file: an edit makes a new stamp (and a new template_hash, new keys)."""
    out = []
    for f in files:
        try:
            st = f.stat()
        except OSError:
            return ()
        out.append((st.st_mtime_ns, st.st_size))
    return tuple(out)


def _load(path: Path, template_dir: Path) -> OpFamily:
    name = f"forge_ops.{path.stem}"
    mod = sys.modules.get(name)
    if mod is None or getattr(mod, "__file__", None) != str(path):
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    memo = _LOADED.get((path, template_dir))
    templates = getattr(mod, "TEMPLATES", None)
    files = [path, *(template_dir / t for t in templates.values())] if isinstance(templates, dict) else []
    if memo is not None and memo[0] is mod and memo[1] == _stamp(files) != ():
        return memo[2]
    fam = _load_checked(mod, path, template_dir)
    _LOADED[(path, template_dir)] = (mod, _stamp(files), fam)
    return fam


def _load_checked(mod, path: Path, template_dir: Path) -> OpFamily:
    missing = [attr for attr in REQUIRED if not hasattr(mod, attr)]
    if missing:
        raise TypeError(f"op module {path} lacks {', '.join(missing)}")
    if mod.NAME != path.stem:
        raise TypeError(f"op module {path} declares NAME={mod.NAME!r}; it must match its file name")
    for variant, tmpl in mod.TEMPLATES.items():
        if not (template_dir / tmpl).is_file():
            raise TypeError(f"op {mod.NAME}: template {tmpl} for variant {variant!r} not in {template_dir}")
    chunk = getattr(mod, "ORACLE_CHUNK", None)
    if chunk is not None and chunk not in opkit.ORACLE_CHUNKS:
        raise TypeError(f"op {mod.NAME}: ORACLE_CHUNK={chunk!r}; expected one of {', '.join(opkit.ORACLE_CHUNKS)}")
    _install_defaults(mod)
    _install_strides(mod)
    return OpFamily(mod.NAME, mod, path, template_dir)


def strided_attrs(op, inputs, attrs: dict) -> tuple[dict, str | None]:
    """(attrs with the "strides" attribute of these inputs' layout, None) or (attrs, why not): inputs not
    contiguous are taken where the op family lists them in STRIDED_INPUTS, in a layout its kernels take
    (opkit.check_layout); the spec, and so the search and the key, then carry the layout."""
    if all(t.is_contiguous() for t in inputs):
        # (attrs may carry the layout of other tensors: a region first found on eager's view, resolved for the
        # contiguous output of the kernel that feeds it)
        return {k: v for k, v in attrs.items() if k != opkit.STRIDES}, None
    strided = tuple(getattr(op.module, "STRIDED_INPUTS", ()))
    for i, t in enumerate(inputs):
        if t.is_contiguous():
            continue
        if i not in strided:
            return attrs, (f"non-contiguous input {i} (strides {tuple(t.stride())}; {op.name}'s kernels take "
                           + (f"input(s) {list(strided)} strided, the others contiguous)" if strided
                              else "contiguous inputs only)"))
        try:
            opkit.check_layout(tuple(t.shape), tuple(t.stride()), f"input {i}",
                               bool(getattr(op.module, "STRIDED_ANY_ORDER", False)))
        except ValueError as exc:
            return attrs, f"a layout {op.name}'s kernels do not take: {exc}"
    text = opkit.strides_text([(tuple(t.shape), tuple(t.stride())) for t in inputs])
    return {**attrs, opkit.STRIDES: text}, None


def _install_strides(mod: ModuleType) -> None:
    """Wrap the module's make_spec and make_inputs for the "strides" attribute (see the contract above);
    once per module object."""
    if getattr(mod, "_forge_strides", False):
        return
    raw_spec, raw_inputs = mod.make_spec, mod.make_inputs
    strided = tuple(getattr(mod, "STRIDED_INPUTS", ()))
    any_order = bool(getattr(mod, "STRIDED_ANY_ORDER", False))

    @functools.wraps(raw_spec)
    def make_spec(shape, dtype, device, attrs=None):
        attrs = dict(attrs or {})
        text = attrs.pop(opkit.STRIDES, None)
        spec = raw_spec(shape, dtype, device, attrs)
        if text is None:
            return spec
        problem = getattr(mod, "strided_problem", None)
        why = problem(spec) if problem is not None else None
        layouts = opkit.parse_strides(text, [t.shape for t in spec.inputs], strided, any_order)
        # A layout that addresses the tensor as contiguous strides do (a size-1 dim's stride never
        # matters) keeps the canonical strides: one spec, one key, one set of test inputs.
        inputs = tuple(t if st is None or same_layout(t.shape, st, t.strides) else dataclasses.replace(t, strides=st)
                       for t, st in zip(spec.inputs, layouts, strict=True))
        canonical = opkit.strides_text([(t.shape, t.strides) for t in inputs])
        if canonical is None:
            return spec
        if why is not None:
            raise ValueError(why)
        return dataclasses.replace(spec, inputs=inputs, attrs={**spec.attrs, opkit.STRIDES: canonical})

    @functools.wraps(raw_inputs)
    def make_inputs(spec, seed, distribution="normal"):
        tensors = raw_inputs(spec, seed, distribution)
        if opkit.STRIDES not in spec.attrs:
            return tensors
        return tuple(t if s.contiguous else opkit.restride(t, s.strides)
                     for t, s in zip(tensors, spec.inputs, strict=True))

    mod.make_spec, mod.make_inputs = make_spec, make_inputs
    mod._forge_strides = True


def _install_defaults(mod: ModuleType) -> None:
    """Give `mod` the contract's default for each optional name it does not define (once: a module
    reused from sys.modules already has them), recording which in mod._forge_defaults."""
    defaulted = set(getattr(mod, "_forge_defaults", ()))
    for attr, make in DEFAULTS.items():
        if not hasattr(mod, attr):
            setattr(mod, attr, make(mod))
            defaulted.add(attr)
    mod._forge_defaults = frozenset(defaulted)


_AVAILABLE: dict[tuple, dict[str, tuple[Path, Path]]] = {}


def available() -> dict[str, tuple[Path, Path]]:
    # Resolved again only when a directory's file names or the search path change: os.listdir per call
    # (tens of µs), not a glob and a resolve() per file (~2 ms; get() is called for every region of a model).
    dirs = _search_dirs()
    stamp = tuple((str(k), str(t), tuple(sorted(os.listdir(k))) if k.is_dir() else None) for k, t in dirs)
    hit = _AVAILABLE.get(stamp)
    if hit is not None:
        return dict(hit)
    found: dict[str, tuple[Path, Path]] = {}
    for kdir, tdir in dirs:
        if not kdir.is_dir():
            continue
        for p in sorted(kdir.glob("*.py")):
            if not p.name.startswith("_"):
                found.setdefault(p.stem, (p.resolve(), tdir.resolve()))
    _AVAILABLE.clear()  # one entry: the search path of this process, as it is now
    _AVAILABLE[stamp] = found
    return dict(found)


def is_generic(op: OpFamily) -> bool:
    """The op declares GENERIC = True: it matches what many specific families also match (pointwise: any
    elementwise chain), so it is tried after them."""
    return bool(getattr(op.module, "GENERIC", False))


def match_order() -> list[OpFamily]:
    """Every available family in the order matchers are tried (the shim, forge/regions.py): by name,
    the GENERIC ones last, so that gelu, silu_mul, ... win wherever they match too."""
    families = [get(name) for name in sorted(available())]
    return [f for f in families if not is_generic(f)] + [f for f in families if is_generic(f)]


def get(name: str) -> OpFamily:
    ops = available()
    if name not in ops:
        raise UsageError(f"unknown op {shown(name)}{_did_you_mean(name, ops)}; known ops: "
                         f"{', '.join(sorted(ops)) or '(none)'}")
    return _load(*ops[name])


def _did_you_mean(name: object, known) -> str:
    """"; did you mean 'rmsnorm'?" for a near miss (rmsnrm, layernorm, RMSNorm), else ""."""
    import difflib

    if not isinstance(name, str):
        return ""
    folded = {k.replace("_", "").lower(): k for k in known}
    hit = folded.get(name.replace("_", "").replace("-", "").lower())
    close = [hit] if hit else difflib.get_close_matches(name.lower(), list(known), n=1, cutoff=0.75)
    return f"; did you mean {close[0]!r}?" if close else ""
