"""Scale-out of a manifest run: --devices (one runner per GPU, here interpreter lanes standing in for
GPUs), worker pinning through CUDA_VISIBLE_DEVICES, and --executor ray with a local Ray on the CPU."""

from __future__ import annotations

import json

import pytest
import tomli_w
from typer.testing import CliRunner

from forge.cache import Cache
from forge.errors import UsageError
from forge.tuner import batch
from forge.tuner.pool import worker_env
from forge_cli import cli

runner = CliRunner()
MANIFEST = {"defaults": {"device": "cpu", "budget": 1, "workers": 1},
            "op": [{"op": "softmax", "shapes": ["3x7", "2x9", "4x5"]}, {"op": "rmsnorm", "shape": "2x5"}]}


@pytest.fixture
def manifest(tmp_path):
    p = tmp_path / "forge.toml"
    p.write_text(tomli_w.dumps(MANIFEST))
    return p


def test_worker_env_pins_one_gpu_within_the_outer_allocation():
    assert worker_env({}, None).get("CUDA_VISIBLE_DEVICES") is None
    assert worker_env({}, 1)["CUDA_VISIBLE_DEVICES"] == "1"
    # Under an allocation (Slurm, Ray) of GPUs 4 and 6, index 1 is physical GPU 6.
    assert worker_env({"CUDA_VISIBLE_DEVICES": "4, 6"}, 1)["CUDA_VISIBLE_DEVICES"] == "6"
    assert "PYTHONPATH" in worker_env({}, None)


@pytest.mark.parametrize("text", ["", "a", "0,0", "-1", "0,,x"])
def test_parse_devices_rejects_bad_lists(text):
    with pytest.raises(UsageError):
        batch.parse_devices(text)
    assert batch.parse_devices("0, 2,1") == [0, 2, 1]


@pytest.mark.parametrize("args", [["softmax", "--shape", "4x8", "--devices", "0,1"],
                                  ["softmax", "--shape", "4x8", "--executor", "ray"],
                                  ["--manifest", "M", "--devices", "0,1", "--executor", "ray"],
                                  ["--manifest", "M", "--address", "ray://x:1"],
                                  ["--manifest", "M", "--executor", "dask"]])
def test_scaleout_flags_need_a_manifest_and_fit_together(args, manifest):
    args = [str(manifest) if a == "M" else a for a in args]
    res = runner.invoke(cli.app, ["search", *args])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output


@pytest.mark.slow
def test_devices_spread_jobs_one_at_a_time_per_device(manifest, tmp_path):
    res = runner.invoke(cli.app, ["search", "--manifest", str(manifest), "--devices", "0,1", "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    entries = rep["entries"]
    assert rep["devices"] == [0, 1] and rep["failed"] == 0 and len(entries) == 4
    assert {e["device"] for e in entries} == {0, 1}  # both runners took work
    for dev in (0, 1):  # never two jobs at once on one device
        spans = sorted((e["started"], e["finished"]) for e in entries if e["device"] == dev)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False)), spans
    db = Cache(rep["cache"])
    assert sorted(e.key for e in db.entries()) == sorted(e["key"] for e in entries)  # one decision per job
    # The same keys as a plain run: which device ran a job is not part of its identity.
    again = json.loads(runner.invoke(cli.app, ["search", "--manifest", str(manifest), "--json"]).stdout)
    assert {e["status"] for e in again["entries"]} == {"cached"}


@pytest.mark.slow
def test_ray_executor_with_a_local_ray(manifest, tmp_path):
    import ray  # noqa: F401 - installed with the test extras (forge-kernel[ray])

    res = runner.invoke(cli.app, ["search", "--manifest", str(manifest), "--executor", "ray", "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep["executor"] == "ray" and rep["failed"] == 0
    assert {e["status"] for e in rep["entries"]} == {"searched"}
    db = Cache(rep["cache"])
    stored = {e.key: e for e in db.entries()}
    assert sorted(stored) == sorted(e["key"] for e in rep["entries"])  # merged into the driver's cache
    assert all(stored[e["key"]].decision == e["decision"] for e in rep["entries"])
    # Rerun: the driver's cache already holds every key, so no task searches.
    again = json.loads(runner.invoke(cli.app, ["search", "--manifest", str(manifest), "--executor", "ray",
                                               "--json"]).stdout)
    assert {e["status"] for e in again["entries"]} == {"cached"}
