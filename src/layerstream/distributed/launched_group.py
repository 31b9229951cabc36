"""Joining torchrun's process group for a pipeline that asks for allgather, so that a script written for one
process runs unchanged under ``torchrun --nproc-per-node N`` (a group initialized before loading is kept).
"""

from __future__ import annotations

import os

import torch

from layerstream.config.offload_config import OffloadConfig


def wants_allgather(config: OffloadConfig) -> bool:
    """Whether a layer-mode component of `config` asks for `weight_transfer: "allgather"`."""
    return config.mode == "layer" and any(o.weight_transfer == "allgather" for o in config.layer_options.values())


def join_launched_group(config: OffloadConfig, device: torch.device | str | None, process_group=None) -> torch.device | None:
    """The device this rank computes on, after joining torchrun's group, where `config` asks for allgather, the
    environment names more than one rank, no `process_group` is given and none is initialized; else None (the
    caller picks the device as it would)."""
    import torch.distributed as dist

    world_size = os.environ.get("WORLD_SIZE", "1")
    launched = world_size.isdigit() and int(world_size) > 1
    if not (launched and wants_allgather(config)) or process_group is not None or not dist.is_available() or dist.is_initialized():
        return None
    from layerstream.distributed.process_group import init_distributed

    return init_distributed(device)
