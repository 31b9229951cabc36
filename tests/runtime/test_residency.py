"""Resident layers, auto budgets, offload_submodules, on-demand components and prefetch depth."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from layerstream import OffloadPlan, enable_offload
from layerstream.plan.resolved import OffloadPlanResolutionError
from layerstream.errors import OffloadError
from runtime_toys import ToyBlock, ToyDiT, observe_bound_blocks, run, tiny_wan_transformer

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast


class ResidentPipeline(nn.Module):
    _offload_plan = OffloadPlan(block_attrs={"transformer": ("blocks",)}, resident_dit_paths=frozenset({"transformer"}))

    def __init__(self, num_blocks=6, dim=32):
        super().__init__()
        torch.manual_seed(0)
        self.transformer = ToyDiT(dim=dim, num_blocks=num_blocks).eval()

    def forward(self, x):
        return self.transformer(x)


def _config(resident_layers, **dit):
    return {"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"resident_layers": resident_layers, **dit}}}


@pytest.mark.parametrize("resident_layers", [0, 1, 5])
def test_resident_layers_bit_identical_and_never_transferred(resident_layers):
    pipe = ResidentPipeline(num_blocks=6)
    x = torch.randn(2, 3, 32)
    expected = run(pipe, (x,))
    handle = enable_offload(pipe, _config(resident_layers), device="cpu")
    for _ in range(3):
        assert torch.equal(run(pipe, (x,)), expected)
    transfers = handle.block_transfers()
    resident = [f"transformer.blocks.{i}" for i in range(resident_layers)]
    assert all(path not in transfers for path in resident)  # resident blocks are not in the store at all
    assert all(n > 0 for n in transfers.values()) and len(transfers) == 6 - resident_layers
    for i in range(resident_layers):
        assert pipe.transformer.blocks[i].proj.weight.numel() > 0  # real weights, always on the device
    stats = handle.stats()
    assert stats.num_resident_blocks == resident_layers and stats.num_streamed_blocks == 6 - resident_layers
    assert "resident_layers" in stats.residency["transformer"] or resident_layers == 0
    handle.disable()
    assert torch.equal(run(pipe, (x,)), expected)


def test_resident_layers_on_undeclared_dit_is_an_error():
    model = ToyDiT(dim=16, num_blocks=4)  # blocks from the class attribute: residency not declared
    with pytest.raises(OffloadPlanResolutionError, match="resident_dit_paths"):
        enable_offload(model, _config(1), device="cpu")


def test_resident_layers_on_automatically_discovered_dit():
    model, inputs = tiny_wan_transformer()
    expected = run(model, inputs)
    handle = enable_offload(model, _config(1), device="cpu")
    assert torch.equal(run(model, inputs), expected)
    assert "blocks.0" not in handle.block_transfers() and handle.stats().num_resident_blocks == 1
    handle.disable()


def test_auto_with_tiny_budget_streams_everything_and_large_budget_keeps_all():
    pipe = ResidentPipeline(num_blocks=6)
    x = torch.randn(2, 3, 32)
    expected = run(pipe, (x,))
    small = enable_offload(pipe, _config("auto", device_budget_gb=1e-9), device="cpu")
    assert torch.equal(run(pipe, (x,)), expected)
    assert small.stats().num_resident_blocks == 0 and len(small.block_transfers()) == 6
    assert "auto" in small.stats().residency["transformer"]
    small.disable()
    large = enable_offload(pipe, _config("auto", device_budget_gb=100.0), device="cpu")
    assert torch.equal(run(pipe, (x,)), expected)
    assert large.stats().num_resident_blocks == 6 and large.block_transfers() == {}
    assert large.stats().bytes_transferred == 0
    large.disable()


def test_auto_spreads_resident_blocks_and_stays_identical():
    pipe = ResidentPipeline(num_blocks=6)
    x = torch.randn(2, 3, 32)
    expected = run(pipe, (x,))
    block_bytes = sum(p.numel() * p.element_size() for p in pipe.transformer.blocks[0].parameters())
    block_bytes += sum(b.numel() * b.element_size() for b in pipe.transformer.blocks[0].buffers())
    non_block = sum(p.numel() * p.element_size() for n, p in pipe.named_parameters() if ".blocks." not in n)
    slots = 2 * (block_bytes + 64 * 8)
    budget = non_block + slots + 2.5 * block_bytes  # room for two resident blocks
    handle = enable_offload(pipe, _config("auto", device_budget_gb=budget / 1e9), device="cpu")
    assert torch.equal(run(pipe, (x,)), expected)
    streamed = set(handle.block_transfers())
    resident = {f"transformer.blocks.{i}" for i in range(6)} - streamed
    assert len(resident) == 2
    assert resident != {"transformer.blocks.0", "transformer.blocks.1"}  # spread, not leading
    handle.disable()


def test_auto_on_cpu_without_budget_is_an_error():
    pipe = ResidentPipeline()
    with pytest.raises(OffloadError, match="device_budget_gb"):
        enable_offload(pipe, _config("auto"), device="cpu")
    assert all(not m._forward_pre_hooks for m in pipe.modules())


class ContextEncoder(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.layers = nn.ModuleList(ToyBlock(dim) for _ in range(3))

    def forward(self, h):
        for layer in self.layers:
            h = layer(h)
        return h


class DiTWithContextEncoder(ToyDiT):
    def __init__(self, dim=32):
        super().__init__(dim=dim, num_blocks=3)
        self.context_encoder = ContextEncoder(dim)

    def forward(self, x):
        return super().forward(x + self.context_encoder(x))


class SubmodulePipeline(nn.Module):
    _offload_plan = OffloadPlan(
        block_attrs={"transformer": ("blocks",)},
        offload_submodules={"transformer.context_encoder": "layers"},
    )

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.transformer = DiTWithContextEncoder().eval()

    def forward(self, x):
        return self.transformer(x)


def test_offload_submodules_stream_with_their_own_chain():
    pipe = SubmodulePipeline()
    x = torch.randn(2, 3, 32)
    expected = run(pipe, (x,))
    handle = enable_offload(pipe, {"mode": "layer", "components": ["dit"]}, device="cpu")
    for _ in range(3):
        assert torch.equal(run(pipe, (x,)), expected)
    transfers = handle.block_transfers()
    assert {f"transformer.context_encoder.layers.{i}" for i in range(3)} <= set(transfers)
    assert pipe.transformer.context_encoder.layers[0].proj.weight.numel() == 0
    # the chains are separate: the child's last layer predicts the child's first layer
    blocks = {b.path: b for b in handle.streamer.blocks}
    last_child = blocks["transformer.context_encoder.layers.2"]
    assert handle.streamer.blocks[last_child.next_index].path in (
        "transformer.context_encoder.layers.0",
        "transformer.blocks.0",  # or what it learned actually runs next
    )
    handle.disable()
    assert torch.equal(run(pipe, (x,)), expected)


class OnDemandEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.calls: list[str] = []

    def load_to_device(self):
        self.calls.append("load_to_device")

    def offload_to_cpu(self):
        self.calls.append("offload_to_cpu")


class OnDemandPipeline(nn.Module):
    _offload_plan = OffloadPlan(on_demand_component_paths=frozenset({"image_encoder"}))

    def __init__(self, encoder):
        super().__init__()
        torch.manual_seed(0)
        self.transformer = ToyDiT(dim=16, num_blocks=3)
        self.image_encoder = encoder


def test_an_unselected_on_demand_component_stays_resident():
    # image encoders cannot be selected, so the pipeline's offload_to_cpu() is never called (issue 26 item 3;
    # selected on-demand components: tests/plan/test_vllm_omni_compat_more.py)
    encoder = OnDemandEncoder()
    pipe = OnDemandPipeline(encoder)
    handle = enable_offload(pipe, {"mode": "layer", "components": ["dit"]}, device="cpu")
    run(pipe.transformer, (torch.randn(1, 16),))
    assert handle.plan.component("image_encoder").action == "resident"
    assert handle.stats().per_component["image_encoder"].device_bytes > 0
    handle.disable()
    assert encoder.calls == []


@pytest.mark.parametrize("missing", ["load_to_device", "offload_to_cpu"])
def test_on_demand_component_missing_a_method_is_an_error(missing):
    class Partial(nn.Module):
        pass

    setattr(Partial, "load_to_device" if missing == "offload_to_cpu" else "offload_to_cpu", lambda self: None)
    pipe = OnDemandPipeline(Partial())
    with pytest.raises(OffloadPlanResolutionError, match=rf"image_encoder.*{missing}|{missing}.*image_encoder"):
        enable_offload(pipe, {"mode": "layer", "components": ["dit"]}, device="cpu")


def test_on_demand_component_that_is_not_callable_is_an_error():
    class NotCallable(nn.Module):
        load_to_device = None
        offload_to_cpu = None

    pipe = OnDemandPipeline(NotCallable())
    with pytest.raises(OffloadPlanResolutionError, match="image_encoder"):
        enable_offload(pipe, {"mode": "layer", "components": ["dit"]}, device="cpu")


def test_prefetch_depth_two_keeps_two_blocks_in_flight():
    torch.manual_seed(0)
    model = ToyDiT(dim=32, num_blocks=6).eval()
    x = torch.randn(2, 3, 32)
    expected = run(model, (x,))
    config = {"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"prefetch_depth": 2}}}
    handle = enable_offload(model, config, device="cpu")
    in_flight = []

    def check(streamer):
        assert streamer.num_materialized <= streamer.num_slots == 3
        in_flight.append(sum(1 for b in streamer.slot_block if b is not None))

    observe_bound_blocks(handle, check)
    for _ in range(3):
        assert torch.equal(run(model, (x,)), expected)
    stats = handle.stats()
    assert stats.num_slots == 3 and stats.max_materialized_blocks <= 3
    assert max(in_flight) == 3  # the running block plus two prefetched ones
    assert stats.num_sync_loads <= 1  # only the very first block of the first forward
    handle.disable()
