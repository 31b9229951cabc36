"""Scale-out: `weight_transfer: "allgather"` over torch.distributed, and data-parallel launches with torchrun.
Nothing here is imported by single-process use; the public helpers load on first use.
"""

from layerstream.lazy import lazy_exports

__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "layerstream.distributed.process_group": ("init_distributed", "destroy_distributed", "backend_for"),
        "layerstream.distributed.launch": ("launch_torchrun", "rank_info", "gather_objects", "in_launched_rank"),
    },
)
