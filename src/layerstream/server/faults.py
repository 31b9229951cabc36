"""Fault injection for tests: make one prompt raise inside a transformer block.

This is a test-only switch, off by default. It is read from the environment of the server process at
startup (``LAYERSTREAM_SERVE_FAULT_PROMPT=explode layerstream serve ...``), never from a request, so a
client cannot turn it on over HTTP. When set, a request whose prompt is exactly that text raises
`InjectedFault` from a forward pre-hook on the first streamed block, after the offload runtime's own
pre-hook has bound the block to a device slot: the failure happens where a real one would (mid-forward,
with a slot in use), which is what the server's "500, then the next request succeeds" promise is about.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger(__name__)

FAULT_PROMPT_ENV = "LAYERSTREAM_SERVE_FAULT_PROMPT"


class InjectedFault(RuntimeError):
    """Raised on purpose by the fault-injection switch."""


class FaultInjector:
    """A forward pre-hook on one transformer block that raises while armed."""

    def __init__(self, block: Any, block_path: str, prompt: str):
        self.prompt = prompt
        self.block_path = block_path
        self._armed = False
        # registered after enable_offload's hooks, so it runs once the block already sits in a slot
        self._hook = block.register_forward_pre_hook(self._maybe_raise)

    @classmethod
    def install(cls, omni: Any, prompt: str) -> FaultInjector:
        """Hook the first streamed block of `omni` (or its transformer when nothing streams by blocks)."""
        from layerstream.plan.resolved import lookup

        path = _first_streamed_block_path(omni) or "transformer"
        try:
            block = lookup(omni.pipeline, path)
        except AttributeError as e:
            raise ValueError(f"{FAULT_PROMPT_ENV}: {omni.model} has no streamed block nor transformer to hook") from e
        logger.warning("fault injection is on (%s): the prompt %r raises inside %s", FAULT_PROMPT_ENV, prompt, path)
        return cls(block, path, prompt)

    def matches(self, prompt: str) -> bool:
        return prompt == self.prompt

    @contextlib.contextmanager
    def armed(self) -> Iterator[None]:
        """Raise from the hooked block for the duration of the block (one generation)."""
        self._armed = True
        try:
            yield
        finally:
            self._armed = False

    def remove(self) -> None:
        self._hook.remove()

    def _maybe_raise(self, module: Any, args: Any) -> None:
        if self._armed:
            raise InjectedFault(f"injected fault in {self.block_path} (prompt {self.prompt!r}, {FAULT_PROMPT_ENV})")


def _first_streamed_block_path(omni: Any) -> str | None:
    handle = getattr(omni, "handle", None)
    plan = getattr(handle, "plan", None)
    streamed = getattr(plan, "streamed", ())
    # the DiT first: its blocks run on every denoising step, which is where a real fault would hurt
    for component in sorted(streamed, key=lambda c: c.category != "dit"):
        for stack in component.stacks:
            if stack.block_paths:
                return stack.block_paths[0]
    return None
