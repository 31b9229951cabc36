"""Fault injection for the server tests: make one prompt raise inside a streamed transformer block.

Test-side only: `serve_with_fault.py` runs the real command line with `GenerationService` handed an `Omni`
wrapped in `FaultInjectingOmni`. A generation whose prompt is exactly the fault prompt raises `InjectedFault`
from a forward pre-hook on the first streamed block, registered after the offload runtime's own pre-hook, so
the block already sits in a device slot when it fails: the failure happens where a real one would
(mid-forward, with a slot in use), which is what the server's "500, then the next request succeeds" promise
is about.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

FAULT_PROMPT_ENV = "LAYERSTREAM_TEST_FAULT_PROMPT"


class InjectedFault(RuntimeError):
    """Raised on purpose inside a transformer block."""


class FaultInjector:
    """A forward pre-hook on one streamed block that raises while armed."""

    def __init__(self, block: Any, block_path: str):
        self.block_path = block_path
        self._armed = False
        # registered after enable_offload's hooks, so it runs once the block already sits in a slot
        self._hook = block.register_forward_pre_hook(self._maybe_raise)

    @classmethod
    def install(cls, omni: Any) -> FaultInjector:
        """Hook the first streamed block of `omni`'s DiT; refuses a model with none (the test would mean nothing)."""
        from layerstream.plan.resolved import lookup

        path = _first_streamed_block_path(omni)
        if path is None:
            raise RuntimeError(f"{omni.model}: no streamed block to inject a fault into")
        return cls(lookup(omni.pipeline, path), path)

    @contextlib.contextmanager
    def armed(self) -> Iterator[None]:
        self._armed = True
        try:
            yield
        finally:
            self._armed = False

    def _maybe_raise(self, module: Any, args: Any) -> None:
        if self._armed:
            raise InjectedFault(f"injected fault in {self.block_path}")


class FaultInjectingOmni:
    """An `Omni` whose `run` (and `run_batch`, for a batch holding it) raises `InjectedFault` inside
    its first streamed block for one prompt."""

    def __init__(self, omni: Any, prompt: str):
        self.fault_prompt = prompt
        self._omni = omni
        self._injector = FaultInjector.install(omni)

    @property
    def block_path(self) -> str:
        return self._injector.block_path

    def run(self, request: Any, **kwargs: Any) -> Any:
        if request.prompt != self.fault_prompt:
            return self._omni.run(request, **kwargs)
        with self._injector.armed():
            return self._omni.run(request, **kwargs)

    def run_batch(self, requests: Any, **kwargs: Any) -> Any:
        """A batch raises if any of its prompts is the fault prompt, as a real fault fails the whole call."""
        if all(request.prompt != self.fault_prompt for request in requests):
            return self._omni.run_batch(requests, **kwargs)
        with self._injector.armed():
            return self._omni.run_batch(requests, **kwargs)

    def __getattr__(self, name: str) -> Any:  # everything else is the wrapped Omni's
        return getattr(self._omni, name)


def _first_streamed_block_path(omni: Any) -> str | None:
    plan = getattr(getattr(omni, "handle", None), "plan", None)
    # the DiT first: its blocks run on every denoising step, which is where a real fault would hurt
    for component in sorted(getattr(plan, "streamed", ()), key=lambda c: c.category != "dit"):
        for stack in component.stacks:
            if stack.block_paths:
                return stack.block_paths[0]
    return None
