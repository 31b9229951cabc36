"""`state_dict()` and `load_state_dict()` on a model whose blocks stream, through the host store: `state_dict()`
gives the store's bytes as host tensors (a write through them outdates a slot copied before); a load binds each
block to its host tensors, then evicts it and forgets its slot copy. A load that would replace a streamed
Parameter (`assign=True`), or one into a block this process does not hold whole, is refused first.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from layerstream.errors import UnsupportedUseError
from layerstream.runtime.streaming.streamer import BlockStreamer, StreamedBlock


def _entry_keys(block: StreamedBlock) -> list[list[str]]:
    """For every layout entry, its state_dict keys relative to the block (under each name of its module)."""
    names: dict[int, list[str]] = {}
    for name, module in block.module.named_modules(remove_duplicate=False):
        names.setdefault(id(module), []).append(name)
    out = []
    for e in block.host.layout.entries:
        out.append([f"{prefix}.{e.name}" if prefix else e.name for prefix in names.get(id(e.module), [])])
    return out


def install_state_dict_hooks(
    streamer: BlockStreamer,
    blocks: list[StreamedBlock],
    components: dict[str, nn.Module],
    on_block_loaded: Callable[[StreamedBlock], None] = lambda block: None,
) -> list[tuple[str, str, str, object]]:
    """Hooks on every streamed block and a load check per component: (module path, name, what, handle) each."""
    handles = []
    bound: set[int] = set()  # blocks bound to their host tensors by a load in progress
    for block in blocks:

        def on_state_dict(module, state_dict, prefix, local_metadata, block=block):
            # wrapper subclasses (torchao) come back whole: the same type over the store's inner tensors
            tensors = block.host.binder.public_tensors(block.host.host_tensors())
            block.host.sync_host_tensors_(written=False)  # a lossless store's decoded copies are the caller's now
            # names are read now, not at enable: PEFT moves a LoRA'd Linear's weights under `base_layer`
            for tensor, entry_keys in zip(tensors, _entry_keys(block)):
                if tensor is None:
                    continue  # another inner tensor of a wrapper given whole above
                for key in entry_keys:
                    if prefix + key in state_dict:
                        state_dict[prefix + key] = tensor

        def before_load(module, state_dict, prefix, local_metadata, *args, block=block):
            if local_metadata.get("assign_to_params_buffers", False):
                # assign=True loading only tensors that do not stream (PEFT loads LoRA weights this way)
                _refuse_assign_to_streamed(state_dict, [block], {id(module): prefix.rstrip(".")}, "", block.path)
                return
            if block.host.binder.bound:
                return  # bound by whoever called the load (LoRA support, to the host store): theirs to evict
            block.host.binder.bind_(block.host.host_tensors())  # torch copies the new values into the store
            bound.add(block.index)

        def after_load(module, incompatible_keys, block=block):
            if block.index not in bound:
                return
            bound.discard(block.index)
            block.host.binder.evict_()
            block.host.sync_host_tensors_(written=True)  # a lossless store codes the loaded values again
            # the load wrote through Parameters bound by `.data`, whose version counters are their own: forget the
            # slot (a copy in flight may have read old bytes; the next one is queued behind this write)
            streamer.forget_copy_(block)
            on_block_loaded(block)

        handles.append((block.path, "state_dict", "gives the host store's weights", block.module._register_state_dict_hook(on_state_dict)))
        handles.append((
            block.path, "load_state_dict.pre", "loads the new values into the host store",
            block.module._register_load_state_dict_pre_hook(before_load, with_module=True),
        ))
        handles.append((block.path, "load_state_dict.post", "evicts the block again", block.module.register_load_state_dict_post_hook(after_load)))

    for path, module in components.items():
        mine = [b for b in blocks if b.component == path]
        if not mine:
            continue

        def check_before_load(module, state_dict, prefix, local_metadata, *args, mine=mine, path=path):
            if local_metadata.get("assign_to_params_buffers", False):
                names = {id(m): name for name, m in module.named_modules()}
                _refuse_assign_to_streamed(state_dict, mine, names, prefix, path or "<model>")
            for block in mine:
                block.host.host_tensors()  # raises, before anything is loaded, where the store cannot take it
                block.host.sync_host_tensors_(written=False)

        handles.append((
            path, "load_state_dict.check", "refuses a load the stores cannot take, before anything changes",
            module._register_load_state_dict_pre_hook(check_before_load, with_module=True),
        ))
    return handles


def _refuse_assign_to_streamed(state_dict, blocks: list[StreamedBlock], names: dict[int, str], prefix: str, where: str) -> None:
    """Refuse `load_state_dict(assign=True)` where it would replace a tensor of a streamed block (`names`: id
    of each block module -> its name)."""
    for block in blocks:
        block_prefix = prefix + names.get(id(block.module), "")
        for entry_keys in _entry_keys(block):
            for key in entry_keys:
                full = f"{block_prefix}.{key}" if block_prefix else key
                if full in state_dict:
                    raise UnsupportedUseError(
                        f"{where}: load_state_dict(assign=True) would replace the Parameter objects layerstream "
                        f"streams into ({full}); load without assign (the values go into the host store), or call "
                        "handle.disable() first"
                    )
