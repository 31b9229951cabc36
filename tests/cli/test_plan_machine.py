"""`layerstream plan MODEL --device-memory GB --host-memory GB ...`: the plan for a machine, its JSON, its errors."""

from __future__ import annotations

import json
import re

import pytest

from layerstream.cli import plan_cmd
from layerstream.cli.main import main
from layerstream.machine.planner import Machine, plan_for_machine
from layerstream.machine.step_time import block_flops
from layerstream.models.generation_estimates import block_activation_nbytes, decode_steps, latent_tokens
from layerstream.models.generation_size import pipeline_generation
from layerstream.models.loading import load_pipeline

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast

EXIT_USAGE = 2
SMALL = ["--height", "32", "--width", "32", "--num-frames", "5"]
"""A small generation, so that --measure takes a moment on the CPU."""


def run_plan(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(["plan", *argv])
    except SystemExit as e:  # a flag's value refused by argparse, through the CLI's one-line error
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def tiny_wan():
    return load_pipeline("tiny-wan")


def _must_not_load(args):
    pytest.fail("the model was loaded before the flags were checked")


@pytest.mark.parametrize(
    "argv, fragments",
    [
        (["--host-memory", "8"], ["--host-memory = 8", "needs --device-memory"]),
        (["--device-memory", "24"], ["--device-memory = 24", "needs --host-memory"]),
        (["--device-memory", "0", "--host-memory", "8"], ["--device-memory", "0", "a finite number > 0"]),
        (["--device-memory", "24", "--host-memory", "nan"], ["--host-memory", "nan"]),
        (["--device-memory", "24", "--host-memory", "8", "--link-gbps", "-1"], ["--link-gbps", "-1"]),
        (["--device-memory", "24", "--host-memory", "8", "--disk-gbps", "x"], ["--disk-gbps", "'x'"]),
        (["--measure"], ["--measure", "only used with --device-memory and --host-memory"]),
        (["--allow-lossy"], ["--allow-lossy", "only used with"]),
        (["--device-memory", "24", "--host-memory", "8", "--diffusion-offload-config", "{}"], ["--diffusion-offload-config", "recommends"]),
    ],
)
def test_bad_flags_give_one_line_before_loading(capsys, monkeypatch, argv, fragments):
    monkeypatch.setattr(plan_cmd, "_skeleton", _must_not_load)
    monkeypatch.setattr(plan_cmd, "_weights", _must_not_load)
    code, out, err = run_plan(capsys, "tiny-wan", *argv)
    assert code == EXIT_USAGE and out == "" and err.count("\n") == 1 and err.startswith("layerstream: error: "), err
    for fragment in fragments:
        assert fragment in err


def test_a_size_the_model_cannot_make_is_refused_as_generate_refuses_it(capsys, monkeypatch):
    """--height 1000000 traced the tiled decode tile by tile for over a minute; it is refused before any tracing."""
    from layerstream.machine import planner

    monkeypatch.setattr(planner, "plan_for_machine", lambda *a, **k: pytest.fail("planned a size the model cannot make"))
    code, out, err = run_plan(capsys, "tiny-wan", "--device-memory", "24", "--host-memory", "16", "--height", "1000000")
    assert code == EXIT_USAGE and out == "" and err.count("\n") == 1
    assert "--height = 1000000 is not valid; expected a multiple of 16 up to 1024 for tiny-wan" in err


def test_a_machine_too_small_is_one_line_naming_the_figure(capsys):
    code, out, err = run_plan(capsys, "tiny-wan", "--device-memory", "24", "--host-memory", "1")
    assert code == EXIT_USAGE and out == "" and err.count("\n") == 1
    assert "--host-memory = 1 is not valid" in err and "baseline of 1.41 GB" in err
    assert err.endswith("(imports and the device's context; set by --baseline-gb)\n")  # every field as its flag
    # under the allowance beside the weights (the 4 GB activation reserve this once named is gone: the reserve is
    # the request's own estimate, `tests/cli/test_plan_phases.py`)
    code, _, err = run_plan(capsys, "tiny-wan", "--device-memory", "0.5", "--host-memory", "8")
    assert code == EXIT_USAGE and err.count("\n") == 1 and "--device-memory = 0.5: VAE decode 0.506 GB" in err
    assert "the weights kept on the device, the slot ring and the allowance alone need 0.5 GB" in err


def test_json_gives_the_config_to_paste_and_the_figures(capsys, tiny_wan):
    code, out, err = run_plan(capsys, "tiny-wan", "--device-memory", "4.0003", "--activation-reserve-gb", "4", "--host-memory", "4", "--json", *SMALL)
    assert code == 0, err
    recommended = json.loads(out)["recommended"]
    config = recommended["diffusion_offload_config"]
    assert config["layer_options"]["dit"] == {"resident_layers": "auto", "device_budget_gb": 0.0003}
    assert "storage_dtype" not in config["layer_options"]["dit"]  # lossless unless --allow-lossy
    assert set(recommended["bytes"]) == {"device", "host", "disk"} and recommended["bound"] in ("compute", "link", "disk")
    assert recommended["predicted_seconds_per_step"] > 0 and recommended["per_step"]["disk_bytes"] == 0
    assert recommended["predicted_decode_seconds"] > 0
    assert recommended["host_budget"]["budget_bytes"] is None  # everything fits: no disk tier, no host_budget_gb
    assert "host_budget_gb" not in config


def test_json_states_the_generation_planned_for_and_where_each_figure_came_from(capsys, tiny_wan):
    """The size, frames and steps planned for: the flags given, the model's rules for the rest (tiny-wan's own
    steps and size, not its diffusers pipeline's 50 steps at 480x832), with and without a machine."""
    from layerstream.models.model_rules import read_model_rules

    rules = read_model_rules(tiny_wan, "tiny-wan")
    code, out, err = run_plan(capsys, "tiny-wan", "--device-memory", "4.0003", "--activation-reserve-gb", "4", "--host-memory", "4", "--json", "--height", "32")
    assert code == 0, err
    generation = json.loads(out)["generation"]
    assert generation["height"] == {"value": 32, "from": "--height"}
    assert generation["width"] == {"value": rules.default_width, "from": "the model's rules"}
    assert generation["num_frames"] == {"value": rules.default_num_frames, "from": "the model's rules"}
    assert generation["num_inference_steps"] == {"value": rules.default_num_inference_steps, "from": "the model's rules"}
    assert rules.default_num_inference_steps != 50  # the tiny model's own steps, which its pipeline's call does not say
    code, out, err = run_plan(capsys, "tiny-wan", "--device-memory", "4.0003", "--activation-reserve-gb", "4", "--host-memory", "4", "--json", "--steps", "7")
    assert code == 0 and json.loads(out)["generation"]["num_inference_steps"] == {"value": 7, "from": "--steps"}
    code, out, err = run_plan(capsys, "tiny-wan", "--json")
    assert code == 0, err
    plain = json.loads(out)["generation"]
    assert {name: figure["from"] for name, figure in plain.items()} == dict.fromkeys(plain, "the model's rules")
    assert plain["height"]["value"] == rules.default_height and plain["num_inference_steps"]["value"] == rules.default_num_inference_steps


def test_the_prediction_is_the_bench_ideal_of_the_placed_blocks(tiny_wan):
    from layerstream.plan.resolved import lookup
    from layerstream.timing import ideal

    machine = Machine(device_memory_gb=4.0003, activation_reserve_gb=4.0, host_memory_gb=4, device_tflops=1e-3, link_gbps=1e-3)
    result = plan_for_machine(tiny_wan, machine, generation=pipeline_generation(tiny_wan, height=32, width=32, num_frames=5))
    tokens = latent_tokens(tiny_wan, {"height": 32, "width": 32, "num_frames": 5})
    assert tokens == 2 * 2 * 2  # 32 px / 16 px per token, squared, times (5 - 1) / 4 + 1 latent frames
    blocks = [p for c in result.placement.chains for p in c.block_paths]
    resident = set(result.placement.residency["transformer"].resident_block_paths)
    paths = [f"transformer.blocks.{i}" for i in range(len(tiny_wan.transformer.blocks))]
    compute = [block_flops(lookup(tiny_wan, p), tokens) / 1e9 for p in paths]
    sizes = [result.placement.block_slot_nbytes.get(p, 0) for p in paths]
    link = ideal.block_transfer_seconds(sizes, [p not in resident and p in blocks for p in paths], 1e-3)
    assert result.seconds_per_step == pytest.approx(2 * ideal.ideal_forward_seconds(compute, link))
    assert result.bound == "link" and result.link_nbytes_per_step == 2 * sum(sizes)
    # the decode: its work in steps (what a server's first job's ETA prices too) at the step's compute seconds
    planned_decode = decode_steps(tiny_wan, {"height": 32, "width": 32, "num_frames": 5}, 2) * 2 * sum(compute)
    assert result.decode_seconds == pytest.approx(planned_decode) and result.decode_seconds > 0


def test_a_small_host_puts_blocks_on_disk_and_the_disk_shows_in_the_prediction(tiny_wan):
    machine = Machine(device_memory_gb=4.0003, activation_reserve_gb=4.0, host_memory_gb=1.41 + 2.0 + 0.00025, disk_gbps=1e-4, host_reserve_gb=2.0)  # staging 0.16 MB + two blocks
    result = plan_for_machine(tiny_wan, machine, generation=pipeline_generation(tiny_wan, height=32, width=32, num_frames=5))
    tier = result.placement.host_tier
    assert result.config["host_budget_gb"] == pytest.approx(result.host_budget.budget_gb, rel=1e-3)
    assert result.config["host_budget_gb"] <= result.host_budget.budget_gb  # rounded down: pasted back it still fits
    assert tier is not None and tier.disk_block_paths and result.disk_nbytes_per_step > 0
    assert result.bound == "disk" and result.host_nbytes <= machine.host_memory_gb * 1e9


def test_allow_lossy_recommends_float8(tiny_wan):
    machine = Machine(device_memory_gb=4.0003, activation_reserve_gb=4.0, host_memory_gb=8, allow_lossy=True)
    result = plan_for_machine(tiny_wan, machine, generation=pipeline_generation(tiny_wan, height=32, width=32, num_frames=5))
    assert result.config["layer_options"]["dit"]["storage_dtype"] == "float8_e4m3fn"
    lossless = plan_for_machine(tiny_wan, Machine(device_memory_gb=4.0003, activation_reserve_gb=4.0, host_memory_gb=8), generation=pipeline_generation(tiny_wan, height=32, width=32, num_frames=5))
    assert result.link_nbytes_per_step < lossless.link_nbytes_per_step  # float8 bytes (and the scales) on the link


def test_measure_times_the_blocks_on_this_device(capsys):
    code, out, err = run_plan(capsys, "tiny-wan", "--device-memory", "4.0003", "--activation-reserve-gb", "4", "--host-memory", "4", "--measure", "--json", *SMALL)
    assert code == 0, err
    recommended = json.loads(out)["recommended"]
    assert recommended["compute"].startswith("measured") and recommended["predicted_seconds_per_step"] > 0


def test_the_table_names_the_bound_and_the_config_to_paste(capsys):
    code, out, err = run_plan(capsys, "tiny-wan", "--device-memory", "4.0003", "--activation-reserve-gb", "4", "--host-memory", "4", *SMALL)
    assert code == 0, err
    assert "predicted:" in out and "bound by" in out and "--diffusion-offload-config '" in out
    # seconds and bytes as people read them, in decimal units only: "185 ns per step", not "1.848e-07 s"
    assert re.search(r"predicted: [\d.]+ (ns|µs|ms|s) per step", out) and "e-0" not in out
    assert re.search(r"VAE decode: untiled .*, about [\d.]+ (ns|µs|ms|s) \(its convolutions' FLOPs at the step's compute rate\)", out)
    assert not re.search(r"\b(KiB|MiB|GiB)\b", out)
    pasted = out.split("--diffusion-offload-config '")[1].split("'")[0]
    from layerstream.config.offload_config import parse_offload_config

    assert parse_offload_config(pasted).layer_options["dit"].resident_layers == "auto"


def test_the_lossy_plan_runs_and_keeps_blocks_in_memory_where_a_disk_tier_would_cost_more(tiny_wan):
    import numpy as np

    from layerstream import Omni

    size = {"height": 32, "width": 32, "num_frames": 5}
    roomy = plan_for_machine(tiny_wan, Machine(device_memory_gb=4.0003, activation_reserve_gb=4.0, host_memory_gb=8, allow_lossy=True), generation=pipeline_generation(tiny_wan, **size))
    block = roomy.host_budget.streamed_nbytes // len(tiny_wan.transformer.blocks)  # float8 bytes and scales
    room = sum(roomy.host_budget.needs.values()) + 5 * block // 2  # two and a half blocks beside the rings
    result = plan_for_machine(tiny_wan, Machine(device_memory_gb=4.0003, activation_reserve_gb=4.0, host_memory_gb=1.41 + room / 1e9, allow_lossy=True), generation=pipeline_generation(tiny_wan, **size))
    # the staging ring a disk tier would need (three float8 blocks, not three slots) and the budget left beside
    # it cost more than holding every block: no disk tier
    staging = result.host_budget.needs["disk staging ring"]
    assert staging == 3 * roomy.host_budget.streamed_nbytes // len(roomy.placement.streamed_block_paths)
    assert staging < roomy.host_budget.streamed_nbytes <= 5 * block // 2 + staging
    assert "host_budget_gb" not in result.config and result.config["layer_options"]["dit"]["storage_dtype"] == "float8_e4m3fn"
    omni = Omni(model="tiny-wan", diffusion_offload_config=dict(result.config))
    output = np.asarray(omni.generate(prompt="a fox", num_inference_steps=2, seed=0, **size, keep_raw=True).raw)
    assert np.isfinite(output).all() and omni.stats().disk_bytes_read == 0
    omni.close()


def test_the_activation_estimate_of_a_wan_block_at_720p():
    """Wan 2.2 A14B's block at 720p x 81 frames (75,600 tokens, width 5120, FFN 13824, bfloat16): the residual
    stream and its normed copy beside the FFN's two 13824-wide intermediates are the peak."""
    import torch
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock


    with torch.device("meta"):
        block = WanTransformerBlock(dim=5120, ffn_dim=13824, num_heads=40, qk_norm="rms_norm_across_heads", cross_attn_norm=True, eps=1e-6).to(torch.bfloat16)
    tokens = 21 * 45 * 80
    assert block_activation_nbytes(block, tokens) == tokens * (2 * 5120 + 2 * 13824) * 2  # 5.73 GB


def test_the_host_reserve_is_estimated_for_the_generation_and_host_reserve_gb_overrides_it(capsys, tiny_wan):
    from layerstream.host.reserve import DECODED_BYTES_PER_VALUE, ENCODING_BYTES_PER_VALUE, FLOOR_NBYTES, estimate_host_reserve

    video = {"height": 720, "width": 1280, "num_frames": 81}
    reserve = estimate_host_reserve(tiny_wan, device_is_host=False, generation=pipeline_generation(tiny_wan, **video))
    values = 720 * 1280 * 81 * 3
    assert reserve.parts["decoded frames"] == DECODED_BYTES_PER_VALUE * values  # 2.9 GB: more than the old flat 2 GB
    assert reserve.parts["output encoding"] == ENCODING_BYTES_PER_VALUE * values
    assert reserve.nbytes == sum(reserve.parts.values()) > 3e9 and "activations (the device is the host)" not in reserve.parts
    on_cpu = estimate_host_reserve(tiny_wan, device_is_host=True, generation=pipeline_generation(tiny_wan, **video), dit_blocks=(tiny_wan.transformer.blocks[0],))
    assert on_cpu.parts["activations (the device is the host)"] > 0 and on_cpu.nbytes > reserve.nbytes
    small = estimate_host_reserve(tiny_wan, device_is_host=False, generation=pipeline_generation(tiny_wan, height=32, width=32, num_frames=5))
    assert small.nbytes == FLOOR_NBYTES > sum(small.parts.values())  # a small generation: the floor

    machine = Machine(device_memory_gb=8, host_memory_gb=16)
    planned = plan_for_machine(tiny_wan, machine, generation=pipeline_generation(tiny_wan, **video))
    assert planned.host_budget.needs["reserve (estimated)"] == reserve.nbytes
    assert "estimated for 720x1280 x 81 frames: decoded frames 2.91 GB" in planned.host_budget.describe()
    given = plan_for_machine(tiny_wan, Machine(device_memory_gb=8, host_memory_gb=16, host_reserve_gb=0.5), generation=pipeline_generation(tiny_wan, **video))
    assert given.host_budget.needs["reserve (host_reserve_gb)"] == 500_000_000 and given.host_reserve.parts == {}

    # the command line plans what tiny-wan can make (a side of at most 1024): the same estimate, worded
    code, out, _ = run_plan(capsys, "tiny-wan", "--device-memory", "8", "--host-memory", "16", "--height", "720", "--width", "1024", "--num-frames", "81")
    wide = plan_for_machine(tiny_wan, machine, generation=pipeline_generation(tiny_wan, height=720, width=1024, num_frames=81))
    assert code == 0 and "estimated for 720x1024 x 81 frames: decoded frames" in out
    assert wide.host_budget.describe().split("estimated for")[1].split(")")[0] in out
