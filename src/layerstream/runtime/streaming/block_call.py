"""How a call enters a streamed block: bind it to its slot, run it, evict it, outside any compiled graph. Hooks
would be traced into a compiled region with the placeholders, so the block is entered in the slot torch keeps
for a module's compiled call (`module._compiled_call_impl`), opaque to dynamo: a model compiled whole breaks its
graph at each streamed block; `module.compile(...)` compiles the inner call and leaves the streaming around it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from layerstream.runtime.streaming.streamer import BlockStreamer, StreamedBlock

_COMPILED = "_compiled_call_impl"
_COMPILE = "compile"
_FORWARD = "forward"

GRAPH_BREAK_REASON = (
    "layerstream binds a streamed block's weights to a device slot outside any compiled graph: a model "
    "compiled whole breaks its graph at every streamed block (use fullgraph=False), while the blocks compile "
    "as regions of their own (compile_repeated_blocks(fullgraph=True) works)"
)


class BlockCall:
    """`module._compiled_call_impl` of a streamed block; `inner` is what `Module.__call__` would call without it."""

    def __init__(self, streamer: BlockStreamer, block: StreamedBlock):
        module = block.module
        self._streamer = streamer
        self._block = block
        self._module = module
        self._had_compiled = _COMPILED in module.__dict__
        self._previous = module.__dict__.get(_COMPILED)
        self.inner: Callable = self._previous if self._previous is not None else module._call_impl
        self._had_compile = _COMPILE in module.__dict__
        self._previous_compile = module.__dict__.get(_COMPILE)
        # the streamer's own work never runs under dynamo (recursive); the block's call inside `_run` does, as
        # a frame of its own, when the model is being compiled (not recursive)
        self._pre_forward = torch.compiler.disable(streamer.pre_forward, reason=GRAPH_BREAK_REASON)
        self._post_forward = torch.compiler.disable(streamer.post_forward, reason=GRAPH_BREAK_REASON)
        self._call = torch.compiler.disable(self._run, recursive=False, reason=GRAPH_BREAK_REASON)
        module.__dict__[_COMPILED] = self._call
        module.__dict__[_COMPILE] = self.compile
        # dynamo inlines a hook-free module's class `forward` directly, skipping `__call__` and so this call;
        # an instance `forward` (the same bound method) makes it trace `__call__`, which reaches this call
        self._forward = None
        if _FORWARD not in module.__dict__:
            self._forward = module.__dict__[_FORWARD] = module.forward

    def _run(self, *args, **kwargs):
        block = self._block
        self._pre_forward(block)
        try:
            output = self.inner(*args, **kwargs)
        except BaseException:
            # also on KeyboardInterrupt (which torch's always_call hooks miss): the slot goes back at once
            self._post_forward(block, None, failed=True)
            raise
        self._post_forward(block, output)
        return output

    def compile(self, *args, **kwargs) -> None:
        """`nn.Module.compile` on a streamed block: compile its inner call, keep the streaming around it."""
        self.inner = torch.compile(self._module._call_impl, *args, **kwargs)

    @property
    def compiled(self) -> bool:
        return not _is_bound_call_impl(self.inner, self._module)

    def remove(self) -> None:
        """Give the module back its own call: a block compiled while enabled stays compiled."""
        module = self._module
        if module.__dict__.get(_COMPILED) is self._call:
            if _is_bound_call_impl(self.inner, module):
                if self._had_compiled:
                    module.__dict__[_COMPILED] = self._previous
                else:
                    del module.__dict__[_COMPILED]
            else:
                module.__dict__[_COMPILED] = self.inner
        if self._forward is not None and module.__dict__.get(_FORWARD) is self._forward:
            del module.__dict__[_FORWARD]
        if module.__dict__.get(_COMPILE) == self.compile:
            if self._had_compile:
                module.__dict__[_COMPILE] = self._previous_compile
            else:
                del module.__dict__[_COMPILE]

    def __repr__(self) -> str:
        return f"BlockCall({self._block.path}{', compiled' if self.compiled else ''})"


def _is_bound_call_impl(fn, module: nn.Module) -> bool:
    return getattr(fn, "__self__", None) is module and getattr(fn, "__func__", None) is nn.Module._call_impl
