"""The calls the accelerator copy engine makes on its device, in one small class with torch.cuda's behaviour as
defaults: streams and events, the current device, graph capture, the allocator's stream uses, host
registration. A stand-in (the tests' recorder, the CPU simulation of `benchmarks/gpu_checks.py`) subclasses it
and overrides what it models, so that the engine calls every method without asking whether it exists.
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

CUDA_HOST_REGISTER_PORTABLE = 1
"""cudaHostRegisterPortable: pinned for every CUDA context, not only the current device's."""


class AcceleratorApi:
    """torch.cuda's streams and events (or another `torch.accelerator` module with the same `Stream`, `Event`,
    `stream(...)`, `current_stream(...)` and `device(...)`), as the accelerator engine uses them. Building one
    touches no device; the CUDA-only calls (capture, host registration) answer "no" where CUDA is not in use, so
    a CPU-only machine never reaches the CUDA runtime through them."""

    def __init__(self, module: ModuleType | None = None):
        self.module = torch.cuda if module is None else module

    def Stream(self, device=None):  # noqa: N802 - mirrors torch.cuda.Stream
        return self.module.Stream(device=device)

    def Event(self, enable_timing: bool = False):  # noqa: N802 - mirrors torch.cuda.Event
        return self.module.Event(enable_timing=enable_timing)

    def stream(self, stream):
        """A context in which `stream` is the current stream of its device."""
        return self.module.stream(stream)

    def current_stream(self, device=None):
        return self.module.current_stream(device)

    def device(self, device: torch.device):
        """A context in which `device` is the current device (`torch.cuda.device(d)`)."""
        return self.module.device(device)

    def is_current_stream_capturing(self) -> bool:
        """Whether the current stream is being captured into a CUDA graph; a process that has not initialized
        CUDA captures nothing (and a CPU build has no capture query to ask)."""
        return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        """The caching allocator waits for `stream`'s work queued by the time `tensor` is freed before reusing
        its memory."""
        tensor.record_stream(stream)

    def host_register(self, buffer: torch.Tensor) -> bool:
        """Page-lock a host buffer in place; True if pinned (False where CUDA is not available)."""
        return pin_buffer_(buffer)

    def host_unregister(self, buffer: torch.Tensor) -> None:
        unpin_buffer_(buffer)


def pin_buffer_(buffer: torch.Tensor) -> bool:
    """Page-lock a host buffer in place (exact size: no power-of-two rounding). Returns True if pinned. The
    caller makes its device current (`AcceleratorCopyEngine.pin_`): a thread of its own would otherwise have
    device 0 current and create a CUDA context there (every rank of a machine on GPU 0)."""
    if not torch.cuda.is_available():
        return False
    err = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel() * buffer.element_size(), CUDA_HOST_REGISTER_PORTABLE)
    ok = int(err) == 0 if not isinstance(err, tuple) else int(err[0]) == 0
    if not ok:
        logger.warning("cudaHostRegister failed (%s); block buffer stays pageable", err)
    return ok


def unpin_buffer_(buffer: torch.Tensor) -> None:
    if torch.cuda.is_available():
        torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())
