"""Fixtures the runtime tests share."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def gloo_group_of_one():
    """A default gloo process group with this process as its only rank (torn down after the module)."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()
