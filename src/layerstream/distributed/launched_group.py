"""Joining torchrun's process group for a pipeline that asks for allgather, so that a script written for one
process runs unchanged under ``torchrun --nproc-per-node N`` (a group initialized before loading is kept).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from layerstream.config.offload_config import OffloadConfig
from layerstream.distributed.process_group import init_distributed


def join_launched_group(config: OffloadConfig, device: torch.device | str | None, process_group=None) -> torch.device | None:
    """The device this rank computes on after joining torchrun's group, where `config` asks for allgather over
    several launched ranks and no group is given or initialized; else None."""
    world_size = os.environ.get("WORLD_SIZE", "1")
    launched = world_size.isdigit() and int(world_size) > 1
    allgather = config.mode == "layer" and any(o.weight_transfer == "allgather" for o in config.layer_options.values())
    if not (launched and allgather) or process_group is not None or not dist.is_available() or dist.is_initialized():
        return None
    return init_distributed(device)
