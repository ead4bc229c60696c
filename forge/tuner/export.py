"""`forge export`: a cached kernel decision as code that runs without forge.

Two output formats (docs/export.md):

  module       one Python file: a metadata header (spec, environment, timings), the winning Triton
               source verbatim, the op's launch glue, and a plain function with the op's natural
               signature (rmsnorm(x, w, *, eps=...) -> y) that checks its arguments against the spec
               the kernel was tuned and validated for and raises ValueError for anything else.
  hf-kernels   a Hugging Face `kernels` repository of every tuned shape of an op (or of a model's ops),
               each kernel that same module, with layers for kernels.kernelize: forge/tuner/hf_export.py.

The glue is generic: the op module's `alloc_output` and `run` (kernels/<op>.py) are copied, with
every module-level name they use (helpers, constants, imports), found with `symtable`. An op whose
glue needs forge itself (e.g. calls into forge.opkit at run time) cannot be exported; that is
reported as a usage error naming the name.
"""

from __future__ import annotations

import ast
import builtins
import datetime
import json
import keyword
import pprint
import re
import symtable
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forge import key as keys
from forge.cache import Cache, Entry
from forge.errors import UsageError
from forge.loader import atomic_write  # noqa: F401 - hf_export and tests take it from here
from forge.ops import OpFamily
from forge.spec import DTYPES, KernelSpec
from forge.tuner import bundle

FORMATS = ("module", "hf-kernels")
EXPORT_VERSION = 1


class NotExportable(UsageError):
    """The entry or op cannot be exported (exit 2); the message says why."""


# -- finding the entry --------------------------------------------------------------------------------

def check_exportable(entry: Entry, what: str) -> None:
    """Only a kernel decision that passes forge/key.py verify_entry: its source intact, its spec, variant
    and params a point of the installed op's space, and its source what the installed templates render
    for them (an entry imported with --trust, or edited in the DB, is refused)."""
    if entry.decision == "torch":
        raise NotExportable(f"{what}: the cached decision is torch's own fused op (faster than every forge kernel "
                            "tried), so there is no forge kernel to export; call that op in your code")
    if entry.decision != "kernel":
        raise NotExportable(f"{what}: the cached decision is eager (no candidate beat eager by the required "
                            "margin), so there is no kernel to export")
    try:
        bundle.check_integrity(entry)
    except bundle.Rejected as exc:
        raise NotExportable(f"{what}: cached entry {entry.key[:12]} cannot be exported: {exc}") from None
    problem = keys.verify_entry(entry)
    if problem is not None:
        raise NotExportable(f"{what}: cached entry {entry.key[:12]} cannot be exported: {problem}")


# -- the op's glue (alloc_output, run and what they use) ----------------------------------------------

_ENTRY_POINTS = ("alloc_output", "run")
_FORGE_PACKAGES = ("forge", "forge_cli", "forge_ops")


class _StripAnnotations(ast.NodeTransformer):
    """Annotations name forge types (spec: KernelSpec); the exported glue needs none of them."""

    def _args(self, node):
        for a in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs,
                  node.args.vararg, node.args.kwarg):
            if a is not None:
                a.annotation = None
        if hasattr(node, "returns"):
            node.returns = None
        self.generic_visit(node)
        return node

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _args

    def visit_AnnAssign(self, node):
        if node.value is None:
            return None
        return ast.copy_location(ast.Assign(targets=[node.target], value=node.value), node)


def _strip(node: ast.stmt) -> ast.stmt:
    import copy

    stripped = _StripAnnotations().visit(copy.deepcopy(node))
    return ast.fix_missing_locations(stripped)


def _globals_used(code: str) -> set[str]:
    """Module-level names the statement(s) in `code` read (symtable: exact, not a textual guess)."""
    top = symtable.symtable(code, "<glue>", "exec")
    used = {s.get_name() for s in top.get_symbols() if s.is_referenced()}

    def walk(table) -> None:
        for child in table.get_children():
            for s in child.get_symbols():
                if s.is_global() and (s.is_referenced() or s.is_declared_global()):
                    used.add(s.get_name())
            walk(child)

    walk(top)
    return used


@dataclass
class Glue:
    source: str  # the body of _forge_glue(): imports and definitions, in the op module's order
    input_names: list[str]


def _top_level(tree: ast.Module) -> dict[str, tuple[int, ast.stmt, ast.alias | None]]:
    """name -> (statement index, statement, import alias) for every module-level binding."""
    found: dict[str, tuple[int, ast.stmt, ast.alias | None]] = {}
    for i, node in enumerate(tree.body):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            found[node.name] = (i, node, None)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        found[n.id] = (i, node, None)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                name = alias.asname or alias.name.split(".")[0]
                found[name] = (i, node, alias)
    return found


def _input_names(tree: ast.Module, count: int) -> list[str]:
    """The op's natural argument names, read from `x, w = inputs` (or `x = inputs[0]`) in run() or
    reference(); x0, x1, ... when neither says."""
    for fname in ("run", "reference", "oracle"):
        fn = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == fname), None)
        position = 1 if fname == "run" else 0  # run(module, inputs, out, attrs); reference(inputs, attrs)
        if fn is None or len(fn.args.args) <= position:
            continue
        param = fn.args.args[position].arg
        for node in ast.walk(fn):
            if not isinstance(node, ast.Assign) or len(node.targets) != 1:
                continue
            target, value = node.targets[0], node.value
            if isinstance(value, ast.Name) and value.id == param and isinstance(target, ast.Tuple):
                names = [e.id for e in target.elts if isinstance(e, ast.Name)]
                if len(names) == len(target.elts) == count:
                    return names
            if (count == 1 and isinstance(target, ast.Name) and isinstance(value, ast.Subscript)
                    and isinstance(value.value, ast.Name) and value.value.id == param
                    and isinstance(value.slice, ast.Constant) and value.slice.value == 0):
                return [target.id]
    return ["x"] if count == 1 else [f"x{i}" for i in range(count)]


def glue(op: OpFamily, n_inputs: int) -> Glue:
    """alloc_output and run of `op`, with every module-level helper, constant and import they use."""
    tree = ast.parse(op.path.read_text(), filename=str(op.path))
    defs = _top_level(tree)
    missing = [name for name in _ENTRY_POINTS if name not in defs]
    if missing:
        raise NotExportable(f"op {op.name}: {op.path} defines no {', '.join(missing)} at module level, "
                            "so its launch glue cannot be copied")
    needed: dict[int, set[str]] = {}  # statement index -> names needed from it (imports: per alias)
    queue, seen = list(_ENTRY_POINTS), set()
    why: dict[str, str] = {name: name for name in _ENTRY_POINTS}
    while queue:
        name = queue.pop()
        if name in seen:
            continue
        seen.add(name)
        if name not in defs:
            if hasattr(builtins, name):
                continue
            raise NotExportable(f"op {op.name}: {why[name]} uses {name!r}, which {op.path.name} does not define "
                                "at module level")
        index, node, alias = defs[name]
        if alias is not None:
            module = node.module if isinstance(node, ast.ImportFrom) else alias.name
            if isinstance(node, ast.ImportFrom) and node.level:
                raise NotExportable(f"op {op.name}: {why[name]} uses {name!r} from a relative import")
            if module and module.split(".")[0] in _FORGE_PACKAGES:
                raise NotExportable(f"op {op.name} cannot be exported standalone: its launch glue "
                                    f"({why[name]}) uses {name!r} from {module}, which is part of forge")
            needed.setdefault(index, set()).add(name)
            continue
        needed.setdefault(index, set()).add(name)
        code = ast.unparse(_strip(node))
        if re.search(r"^\s*global\s", code, re.M):
            raise NotExportable(f"op {op.name}: {name} declares a global, which the copied glue cannot keep")
        for dep in _globals_used(code) - {name}:
            why.setdefault(dep, f"{why[name]} -> {dep}" if why[name] != dep else dep)
            queue.append(dep)
    parts = []
    for index in sorted(needed):
        node = tree.body[index]
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a for a in node.names if (a.asname or a.name.split(".")[0]) in needed[index]]
            node = ast.Import(names=names) if isinstance(node, ast.Import) else ast.ImportFrom(
                module=node.module, names=names, level=0)
            parts.append(ast.unparse(node))
        else:
            parts.append(ast.unparse(_strip(node)))
    return Glue("\n\n".join(parts), _input_names(tree, n_inputs))


# -- the module ---------------------------------------------------------------------------------------

# The module's own top-level names, all prefixed so they cannot meet the kernel's (checked anyway). A
# hf-kernels repository's dispatcher (hf_runtime.DISPATCH) calls _forge_problem, _forge_unrunnable and
# _forge_call of modules that earlier exports wrote: keep those names and what they do.
_RUNTIME = '''
class _ForgeTensorSpec:
    """The subset of forge.spec.TensorSpec the copied glue may read."""

    def __init__(self, d):
        self.shape = tuple(d["shape"])
        self.dtype = d["dtype"]
        self.strides = tuple(d["strides"])
        self.device = d["device"]

    @property
    def numel(self):
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def itemsize(self):
        return {"float16": 2, "bfloat16": 2, "float32": 4, "int64": 8, "int32": 4}[self.dtype]

    @property
    def nbytes(self):
        return self.numel * self.itemsize

    def layout_is(self, strides):
        """`strides` address this spec's shape as its own strides do (a size-1 dim's stride never matters)."""
        return all(n == 1 or a == b for n, a, b in zip(self.shape, strides, self.strides))

    @property
    def contiguous(self):
        acc, want = 1, []
        for n in reversed(self.shape):
            want.append(acc)
            acc *= n
        return self.layout_is(tuple(reversed(want)))


class _ForgeSpec:
    """The subset of forge.spec.KernelSpec the copied glue may read."""

    def __init__(self, d):
        self.op = d["op"]
        self.inputs = tuple(_ForgeTensorSpec(t) for t in d["inputs"])
        self.attrs = dict(d["attrs"])
        self._dict = d

    def to_dict(self):
        return self._dict

    @property
    def shape_str(self):
        return "x".join(str(s) for s in self.inputs[0].shape)

    @property
    def dtype(self):
        return self.inputs[0].dtype

    @property
    def device(self):
        return self.inputs[0].device


SPEC = _ForgeSpec(METADATA["spec"])
_FORGE_ALIGNMENT = 16  # bytes: kernels were validated on freshly allocated (aligned) tensors


class _ForgeKernel:
    """What the op's run() calls `module`: this file's kernel source (launch() and friends)."""

    def __getattr__(self, name):
        try:
            return globals()[name]
        except KeyError:
            raise AttributeError(name) from None


_FORGE_KERNEL = _ForgeKernel()
_FORGE_NO_ATTR = object()  # an attribute the spec does not have: never equal to a value passed
_forge_env_checked = []


def _forge_environment_differences():
    """[(what, tuned, running)] between the tuning environment and this process."""
    env = METADATA["env"]
    running = {"torch": _forge_torch.__version__}
    try:
        from importlib.metadata import version

        running["triton"] = version("triton")
    except Exception:
        import triton

        running["triton"] = triton.__version__
    if env["backend"] == "cuda":
        props = _forge_torch.cuda.get_device_properties(_forge_torch.cuda.current_device())
        running["gpu"] = props.name
        running["cc"] = f"{props.major}.{props.minor}"
    return [(k, env.get(k), v) for k, v in running.items() if env.get(k) != v]


def _forge_unrunnable():
    """Why this process cannot run the kernel at all (a RuntimeError message), or None."""
    if _FORGE_DEVICE == "cpu" and _forge_os.environ.get("TRITON_INTERPRET") != "1":
        return (f"{_FORGE_FUNCTION} was tuned on the Triton interpreter (CPU tensors): set TRITON_INTERPRET=1 "
                "before triton is first imported")
    return None


def _forge_problem(args, attrs):
    """Why the arguments are not exactly the inputs the kernel was validated for (a ValueError message), or
    None. Never raises: a hf-kernels repository's dispatcher asks it before choosing this kernel."""
    if len(args) != len(_FORGE_INPUTS):
        return f"{_FORGE_FUNCTION}() takes {len(_FORGE_INPUTS)} inputs {_FORGE_INPUTS}, got {len(args)}"
    for name, value in attrs.items():
        expected = SPEC.attrs.get(name, _FORGE_NO_ATTR)
        if value != expected:
            return f"{_FORGE_FUNCTION}() was tuned for {name}={expected!r}, got {name}={value!r}"
    device = None
    for name, t, want in zip(_FORGE_INPUTS, args, SPEC.inputs):
        if not isinstance(t, _forge_torch.Tensor):
            return f"{_FORGE_FUNCTION}(): {name} must be a torch.Tensor, got {type(t).__name__}"
        if tuple(t.shape) != want.shape or str(t.dtype) != "torch." + want.dtype:
            return (f"{_FORGE_FUNCTION}(): {name} must be {want.dtype} of shape {want.shape} (the spec it was "
                    f"tuned for), got {str(t.dtype).replace('torch.', '')} of shape {tuple(t.shape)}")
        if t.device.type != want.device:
            return f"{_FORGE_FUNCTION}(): {name} must be on {want.device}, got {t.device}"
        if device is not None and t.device != device:
            return f"{_FORGE_FUNCTION}(): all inputs must be on one device, got {device} and {t.device}"
        device = t.device
        if not want.layout_is(tuple(t.stride())):
            if want.contiguous:
                return (f"{_FORGE_FUNCTION}(): {name} must be contiguous (the kernel indexes row-major memory); "
                        "pass .contiguous()")
            return (f"{_FORGE_FUNCTION}(): {name} must have strides {want.strides} (the layout it was tuned "
                    f"for), got {tuple(t.stride())}")
        if t.data_ptr() % _FORGE_ALIGNMENT:
            return f"{_FORGE_FUNCTION}(): {name} must be {_FORGE_ALIGNMENT}-byte aligned"
        if t.requires_grad and _forge_torch.is_grad_enabled():
            return (f"{_FORGE_FUNCTION}(): {name} requires grad, but the kernel is forward-only; call it under "
                    "torch.no_grad()")
    return None


def _forge_check(args, attrs):
    """The arguments as the kernel's inputs, or ValueError: the kernel was validated for exactly SPEC."""
    unrunnable = _forge_unrunnable()
    if unrunnable:
        raise RuntimeError(unrunnable)
    problem = _forge_problem(args, attrs)
    if problem:
        raise ValueError(problem)
    if not _forge_env_checked:
        _forge_env_checked.append(True)
        diff = _forge_environment_differences()
        if diff:
            _forge_warnings.warn(
                f"{_FORGE_FUNCTION}: tuned and validated with "
                + ", ".join(f"{k} {a}" for k, a, _ in diff) + "; running with "
                + ", ".join(f"{k} {b}" for k, _, b in diff) + " (its timings do not apply here)",
                RuntimeWarning, stacklevel=3)
    return tuple(args), args[0].device


def _forge_call(args, attrs):
    inputs, device = _forge_check(args, attrs)
    out = _forge_alloc_output(inputs, SPEC)
    if device.type == "cuda":
        with _forge_torch.cuda.device(device):
            _forge_run(_FORGE_KERNEL, inputs, out, SPEC.attrs)
    else:
        _forge_run(_FORGE_KERNEL, inputs, out, SPEC.attrs)
    return out
'''

_RESERVED = {"annotations", "METADATA", "SPEC", "_ForgeTensorSpec", "_ForgeSpec", "_ForgeKernel", "_FORGE_KERNEL",
             "_FORGE_ALIGNMENT", "_FORGE_DEVICE", "_FORGE_FUNCTION", "_FORGE_INPUTS", "_forge_os", "_forge_torch",
             "_forge_warnings", "_forge_glue", "_forge_alloc_output", "_forge_run", "_forge_check", "_forge_call",
             "_forge_env_checked", "_forge_environment_differences", "_forge_unrunnable", "_forge_problem",
             "_FORGE_NO_ATTR", "__all__"}


def _bound_names(source: str) -> set[str]:
    names = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update(a.asname or a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
    return names


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def docstring_safe(header: str) -> str:
    """The header is a docstring: no backslashes (escapes) or triple quotes from the values in it."""
    quotes = '"' * 3
    body = header[3:-4].replace("\\", "/").replace(quotes, "'" * 3)
    return quotes + body + quotes + "\n"


def _fmt_q(q: dict | None) -> str:
    if not q:
        return "-"
    return " / ".join(f"{q.get(k, float('nan')):,.2f}" for k in ("p20", "p50", "p80"))


def metadata(entry: Entry, op: OpFamily) -> dict[str, Any]:
    return {"forge_export": EXPORT_VERSION, "op": entry.op, "key": entry.key, "spec": entry.spec, "env": entry.env,
            "decision": entry.decision, "variant": entry.variant, "params": entry.params,
            "source_sha256": entry.source_sha256, "template_hash": entry.template_hash,
            "template": op.module.TEMPLATES.get(entry.variant), "winner_us": entry.winner,
            "eager_us": entry.baseline, "speedup": entry.speedup,
            "timing_clock": "cuda-events (device time)" if entry.env.get("backend") == "cuda"
            else "host clock (Triton interpreter)",
            "candidates": len(entry.candidates), "search_seconds": entry.search_seconds,
            "forge_version": entry.forge_version, "created_at": entry.created_at}


def render_module(entry: Entry, op: OpFamily, *, function: str | None = None) -> str:
    """The standalone module for a kernel entry (already checked with check_exportable)."""
    spec = KernelSpec.from_dict(entry.spec)
    function = function or op.name
    if not function.isidentifier() or keyword.iskeyword(function):
        raise NotExportable(f"{function!r} is not a valid Python function name")
    g = glue(op, len(spec.inputs))
    attrs = {k: v for k, v in spec.attrs.items() if k.isidentifier() and not keyword.iskeyword(k)}
    clash = (_bound_names(entry.source) & (_RESERVED | {function})) | (set(g.input_names) & set(attrs)) \
        | ({function} & (set(g.input_names) | set(attrs)))
    if clash:
        raise NotExportable(f"op {op.name}: names {sorted(clash)} would clash in the exported module")
    meta = metadata(entry, op)
    env = entry.env
    device = spec.device
    when = datetime.datetime.fromtimestamp(entry.created_at, datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    params = ", ".join(f"{k}={v}" for k, v in (entry.params or {}).items())
    sig_args = ", ".join(g.input_names)
    sig_attrs = "".join(f", {k}={v!r}" for k, v in attrs.items())
    sig = f"{sig_args}, *{sig_attrs}" if attrs else sig_args
    input_lines = "\n".join(f"    {n}: {t.dtype} {t.shape}, "
                            f"{'contiguous' if t.contiguous else f'strides {t.strides}'}, {t.device}"
                            for n, t in zip(g.input_names, spec.inputs, strict=True))
    envs = ", ".join(f"{k} {env[k]}" for k in ("backend", "gpu", "cc", "driver", "cuda", "cpu", "torch", "triton")
                     if env.get(k) is not None)
    speed = f"{entry.speedup:.2f}x" if entry.speedup else "-"
    header = f'''"""forge export: {op.name} {spec.shape_str} {spec.dtype}, variant {entry.variant}({params}).

Call:
    {function}({sig}) -> output
It runs only what it was tuned and validated for; anything else raises ValueError:
{input_lines}
    attributes {json.dumps(spec.attrs)}

Tuned in: {envs}; templates {env.get("templates", "")[:12]}.
Timings, {meta["timing_clock"]}, p20 / p50 / p80 in µs: kernel {_fmt_q(entry.winner)}; \
eager {_fmt_q(entry.baseline)}; speedup {speed}.
Search: {_plural(len(entry.candidates), "candidate")}, {entry.search_seconds:.1f} s, forge {entry.forge_version}, \
{when}.
Cache key {entry.key}; kernel source sha256 {entry.source_sha256}.

Generated by `forge export`: needs torch and triton only, not forge. Everything above is in METADATA.
"""
'''
    glue_body = textwrap.indent(g.source, "    ")
    call_attrs = "{" + ", ".join(f"{k!r}: {k}" for k in attrs) + "}"
    parts = [
        header,
        "from __future__ import annotations\n\n",
        "import os as _forge_os\nimport warnings as _forge_warnings\n\nimport torch as _forge_torch\n\n",
        f"__all__ = [{function!r}, 'SPEC', 'METADATA']\n\n",
        "METADATA = " + pprint.pformat(meta, width=110, sort_dicts=True) + "\n\n",
        f"_FORGE_FUNCTION = {function!r}\n_FORGE_INPUTS = {tuple(g.input_names)!r}\n_FORGE_DEVICE = {device!r}\n\n",
        f"# ---- forge kernel source: templates/{meta['template']}, sha256 {entry.source_sha256} (verbatim) ----\n",
        entry.source if entry.source.endswith("\n") else entry.source + "\n",
        "# ---- end of forge kernel source ----\n\n\n",
        "def _forge_glue():\n",
        f'    """alloc_output() and run() of forge\'s kernels/{op.path.name}, with what they use (copied)."""\n',
        glue_body + "\n",
        "    return alloc_output, run\n\n\n",
        "_forge_alloc_output, _forge_run = _forge_glue()\n\n",
        _RUNTIME,
        f"\n\ndef {function}({sig}):\n",
        f'    """{op.name} ({getattr(op.module, "SUMMARY", op.name)}) for exactly the spec above; returns a new '
        'tensor."""\n',
        f"    return _forge_call(({sig_args}{',' if len(g.input_names) == 1 else ''}), {call_attrs})\n",
    ]
    text = "".join([docstring_safe(header), *parts[1:]])
    compile(text, f"<forge export {op.name}>", "exec")  # a bug here must not reach the user's file
    return text


# -- writing ------------------------------------------------------------------------------------------

def default_name(entry: Entry) -> str:
    spec = KernelSpec.from_dict(entry.spec)
    return f"{entry.op}_{spec.shape_str}_{spec.dtype}"


@dataclass
class Exported:
    path: Path  # the module file, or the hf-kernels repository directory
    module: Path  # the Python file holding the kernel
    name: str
    function: str
    format: str
    extra: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"format": self.format, "path": str(self.path), "module": str(self.module), "name": self.name,
                "function": self.function, **self.extra}


def export(entry: Entry, op: OpFamily, out_dir: Path, *, fmt: str = "module", name: str | None = None) -> Exported:
    """Write one kernel entry: a module file DIR/NAME.py, or (hf-kernels) into the repository DIR/forge-NAME
    (default forge-OP), which keeps every kernel it already holds (forge/tuner/hf_export.py)."""
    if fmt not in FORMATS:
        raise UsageError(f"unknown --format {fmt!r}; expected one of {', '.join(FORMATS)}")
    check_exportable(entry, f"{entry.op} {default_name(entry)}")
    if fmt == "hf-kernels":
        from forge.tuner import hf_export  # it builds on this module: imported here, not at the top

        return hf_export.export_hf([entry], out_dir, name=name)
    name = name or default_name(entry)
    try:
        if not name.isidentifier() or keyword.iskeyword(name):
            raise UsageError(f"--name {name!r} is not an importable module name (letters, digits, _)")
        text = render_module(entry, op)
        path = out_dir / f"{name}.py"
        atomic_write(path, text)
        return Exported(path, path, name, op.name, fmt, {"key": entry.key})
    except OSError as exc:
        raise UsageError(f"cannot write to {out_dir}: {exc.strerror or exc}") from None


def lookup(cache: Cache, op_name: str, shape: tuple[int, ...], dtype: str, device: str | None,
           attrs: dict[str, Any]) -> tuple[OpFamily, Entry]:
    """The cached decision `forge search` with the same arguments would find on this machine."""
    from forge.tuner import engine

    if dtype not in DTYPES:
        raise UsageError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
    backend = engine.resolve_backend(device)
    loc = keys.request(op_name, shape, dtype, backend, attrs)
    op, spec, key = loc.op, loc.spec, loc.key
    entry = cache.get(key)
    if entry is None:
        attr_args = "".join(f" --attr {k}={json.dumps(v)}" for k, v in attrs.items())
        raise NotExportable(
            f"{op_name} {spec.shape_str} {dtype} on {backend} is not tuned in {cache.path} (no entry for key "
            f"{key[:12]}): run `forge search {op_name} --shape {spec.shape_str} --dtype {dtype}"
            f"{' --device ' + device if device else ''}{attr_args}` first, or export an entry by --key")
    return op, entry
