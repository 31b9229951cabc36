"""A convolution's scratch on the CPU, as the VAE decode's planned peak counts it (`models/decode/conv_scratch`):
the traced peak of one convolution covers what torch's allocator really holds while it runs, and that is far
more than its output (ATen's unfolding kernel, oneDNN's blocked copies)."""

from __future__ import annotations

import pytest
import torch
from benchmark_modules import benchmark_module

from layerstream.models.decode.meta_peak import trace_call

pytestmark = pytest.mark.fast


@pytest.mark.parametrize(
    "shape, unfolding",
    [((1, 8, 32, 32), True), ((1, 8, 48, 48), True), ((2, 8, 32, 32), False)],
    ids=["unfolding", "unfolding-larger", "onednn-batch"],  # ATen's rule picks the kernel (conv_scratch)
)
def test_a_convolutions_planned_peak_covers_the_allocators_and_its_scratch_is_real(shape, unfolding):
    conv = torch.nn.Conv2d(8, 8, 3, padding=1)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        conv(x)  # warm: a kernel's first-call allocations are not the convolution's
        measured = benchmark_module("vae_decode").allocator_peak(lambda: conv(x))
    skeleton, latents = torch.nn.Conv2d(8, 8, 3, padding=1, device="meta"), torch.empty(shape, device="meta")
    planned = trace_call(lambda: skeleton(latents), device_type="cpu").peak_nbytes
    assert planned >= measured, (planned, measured)  # never short
    if unfolding:  # ATen's own kernel, the same on every CPU: its unfolded input (9 times it) is the peak
        output_nbytes = x.nbytes  # 8 channels in, 8 out, same size
        assert measured >= 9 * output_nbytes  # the control: a plan of the output alone would be far short
        assert planned <= 1.1 * measured, (planned, measured)
