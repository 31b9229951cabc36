"""`state_dict()` and `load_state_dict()` on a model whose blocks stream.

Between calls a streamed block holds empty placeholders, so without help `state_dict()` would save nothing of
it and `load_state_dict()` would fail on every block weight after overwriting the resident ones. These hooks
make both work on the host store, which holds the real weights:
- `state_dict()`: each streamed block's entries are the store's bytes, as host tensors (views: no copy);
- `load_state_dict()`: each streamed block is bound to its host tensors while torch loads it, so the new
  values land in the store (shapes checked by torch as usual), then evicted again; a slot still holding the
  old bytes is forgotten, so the next call streams the new weights.
Where this process does not hold a block whole (allgather shards), or `assign=True` asks to replace the
Parameter objects, loading is refused at the component before anything is loaded.
"""

from __future__ import annotations

from torch import nn

from layerstream.errors import UnsupportedUseError
from layerstream.runtime.streamer import BlockStreamer, StreamedBlock


def _entry_keys(block: StreamedBlock) -> list[list[str]]:
    """For every layout entry, its state_dict keys relative to the block (a module reachable by two names
    appears under both)."""
    names: dict[int, list[str]] = {}
    for name, module in block.module.named_modules(remove_duplicate=False):
        names.setdefault(id(module), []).append(name)
    out = []
    for e in block.host.layout.entries:
        out.append([f"{prefix}.{e.name}" if prefix else e.name for prefix in names.get(id(e.module), [])])
    return out


def install_state_dict_hooks(streamer: BlockStreamer, blocks: list[StreamedBlock], components: dict[str, nn.Module]) -> list:
    """Hooks on every streamed block (and a load check on each streamed component); returns removable handles."""
    handles = []
    for block in blocks:
        keys = _entry_keys(block)

        def on_state_dict(module, state_dict, prefix, local_metadata, block=block, keys=keys):
            tensors = block.host.host_tensors()
            for tensor, entry_keys in zip(tensors, keys):
                for key in entry_keys:
                    if prefix + key in state_dict:
                        state_dict[prefix + key] = tensor

        def before_load(module, state_dict, prefix, local_metadata, *args, block=block):
            _refuse_assign(local_metadata, block.path)
            block.host.binder.bind_(block.host.host_tensors())  # torch copies the new values into the store

        def after_load(module, incompatible_keys, block=block):
            block.host.binder.evict_()
            streamer.forget_copy_(block)

        handles.append(block.module._register_state_dict_hook(on_state_dict))
        handles.append(block.module._register_load_state_dict_pre_hook(before_load, with_module=True))
        handles.append(block.module.register_load_state_dict_post_hook(after_load))

    for path, module in components.items():
        mine = [b for b in blocks if b.component == path]
        if not mine:
            continue

        def check_before_load(module, state_dict, prefix, local_metadata, *args, mine=mine, path=path):
            _refuse_assign(local_metadata, path or "<model>")
            for block in mine:
                block.host.host_tensors()  # raises, before anything is loaded, where the store cannot take it

        handles.append(module._register_load_state_dict_pre_hook(check_before_load, with_module=True))
    return handles


def _refuse_assign(local_metadata: dict, where: str) -> None:
    if local_metadata.get("assign_to_params_buffers", False):
        raise UnsupportedUseError(
            f"{where}: load_state_dict(assign=True) would replace the Parameter objects layerstream streams into; "
            "load without assign (the values go into the host store), or call handle.disable() first"
        )
