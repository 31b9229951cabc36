"""The scratch a convolution kernel allocates beside its output while it runs, by device: what a traced
decode adds to the live tensors at each convolution (`meta_peak`).

On the CPU, PyTorch runs a float32 convolution through oneDNN or through its own unfold-and-multiply kernel,
by a rule of thumb on the shapes and thread count (``ConvParams::use_mkldnn`` in ATen's Convolution.cpp);
bfloat16 goes to oneDNN wherever the CPU has the instructions. What oneDNN allocated, read from the CPU
allocator's events around each convolution of a Flux VAE decode (torch 2.13, AVX-512): a copy of the input,
one of the weights and the output in its blocked layout (channels rounded up to 16), then the plain output
while the blocked one is still held; a bfloat16 1x1 convolution takes float32 copies of its input and output
instead. The native kernel unfolds its input into columns, ``in_channels x kernel volume x output positions``
per sample: at 8 channels, a 3x3x3 kernel makes them 27x the input, which is what a narrow Wan VAE's decode is
made of on the CPU. On CUDA, cuDNN takes a workspace of its choosing (its heuristics pick one that fits): not
measured here, counted as one buffer of the larger of input and output.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

DeviceType = Literal["cuda", "cpu"]

_BLOCK = 16
"""oneDNN's blocked layouts hold channels in groups of 16 (AVX-512): a 3-channel output takes 16 channels' bytes."""
_ONEDNN_MIN_ELEMENTS = 20480
"""Below this, ATen's rule sends a float32 batch-1 convolution to its native kernel (N x C x the first two
spatial sizes; "for some case, native is faster")."""


def convolution_scratch_nbytes(device_type: DeviceType, args: tuple, out: torch.Tensor) -> int:
    """Scratch bytes of ``aten.convolution(input, weight, bias, stride, padding, dilation, transposed,
    output_padding, groups)`` with output `out`, on a device of `device_type`."""
    input, weight = args[0], args[1]
    if device_type != "cpu":
        return max(input.nbytes, out.nbytes)
    stride, padding, transposed = tuple(args[3]), tuple(args[4]), bool(args[6])
    kernel = tuple(weight.shape[2:])
    pointwise = all(k == 1 for k in kernel)
    if _cpu_uses_onednn(input, weight, args):
        return _onednn_scratch_nbytes(input, weight, out, pointwise=pointwise)
    if transposed or (pointwise and all(s == 1 for s in stride) and not any(padding)):
        return 0  # a 1x1 kernel multiplies the input as it lies
    columns = input.shape[1] * math.prod(kernel) * math.prod(out.shape[2:]) * input.shape[0]
    return columns * input.element_size()


def _onednn_scratch_nbytes(input: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, *, pointwise: bool) -> int:
    """Beyond the output: the most oneDNN holds at once during the call (module docstring)."""
    blocked_out = out.nbytes // out.shape[1] * (-(-out.shape[1] // _BLOCK) * _BLOCK)
    if pointwise and input.element_size() == 2:  # float32 copies of input and output
        return 2 * input.nbytes + 2 * blocked_out + weight.nbytes
    return max(input.nbytes + weight.nbytes + blocked_out - out.nbytes, blocked_out)


def _cpu_uses_onednn(input: torch.Tensor, weight: torch.Tensor, args: tuple) -> bool:
    """ATen's ``use_mkldnn`` for a CPU tensor (torch 2.x)."""
    if not torch.backends.mkldnn.is_available() or not torch.backends.mkldnn.enabled:
        return False
    if input.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if input.dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    if input.dtype != torch.float32:
        return False
    stride, dilation, groups = tuple(args[3]), tuple(args[5]), int(args[8])
    strided, dilated = any(s != 1 for s in stride), any(d != 1 for d in dilation)
    one_by_one = weight.shape[-1] == 1 and weight.shape[-2] == 1
    if not (strided or dilated or input.shape[0] >= 16 or not one_by_one or torch.get_num_threads() > 1):
        return False
    big_kernel = weight.shape[-1] > 3 and weight.shape[-2] > 3
    elements = input.shape[0] * input.shape[1] * input.shape[2] * input.shape[3]
    return groups > 1 or big_kernel or input.shape[0] > 1 or elements > _ONEDNN_MIN_ELEMENTS
