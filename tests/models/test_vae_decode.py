"""The VAE decode's device peak, planned from the VAE's structure on the meta device."""

from __future__ import annotations

import pytest
import torch
from diffusers import AutoencoderKL, AutoencoderKLQwenImage, AutoencoderKLWan

from layerstream.models.tiny_components import _wan_vae
from layerstream.models.decode.meta_peak import trace_call
from layerstream.models.decode.vae_decode import estimate_decode_peak, latent_shape

pytestmark = pytest.mark.fast


def _flux_like_vae() -> AutoencoderKL:
    with torch.device("meta"):
        return AutoencoderKL(
            down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4,
            block_out_channels=(8, 8, 16, 16),
            layers_per_block=1,
            latent_channels=16,
            norm_num_groups=4,
            use_quant_conv=False,
            use_post_quant_conv=False,
        )


def test_latent_shapes_follow_each_vaes_compression():
    wan = _wan_vae()
    assert latent_shape(wan, height=64, width=96, num_frames=9) == (1, 4, 3, 8, 12)
    assert latent_shape(_flux_like_vae(), height=64, width=96, num_frames=None, batch=2) == (2, 16, 8, 12)
    qwen = AutoencoderKLQwenImage(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1)
    assert latent_shape(qwen, height=64, width=64, num_frames=None) == (1, 16, 1, 8, 8)
    with pytest.raises(ValueError, match="multiples of the VAE's 8x"):
        latent_shape(wan, height=60, width=64, num_frames=1)


def test_a_loaded_vae_and_its_meta_skeleton_plan_the_same_peak():
    """The estimate from a meta skeleton (its config only) is the peak of the loaded VAE's own decode, traced
    here without the estimate's cache or its replay of the decoder's repeated calls."""
    loaded = _wan_vae()
    with torch.device("meta"):
        skeleton = AutoencoderKLWan.from_config(loaded.config)
    planned = estimate_decode_peak(skeleton, height=64, width=64, num_frames=9, tiled=False, dtype=torch.float32)
    # weights are reported apart, never inside the peak
    assert planned.weight_nbytes == sum(p.numel() * 4 for p in loaded.parameters())
    latents = torch.empty(1, 4, 3, 8, 8, device="meta")  # 4 channels, 9 frames as 1 + 2 latent, 8x spatial
    loaded.to("meta")  # its own modules and attributes, without the weights' bytes (the trace reads shapes)
    traced = trace_call(lambda: loaded.decode(latents, return_dict=False)).peak_nbytes
    assert planned.activation_nbytes == traced
    assert planned.nbytes == traced + latents.numel() * 4
    output_nbytes = 3 * 9 * 64 * 64 * 4
    assert planned.activation_nbytes > output_nbytes  # the output at least, plus the feature cache


def test_more_frames_and_larger_sizes_need_more_and_tiles_need_less():
    vae = _wan_vae()
    vae.tile_sample_min_height = vae.tile_sample_min_width = 32  # tiles smaller than the output
    vae.tile_sample_stride_height = vae.tile_sample_stride_width = 24
    peak = {
        (size, frames, tiled): estimate_decode_peak(
            vae, height=size, width=size, num_frames=frames, tiled=tiled, dtype=torch.float32
        ).nbytes
        for size, frames, tiled in [(64, 5, False), (64, 9, False), (96, 9, False), (96, 9, True)]
    }
    assert peak[64, 5, False] < peak[64, 9, False] < peak[96, 9, False]
    assert peak[96, 9, True] < peak[96, 9, False]


def test_an_image_vae_decodes_whole_and_bfloat16_halves_it():
    vae = _flux_like_vae()
    full = estimate_decode_peak(vae, height=128, width=128, num_frames=None, tiled=False, dtype=torch.float32)
    half = estimate_decode_peak(vae, height=128, width=128, num_frames=None, tiled=False, dtype=torch.bfloat16)
    assert full.latent_shape == (1, 16, 16, 16)
    assert half.nbytes * 2 == pytest.approx(full.nbytes, rel=0.05)


def test_replayed_decoder_calls_count_the_same_bytes_as_running_every_op():
    from layerstream.models.decode.vae_decode import _VaeKey

    vae = _VaeKey.of(_wan_vae(), torch.float32).build_meta()
    vae.tile_sample_min_height = vae.tile_sample_min_width = 32
    vae.tile_sample_stride_height = vae.tile_sample_stride_width = 24
    latents = torch.empty(1, 4, 5, 8, 8, device="meta")  # frames 3 to 5 repeat one call
    for tiled in (False, True):
        vae.use_tiling = tiled
        full = trace_call(lambda: vae.decode(latents))
        replayed = trace_call(lambda: vae.decode(latents), replayed=[vae.decoder])
        assert replayed.peak_nbytes == full.peak_nbytes and replayed.num_ops < full.num_ops


def test_the_planned_flops_are_the_convolutions_of_the_vaes_own_decode_replays_included():
    """The decode's work (`DecodePeak.flops`), traced with the decoder's repeated calls replayed, is what torch's
    own counter finds in the convolutions of a real decode (one call per latent frame, none replayed)."""
    from torch.utils.flop_counter import FlopCounterMode

    vae = _wan_vae().eval()
    planned = estimate_decode_peak(vae, height=64, width=64, num_frames=17, tiled=False, dtype=torch.float32)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        vae.decode(torch.randn(1, 4, 5, 8, 8), return_dict=False)
    convolutions = counter.get_flop_counts()["Global"][torch.ops.aten.convolution]
    assert planned.flops == convolutions > 0
