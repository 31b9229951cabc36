"""Scale-out: `weight_transfer: "allgather"` over torch.distributed, and data-parallel launches with torchrun.

Nothing here is imported by single-process use; `enable_offload` imports the modules it needs only when a
component asks for allgather. The public helpers load on first use:

- `init_distributed(device)` / `destroy_distributed()`: join / leave the group torchrun describes;
- `launch_torchrun(nproc, module_args)`, `rank_info()`, `gather_objects(obj)`: data-parallel generation.
"""

_LAZY = {
    "init_distributed": "layerstream.distributed.process_group",
    "destroy_distributed": "layerstream.distributed.process_group",
    "backend_for": "layerstream.distributed.process_group",
    "launch_torchrun": "layerstream.distributed.launch",
    "rank_info": "layerstream.distributed.launch",
    "gather_objects": "layerstream.distributed.launch",
    "in_launched_rank": "layerstream.distributed.launch",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'layerstream.distributed' has no attribute {name!r}")
