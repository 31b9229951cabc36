"""vae_use_tiling / vae_use_slicing: the choice (pure), its application per call, and runs on tiny-wan that
tile only where the decode would not fit the device memory left (the CPU stand-in's `device_memory_gb`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from layerstream.models.decode.decode_memory import held_on_device
from layerstream.models.decode.vae_decode import estimate_decode_peak
from layerstream.models.decode.vae_tiling import LOSSY_NOTE, choose_vae_decode, choose_vae_tiling, vae_for
from layerstream.omni import GenerationError, Omni

MB = 10**6
SIZE = {"height": 64, "width": 64, "num_frames": 5}


@pytest.mark.fast
def test_auto_tiles_only_what_does_not_fit_and_says_why():
    fits = choose_vae_tiling("auto", 300 * MB, 100 * MB, 400 * MB)
    assert (fits.tiled, fits.fits, fits.peak_nbytes) == (False, True, 300 * MB)
    assert LOSSY_NOTE not in fits.reason
    tiled = choose_vae_tiling("auto", 300 * MB, 100 * MB, 200 * MB)
    assert (tiled.tiled, tiled.fits, tiled.peak_nbytes) == (True, True, 100 * MB)
    assert "0.3 GB, more than the 0.2 GB left" in tiled.reason and LOSSY_NOTE in tiled.reason
    neither = choose_vae_tiling("auto", 300 * MB, 100 * MB, 50 * MB)
    assert (neither.tiled, neither.fits) == (True, False)
    unknown = choose_vae_tiling("auto", 300 * MB, 100 * MB, None)
    assert (unknown.tiled, unknown.fits) == (False, True) and "no device memory to read" in unknown.reason


@pytest.mark.fast
def test_fixed_settings_are_kept_and_a_decode_that_cannot_fit_is_named():
    refused = choose_vae_tiling(False, 300 * MB, 100 * MB, 200 * MB)
    assert (refused.tiled, refused.fits) == (False, False)
    assert "needs 0.3 GB, more than the 0.2 GB of device memory left" in refused.reason
    assert 'set vae_use_tiling to "auto" or true' in refused.reason
    always = choose_vae_tiling(True, 300 * MB, 100 * MB, 400 * MB)
    assert (always.tiled, always.fits) == (True, True) and LOSSY_NOTE in always.reason


@pytest.mark.fast
def test_auto_slicing_splits_only_a_batch_that_does_not_fit_whole():
    peaks = {(False, False): 500 * MB, (False, True): 200 * MB, (True, False): 150 * MB, (True, True): 60 * MB}
    assert choose_vae_decode("auto", "auto", peaks, peaks.get, 600 * MB).sliced is False
    sliced = choose_vae_decode("auto", "auto", peaks, peaks.get, 300 * MB)
    assert (sliced.tiled, sliced.sliced) == (False, True)  # bit-identical ways before tiles
    assert (choose_vae_decode("auto", False, peaks, peaks.get, 300 * MB).tiled) is True
    both = choose_vae_decode("auto", "auto", peaks, peaks.get, 100 * MB)
    assert (both.tiled, both.sliced, both.fits) == (True, True, True)


def test_a_calls_vae_decodes_as_chosen_and_the_shared_vae_is_never_written():
    from layerstream.models.tiny_components import _wan_vae

    vae = _wan_vae()
    view = vae_for(vae, tiled=True, sliced=True)
    assert view.use_tiling and view.use_slicing and not vae.use_tiling and not vae.use_slicing
    assert view.decoder is vae.decoder and vae_for(vae, tiled=False, sliced=False) is vae


def _tiny_tiles(vae) -> None:
    """Tiles smaller than the tiny output, so that tiling has something to save."""
    vae.tile_sample_min_height = vae.tile_sample_min_width = 32
    vae.tile_sample_stride_height = vae.tile_sample_stride_width = 24


def test_module_mode_swaps_the_calls_vae_view_in_and_decodes_it_tiled_bit_for_bit():
    """Module mode wraps the VAE's ``decode`` on the instance: a call's view is swapped in by the same wrapper,
    and decodes tiled while the shared VAE keeps its own setting throughout."""
    resident = Omni("tiny-wan", offload=False, vae_use_tiling=True)
    config = {"mode": "module", "components": ["dit", "text_encoder", "vae"]}
    swapped = Omni("tiny-wan", device="cpu", diffusion_offload_config=config, vae_use_tiling=True)
    seen = []  # the shared VAE's setting while each call decodes
    for omni in (resident, swapped):
        vae = omni.pipeline.vae
        _tiny_tiles(vae)
        vae.decoder.register_forward_pre_hook(lambda *_, vae=vae: seen.append(vae.use_tiling))
    before = swapped.stats().per_component["vae"].num_transfers
    run = {"seed": 3, "num_inference_steps": 1, "keep_raw": True, **SIZE}
    outputs = [o.generate("a red fox", **run) for o in (resident, swapped)]
    assert all(o.stats.vae_decode.tiled for o in outputs) and np.array_equal(outputs[0].raw, outputs[1].raw)
    assert swapped.stats().per_component["vae"].num_transfers == before + 1  # swapped in around the view's decode
    assert seen and not any(seen)  # while each decoded tiled, the shared VAE said untiled
    swapped.close()


@pytest.fixture(scope="module")
def omni():
    omni = Omni("tiny-wan", device="cpu")
    _tiny_tiles(omni.pipeline.vae)
    yield omni
    omni.close()


def _device_memory_gb(omni) -> float:
    """A stand-in device memory that leaves room for the tiled decode but not for the untiled one."""
    vae = omni.pipeline.vae
    peaks = {}
    for tiled in (False, True):
        peaks[tiled] = estimate_decode_peak(vae, **SIZE, tiled=tiled, dtype=torch.float32, device_type="cpu").nbytes
    assert peaks[True] < peaks[False]
    held = held_on_device(omni.pipeline, omni.device, omni.stats())
    return (held + (peaks[True] + peaks[False]) / 2) / 1e9


def _measured_decode_peak(omni, *, tiled: bool) -> int:
    """The CPU allocator's peak while the pipeline's VAE decodes latents of `SIZE`."""
    from benchmark_modules import benchmark_module

    from layerstream.models.decode.vae_decode import latent_shape

    vae = omni.pipeline.vae
    latents = torch.randn(latent_shape(vae, **SIZE))
    with torch.no_grad():
        view = vae_for(vae, tiled=tiled, sliced=False)
        return benchmark_module("vae_decode").allocator_peak(lambda: view.decode(latents))


def _run(omni, settings: dict, **kwargs):
    omni.runner.vae_settings = settings
    return omni.generate("a red fox", seed=3, num_inference_steps=1, keep_raw=True, **SIZE, **kwargs)


def test_auto_leaves_a_decode_that_fits_untiled_and_tiles_under_a_small_budget(omni):
    from layerstream.models.decode.decode_memory import VaeDecodeSettings

    untiled = _run(omni, VaeDecodeSettings(vae_use_tiling=False))
    roomy = _run(omni, VaeDecodeSettings(device_memory_gb=100.0))
    assert not roomy.stats.vae_decode.tiled and np.array_equal(roomy.raw, untiled.raw)  # not a bit changed
    small = _device_memory_gb(omni)
    shared = []  # the shared VAE's setting while the call decodes
    hook = omni.pipeline.vae.decoder.register_forward_pre_hook(lambda *_: shared.append(omni.pipeline.vae.use_tiling))
    tight = _run(omni, VaeDecodeSettings(device_memory_gb=small))
    hook.remove()
    choice = tight.stats.vae_decode
    assert choice.tiled and choice.fits and LOSSY_NOTE in choice.reason
    assert choice.peak_nbytes <= choice.free_nbytes  # the tiled decode, as planned, inside what was left
    assert _measured_decode_peak(omni, tiled=True) <= choice.free_nbytes  # and as the CPU allocator counts it
    assert not np.array_equal(tight.raw, untiled.raw)  # blended tile edges: why it is never silent
    assert shared and not any(shared)  # the call decoded tiled through its own view: the shared VAE never changed


def test_false_refuses_a_decode_that_cannot_fit_before_the_first_step(omni):
    from layerstream.models.decode.decode_memory import VaeDecodeSettings

    small = _device_memory_gb(omni)
    steps = []
    with pytest.raises(GenerationError, match=r"needs .* more than the .* of device memory left"):
        _run(omni, VaeDecodeSettings(vae_use_tiling=False, device_memory_gb=small), on_step=lambda *a: steps.append(a))
    assert steps == []


def test_slicing_asked_for_a_single_output_decodes_it_whole(omni):
    """Slicing splits a batch: one output decodes as it would whole, the same bits, and the VAE is left as it was."""
    from layerstream.models.decode.decode_memory import VaeDecodeSettings

    whole = _run(omni, VaeDecodeSettings(vae_use_tiling=False, device_memory_gb=100.0))
    sliced = _run(omni, VaeDecodeSettings(vae_use_tiling=False, vae_use_slicing=True, device_memory_gb=100.0))
    assert sliced.stats.vae_decode.fits and sliced.stats.vae_decode.peak_nbytes == whole.stats.vae_decode.peak_nbytes
    assert np.array_equal(sliced.raw, whole.raw) and not omni.pipeline.vae.use_slicing


@pytest.mark.fast
def test_the_phases_of_a_pipeline_without_a_text_encoder_are_its_dits():
    """A caller that passes prompt embeddings drops the text encoder: the reserve is still estimated."""
    from layerstream.models.tiny import build_tiny_pipeline
    from layerstream.plan.phase_blocks import phase_blocks

    pipeline = build_tiny_pipeline("tiny-wan")
    pipeline.text_encoder = None
    blocks = phase_blocks(pipeline)
    assert blocks.text_encoder_blocks == () and blocks.dit_blocks == (pipeline.transformer.blocks[0], pipeline.transformer_2.blocks[0])


@pytest.mark.fast
def test_a_pipeline_without_a_text_encoder_is_planned_for_a_machine():
    """The planner weighs streaming the text encoder against keeping it resident: with none, it plans the DiTs."""
    from layerstream.machine.planner import Machine, plan_for_machine
    from layerstream.models.tiny import build_tiny_pipeline

    pipeline = build_tiny_pipeline("tiny-wan")
    pipeline.text_encoder = None
    plan = plan_for_machine(pipeline, Machine(device_memory_gb=8, host_memory_gb=16))
    assert "text_encoder" not in plan.config["components"] and "dit" in plan.config["components"]


def test_a_decode_of_one_output_traces_each_tiling_once_sliced_or_not(omni, monkeypatch):
    """A batch of one decodes sliced as whole: the choice under a small budget traces untiled and tiled once each."""
    from layerstream.models.decode import decode_memory

    traced = []
    planned = decode_memory._planned_peak
    monkeypatch.setattr(decode_memory, "_planned_peak", lambda *a: traced.append(a[-1]) or planned(*a))
    settings = decode_memory.VaeDecodeSettings(device_memory_gb=_device_memory_gb(omni))
    assert _run(omni, settings).stats.vae_decode.tiled
    assert sorted(traced) == [(False, False), (True, False)]
