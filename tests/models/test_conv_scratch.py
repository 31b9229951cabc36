"""A convolution's scratch on the CPU, as the VAE decode's planned peak counts it (`models/decode/conv_scratch`):
the traced peak of one convolution covers what torch's allocator really holds while it runs, and that is far
more than its output (ATen's unfolding kernel, oneDNN's blocked copies)."""

from __future__ import annotations

import pytest
import torch
from benchmark_modules import benchmark_module

from layerstream.models.decode.meta_peak import trace_peak_nbytes

pytestmark = pytest.mark.fast


@pytest.mark.parametrize(
    "shape",
    [(1, 8, 32, 32), (1, 8, 48, 48), (2, 8, 32, 32)],
    ids=["unfolding", "unfolding-larger", "onednn-batch"],  # ATen's rule picks the kernel (conv_scratch)
)
def test_a_convolutions_planned_peak_covers_the_allocators_and_its_scratch_is_real(shape):
    conv = torch.nn.Conv2d(8, 8, 3, padding=1)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        conv(x)  # warm: a kernel's first-call allocations are not the convolution's
        measured = benchmark_module("vae_decode").allocator_peak(lambda: conv(x))
    output_nbytes = x.nbytes  # 8 channels in, 8 out, same size
    assert measured >= 3 * output_nbytes  # the control: the scratch is most of the peak, a plan without it is short
    skeleton, latents = torch.nn.Conv2d(8, 8, 3, padding=1, device="meta"), torch.empty(shape, device="meta")
    planned, _ = trace_peak_nbytes(lambda: skeleton(latents), device_type="cpu")
    assert measured <= planned <= 1.25 * measured, (planned, measured)
