"""`forge export --format hf-kernels`: one Hugging Face `kernels` repository per op (or per model) holding
every tuned shape, whose `layers` `kernels.kernelize` maps onto a tiny Hugging Face Llama built from a
config, on the CPU (Triton interpreter, offline). A layer runs a tuned kernel only for a call that is
exactly one of its specs (the counters and a wrapped Triton launch prove it ran) and the model layer's own
forward for anything else (untuned shape, another eps, autograd on, a tampered index). Re-exporting adds
kernels and loses none, atomically; the repository runs where forge cannot be imported."""

from __future__ import annotations

import ast
import copy
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # before huggingface_hub is imported: nothing here may touch a hub
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from forge import ops  # noqa: E402
from forge.cache import Cache  # noqa: E402
from forge.errors import UsageError  # noqa: E402
from forge.tuner import engine, export, hf_export, hf_runtime, stats  # noqa: E402
from forge_cli import cli  # noqa: E402
from tests.conftest import HAS_CUDA  # noqa: E402
from tests.test_export import NO_FORGE, _clean_env, _imports, kernel_entry  # noqa: E402

pytestmark = pytest.mark.skipif(HAS_CUDA, reason="exercises the interpreter path (CPU tensors)")
runner = CliRunner()

# A tiny Llama (as tests/test_trace_capture.py builds it): hidden 64, 4 heads of 16, 2 KV heads, MLP 128.
LLAMA_CFG = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=1)
# What its layers see for one sequence of 8 tokens (prefill) and of 1 token (a decode step): RMSNorm
# (1, S, 64), the MLP's gate and up (1, S, 128), and q (1, 4, S, 16) / k (1, 2, S, 16) with a (1, 16)
# cos/sin table for rotary. A prefill q is a transpose (not contiguous), so rotary is tuned for decode only.
TUNED = [("rmsnorm", (1, 8, 64)), ("rmsnorm", (1, 1, 64)), ("silu_mul", (1, 8, 128)),
         ("rope", (1, 4, 1, 16)), ("rope", (1, 2, 1, 16))]


def _hf_kernels():
    kernels = pytest.importorskip("kernels")
    if not hasattr(kernels, "get_local_kernel"):  # forge's own kernels/ directory, as a namespace package
        pytest.skip("Hugging Face `kernels` is not installed (pip install kernels)")
    return kernels


def _read_entries(index: Path) -> list[dict]:
    tree = ast.parse(index.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "ENTRIES")
    return ast.literal_eval(node.value)


# -- the repository: layout, merging, atomicity (no `kernels` needed) --------------------------------------

def test_layout_one_repository_per_op_with_every_shape(tmp_path):
    first, second = kernel_entry("rmsnorm", (3, 40)), kernel_entry("rmsnorm", (5, 40), attrs={"eps": 1e-5})
    op = ops.get("rmsnorm")
    done = export.export(first, op, tmp_path, fmt="hf-kernels")
    repo, build = tmp_path / "forge-rmsnorm", tmp_path / "forge-rmsnorm" / "build" / "torch-cpu"
    assert done.path == repo and done.name == "forge-rmsnorm" and done.extra["added"] == [first.key]
    meta = json.loads((build / "metadata.json").read_text())
    assert meta["name"] == "forge-rmsnorm" and meta["backend"] == {"type": "cpu"} and meta["python-depends"] == []
    assert meta["id"].startswith("_forge_rmsnorm_cpu_")
    # Each kernel is the module format's file, unchanged; the fixed files are forge's text, verbatim.
    assert (build / f"_forge_rmsnorm_{first.key[:16]}.py").read_text() == export.render_module(first, op)
    assert (build / "layers.py").read_text() == hf_runtime.LAYERS
    assert (build / "_forge_dispatch.py").read_text() == hf_runtime.DISPATCH
    assert (build / "forge_rmsnorm" / "__init__.py").is_file()  # older kernels releases
    done = hf_export.export_hf([second], tmp_path)
    assert done.extra["added"] == [second.key] and done.extra["entries"] == 2
    assert {r["key"] for r in _read_entries(build / "__init__.py")} == {first.key, second.key}
    assert json.loads((build / "metadata.json").read_text())["id"] != meta["id"]  # unique per set of kernels
    index = (build / "__init__.py").read_text()
    # Two eps values: the function takes eps without a default (a wrong default would pick a kernel).
    assert "def rmsnorm(x, w, *, eps):" in index
    readme = (repo / "README.md").read_text()
    assert "| `RMSNorm` | `RMSNorm` | rmsnorm |" in readme and "float32 5x40" in readme and "kernelize" in readme
    for path in build.rglob("*.py"):  # everything generated runs without forge
        assert not {n.split(".")[0] for n in _imports(path.read_text())} & {"forge", "forge_cli", "forge_ops"}, path


def test_reexport_keeps_every_kernel_replaces_by_spec_and_keeps_the_newer(tmp_path):
    old = kernel_entry("rmsnorm", (3, 40), created_at=1000.0)
    other = kernel_entry("rmsnorm", (4, 40))
    hf_export.export_hf([old, other], tmp_path)
    build = tmp_path / "forge-rmsnorm" / "build" / "torch-cpu"
    again = hf_export.export_hf([old], tmp_path)
    assert again.extra["unchanged"] == [old.key] and again.extra["entries"] == 2
    # The same spec tuned again (another environment: another key), newer: it replaces the old kernel.
    newer = kernel_entry("rmsnorm", (3, 40), created_at=2000.0,
                         env={**old.env, "torch": "9.9.9"})
    done = hf_export.export_hf([newer], tmp_path)
    assert done.extra["replaced"] == [old.key] and done.extra["entries"] == 2
    assert {r["key"] for r in _read_entries(build / "__init__.py")} == {newer.key, other.key}
    assert not (build / f"_forge_rmsnorm_{old.key[:16]}.py").exists()  # no longer in the index
    # An older one is not written over the newer (as `forge cache merge` keeps the newer entry).
    done = hf_export.export_hf([old], tmp_path)
    assert done.extra["superseded"] == [old.key] and done.extra["added"] == done.extra["replaced"] == []
    assert {r["key"] for r in _read_entries(build / "__init__.py")} == {newer.key, other.key}
    # Several ops in one repository (one per model) need a name; a different op joins an op's repository.
    with pytest.raises(UsageError, match="give the repository a --name"):
        hf_export.export_hf([other, kernel_entry("silu_mul", (3, 7))], tmp_path)
    done = hf_export.export_hf([other, kernel_entry("silu_mul", (3, 7))], tmp_path, name="tiny_model")
    assert done.path == tmp_path / "forge-tiny-model" and done.function == "rmsnorm, silu_mul"


def test_a_failed_export_leaves_the_repository_as_it_was(tmp_path, monkeypatch):
    """The index is written last: a failure before it (here: writing it) loses nothing already exported."""
    first = kernel_entry("rmsnorm", (3, 40))
    hf_export.export_hf([first], tmp_path)
    build = tmp_path / "forge-rmsnorm" / "build" / "torch-cpu"
    before = (build / "__init__.py").read_text()
    real = hf_export.atomic_write

    def failing(path, text):
        if path.name == "__init__.py" and path.parent == build:
            raise OSError(28, "No space left on device")
        real(path, text)

    monkeypatch.setattr(hf_export, "atomic_write", failing)
    with pytest.raises(UsageError, match="cannot write .*No space left"):
        hf_export.export_hf([kernel_entry("rmsnorm", (5, 40))], tmp_path)
    assert (build / "__init__.py").read_text() == before
    assert all((build / f"{r['module']}.py").is_file() for r in _read_entries(build / "__init__.py"))


def test_two_exports_into_one_repository_at_once_lose_nothing(tmp_path, monkeypatch):
    """Each export reads the index, extends it and writes it back: without the repository lock the slower
    one would write an index without the other's kernel. Reading is slowed here to make them overlap."""
    real = hf_export._read_index

    def slow(path):
        rows = real(path)
        time.sleep(0.3)
        return rows

    monkeypatch.setattr(hf_export, "_read_index", slow)
    entries = [kernel_entry("rmsnorm", (3, 40)), kernel_entry("rmsnorm", (5, 40))]
    errors = []

    def export_one(entry):
        try:
            hf_export.export_hf([entry], tmp_path)
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=export_one, args=(e,)) for e in entries]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    index = tmp_path / "forge-rmsnorm" / "build" / "torch-cpu" / "__init__.py"
    assert {r["key"] for r in real(index)} == {e.key for e in entries}


def test_an_unknown_or_damaged_repository_is_refused_not_overwritten(tmp_path):
    build = tmp_path / "forge-rmsnorm" / "build" / "torch-cpu"
    build.mkdir(parents=True)
    (build / "__init__.py").write_text('"""an older one-kernel export"""\ndef rmsnorm(x, w): ...\n')
    with pytest.raises(UsageError, match="not the index of a forge hf-kernels repository"):
        hf_export.export_hf([kernel_entry("rmsnorm", (3, 40))], tmp_path)
    assert "older one-kernel export" in (build / "__init__.py").read_text()
    (build / "__init__.py").write_text('ENTRIES = [{"module": "../../elsewhere", "op": "rmsnorm"}]\n')
    with pytest.raises(UsageError, match="not one forge export writes"):
        hf_export.export_hf([kernel_entry("rmsnorm", (3, 40))], tmp_path)
    (build / "__init__.py").unlink()
    hf_export.export_hf([kernel_entry("rmsnorm", (3, 40))], tmp_path)
    next(build.glob("_forge_rmsnorm_*.py")).unlink()
    with pytest.raises(UsageError, match="missing: the repository is damaged"):
        hf_export.export_hf([kernel_entry("rmsnorm", (5, 40))], tmp_path)


def test_all_shapes_takes_one_kernel_per_spec_and_skips_what_cannot_be_exported(tmp_path):
    db = Cache(tmp_path / "forge.db")
    here = kernel_entry("rmsnorm", (3, 40), created_at=1000.0)
    elsewhere = kernel_entry("rmsnorm", (3, 40), created_at=2000.0, env={**here.env, "torch": "0.0.1"})
    tampered = kernel_entry("rmsnorm", (5, 40))
    for entry in (here, elsewhere, tampered, kernel_entry("rmsnorm", (6, 40), decision="eager"),
                  kernel_entry("silu_mul", (3, 7))):
        db.put(entry)
    db._conn.execute("UPDATE entries SET source = source || '# edited' WHERE key = ?", (tampered.key,))
    selection = hf_export.op_entries(db, "rmsnorm")
    # One kernel per spec, the one tuned on this machine although the other is newer; the edited entry is
    # reported, the eager one counted, the other op's left alone.
    assert [e.key for e in selection.entries] == [here.key] and selection.eager == 1
    assert [(e.key, "source_sha256" in why) for e, why in selection.skipped] == [(tampered.key, True)]
    with pytest.raises(export.NotExportable, match="no exportable kernel entry of rmsnorm on cuda"):
        hf_export.op_entries(db, "rmsnorm", device="cuda")
    res = _cli("rmsnorm", "--all-shapes", "--format", "hf-kernels", "--cache", str(tmp_path / "forge.db"), "-o",
               str(tmp_path / "hub"))
    assert res.exit_code == 0 and "skipped:" in res.output and "1 added" in " ".join(res.output.split())


# -- real cache entries, the CLI, and kernelize on a tiny Llama ------------------------------------------

@pytest.fixture(scope="module")
def tuned_db(tmp_path_factory):
    """Real searches on the interpreter for what the tiny Llama's layers see (acceptance forced, as eager
    always wins there), plus an eager decision, which --all-shapes leaves out."""
    d = tmp_path_factory.mktemp("tuned")
    mp = pytest.MonkeyPatch()
    mp.setenv("FORGE_LOCK_DIR", str(d / "locks"))
    mp.setattr(stats, "accepts", lambda *a, **k: True)
    try:
        db = Cache(d / "forge.db")
        for op_name, shape in TUNED:
            report = engine.search(op_name, shape, "float32", device="cpu", cache=db,
                                   options=engine.SearchOptions(budget=1, workers=1))
            assert report.decision == "kernel", (op_name, shape)
        db.put(kernel_entry("rmsnorm", (2, 64), decision="eager"))
        db.close()
    finally:
        mp.undo()
    return d / "forge.db"


def _cli(*args):
    res = runner.invoke(cli.app, ["export", *args])
    assert "Traceback" not in res.output, res.output
    return res


@pytest.mark.slow
def test_cli_all_shapes_per_op_and_per_model(tuned_db, tmp_path):
    hub = tmp_path / "hub"
    res = _cli("rmsnorm", "--all-shapes", "--format", "hf-kernels", "--cache", str(tuned_db), "-o", str(hub),
               "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["path"] == str(hub / "forge-rmsnorm") and len(doc["added"]) == 2 and doc["entries"] == 2
    assert doc["skipped"] == []  # the eager decision is not a kernel: nothing to skip
    # One repository per model: every op's shapes, op by op, under one name; the second export keeps the first.
    for op_name in ("rmsnorm", "silu_mul", "rope"):
        res = _cli(op_name, "--all-shapes", "--format", "hf-kernels", "--name", "llama-tiny", "--cache",
                   str(tuned_db), "-o", str(hub))
        assert res.exit_code == 0, res.output
    assert "5 in the repository" in " ".join(res.stdout.split())
    build = hub / "forge-llama-tiny" / "build" / "torch-cpu"
    assert sorted((r["op"], tuple(r["spec"]["inputs"][0]["shape"])) for r in _read_entries(build / "__init__.py")) \
        == sorted(TUNED)
    # The single-shape form adds one kernel to the op's repository.
    res = _cli("rmsnorm", "--shape", "1x8x64", "--dtype", "float32", "--device", "cpu", "--format", "hf-kernels",
               "--cache", str(tuned_db), "-o", str(tmp_path / "one"), "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["entries"] == 1, res.output


@pytest.mark.slow
@pytest.mark.parametrize("args,needle", [
    (["rmsnorm", "--all-shapes"], "add --format hf-kernels"),
    (["rmsnorm", "--all-shapes", "--format", "hf-kernels", "--shape", "1x8x64"], "not --shape"),
    (["--all-shapes", "--format", "hf-kernels"], "give OP"),
    (["nosuchop", "--all-shapes", "--format", "hf-kernels"], "unknown op"),
    (["rmsnorm", "--all-shapes", "--format", "hf-kernels", "--dtype", "float16"], "no exportable kernel entry"),
    (["gelu", "--all-shapes", "--format", "hf-kernels"], "no exportable kernel entry of gelu"),
    (["rmsnorm", "--all-shapes", "--format", "hf-kernels", "--name", "Not Valid"], "valid Hugging Face kernel name"),
])
def test_cli_all_shapes_errors(tuned_db, tmp_path, args, needle):
    res = _cli(*args, "--cache", str(tuned_db), "-o", str(tmp_path / "o"))
    assert res.exit_code == 2 and needle in " ".join(res.output.split()), res.output
    assert not (tmp_path / "o" / "forge-rmsnorm").exists()


@pytest.fixture(scope="module")
def llama_repo(tuned_db, tmp_path_factory):
    hub = tmp_path_factory.mktemp("hub")
    db = Cache(tuned_db)
    entries = [e for op_name in ("rmsnorm", "silu_mul", "rope") for e in hf_export.op_entries(db, op_name).entries]
    return hf_export.export_hf(entries, hub, name="llama-tiny").path


class _Norm(nn.Module):
    """The attributes transformers' RMSNorm contract names (weight, variance_epsilon), and its formula."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(64))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA_CFG)).eval()


def _mark_llama_layers(kernels, monkeypatch):
    """Make LlamaRMSNorm, LlamaMLP and apply_rotary_pos_emb kernelize-able, undone after the test.

    transformers decorates LlamaRMSNorm with @use_kernel_forward_from_hub("RMSNorm") and apply_rotary_pos_emb
    with ("rotary_pos_emb") only when it accepts the installed `kernels` (transformers 5.24 wants >= 0.18.2;
    with 0.17.2 its decorators are no-ops); kernels' own replace_kernel_forward_from_hub and
    use_kernel_forward_from_hub set what they would. LlamaMLP is marked "SwiGLUMLP" in any case (transformers
    marks no MLP). Returns the rotary function-module, which every LlamaAttention calls."""
    from transformers.models.llama import modeling_llama

    for cls, name in ((modeling_llama.LlamaRMSNorm, "RMSNorm"), (modeling_llama.LlamaMLP, "SwiGLUMLP")):
        if getattr(cls, "kernel_layer_name", None) != name:
            monkeypatch.setattr(cls, "kernel_layer_name", None, raising=False)  # so that undo removes them
            monkeypatch.setattr(cls, "kernel_condition", None, raising=False)
            kernels.replace_kernel_forward_from_hub(cls, name)
    rotary = modeling_llama.apply_rotary_pos_emb
    if getattr(type(rotary), "kernel_layer_name", None) != "rotary_pos_emb":
        rotary = kernels.use_kernel_forward_from_hub("rotary_pos_emb")(rotary)
        monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", rotary)
    # kernelize replaces this one shared module's forward: restore it for the other tests.
    monkeypatch.setattr(rotary, "forward", rotary.forward)
    return rotary


def _kernelize(kernels, model, rotary, mapping):
    @kernels.use_kernelized_func(rotary)
    class _Holder(nn.Module):  # how kernelize reaches a function-module (LlamaAttention does the same)
        pass

    with kernels.use_kernel_mapping(mapping):
        kernels.kernelize(model, mode=kernels.Mode.INFERENCE, device="cpu")
        kernels.kernelize(_Holder(), mode=kernels.Mode.INFERENCE, device="cpu")
    return model


def _launch_counter(k, monkeypatch):
    """Wrap every entry module's Triton launch (what its run() calls): how often each kernel really ran."""
    launched: dict[str, int] = {}
    for entry in k.ENTRIES:
        mod = sys.modules[f"{k.__name__}.{entry['module']}"]

        def counted(*args, _real=mod.launch, _key=entry["key"], **kwargs):
            launched[_key] = launched.get(_key, 0) + 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(mod, "launch", counted)
    return launched


def _key_of(k, op_name, shape):
    return next(e["key"] for e in k.ENTRIES if e["op"] == op_name and tuple(e["spec"]["inputs"][0]["shape"]) == shape)


@pytest.mark.slow
def test_kernelize_maps_the_layers_onto_a_tiny_llama(llama_repo, monkeypatch):
    kernels = _hf_kernels()
    k = kernels.get_local_kernel(llama_repo)
    assert set(k.layers.HUB_LAYERS) >= {"RMSNorm", "rotary_pos_emb", "SwiGLUMLP"} and len(k.tuned()) == 5
    model = _llama()
    ids = torch.randint(0, LLAMA_CFG["vocab_size"], (1, 8), generator=torch.Generator().manual_seed(1))
    prefill_in, decode_in, untuned_in = ids, ids[:, :1], ids[:, :5]
    # The model's own results, taken before anything is marked or kernelized (the rotary function-module
    # kernelize swaps is shared by every Llama in the process).
    other_eps = copy.deepcopy(model)
    other_eps.model.norm.variance_epsilon = 1e-3
    with torch.no_grad():
        want = {n: model(t).logits for n, t in (("prefill", prefill_in), ("decode", decode_in),
                                                ("untuned", untuned_in))}
        want["other_eps"] = other_eps(prefill_in).logits
    rotary = _mark_llama_layers(kernels, monkeypatch)
    mapping = k.kernel_mapping(device="cpu")
    assert set(mapping) == {"RMSNorm", "rotary_pos_emb", "SwiGLUMLP"}
    _kernelize(kernels, model, rotary, mapping)
    assert model.model.norm.forward.__func__ is k.layers.RMSNorm.forward  # kernelize swapped the forward in
    launched = _launch_counter(k, monkeypatch)

    def run(tokens, grad=False):
        k.reset_stats()
        launched.clear()
        with torch.set_grad_enabled(grad):
            return model(tokens).logits.detach()

    rms8, rms1 = _key_of(k, "rmsnorm", (1, 8, 64)), _key_of(k, "rmsnorm", (1, 1, 64))
    silu8 = _key_of(k, "silu_mul", (1, 8, 128))
    rope_q, rope_k = _key_of(k, "rope", (1, 4, 1, 16)), _key_of(k, "rope", (1, 2, 1, 16))
    # Prefill (8 tokens): 5 RMSNorms (2 per layer and the final one) and 2 MLPs run forge's kernels (the
    # Triton launches counted are theirs); rotary's q is a transpose, not contiguous, and that shape is
    # untuned: the model's own apply_rotary_pos_emb.
    torch.testing.assert_close(run(prefill_in), want["prefill"], rtol=1e-4, atol=1e-5)
    assert k.stats()["kernel"] == {rms8: 5, silu8: 2} and launched == {rms8: 5, silu8: 2}
    assert k.stats()["original"] == {"rotary_pos_emb": 2}
    # A decode-shaped step (1 token): RMSNorm and rotary (q and k) tuned; the MLP at 1 token is not.
    torch.testing.assert_close(run(decode_in), want["decode"], rtol=1e-4, atol=1e-5)
    assert k.stats()["kernel"] == {rms1: 5, rope_q: 2, rope_k: 2} and launched == k.stats()["kernel"]
    assert k.stats()["original"] == {"SwiGLUMLP": 2} and "(1, 1, 128)" in k.stats()["reasons"]["SwiGLUMLP"]
    # An untuned length: every layer runs the model's own forward, so the logits are the model's, bit for bit.
    assert torch.equal(run(untuned_in), want["untuned"])
    assert k.stats()["kernel"] == {} and launched == {}
    assert k.stats()["original"] == {"RMSNorm": 5, "rotary_pos_emb": 2, "SwiGLUMLP": 2}
    # Autograd on: the kernels are forward-only, so none runs.
    assert torch.equal(run(prefill_in, grad=True), want["prefill"])
    assert k.stats()["kernel"] == {} and "requires grad" in k.stats()["reasons"]["RMSNorm"]
    # Another eps than the tuned one (the final norm's): that norm runs its own forward, the others the kernel.
    model.model.norm.variance_epsilon = 1e-3
    torch.testing.assert_close(run(prefill_in), want["other_eps"], rtol=1e-4, atol=1e-5)
    assert k.stats()["kernel"][rms8] == 4 and k.stats()["original"]["RMSNorm"] == 1
    assert "tuned for eps=1e-06, got eps=0.001" in k.stats()["reasons"]["RMSNorm"]


@pytest.mark.slow
def test_a_tampered_index_cannot_send_a_call_to_the_wrong_kernel(llama_repo, tmp_path):
    """ENTRIES is only the first cut: the entry's own module decides. An index edited to claim that the
    (1, 8, 64) kernel serves (1, 5, 64) gets no kernel run for (1, 5, 64)."""
    kernels = _hf_kernels()
    import shutil

    repo = tmp_path / "forge-llama-tiny"
    shutil.copytree(llama_repo, repo)
    index = repo / "build" / "torch-cpu" / "__init__.py"
    text = index.read_text()
    assert text.count("'shape': [1, 8, 64]") == 1
    index.write_text(text.replace("'shape': [1, 8, 64]", "'shape': [1, 5, 64]"))
    meta = repo / "build" / "torch-cpu" / "metadata.json"  # another id: not the module loaded above
    meta.write_text(meta.read_text().replace('"id": "_forge_llama_tiny_cpu_', '"id": "_forge_llama_tiny_cpu_x'))
    k = kernels.get_local_kernel(repo)
    x, w = torch.randn(1, 5, 64), torch.randn(64)
    module, why = k.find("rmsnorm", (x, w), {"eps": 1e-6})
    assert module is None and "x must be float32 of shape (1, 8, 64)" in why
    with pytest.raises(ValueError, match=r"shape \(1, 8, 64\)"):
        k.rmsnorm(x, w)
    # Its layer, on a module of transformers' RMSNorm contract: the module's own forward.
    norm = _Norm()
    with torch.no_grad():
        assert torch.equal(k.layers.RMSNorm.forward(norm, x), norm(x))
    assert k.stats()["kernel"] == {} and "(1, 8, 64)" in k.stats()["reasons"]["RMSNorm"]


_FORGE_FREE = NO_FORGE + textwrap.dedent("""
    from pathlib import Path
    import torch
    from torch import nn
    import kernels

    class RMSNorm(nn.Module):  # transformers' RMSNorm contract: weight, variance_epsilon
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(64))
            self.variance_epsilon = 1e-6

        def forward(self, x):
            v = x.pow(2).mean(-1, keepdim=True)
            return self.weight * (x * torch.rsqrt(v + self.variance_epsilon))

    kernels.replace_kernel_forward_from_hub(RMSNorm, "RMSNorm")
    k = kernels.get_local_kernel(Path(sys.argv[1]))
    norm = RMSNorm()
    x = torch.randn(1, 8, 64)
    with torch.no_grad():
        want = norm(x)
        with kernels.use_kernel_mapping(k.kernel_mapping()):
            kernels.kernelize(norm, mode=kernels.Mode.INFERENCE, device="cpu")
        got = norm(x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert sum(k.stats()["kernel"].values()) == 1, k.stats()
    print("forge-free ok", sorted(m for m in sys.modules if m.split(".")[0] == "forge"))
""")


@pytest.mark.slow
def test_the_repository_loads_and_kernelizes_without_forge(llama_repo, tmp_path):
    _hf_kernels()
    (tmp_path / "run.py").write_text(_FORGE_FREE)
    env = {**_clean_env(), "HF_HUB_OFFLINE": "1"}
    res = subprocess.run([sys.executable, str(tmp_path / "run.py"), str(llama_repo)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "forge-free ok []" in res.stdout
