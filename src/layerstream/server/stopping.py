"""Stopping a started generation between denoising steps: why it stops, the signal, and the error it raises.

A generation cannot be interrupted inside a step (a kernel runs, a block sits in a device slot), but diffusers
calls ``callback_on_step_end`` between steps, and `Omni.generate` hands that call to its ``on_step``. Raising
there unwinds the pipeline where no block holds a slot and the only copy in flight is the last block's
prefetch of the first, so the runtime is as clean as after a finished generation: the next request runs, and
runs bit-identically.

The event loop requests a stop (a deadline passed, the client left, its job was deleted, the server is
shutting down); the worker
thread sees it at the next step boundary, or before the next of a request's ``n`` outputs (the only boundary
of a pipeline whose ``__call__`` takes no ``callback_on_step_end``).
"""

from __future__ import annotations

import threading
from enum import StrEnum

from layerstream.errors import LayerstreamError


class StopReason(StrEnum):
    """Why a generation was asked to stop."""

    TIMEOUT = "timeout"
    """The request's ``timeout`` passed."""
    CLIENT_GONE = "client_gone"
    """The client closed its connection: nobody is left to read the answer."""
    SHUTDOWN = "shutdown"
    """The server got SIGTERM and the running generation outlived --shutdown-timeout."""
    CANCELLED = "cancelled"
    """Its job was deleted (``DELETE /v1/videos/{id}``): nobody wants the result any more."""


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
