"""`OffloadHandle`: what `enable_offload` returns, the public face of one mode backend, which it forgets once
disabled (nothing reachable from a kept handle holds the slot ring or the host store).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

import torch
from torch import nn

from layerstream.plan.resolved import ResolvedOffloadPlan
from layerstream.runtime.modes.hooks import HookInfo, HookSet
from layerstream.runtime.streaming.ownership import CallOwnership
from layerstream.runtime.reporting.stats import OffloadStats, OffloadTrace


class OffloadBackend(Protocol):
    """One mode's running state (`runtime.modes.layer_mode.LayerModeBackend`, `runtime.modes.module_mode.ModuleModeBackend`)."""

    ownership: CallOwnership  # which thread runs the pipeline now (one at a time)
    hooks: HookSet  # everything installed on the pipeline, by name
    streamer: object  # None in module mode
    placement: object  # None in module mode

    def stats(self) -> OffloadStats: ...

    def trace(self) -> OffloadTrace: ...

    def reset_trace(self) -> None: ...

    def block_transfers(self) -> dict[str, int]: ...

    def disable(self) -> None: ...

    def release_when_dropped(self) -> Callable[[], None] | None:
        """What frees threads and host memory if the pipeline is dropped without `disable()` (None: nothing)."""


class OffloadHandle:
    """Reports on and undoes one `enable_offload`: `stats()`, `trace()` and `disable()`."""

    def __init__(
        self,
        plan: ResolvedOffloadPlan,
        device: torch.device,
        backend: OffloadBackend,
        components: Mapping[str, nn.Module],
        on_disable: Callable[[], None] = lambda: None,
        pipeline=None,
    ):
        self.plan = plan
        self.device = device
        self._backend: OffloadBackend | None = backend
        self._components = dict(components)
        self._on_disable = on_disable
        self._final_stats: OffloadStats | None = None
        self._pipeline = pipeline  # kept alive while the handle is: the finalizer on it frees what enable holds

    @property
    def enabled(self) -> bool:
        return self._backend is not None

    @property
    def backend(self) -> OffloadBackend | None:
        return self._backend  # None once disabled

    @property
    def streamer(self):
        """The layer-mode streamer while enabled (its blocks and slots, for inspection), else None."""
        return self._backend.streamer if self._backend is not None else None

    @property
    def placement(self):
        """Where the blocks went (layer mode), else None."""
        return self._backend.placement if self._backend is not None else None

    def hooks(self) -> tuple[HookInfo, ...]:
        """What enable installed, by module path and name (empty once disabled)."""
        return self._backend.hooks.listing() if self._backend is not None else ()

    def stats(self) -> OffloadStats:
        """Counters and memory accounting; after `disable()`, the figures of the moment it was disabled."""
        if self._backend is None:
            return self._final_stats if self._final_stats is not None else OffloadStats()
        return self._backend.stats()

    def block_transfers(self) -> dict[str, int]:
        """Transfers issued per streamed block path (resident blocks never appear)."""
        return self._backend.block_transfers() if self._backend is not None else {}

    def trace(self) -> OffloadTrace:
        """Every copy and compute interval recorded since enable (or `reset_trace`), on one clock."""
        return self._backend.trace() if self._backend is not None else OffloadTrace(())

    def reset_trace(self) -> None:
        """Forget every recorded interval (copies still waiting for their timing events included)."""
        if self._backend is not None:
            self._backend.reset_trace()

    def disable(self) -> None:
        """Remove every hook and give back a fully resident pipeline (the same Parameter objects, same values).
        Under allgather a collective: every rank must call it; after a failure part-way, calling it again goes on."""
        if self._backend is None:
            return
        ownership = self._backend.ownership
        ownership.enter()  # refused while another thread runs the pipeline: it would lose its weights mid-call
        try:
            stats = self._backend.stats()
            self._backend.disable()
            self._final_stats = stats
            self._backend = None
            self._pipeline = None
            self._on_disable()
        finally:
            ownership.exit()

    def __repr__(self) -> str:
        state = "enabled" if self.enabled else "disabled"
        return f"OffloadHandle({self.plan.pipeline_class}, mode={self.plan.config.mode}, device={self.device}, {state})"
