"""`benchmarks/headline.py --smoke --json` runs (a tiny scale, seconds of simulated link and disk): the JSON has
the rows the README documents, each running the planner's configuration, every row's output is bit-identical
to its reference (bfloat16 and lossless: the resident pipeline; float8: float8 with everything in host memory),
and the rows really use the disk tier (blocks on disk, bytes read from disk every step, a host pool shared by the
experts; lossless and float8 move fewer bytes). Times are not asserted (they live in benchmarks/README.md)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "headline.py"


@pytest.fixture
def module(monkeypatch):
    spec = importlib.util.spec_from_file_location("headline_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def test_the_smoke_run_gives_every_row_with_outputs_equal_to_their_reference(module, tmp_path, capsys):
    threads = torch.get_num_threads()
    try:
        code = module.main(["--smoke", "--json", "--disk-dir", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)  # the script leaves a core to the copy and read threads
    result = json.loads(capsys.readouterr().out)  # --json: nothing but the JSON on stdout
    assert code == 0
    assert result["schema"] == "layerstream-headline/1" and result["smoke"] and result["simulated"]
    assert result["scale"]["time_and_bytes"] > 1 and result["ideal"]["s_per_step"] > 0
    rows = {r["name"]: r for r in result["rows"]}
    assert {"bfloat16@3", "bfloat16@7", "lossless@3", "lossless@7", "float8@3", "float8@7"} <= set(rows)
    for row in rows.values():
        assert {"x_ideal", "predicted_s", "measured_s", "status"} <= set(row)
    for name in ("bfloat16@3", "bfloat16@7"):
        row = rows[name]
        assert row["status"] == "measured" and row["bit_identical"] and row["reference"] == "resident"
        assert row["x_ideal"] == pytest.approx(row["measured_s"] / row["ideal_s"])
        assert row["predicted_s"] > 0 and row["disk_blocks_per_expert"] > 0 and row["pooled_blocks_per_expert"] > 0
        assert row["disk_gb_per_step"] > 0  # the disk tier is read every step, not only at enable
        assert "host_budget_gb" in row["config"]  # the planner's configuration, which the row ran
    for name in ("bfloat16@3", "bfloat16@7"):
        assert "storage_dtype" not in rows[name]["config"].get("layer_options", {}).get("dit", {})  # as it is
    for name in ("lossless@3", "lossless@7"):
        row = rows[name]
        assert row["status"] == "measured" and row["bit_identical"] and row["reference"] == "resident"
        assert row["config"]["layer_options"]["dit"]["storage_dtype"] == "lossless"
        assert row["link_gb_per_step"] < rows[name.replace("lossless", "bfloat16")]["link_gb_per_step"]  # coded bytes
    for name in ("float8@3", "float8@7"):
        row = rows[name]
        assert row["status"] == "measured" and row["bit_identical"] and row["reference"] == "float8 in host memory"
        assert row["config"]["layer_options"]["dit"]["storage_dtype"] == "float8_e4m3fn" and "host_budget_gb" in row["config"]
        assert row["link_gb_per_step"] < rows["bfloat16@3"]["link_gb_per_step"]  # float8 moves fewer bytes
        assert row["disk_gb_per_step"] < rows["bfloat16@3"]["disk_gb_per_step"]  # and keeps more of them in host memory
    assert not any(tmp_path.rglob("*.block"))  # disable removed every spill file


def test_bad_flags_are_refused_before_anything_is_built(module, capsys):
    with pytest.raises(SystemExit) as exc:
        module.main(["--steps", "0"])
    assert exc.value.code == 2
    assert "--steps = 0 is not valid; expected an integer >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        module.main(["--disk-gbps", "3"])
    assert "--disk-gbps is for a GPU run" in capsys.readouterr().err


def test_the_planner_prices_the_pools_reads_and_the_host_copies(module):
    """The planner's step on the smoke scenario's machine: the host pool's reads at each change of expert are disk
    bytes spread over the generation's steps, and on a device that is the host the copy and read threads'
    measured cost per GB is compute time, in proportion to the bytes they move."""
    from layerstream.machine.planner import Machine, plan_for_machine
    from layerstream.models.generation_size import pipeline_generation
    from wan22_scenario import SMOKE, meta_pipeline

    pipe = meta_pipeline(SMOKE)
    block = module.block_bytes(pipe.transformer.blocks[0])
    # room for a few resident blocks and the slots beside a reserve given (4 GB, the flat reserve this was written
    # for: the estimate at these scaled blocks would be tiny); host memory for the staging ring
    # and a pool of all but one block of each expert (that one read from disk at every use)
    machine = Machine(
        device_memory_gb=4.0 + 6 * block / 1e9, activation_reserve_gb=4.0, host_memory_gb=11 * block / 1e9, baseline_gb=0.0,
        host_reserve_gb=0.0,
    )  # fmt: skip
    tokens = 16
    plain = plan_for_machine(pipe, machine, generation=pipeline_generation(pipe, tokens=tokens, num_inference_steps=4), lossless=False)  # bfloat16 as it is
    tier = plain.placement.host_tier
    assert tier is not None and tier.pool is not None and tier.pool.block_paths  # the experts share a pool
    pooled = sum(block for p in tier.pool.block_paths if p.startswith("transformer."))
    pooled_2 = sum(block for p in tier.pool.block_paths if p.startswith("transformer_2."))
    on_disk = sum(block for p in tier.disk_block_paths if p.startswith("transformer"))
    assert on_disk > 0  # both terms of the reads below are priced
    # per step: the running expert's disk blocks twice (two forwards), and each expert's pooled blocks once in 4 steps
    assert plain.disk_nbytes_per_step == pytest.approx(2 * on_disk / 2 + (pooled + pooled_2) / 4, abs=2)
    longer = plan_for_machine(pipe, machine, generation=pipeline_generation(pipe, tokens=tokens, num_inference_steps=8), lossless=False)
    assert longer.disk_nbytes_per_step < plain.disk_nbytes_per_step  # the same reads spread over more steps

    costly = plan_for_machine(pipe, dataclasses.replace(machine, host_copy_s_per_gb=0.5), generation=pipeline_generation(pipe, tokens=tokens, num_inference_steps=4), lossless=False)
    moved = costly.link_nbytes_per_step + costly.disk_nbytes_per_step
    extra = costly.stage_seconds_per_step["compute"] - plain.stage_seconds_per_step["compute"]
    assert extra == pytest.approx(0.5 * moved / 1e9, rel=1e-6) and costly.seconds_per_step > plain.seconds_per_step
    assert costly.config == plain.config  # a cost changes the prediction, not the placement
