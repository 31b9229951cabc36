"""The calls the accelerator copy engine makes on its device, with torch.cuda's behaviour as defaults; a stand-in
(the tests' recorder, `benchmarks/gpu_checks.py`'s CPU simulation) subclasses it and overrides what it models.
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

CUDA_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context, not only the current device's


class AcceleratorApi:
    """torch.cuda's calls (or another accelerator module's); touches no device until used."""

    def __init__(self, module: ModuleType | None = None):
        self.module = torch.cuda if module is None else module

    def Stream(self, device=None):  # noqa: N802 - mirrors torch.cuda.Stream
        return self.module.Stream(device=device)

    def Event(self, enable_timing: bool = False):  # noqa: N802 - mirrors torch.cuda.Event
        return self.module.Event(enable_timing=enable_timing)

    def stream(self, stream):
        return self.module.stream(stream)

    def current_stream(self, device=None):
        return self.module.current_stream(device)

    def device(self, device: torch.device):
        return self.module.device(device)

    def is_current_stream_capturing(self) -> bool:
        # a process that has not initialized CUDA captures nothing (and a CPU build has no query to ask)
        return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        tensor.record_stream(stream)  # the allocator waits for `stream`'s queued work before reusing the memory

    def host_register(self, buffer: torch.Tensor) -> bool:
        """Page-lock a buffer at its exact size; the caller makes its device current (else a context on GPU 0)."""
        if not torch.cuda.is_available():
            return False
        nbytes = buffer.numel() * buffer.element_size()
        err = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, CUDA_HOST_REGISTER_PORTABLE)
        ok = int(err) == 0 if not isinstance(err, tuple) else int(err[0]) == 0
        if not ok:
            logger.warning("cudaHostRegister failed (%s); block buffer stays pageable", err)
        return ok

    def host_unregister(self, buffer: torch.Tensor) -> None:
        if torch.cuda.is_available():
            torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())
