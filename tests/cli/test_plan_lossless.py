"""The machine planner and the lossless form: without `--allow-lossy`, a link- or disk-bound bfloat16 model is
recommended `storage_dtype: "lossless"` where the fewer bytes (with the decode on the device) predict a faster
step; a compute-bound one, and a float32 one (nothing to code), keep their bytes as they are."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from layerstream.machine.planner import Machine, _plan_for_machine, plan_for_machine
from layerstream.models.generation_size import pipeline_generation
from layerstream.models.loading import load_pipeline

SIZE = {"height": 32, "width": 32, "num_frames": 5}


@pytest.fixture(scope="module")
def tiny_wan_bf16():
    return load_pipeline("tiny-wan", dtype=torch.bfloat16)


def test_a_link_bound_bfloat16_model_is_recommended_lossless_without_allow_lossy(tiny_wan_bf16):
    machine = Machine(device_memory_gb=4.0003, activation_reserve_gb=4.0, host_memory_gb=4, device_tflops=1e3, link_gbps=1e-3)
    result = plan_for_machine(tiny_wan_bf16, machine, generation=pipeline_generation(tiny_wan_bf16, **SIZE))
    assert result.config["layer_options"]["dit"]["storage_dtype"] == "lossless"
    assert any("lossless" in note for note in result.notes)
    plain = _plan_for_machine(tiny_wan_bf16, machine, generation=pipeline_generation(tiny_wan_bf16, **SIZE))  # the same machine, the bytes as they are
    assert "storage_dtype" not in plain.config["layer_options"]["dit"]
    assert result.link_nbytes_per_step < plain.link_nbytes_per_step and result.seconds_per_step < plain.seconds_per_step


def test_a_compute_bound_model_keeps_its_bytes(tiny_wan_bf16):
    machine = Machine(device_memory_gb=4.0003, activation_reserve_gb=4.0, host_memory_gb=4, device_tflops=1e-6, link_gbps=100)
    result = plan_for_machine(tiny_wan_bf16, machine, generation=pipeline_generation(tiny_wan_bf16, **SIZE))
    assert result.bound == "compute"
    assert "storage_dtype" not in result.config["layer_options"]["dit"]


def test_the_decode_rate_lengthens_the_link_stage_and_a_shared_core_the_compute(tiny_wan_bf16):
    from layerstream.machine.planner import DEVICE_DECODE_GBPS, MachinePlanError, check_machine
    from layerstream.runtime.packing.lossless_code import ESTIMATED_CODED_FRACTION

    machine = Machine(device_memory_gb=4.0003, activation_reserve_gb=4.0, host_memory_gb=4, device_tflops=1e3, link_gbps=1)
    fast = plan_for_machine(tiny_wan_bf16, machine, generation=pipeline_generation(tiny_wan_bf16, **SIZE), lossless=True)
    assert machine.decode_gbps == DEVICE_DECODE_GBPS and fast.config["layer_options"]["dit"]["storage_dtype"] == "lossless"
    slow = plan_for_machine(tiny_wan_bf16, dataclasses.replace(machine, decode_gbps=0.01), generation=pipeline_generation(tiny_wan_bf16, **SIZE), lossless=True)
    decoded_gb = slow.link_nbytes_per_step / ESTIMATED_CODED_FRACTION / 1e9
    extra = decoded_gb / 0.01 - decoded_gb / DEVICE_DECODE_GBPS  # the same bytes decoded at 0.01 GB/s instead
    assert slow.stage_seconds_per_step["link"] - fast.stage_seconds_per_step["link"] == pytest.approx(extra, rel=1e-6)
    shared = plan_for_machine(tiny_wan_bf16, dataclasses.replace(machine, host_decode_s_per_gb=2.0), generation=pipeline_generation(tiny_wan_bf16, **SIZE), lossless=True)
    assert shared.stage_seconds_per_step["compute"] - fast.stage_seconds_per_step["compute"] == pytest.approx(2.0 * decoded_gb, rel=1e-6)
    plain = plan_for_machine(tiny_wan_bf16, dataclasses.replace(machine, host_decode_s_per_gb=2.0), generation=pipeline_generation(tiny_wan_bf16, **SIZE), lossless=False)
    assert plain.stage_seconds_per_step == plan_for_machine(tiny_wan_bf16, machine, generation=pipeline_generation(tiny_wan_bf16, **SIZE), lossless=False).stage_seconds_per_step
    with pytest.raises(MachinePlanError, match=r"decode_gbps = 0 is not valid"):
        check_machine(dataclasses.replace(machine, decode_gbps=0))


def test_a_copy_thread_and_reads_on_one_core_add_up(tiny_wan_bf16):
    """With a disk tier: where the copy thread and the reads share a core their times per block add up (the
    transfer stage is the core's busy time); apart, they overlap as a DMA engine and a disk do."""
    roomy = Machine(device_memory_gb=4.0003, activation_reserve_gb=4.0, host_memory_gb=4, device_tflops=1e3, link_gbps=1, disk_gbps=0.5, baseline_gb=0, host_reserve_gb=0)
    choice = plan_for_machine(tiny_wan_bf16, roomy, generation=pipeline_generation(tiny_wan_bf16, **SIZE), lossless=False).host_budget
    # host memory for the staging ring and a quarter of the streamed blocks: the rest on disk
    machine = dataclasses.replace(roomy, host_memory_gb=(sum(choice.needs.values()) + choice.streamed_nbytes // 4) / 1e9)
    apart = plan_for_machine(tiny_wan_bf16, machine, generation=pipeline_generation(tiny_wan_bf16, **SIZE), lossless=False)
    budget = apart.host_budget.budget_nbytes
    assert budget is not None and apart.disk_nbytes_per_step > 0, "the plan needs a disk tier for this check"
    shared = plan_for_machine(tiny_wan_bf16, dataclasses.replace(machine, copy_and_read_share_a_core=True), generation=pipeline_generation(tiny_wan_bf16, **SIZE), lossless=False)
    assert shared.config == apart.config
    stages = apart.stage_seconds_per_step
    assert shared.stage_seconds_per_step["link"] == pytest.approx(stages["link"] + stages["disk"], rel=1e-9)
    assert shared.seconds_per_step > apart.seconds_per_step
