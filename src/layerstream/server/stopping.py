"""Stopping a started generation between denoising steps: why it stops, the signal, and the error it raises.
Raising in diffusers' ``callback_on_step_end`` (`Omni.generate`'s ``on_step``) unwinds the pipeline where no
block holds a slot and the only copy in flight is the last block's prefetch of the first: the runtime is as
clean as after a finished generation, and the next request runs bit-identically. The worker also checks before
each of a request's ``n`` outputs (the only boundary of a pipeline without that callback)."""

from __future__ import annotations

import threading
from enum import StrEnum

from layerstream.errors import LayerstreamError


class StopReason(StrEnum):
    TIMEOUT = "timeout"  # the request's ``timeout`` passed
    CLIENT_GONE = "client_gone"  # nobody is left to read the answer
    SHUTDOWN = "shutdown"  # SIGTERM, and the running generation outlived --shutdown-timeout
    CANCELLED = "cancelled"  # its job was deleted


class GenerationStopped(LayerstreamError):
    """A generation stopped on request, between two denoising steps; `reason` says why."""

    def __init__(self, reason: StopReason, message: str):
        super().__init__(message)
        self.reason = reason


class StopSignal:
    """A one-way flag set from any thread and checked by the worker; the first reason given is kept."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reason: StopReason | None = None

    @property
    def reason(self) -> StopReason | None:
        return self._reason

    def request(self, reason: StopReason) -> None:
        with self._lock:  # two requests can race (deadline and disconnect); the answer follows the first
            if self._reason is None:
                self._reason = reason

    def raise_if_requested(self, where: str) -> None:
        """Raise `GenerationStopped` if a stop was requested; `where` says how far the generation got."""
        reason = self._reason
        if reason is not None:
            raise GenerationStopped(reason, f"generation stopped ({reason}) {where}")
