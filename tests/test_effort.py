"""Effort presets (issue 17): --effort / FORGE_EFFORT / a manifest's effort set the candidate budget where no
layer names one; an explicit budget wins at any precedence."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import forge
from forge.errors import UsageError
from forge.tuner import manifest
from forge_cli import cli

runner = CliRunner()


@pytest.mark.parametrize(("cli_", "env", "layers", "want"), [
    ({}, {}, (), 50),
    ({"effort": "quick"}, {}, (), 12),
    ({"effort": "full"}, {}, (), manifest.EFFORT_BUDGET["full"]),
    ({}, {"FORGE_EFFORT": "quick"}, (), 12),
    ({}, {}, ({"effort": "quick"},), 12),
    ({"effort": "quick"}, {}, ({"budget": 30},), 30),          # an entry's budget beats the CLI's effort
    ({"effort": "full", "budget": 7}, {}, (), 7),
    ({}, {"FORGE_BUDGET": "9", "FORGE_EFFORT": "full"}, (), 9),
    ({"effort": "quick"}, {}, ({}, {"effort": "full"}), 12),    # the CLI's effort beats [defaults]'
])
def test_budget_follows_the_effort_unless_a_budget_is_given(cli_, env, layers, want):
    assert manifest.resolve("budget", cli_, env, *layers) == want


def test_bad_efforts_are_usage_errors(tmp_path):
    res = runner.invoke(cli.app, ["search", "softmax", "--shape", "4x8", "--effort", "max", "--device", "cpu"])
    assert res.exit_code == 2 and "--effort" in res.output and "'quick'" in res.output
    with pytest.raises(UsageError, match="effort"):
        forge.search("softmax", (4, 8), "float32", device="cpu", effort="max", cache=tmp_path / "c.db")
    m = tmp_path / "m.toml"
    m.write_text('[defaults]\ndevice = "cpu"\n[[op]]\nop = "softmax"\nshapes = ["4x8"]\neffort = "lots"\n')
    with pytest.raises(manifest.ManifestError, match="effort"):
        manifest.load(m)


def test_quick_effort_searches_a_dozen_candidates_at_most(tmp_path):
    res = runner.invoke(cli.app, ["search", "layer_norm", "--shape", "4x300", "--dtype", "float32", "--device", "cpu",
                                  "--effort", "quick", "--json", "--workers", "1", "--cache", str(tmp_path / "c.db")])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert 1 < len([c for c in doc["candidates"] if c["variant"] != "torch"]) <= 12
    m = tmp_path / "m.toml"
    m.write_text('[defaults]\ndevice = "cpu"\neffort = "quick"\n[[op]]\nop = "softmax"\nshapes = ["4x8"]\n'
                 '[[op]]\nop = "softmax"\nshapes = ["4x16"]\nbudget = 3\n')
    assert [j.budget for j in manifest.load(m).jobs] == [12, 3]
