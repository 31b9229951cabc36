"""Every phase's device peak, planned (`machine.phases`, `machine.device_fit`): each phase adds up from its parts,
the largest bounds the device, residency "auto" leaves the largest phase's transient free (the request's own
estimate, no flat floor), and a device that cannot hold some phase is refused naming it and what would fit."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from layerstream.machine.phases import ALLOWANCE, SLOT_RING, WEIGHTS
from layerstream.machine.planner import Machine, MachinePlanError, plan_for_machine
from layerstream.models.generation_estimates import block_activation_nbytes
from layerstream.models.generation_size import pipeline_generation
from layerstream.models.loading import load_pipeline
from layerstream.cli.main import main

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast


def run_plan(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def tiny_wan():
    return load_pipeline("tiny-wan")


def _transient(phase) -> int:
    return phase.nbytes - sum(phase.parts[k] for k in (WEIGHTS, SLOT_RING, ALLOWANCE))


def test_each_phase_adds_up_from_its_parts_and_the_largest_bounds_the_device(tiny_wan):
    machine = Machine(device_memory_gb=8, host_memory_gb=16, activation_reserve_gb=7.9999)  # every block streams
    result = plan_for_machine(tiny_wan, machine, generation=pipeline_generation(tiny_wan, height=32, width=32, num_frames=5))
    phases = result.device_phases
    assert [p.phase for p in phases.phases] == ["prompt encoding", "denoising", "VAE decode"]  # no image encoder
    for phase in phases.phases:
        assert phase.nbytes == sum(phase.parts.values())
        assert phase.parts[WEIGHTS] == sum(phases.weights_by_component.values())  # the resident parts, every phase
        assert phase.parts[SLOT_RING] == result.placement.ring_nbytes > 0 and phase.parts[ALLOWANCE] == 0.5e9
    assert phases.weights_by_component["vae"] == sum(p.numel() * p.element_size() for p in tiny_wan.vae.parameters()) + sum(
        b.numel() * b.element_size() for b in tiny_wan.vae.buffers()
    )
    assert phases.peak.nbytes == max(p.nbytes for p in phases.phases) == result.device_nbytes
    assert phases.peak.phase == "VAE decode"  # 32x32 x 5 frames decoded, against 8 latent tokens and 512 text ones
    document = result.to_dict()["recommended"]["phases"]
    assert document["device"]["bounded_by"] == "VAE decode" and document["device"]["peak_bytes"] == result.device_nbytes
    assert set(document["device"]["phases"]["denoising"]) == {"bytes", "parts", "note"}
    host = document["host"]
    assert set(host["phases"]) == {"loading and enabling", "generating"} and host["phases"]["generating"]["bytes"] == result.host_nbytes


def test_the_reserve_is_the_requests_own_estimate_not_a_floor(tiny_wan):
    """residency "auto" leaves the largest phase's transient and the allowance free: a small request leaves
    little (tiny-wan, under 1 MB, once had 4 GB set aside), a large one its own activations."""
    machine = Machine(device_memory_gb=24, host_memory_gb=16)
    small = plan_for_machine(tiny_wan, machine, generation=pipeline_generation(tiny_wan, height=64, width=64, num_frames=9))
    largest = max(_transient(p) for p in small.device_phases.phases)
    assert small.activation_reserve_gb == pytest.approx((largest + 0.5e9) / 1e9) and small.activation_reserve_gb < 0.55
    assert small.config["layer_options"]["dit"]["device_budget_gb"] == pytest.approx(24 - small.activation_reserve_gb, abs=1e-4)
    block = tiny_wan.transformer.blocks[0]
    tokens = int(10e9 // block_activation_nbytes(block, 1))  # about 10 GB of activations in one forward
    large = plan_for_machine(tiny_wan, machine, generation=pipeline_generation(tiny_wan, height=64, width=64, num_frames=9, tokens=tokens))
    denoising = large.device_phases.phase("denoising")
    assert large.device_phases.peak is denoising and 9.9e9 < _transient(denoising) < 10.01e9
    assert large.activation_reserve_gb == pytest.approx((_transient(denoising) + 0.5e9) / 1e9)
    assert large.config["layer_options"]["dit"]["device_budget_gb"] == pytest.approx(24 - large.activation_reserve_gb, abs=1e-4)
    assert large.device_nbytes <= 24e9


def test_tiny_wan_plans_on_4_gb_and_json_states_each_phase(capsys):
    code, out, err = run_plan(capsys, "tiny-wan", "--device-memory", "4", "--host-memory", "16", "--json")
    assert code == 0, err  # refused before: "leaves nothing beside the activation reserve of 4 GB"
    device = json.loads(out)["recommended"]["phases"]["device"]
    assert device["memory_bytes"] == 4e9 and device["peak_bytes"] <= 4e9 and device["bounded_by"] in device["phases"]
    code, out, err = run_plan(capsys, "tiny-wan", "--device-memory", "4", "--host-memory", "16")
    assert code == 0 and "at its peak, in VAE decode" in out and "    denoising " in out and "loading and enabling" in out


@pytest.fixture(scope="module")
def tiny_wan_with_wan_vae():
    """tiny-wan holding a meta skeleton of Wan 2.x's own VAE (its published config): decode peaks at a real width."""
    import torch
    from diffusers import AutoencoderKLWan

    pipe = load_pipeline("tiny-wan")
    with torch.device("meta"):
        pipe.vae = AutoencoderKLWan(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, temperal_downsample=[False, True, True])
    return pipe


def test_a_decode_that_does_not_fit_is_refused_naming_it_and_what_would_fit(tiny_wan_with_wan_vae):
    """`vae_use_tiling` false with an untiled decode that cannot fit: refused before any step, naming the phase,
    its parts and the device, with what fits instead (a tiled decode, a smaller size); "auto" tiles it and says
    so (lossy at the tiles' edges); the text encoder stays resident, its phase fits."""
    pipe = tiny_wan_with_wan_vae
    video = pipeline_generation(pipe, height=320, width=320, num_frames=5)
    roomy = plan_for_machine(pipe, Machine(device_memory_gb=24, host_memory_gb=16, device_allowance_gb=0), generation=video)
    decode = roomy.device_phases.peak
    kept, untiled = decode.nbytes - _transient(decode), _transient(decode)
    assert decode.phase == "VAE decode" and "untiled" in list(decode.parts)[-1] and not roomy.notes
    tight = Machine(device_memory_gb=(kept + 0.8 * untiled) / 1e9, host_memory_gb=16, device_allowance_gb=0, vae_use_tiling=False)
    with pytest.raises(MachinePlanError) as refused:
        plan_for_machine(pipe, tight, generation=video)
    message = str(refused.value)
    peak = refused.value.peak  # the phase that bounds, as data (the machines table prints it)
    assert peak.phase == "VAE decode" and message.startswith(f"device_memory_gb = {tight.device_memory_gb:g}: {peak.describe()}")
    assert "the VAE's decode at 320x320 x 5 frames, untiled" in message and "more than the device's" in message
    assert 'it would fit with a tiled decode (vae_use_tiling true or "auto": ' in message and "not bit-identical" in message
    assert ", or 240x240 x 5 frames (" in message and message.endswith(f"or a device of {peak.nbytes / 1e9:.3g} GB")
    tiled = plan_for_machine(pipe, dataclasses.replace(tight, vae_use_tiling="auto"), generation=video)
    phase = tiled.device_phases.phase("VAE decode")
    assert "tiled" in list(phase.parts)[-1] and "not bit-identical" in phase.note and tiled.device_nbytes <= tight.device_memory_gb * 1e9
    assert any(n.startswith("the VAE decode is tiled: vae_use_tiling auto") and "the whole decode needs" in n for n in tiled.notes)
    assert tiled.to_dict()["recommended"]["decode"]["tiled"] is True
    assert "text_encoder" not in tiled.config["components"]


def test_enabling_leaves_free_the_reserve_the_planner_recommends(tiny_wan):
    """Residency "auto" without a budget or a reserve given leaves the same estimate free as the planner (the
    largest phase's transient and the allowance); a reserve given wins, and without a generation the default."""
    from layerstream.config.offload_config import DEFAULT_ACTIVATION_RESERVE_GB
    from layerstream.offload import _estimated_reserve, estimated_activation_reserve
    from layerstream.plan.placement import read_device_budget
    from layerstream.plan.resolver import resolve_offload_plan

    video = pipeline_generation(tiny_wan, height=64, width=64, num_frames=9)
    planned = plan_for_machine(tiny_wan, Machine(device_memory_gb=24, host_memory_gb=16), generation=video)
    reserve = estimated_activation_reserve(tiny_wan, video)
    assert reserve.nbytes == round(planned.activation_reserve_gb * 1e9)
    auto = resolve_offload_plan(tiny_wan, {"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"resident_layers": "auto"}}})
    assert _estimated_reserve(tiny_wan, auto, torch.device("cuda", 0), video) == reserve
    assert _estimated_reserve(tiny_wan, auto, torch.device("cpu"), video) is None  # no device memory to read
    budget = read_device_budget(auto, "cuda:0", 8_000_000_000, reserve)
    assert budget.nbytes == 8_000_000_000 - reserve.nbytes
    assert "estimated for 64x64 x 9 frames" in budget.source and "VAE decode, the VAE's decode at 64x64 x 9 frames, untiled" in budget.source
    given = resolve_offload_plan(tiny_wan, {"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"resident_layers": "auto", "activation_reserve_gb": 1}}})
    assert _estimated_reserve(tiny_wan, given, torch.device("cuda", 0), video) is None
    assert read_device_budget(given, "cuda:0", 8_000_000_000, reserve).nbytes == 7_000_000_000
    default = read_device_budget(auto, "cuda:0", 8_000_000_000)
    assert default.nbytes == 8e9 - DEFAULT_ACTIVATION_RESERVE_GB * 1e9 and "no generation to estimate it for" in default.source


def test_an_image_encoder_has_its_phase():
    pipe = load_pipeline("tiny-wan-i2v")
    result = plan_for_machine(pipe, Machine(device_memory_gb=4, host_memory_gb=16), generation=pipeline_generation(pipe, height=32, width=32, num_frames=5))
    image = result.device_phases.phase("image encoding")
    assert image is not None and "the image encoder's forward at 17 tokens" in list(image.parts)[-1]  # 32 px in 8 px patches, a class token
    assert [p.phase for p in result.device_phases.phases] == ["prompt encoding", "image encoding", "denoising", "VAE decode"]
