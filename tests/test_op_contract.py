"""The op contract (forge/ops.py): required names fail loudly when absent, optional ones get the
contract's default (fill_missing, oracle, tolerance) unless the op file defines its own, and every
built-in op exposes the whole contract once loaded. Also the nominal hardware table (forge/hardware.py)."""

from __future__ import annotations

import ast
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from forge import hardware, opkit, ops
from forge.opkit import ROW_TOLERANCE, Tolerance
from forge.spec import DTYPES

# A minimal op: y[i] = x[i, idx[i]] + shift, with an int64 index input (so the default oracle's handling
# of non-floating inputs shows: a float64 index would make gather raise). It defines only what the
# contract requires.
TINY = '''
from forge import opkit
from forge.spec import KernelSpec, TensorSpec

NAME = "{name}"
TEMPLATES = {{"only": "{name}.j2"}}
DEFAULT_ATTRS = {{"shift": 0.0}}


def make_spec(shape, dtype, device, attrs=None):
    return KernelSpec(NAME, (TensorSpec(shape, dtype, device=device), TensorSpec(shape[:1], "int64", device=device)),
                      {{**DEFAULT_ATTRS, **(attrs or {{}})}})


def make_inputs(spec, seed, distribution="normal"):
    import torch

    x, i = spec.inputs
    gen = opkit.generator(seed, x.device)
    return (opkit.random_tensor(x.shape, x.dtype, x.device, gen, distribution),
            torch.randint(0, x.shape[1], i.shape, generator=gen))


def reference(inputs, attrs):
    x, idx = inputs
    return x.gather(1, idx[:, None])[:, 0] + attrs["shift"]


def alloc_output(inputs, spec):
    import torch

    return torch.empty(inputs[0].shape[:1], dtype=inputs[0].dtype)


def run(module, inputs, out, attrs):
    module.launch(*inputs, out)


def space(spec):
    return opkit.Space({{"only": {{"num_warps": [1]}}}}, valid=lambda c: True)


def default(spec):
    return opkit.Candidate.make("only", num_warps=1)


def render_context(spec, cand):
    return dict(cand.p)


def bytes_moved(spec):
    return 0


def flops(spec):
    return 0
'''

# Definitions that override every default, each with an observable effect.
OWN = '''

def fill_missing(inputs):
    x, idx = inputs
    return (x, idx if idx is not None else idx_zeros(x))


def idx_zeros(x):
    import torch

    return torch.zeros(x.shape[0], dtype=torch.int64)


def oracle(inputs, attrs):
    return ("own oracle", inputs, attrs)


def tolerance(dtype):
    return opkit.Tolerance(rel_norm=0.5, atol=0.25, rtol=0.125)
'''


@pytest.fixture
def op_dir(tmp_path, monkeypatch):
    """A directory on FORGE_OPS_PATH; write(name, source) puts an op (and its template) there. The
    loaded modules are dropped from sys.modules afterwards."""
    d = tmp_path / "ops"
    (d / "templates").mkdir(parents=True)
    monkeypatch.setenv("FORGE_OPS_PATH", str(d))
    written = []

    def write(name: str, source: str) -> Path:
        (d / "templates" / f"{name}.j2").write_text("def launch(*args):\n    pass\n")
        path = d / f"{name}.py"
        path.write_text(textwrap.dedent(source))
        written.append(name)
        return path

    yield write
    for name in written:
        sys.modules.pop(f"forge_ops.{name}", None)


def test_families_are_loaded_once_until_a_file_changes(op_dir):
    """get() is called for every region of a model: the family (and its template_hash) is reused while the
    module and the files are unchanged; an edited template is a new hash (new keys), a new op file is seen."""
    import os

    path = op_dir("tiny_memo", TINY.format(name="tiny_memo"))
    first = ops.get("tiny_memo")
    assert ops.get("tiny_memo") is first
    h = first.template_hash
    tmpl = path.parent / "templates" / "tiny_memo.j2"
    tmpl.write_text("def launch(*args):\n    return None\n")
    st = tmpl.stat()
    os.utime(tmpl, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a later mtime on any filesystem clock
    second = ops.get("tiny_memo")
    assert second is not first and second.template_hash != h
    assert "tiny_memo2" not in ops.available()
    op_dir("tiny_memo2", TINY.format(name="tiny_memo2"))
    assert "tiny_memo2" in ops.available() and ops.get("tiny_memo2").name == "tiny_memo2"


def _inputs():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=torch.float32)
    return x, torch.tensor([2, 0], dtype=torch.int64)


def test_an_op_that_omits_the_optional_names_gets_the_defaults(op_dir):
    op_dir("tiny_defaults", TINY.format(name="tiny_defaults"))
    op = ops.get("tiny_defaults")
    mod = op.module
    assert op.defaulted == frozenset({"fill_missing", "oracle", "tolerance"}) == frozenset(ops.DEFAULTS)
    # fill_missing: the identity, as a tuple of the very same objects (None stays None).
    x, idx = _inputs()
    filled = mod.fill_missing([x, idx])
    assert type(filled) is tuple and len(filled) == 2 and filled[0] is x and filled[1] is idx
    assert mod.fill_missing([x, None]) == (x, None)
    assert mod.fill_missing is ops.default_fill_missing
    # tolerance: the row ops' table, every dtype.
    for dtype in DTYPES:
        assert mod.tolerance(dtype) == ROW_TOLERANCE[dtype]
    assert mod.tolerance("float16") == Tolerance(rel_norm=2e-3, atol=1e-5, rtol=2e-3)
    with pytest.raises(KeyError):
        mod.tolerance("int64")
    # oracle: this op's reference, in float64, index input untouched.
    out = mod.oracle(_inputs(), {"shift": 0.5})
    assert out.dtype == torch.float64
    assert out.tolist() == [3.5, 4.5]


def test_the_default_oracle_computes_in_float64_and_passes_integer_inputs_as_they_are(op_dir):
    op_dir("tiny_oracle", TINY.format(name="tiny_oracle"))
    mod = ops.get("tiny_oracle").module
    x, idx = _inputs()
    seen = []
    real_reference = mod.reference

    def spy(inputs, attrs):
        seen.append(inputs)
        return real_reference(inputs, attrs)

    mod.reference = spy  # the default oracle looks `reference` up per call
    shift = 1e-12  # lost in float32 (1 + 1e-12 == 1), kept in float64
    got = mod.oracle((x, idx), {"shift": shift})
    (xd, idx_seen), = seen
    assert xd.dtype == torch.float64 and torch.equal(xd, x.double())
    assert idx_seen is idx and idx_seen.dtype == torch.int64
    assert x.dtype == torch.float32  # the caller's tensor is not converted in place
    assert got.dtype == torch.float64
    assert got.tolist() == [3.0 + 1e-12, 4.0 + 1e-12]
    assert got[0].item() != 3.0
    # The input-dtype reference loses the shift: the oracle is not the reference.
    assert real_reference((x, idx), {"shift": shift}).tolist() == [3.0, 4.0]
    # fp16 and bf16 inputs too: values exact in float64.
    for dtype in (torch.float16, torch.bfloat16):
        got = mod.oracle((x.to(dtype), idx), {"shift": 0.25})
        assert got.dtype == torch.float64 and got.tolist() == [3.25, 4.25]


def test_an_ops_own_definitions_win_over_the_defaults(op_dir):
    op_dir("tiny_own", TINY.format(name="tiny_own") + OWN)
    op = ops.get("tiny_own")
    mod = op.module
    assert op.defaulted == frozenset()
    for name in ops.DEFAULTS:
        assert getattr(mod, name).__module__ == "forge_ops.tiny_own", name
    x, idx = _inputs()
    assert mod.oracle((x, idx), {"shift": 1.0}) == ("own oracle", (x, idx), {"shift": 1.0})
    assert mod.tolerance("float32") == Tolerance(rel_norm=0.5, atol=0.25, rtol=0.125)
    filled = mod.fill_missing([x, None])
    assert filled[0] is x and filled[1].tolist() == [0, 0]


def test_defaults_fill_only_what_an_op_leaves_out(op_dir):
    op_dir("tiny_some", TINY.format(name="tiny_some") + textwrap.dedent('''

        def tolerance(dtype):
            return opkit.Tolerance(rel_norm=1.0, atol=1.0, rtol=1.0)
        '''))
    op = ops.get("tiny_some")
    assert op.defaulted == frozenset({"fill_missing", "oracle"})
    assert op.module.tolerance("float16") == Tolerance(1.0, 1.0, 1.0)
    assert op.module.oracle(_inputs(), {"shift": 0.0}).dtype == torch.float64
    # Loading again reuses the module from sys.modules: same functions, same record.
    again = ops.get("tiny_some")
    assert again.module is op.module and again.defaulted == op.defaulted
    assert again.module.oracle is op.module.oracle


@pytest.mark.parametrize("name", ops.REQUIRED)
def test_a_missing_required_name_fails_at_load_naming_it(op_dir, name):
    tree = ast.parse(TINY.format(name="tiny_lacking"))
    kept = [node for node in tree.body
            if not (isinstance(node, ast.FunctionDef) and node.name == name)
            and not (isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets))]
    assert len(kept) == len(tree.body) - 1, f"{name} is not defined once in TINY"
    op_dir("tiny_lacking", ast.unparse(ast.Module(body=kept, type_ignores=[])))
    with pytest.raises(TypeError, match=rf"tiny_lacking\.py lacks {name}$"):
        ops.get("tiny_lacking")


def test_missing_names_are_all_named(op_dir):
    src = TINY.format(name="tiny_bare").replace("def flops(", "def _flops(").replace("def run(", "def _run(")
    op_dir("tiny_bare", src)
    with pytest.raises(TypeError, match=r"lacks run, flops$"):
        ops.get("tiny_bare")


def test_the_optional_names_are_not_required():
    assert not set(ops.DEFAULTS) & set(ops.REQUIRED)
    assert set(ops.DEFAULTS) == {"fill_missing", "oracle", "tolerance"}
    # Export copies these two from the op file: they have no default.
    assert {"run", "alloc_output"} <= set(ops.REQUIRED)


# -- the built-in ops ---------------------------------------------------------------------------------
# Which defaults each built-in op takes (the rest it defines itself, and why is written there).
BUILTIN_DEFAULTED = {
    "add_norm": {"tolerance"},  # fills in the norm's w (and b); its oracle stacks y and the rounded h
    "cat": {"fill_missing", "tolerance"},  # a copy: its oracle is the concatenation (exact); tolerance_for: exact
    "cross_entropy": {"fill_missing", "tolerance"},  # its oracle returns inf where the output dtype overflows
    "gelu": {"fill_missing", "tolerance"},  # oracle rounded once to the output dtype
    "layer_norm": {"tolerance"},  # fills in w = 1, b = 0; its oracle views several trailing dims as rows
    "log_softmax": {"fill_missing", "oracle", "tolerance"},
    "matmul": {"fill_missing", "oracle"},  # tolerance grows with K
    "linear": {"fill_missing"},  # oracle in row x column blocks (bias, residual sliced along); tolerance grows with K
    "swiglu": {"fill_missing"},  # oracle in row x column blocks of both weights; tolerance of two GEMMs
    "pointwise": {"fill_missing", "tolerance"},  # oracle: float64, rounded once; tolerance_for: the casts'
    "reduce": {"fill_missing", "tolerance"},  # oracle: rounded once, argmax's first-index rule
    "rmsnorm": {"tolerance"},  # fills in w = 1; its oracle views trailing dims / one dim as rows
    "rope": {"fill_missing", "oracle", "tolerance"},
    "sdpa": {"fill_missing"},  # its own oracle (written out) and tolerance
    "silu_mul": {"fill_missing", "tolerance"},  # oracle rounded once to the output dtype
    "softmax": {"fill_missing", "oracle", "tolerance"},
}
SMALL = {"linear": (5, 7, 9), "swiglu": (2, 3, 7, 9),
         "matmul": (5, 7, 9), "sdpa": (1, 2, 5, 7, 16), "rope": (1, 2, 5, 16), "cross_entropy": (6, 11)}


def _builtin_names() -> list[str]:
    return sorted(ops.available())  # FORGE_OPS_PATH is unset in every test (conftest)


def test_the_builtin_ops_are_the_ones_listed_here():
    assert _builtin_names() == sorted(BUILTIN_DEFAULTED)


@pytest.mark.parametrize("name", sorted(BUILTIN_DEFAULTED))
def test_every_builtin_op_exposes_the_full_contract(name):
    op = ops.get(name)
    mod = op.module
    for attr in (*ops.REQUIRED, *ops.DEFAULTS):
        assert hasattr(mod, attr), attr
    assert op.defaulted == frozenset(BUILTIN_DEFAULTED[name])
    for attr in ("run", "alloc_output"):  # copied verbatim by forge export: defined in the op file
        assert getattr(mod, attr).__module__ == mod.__name__
    for attr in set(ops.DEFAULTS) - op.defaulted:
        assert getattr(mod, attr).__module__ == mod.__name__, attr
    for dtype in DTYPES:
        tol = mod.tolerance(dtype)
        assert isinstance(tol, Tolerance)
        if "tolerance" in op.defaulted:
            assert tol == ROW_TOLERANCE[dtype]
    spec = mod.make_spec(SMALL.get(name, (3, 37)), "float16", "cpu", None)
    inputs = mod.make_inputs(spec, 0)
    filled = mod.fill_missing(list(inputs))  # every input given: nothing to fill in, same tensors
    assert type(filled) is tuple and len(filled) == len(inputs)
    assert all(a is b for a, b in zip(filled, inputs, strict=True))
    ref = mod.oracle(inputs, spec.attrs)
    if "oracle" in op.defaulted:
        want = mod.reference(tuple(t.double() for t in inputs), spec.attrs)
        assert ref.dtype == torch.float64 and torch.equal(ref, want)
    # Every oracle is at least as good as the fp16 eager reference.
    eager = mod.reference(inputs, spec.attrs).double()
    assert torch.allclose(ref.double(), eager, rtol=1e-2, atol=1e-2)


def test_builtin_default_oracle_values_rmsnorm():
    """rmsnorm's oracle (the default) is its formula evaluated in float64."""
    mod = ops.get("rmsnorm").module
    x = torch.tensor([[1.0, 2.0, 2.0, 4.0]], dtype=torch.float16)
    w = torch.tensor([1.0, 0.5, 2.0, 1.0], dtype=torch.float16)
    got = mod.oracle((x, w), {"eps": 0.0})
    assert got.dtype == torch.float64
    # mean(x^2) = 25/4, rsqrt = 0.4
    assert got[0].tolist() == pytest.approx([0.4, 0.4, 1.6, 1.6], rel=1e-15)


def test_cross_entropy_keeps_its_own_oracle_where_the_default_would_differ():
    """The default on (float64 logits, int64 targets) is finite where fp16's sum overflows; the op's own
    oracle answers inf there, as the kernel and torch do."""
    mod = ops.get("cross_entropy").module
    logits = torch.full((4, 2), 0.0, dtype=torch.float16)
    logits[:, 0] = 60000.0
    target = torch.ones(4, dtype=torch.int64)
    attrs = {"reduction": "sum", "ignore_index": -100}
    default = ops.default_oracle(mod.reference, (logits, target), attrs)
    assert default.dtype == torch.float64 and default.item() == pytest.approx(240000.0)
    assert mod.oracle((logits, target), attrs).item() == float("inf")


# -- nominal hardware facts ---------------------------------------------------------------------------
def test_hardware_table_values():
    assert hardware.GPU_SMS == 132  # H100/H200 SXM
    assert hardware.CPU_SMS == 4  # the interpreter's pretend count
    assert hardware.SMEM_PER_PROGRAM == 200 * 1024


def test_hardware_table_is_stdlib_only():
    tree = ast.parse(Path(hardware.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}, imported


def test_the_sm_counts_reach_the_spaces_and_render_contexts():
    from forge.spec import KernelSpec, TensorSpec

    # The interpreter's persistent launchers get CPU_SMS...
    spec = KernelSpec("gelu", (TensorSpec((64, 64), "float32", device="cpu"),), {"approximate": "none"})
    cand = opkit.Candidate.make("persistent", BLOCK=256, num_warps=1, PROGRAMS_PER_SM=1, num_stages=1)
    assert opkit.elementwise_render_context(spec, cand, "gelu")["CPU_SMS"] == hardware.CPU_SMS
    # ...and a persistent point is valid only where some program loops: more blocks than PROGRAMS_PER_SM x SMs.
    space = opkit.elementwise_space(spec)
    assert cand in space  # 16 blocks > 1 x 4
    assert opkit.Candidate.make("persistent", BLOCK=256, num_warps=1, PROGRAMS_PER_SM=4, num_stages=1) not in space
    gpu = KernelSpec("gelu", (TensorSpec((132 * 256,), "float32", device="cuda"),), {"approximate": "none"})
    at = opkit.Candidate.make("persistent", BLOCK=256, num_warps=2, PROGRAMS_PER_SM=1, num_stages=1)
    assert at not in opkit.elementwise_space(gpu)  # exactly 132 blocks: one per program on 132 SMs
    more = KernelSpec("gelu", (TensorSpec((133 * 256,), "float32", device="cuda"),), {"approximate": "none"})
    assert at in opkit.elementwise_space(more)
