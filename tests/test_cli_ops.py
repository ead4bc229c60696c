"""`forge --version`, `forge ops` and "did you mean" for op names (issue 17, visibility)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from forge import ops
from forge._version import __version__
from forge.errors import UsageError
from forge_cli import cli

runner = CliRunner()


def test_version():
    res = runner.invoke(cli.app, ["--version"])
    assert res.exit_code == 0 and res.output.strip() == f"forge {__version__}"


def test_ops_lists_every_family_with_attrs_and_variants():
    res = runner.invoke(cli.app, ["ops", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["version"] == 1
    by = {r["op"]: r for r in doc["ops"]}
    assert set(by) == set(ops.available())
    assert by["rmsnorm"]["attrs"]["eps"] == 1e-6 and "form" in by["rmsnorm"]["optional_attrs"]
    assert set(by["sdpa"]["variants"]) == {"flash", "flash_split", "split_kv"}
    assert all(r["variants"] and r["summary"] for r in doc["ops"])
    table = runner.invoke(cli.app, ["ops"])
    assert table.exit_code == 0 and "layer_norm" in table.output and "split_kv" in table.output


@pytest.mark.parametrize(("typed", "meant"), [("rmsnrm", "rmsnorm"), ("layernorm", "layer_norm"),
                                              ("RMSNorm", "rmsnorm"), ("cross-entropy", "cross_entropy"),
                                              ("softmx", "softmax")])
def test_did_you_mean(typed, meant):
    with pytest.raises(UsageError, match=f"did you mean '{meant}'"):
        ops.get(typed)
    res = runner.invoke(cli.app, ["search", typed, "--shape", "4x8", "--device", "cpu"])
    assert res.exit_code == 2 and f"did you mean '{meant}'" in res.output


def test_no_suggestion_for_something_else():
    with pytest.raises(UsageError) as exc:
        ops.get("convolution")
    assert "did you mean" not in str(exc.value)


def test_shell_completion_script_and_op_names(monkeypatch):
    from forge_cli.options import complete_op

    # The shell named, not detected: typer detects it from the process's ancestors, and a test run whose
    # parent shell has exited (an orphaned background run) has none ("Shell  not supported", exit 1).
    monkeypatch.setenv("_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION", "1")
    res = runner.invoke(cli.app, ["--show-completion", "bash"], prog_name="forge")
    assert res.exit_code == 0 and "_FORGE_COMPLETE" in res.output and "complete" in res.output
    assert complete_op("rms") == ["rmsnorm"]
    assert complete_op("") == sorted(ops.available()) and "cat" in complete_op("c")
    assert complete_op("nope") == []
    # the op argument of search, bench and export completes op names in the shell
    for cmd in ("search", "bench", "export"):
        res = runner.invoke(cli.app, [cmd, "rms"], prog_name="forge",
                            env={"_FORGE_COMPLETE": "complete_bash", "COMP_WORDS": f"forge {cmd} rms",
                                 "COMP_CWORD": "2"})
        assert res.output.split() == ["rmsnorm"], (cmd, res.output)
