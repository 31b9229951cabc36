"""The placement spends `host_budget_gb` in the bytes each store keeps on the host (`host_nbytes`), not in slot
bytes: under one budget the float8 store's host tier holds about twice the blocks of a bfloat16 model, while
its slots (compute layout plus staging region) are larger than the bfloat16 ones."""

from __future__ import annotations

import pytest
import torch

from layerstream.offload import block_layouts, place_for
from layerstream.plan.resolver import resolve_offload_plan
from layerstream.runtime.forms.float8 import float8_forms
from layerstream.runtime.stores.compose import ComponentStores
from layerstream.runtime.stores.local_store import LocalHostStore
from tests.runtime.runtime_toys import ToyDiT, make_my_pipeline

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast

CPU = torch.device("cpu")


def test_the_host_tier_is_priced_in_stored_bytes():
    pipe = make_my_pipeline(dim=64)
    pipe.transformer = ToyDiT(dim=64, num_blocks=12).to(torch.bfloat16)
    block_nbytes = sum(t.numel() * t.element_size() for t in pipe.transformer.blocks[0].state_dict().values())
    config = {"mode": "layer", "components": ["dit"], "host_budget_gb": 3.5 * block_nbytes / 1e9}
    plan = resolve_offload_plan(pipe, config)
    layouts = block_layouts(pipe, plan, CPU)
    bf16 = place_for(plan, layouts, ComponentStores({"transformer": LocalHostStore()}), CPU)
    fp8 = place_for(plan, layouts, ComponentStores({"transformer": LocalHostStore(float8_forms(pipe.transformer, torch.float8_e4m3fn).form)}), CPU)
    num_bf16, num_fp8 = len(bf16.host_tier.host_block_paths), len(fp8.host_tier.host_block_paths)
    assert num_bf16 == 3
    assert 1.6 <= num_fp8 / num_bf16 <= 2.4, (num_bf16, num_fp8)
    assert fp8.host_tier.host_nbytes <= fp8.host_tier.budget_nbytes
    assert fp8.slot_nbytes > bf16.slot_nbytes  # the slot holds the compute layout and the stored bytes
