"""Scale-out: `weight_transfer: "allgather"` over torch.distributed, and data-parallel launches with torchrun.

Nothing here is imported by single-process use; `enable_offload` imports the modules it needs only when a
component asks for allgather. The public helpers load on first use:

- `init_distributed(device)` / `destroy_distributed()`: join / leave the group torchrun describes;
- `launch_torchrun(nproc, module_args)`, `rank_info()`, `gather_objects(obj)`: data-parallel generation.
"""

from layerstream.lazy import lazy_exports

__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "layerstream.distributed.process_group": ("init_distributed", "destroy_distributed", "backend_for"),
        "layerstream.distributed.launch": ("launch_torchrun", "rank_info", "gather_objects", "in_launched_rank"),
    },
)
