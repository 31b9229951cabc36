"""Every phase's device peak, planned (`machine.phases`, `machine.device_fit`): each phase adds up from its parts,
the largest bounds the device, residency "auto" leaves the largest phase's transient free (the request's own
estimate, no flat floor), and a device that cannot hold some phase is refused naming it and what would fit."""

from __future__ import annotations

import json

import pytest

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
    assert [p.phase for p in phases.phases] == ["prompt encoding", "denoising"]  # no image encoder; the decode: branch vae
    for phase in phases.phases:
        assert phase.nbytes == sum(phase.parts.values())
        assert phase.parts[WEIGHTS] == sum(phases.weights_by_component.values())  # the resident parts, every phase
        assert phase.parts[SLOT_RING] == result.placement.ring_nbytes > 0 and phase.parts[ALLOWANCE] == 0.5e9
    assert phases.weights_by_component["vae"] == sum(p.numel() * p.element_size() for p in tiny_wan.vae.parameters()) + sum(
        b.numel() * b.element_size() for b in tiny_wan.vae.buffers()
    )
    assert phases.peak.nbytes == max(p.nbytes for p in phases.phases) == result.device_nbytes
    assert phases.peak.phase == "prompt encoding"  # 512 text tokens against 8 latent ones
    document = result.to_dict()["recommended"]["phases"]
    assert document["device"]["bounded_by"] == "prompt encoding" and document["device"]["peak_bytes"] == result.device_nbytes
    assert set(document["device"]["phases"]["denoising"]) == {"bytes", "parts", "note"}
    host = document["host"]
    assert set(host["phases"]) == {"loading and enabling", "generating"} and host["phases"]["generating"]["bytes"] == result.host_nbytes


def test_the_reserve_is_the_requests_own_estimate_not_a_floor(tiny_wan):
    """residency "auto" leaves the largest phase's transient and the allowance free: a small request leaves
    little (tiny-wan, under 1 MB, once had 4 GB set aside), a large one its own activations."""
    machine = Machine(device_memory_gb=24, host_memory_gb=16)
    small = plan_for_machine(tiny_wan, machine)
    largest = max(_transient(p) for p in small.device_phases.phases)
    assert small.activation_reserve_gb == pytest.approx((largest + 0.5e9) / 1e9) and small.activation_reserve_gb < 0.55
    assert small.config["layer_options"]["dit"]["device_budget_gb"] == pytest.approx(24 - small.activation_reserve_gb, abs=1e-4)
    block = tiny_wan.transformer.blocks[0]
    tokens = int(10e9 // block_activation_nbytes(block, 1))  # about 10 GB of activations in one forward
    large = plan_for_machine(tiny_wan, machine, generation=pipeline_generation(tiny_wan, tokens=tokens))
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
    assert code == 0 and "at its peak, in prompt encoding" in out and "    denoising " in out and "loading and enabling" in out


def test_a_phase_that_does_not_fit_is_refused_naming_it_and_a_size_that_fits(tiny_wan):
    """Where the largest phase cannot fit beside the weights that stay, the refusal names the phase, its parts, the
    device, and a smaller generation whose phases fit (or the device that would run it)."""
    video = pipeline_generation(tiny_wan, height=720, width=1280, num_frames=81)
    roomy = plan_for_machine(tiny_wan, Machine(device_memory_gb=24, host_memory_gb=16, device_allowance_gb=0), generation=video)
    denoising = roomy.device_phases.phase("denoising")
    kept = denoising.nbytes - _transient(denoising)
    assert roomy.device_phases.peak is denoising
    tight = Machine(device_memory_gb=(kept + 0.8 * _transient(denoising)) / 1e9, host_memory_gb=16, device_allowance_gb=0)
    with pytest.raises(MachinePlanError) as refused:
        plan_for_machine(tiny_wan, tight, generation=video)
    message = str(refused.value)
    assert message.startswith(f"device_memory_gb = {tight.device_memory_gb:g}: denoising ")
    assert "a DiT block's forward at 75600 tokens" in message and "more than the device's" in message
    assert "it fits at 528x960 x 81 frames" in message  # 3/4 of each side (whole multiples of 16): 0.55 of the tokens
