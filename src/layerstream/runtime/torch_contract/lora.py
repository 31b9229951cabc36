"""LoRA on streamed blocks while offload is enabled: loading and adding adapters run with every block bound to
its host tensors (adapters stay resident); each LoRA layer's `merge`/`unmerge` runs with its block bound to a
device slot, its bytes going back to the store before the next block. Unfusing rounds exactly as resident; with
``lora_exact_unfuse`` it restores the pre-fuse bytes. A block not held whole, or in float8, refuses all of these.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping

import torch
from torch import nn

from layerstream.runtime.streaming.streamer import BlockStreamer, StreamedBlock
from layerstream.runtime.streaming.wrapping import MethodWrapper

HOST_BOUND_METHODS = ("load_lora_weights", "load_lora_adapter", "add_adapter")  # every block on its host tensors
FUSING_METHODS = ("fuse_lora", "unfuse_lora")  # each LoRA layer's block in a device slot while it (un)merges
FORGETTING_METHODS = ("unload_lora_weights", "unload_lora", "delete_adapters")  # pre-fuse bytes may go after


def tuner_layers(module: nn.Module) -> Iterator[nn.Module]:
    """PEFT's adapter layers under `module` (duck-typed: peft need not be installed to run layerstream)."""
    for m in module.modules():
        if hasattr(m, "merged_adapters") and callable(getattr(m, "merge", None)) and callable(getattr(m, "unmerge", None)):
            yield m


class LoraSupport:
    """Wraps the LoRA entry points so that they see real weights; keeps the pre-fuse bytes of fused blocks."""

    def __init__(self, streamer: BlockStreamer, device: torch.device, *, exact_unfuse: bool = False):
        self._streamer = streamer
        self._device = device
        self._exact_unfuse = exact_unfuse
        self._pre_fuse: dict[int, torch.Tensor] = {}  # block index -> its packed bytes before the first fuse
        self._depth = 0  # nested entry points (pipeline.fuse_lora calls transformer.fuse_lora): the outermost acts
        self._bound: StreamedBlock | None = None  # the block bound for a merge or unmerge
        self._unmerged: set[int] = set()
        self._layer_wrappers: list[MethodWrapper] = []

    @property
    def pre_fuse_bytes(self) -> dict[int, int]:
        """Block index -> host bytes kept to restore it exactly at unfuse."""
        return {i: t.numel() for i, t in self._pre_fuse.items()}

    def wrap_(self, owner) -> list[MethodWrapper]:
        """Wrap the LoRA entry points `owner` (a pipeline or a streamed component) has; returns the wrappers."""
        wrappers = []
        for names, kind in ((HOST_BOUND_METHODS, "host"), (FUSING_METHODS, "fuse"), (FORGETTING_METHODS, "forget")):
            for name in names:
                if callable(getattr(owner, name, None)):
                    wrappers.append(MethodWrapper(owner, name, lambda kind=kind: self._enter(kind), self._leave_fn(kind)))
        return wrappers

    # entry and exit of a wrapped method -----------------------------------------------------------------------
    def _enter(self, kind: str) -> None:
        self._depth += 1
        if self._depth > 1:
            return
        try:
            self._streamer.enter()
            if kind != "forget":
                for block in self._streamer.blocks:
                    block.host.host_tensors()  # refuses, before anything changes, where the store cannot take it
                    block.host.check_lora_()  # a low-precision store refuses LoRA
                    if kind != "host":
                        block.host.sync_host_tensors_(written=False)  # a lossless store's decoded copy goes again
            if kind == "host":
                for block in self._streamer.blocks:
                    block.host.binder.bind_(block.host.host_tensors())
            elif kind == "fuse":
                self._intercept_merges_()
        except BaseException:
            self._depth -= 1
            self._streamer.exit()
            raise

    def _leave_fn(self, kind: str) -> Callable[[], None]:
        def leave() -> None:
            self._depth -= 1
            if self._depth > 0:
                return
            try:
                if kind == "host":
                    self._unbind_from_host_()
                elif kind == "fuse":
                    self._finish_merges_()
                self._forget_unneeded_pre_fuse_()
            finally:
                self._streamer.exit()

        return leave

    # bound to the host store ------------------------------------------------------------------------------------
    def _unbind_from_host_(self) -> None:
        for block in self._streamer.blocks:
            host = block.host.host_tensors()
            try:
                block.host.binder.keep_replaced_(host)
            finally:
                block.host.binder.evict_()
                block.host.sync_host_tensors_(written=True)  # a lossless store codes its decoded copy again
                self._streamer.forget_copy_(block)  # the store's bytes may have changed: stream them anew
            self._move_adapters_to_device_(block)

    def _move_adapters_to_device_(self, block: StreamedBlock) -> None:
        """Tensors a loaded adapter added to a streamed block live on the compute device (resident, with it)."""
        for module in block.module.modules():
            for name, param in module._parameters.items():
                if param is not None and param.device != self._device and param.numel() > 0:
                    param.data = param.data.to(self._device)
            for name, buf in module._buffers.items():
                if buf is not None and buf.device != self._device and buf.numel() > 0:
                    module._buffers[name] = buf.to(self._device)

    # merges and unmerges, one block at a time in a device slot ------------------------------------------------
    def _intercept_merges_(self) -> None:
        self._unmerged.clear()
        for block in self._streamer.blocks:
            for layer in tuner_layers(block.module):
                for name in ("merge", "unmerge"):
                    bind = functools.partial(self._bind_block_, block, name)
                    self._layer_wrappers.append(MethodWrapper(layer, name, bind, lambda: None))

    def _bind_block_(self, block: StreamedBlock, operation: str) -> None:
        if self._bound is not block:
            self._unbind_block_()
            # waits for a copy of the block still in flight (the first block's prefetch after a forward) before the
            # merge writes into its slot; the slot's bytes then go back whole into the store (unbind_after_update_)
            self._streamer.bind_for_update_(block)
            self._bound = block
        if self._exact_unfuse and operation == "merge" and block.index not in self._pre_fuse:
            self._pre_fuse[block.index] = block.host.host_range(0, block.host.layout.nbytes).clone()
        if operation == "unmerge":
            self._unmerged.add(block.index)

    def _unbind_block_(self) -> None:
        block, self._bound = self._bound, None
        if block is not None:
            self._streamer.unbind_after_update_(block)

    def _finish_merges_(self) -> None:
        try:
            self._unbind_block_()
        finally:
            for wrapper in reversed(self._layer_wrappers):
                wrapper.remove()
            self._layer_wrappers.clear()
        for index in sorted(self._unmerged):
            block = self._streamer.blocks[index]
            original = self._pre_fuse.get(index)
            if original is not None and not _any_merged(block):
                # PEFT's unmerge rounds; the bytes from before the first fuse are exact
                block.host.write_back_(original, 0, original.numel())
                self._streamer.forget_copy_(block)
        self._unmerged.clear()

    def _forget_unneeded_pre_fuse_(self) -> None:
        for index in list(self._pre_fuse):
            if not _any_merged(self._streamer.blocks[index]):
                del self._pre_fuse[index]  # unfused, or its adapters unloaded with their fused weights kept

    def forget_block_(self, block: StreamedBlock) -> None:
        """The block's bytes were replaced (`load_state_dict`): its pre-fuse bytes no longer apply."""
        self._pre_fuse.pop(block.index, None)


def _any_merged(block: StreamedBlock) -> bool:
    return any(layer.merged_adapters for layer in tuner_layers(block.module))


def install_lora_support(
    streamer: BlockStreamer, components: Mapping[str, nn.Module], device: torch.device, *, exact_unfuse: bool = False
):
    """(support, wrappers): the streamed components' entry points wrapped (the pipeline's: `support.wrap_`)."""
    support = LoraSupport(streamer, device, exact_unfuse=exact_unfuse)
    wrappers = []
    for module in components.values():
        wrappers += support.wrap_(module)
    return support, wrappers
