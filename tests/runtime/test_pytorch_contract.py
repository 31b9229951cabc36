"""Streaming is invisible to the rest of PyTorch, or refused before anything changes (issue: never a wrong
result). Each test compares against the same model resident, bit for bit."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from layerstream import UnsupportedUseError, enable_offload
from runtime_toys import ToyDiT, run, snapshot, tiny_flux_transformer, tiny_wan_transformer
from tests.same_threading import on_new_thread

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast

DIT = {"mode": "layer", "components": ["dit"]}


def _pair(factory):
    resident, inputs = factory()
    streamed = copy.deepcopy(resident)
    return resident, streamed, inputs


def tiny_sd3_transformer():
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    model = SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=3, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=16, out_channels=4,
    ).eval()
    g = torch.Generator().manual_seed(1)
    inputs = dict(
        hidden_states=torch.randn(1, 4, 8, 8, generator=g),
        encoder_hidden_states=torch.randn(1, 6, 16, generator=g),
        pooled_projections=torch.randn(1, 16, generator=g),
        timestep=torch.tensor([500]),
        return_dict=False,
    )
    return model, inputs


def _toy():
    torch.manual_seed(0)
    return ToyDiT(dim=32, num_blocks=4).eval(), {"x": torch.randn(2, 3, 32)}


# --- 1. autograd ------------------------------------------------------------------------------------------------


def _input_grad(model, inputs):
    inputs = dict(inputs)
    inputs["hidden_states" if "hidden_states" in inputs else "x"] = latents = (
        inputs.get("hidden_states", inputs.get("x")).clone().requires_grad_(True)
    )
    out = model(**inputs)
    out = out[0] if isinstance(out, (tuple, list)) else out
    (out.float().square().sum()).backward()
    return latents.grad


@pytest.mark.parametrize("factory", [_toy, tiny_sd3_transformer, tiny_wan_transformer, tiny_flux_transformer], ids=["toy", "sd3", "wan", "flux"])
def test_input_gradients_through_frozen_streamed_blocks_are_bit_identical(factory):
    resident, streamed, inputs = _pair(factory)
    for model in (resident, streamed):
        model.requires_grad_(False)  # frozen weights, gradient with respect to the latents (guidance, inversion)
    handle = enable_offload(streamed, DIT, device="cpu")
    expected = _input_grad(resident, inputs)
    for _ in range(2):  # the second backward runs after the slots were reused by other blocks
        got = _input_grad(streamed, inputs)
        assert torch.equal(got, expected)
    handle.disable()


def test_a_graph_through_weights_that_require_grad_is_refused_before_the_block_runs():
    resident, streamed, inputs = _pair(_toy)
    handle = enable_offload(streamed, DIT, device="cpu")
    with pytest.raises(UnsupportedUseError, match=r"blocks\.0: .*cannot receive gradients.*requires_grad_\(False\)"):
        streamed(**inputs)
    # nothing stuck: the same model still runs under no_grad, bit-identical
    assert torch.equal(run(streamed, (inputs["x"],)), run(resident, (inputs["x"],)))
    handle.disable()


# --- 2. buffers written in forward ------------------------------------------------------------------------------


class CountingBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.norm = nn.BatchNorm1d(8)
        self.register_buffer("calls", torch.zeros(3))

    def forward(self, x):
        self.calls.add_(1)
        return self.norm(self.proj(x))


class CountingModel(nn.Module):
    _layerwise_offload_blocks_attrs = ["blocks"]

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(CountingBlock() for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_buffers_written_in_forward_are_kept_in_the_host_store():
    torch.manual_seed(0)
    resident = CountingModel().train()  # BatchNorm updates its running statistics in train mode
    streamed = copy.deepcopy(resident)
    handle = enable_offload(streamed, DIT, device="cpu")
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(4, 8, generator=g)
        with torch.no_grad():
            assert torch.equal(streamed(x), resident(x))
    stats = handle.stats()
    buffer_bytes = sum(b.numel() * b.element_size() for block in resident.blocks for b in block.buffers())
    assert stats.bytes_written_back == 3 * buffer_bytes
    handle.disable()
    assert streamed.blocks[1].calls.tolist() == [3.0, 3.0, 3.0]
    after, expected = snapshot(streamed), snapshot(resident)
    assert all(torch.equal(after[k], expected[k]) for k in expected)


# --- 3. state_dict and load_state_dict --------------------------------------------------------------------------


def test_state_dict_returns_the_real_weights_and_load_state_dict_updates_the_store():
    resident, streamed, inputs = _pair(_toy)
    torch.manual_seed(5)
    other = ToyDiT(dim=32, num_blocks=4).eval()
    handle = enable_offload(streamed, DIT, device="cpu")
    saved, expected = streamed.state_dict(), resident.state_dict()
    assert saved.keys() == expected.keys() and all(torch.equal(saved[k], expected[k]) for k in expected)
    x = (inputs["x"],)
    run(streamed, x)  # the first block is prefetched again: its slot holds the old weights
    params = dict(streamed.named_parameters())
    result = streamed.load_state_dict(other.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    assert all(p is params[k] for k, p in streamed.named_parameters())
    assert torch.equal(run(streamed, x), run(other, x))  # the next forward streams the new weights
    assert all(torch.equal(streamed.state_dict()[k], v) for k, v in other.state_dict().items())
    handle.disable()
    assert torch.equal(run(streamed, x), run(other, x))


def test_load_state_dict_with_assign_is_refused_before_anything_changes():
    resident, streamed, inputs = _pair(_toy)
    torch.manual_seed(5)
    other = ToyDiT(dim=32, num_blocks=4).eval()
    handle = enable_offload(streamed, DIT, device="cpu")
    with pytest.raises(UnsupportedUseError, match="assign=True"):
        streamed.load_state_dict(other.state_dict(), assign=True)
    x = (inputs["x"],)
    assert torch.equal(run(streamed, x), run(resident, x))
    handle.disable()


# --- 4 and 7. converting, copying, pickling ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "operation",
    [lambda m: m.half(), lambda m: m.to(torch.float64), lambda m: m.float(), lambda m: m.blocks[1].half()],
    ids=["half", "to-dtype", "float", "block-half"],
)
def test_converting_an_offloaded_model_is_refused_before_anything_changes(operation):
    resident, streamed, inputs = _pair(_toy)
    handle = enable_offload(streamed, DIT, device="cpu")
    with pytest.raises(UnsupportedUseError, match=r"handle\.disable\(\)"):
        operation(streamed)
    x = (inputs["x"],)
    assert torch.equal(run(streamed, x), run(resident, x))
    handle.disable()
    streamed.half()  # works again once disabled
    assert streamed.embed.weight.dtype == torch.float16


@pytest.mark.parametrize("operation", [copy.deepcopy, pickle.dumps, lambda m: copy.deepcopy(m.blocks[0])], ids=["deepcopy", "pickle", "block"])
def test_copying_an_offloaded_model_is_refused_with_a_clear_error(operation):
    resident, streamed, inputs = _pair(_toy)
    handle = enable_offload(streamed, DIT, device="cpu")
    with pytest.raises(UnsupportedUseError, match=r"cannot be copied or pickled.*handle\.disable\(\)"):
        operation(streamed)
    handle.disable()
    clone = copy.deepcopy(streamed)
    x = (inputs["x"],)
    assert torch.equal(run(clone, x), run(resident, x))


# --- 5a. grad modes ---------------------------------------------------------------------------------------------


class TransposingBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.seen: list[tuple[bool, bool]] = []

    def forward(self, x):
        weight = self.proj.weight
        self.seen.append((weight.is_inference(), weight.t().requires_grad))
        return self.proj(x.transpose(1, 2)).transpose(1, 2).contiguous()


class TransposingModel(nn.Module):
    _layerwise_offload_blocks_attrs = ["blocks"]

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(TransposingBlock() for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize(
    "modes",
    [("inference", "no_grad"), ("no_grad", "inference"), ("inference", "inference"), ("frozen_grad", "inference")],
)
def test_bound_weights_look_like_resident_ones_in_every_grad_mode(modes):
    torch.manual_seed(0)
    resident = TransposingModel()
    streamed = copy.deepcopy(resident)
    handle = enable_offload(streamed, DIT, device="cpu")
    x = torch.randn(2, 8, 64)
    contexts = {"inference": torch.inference_mode, "no_grad": torch.no_grad, "frozen_grad": torch.enable_grad}
    for mode in modes:
        for model in (resident, streamed):
            model.requires_grad_(mode != "frozen_grad")
            for block in model.blocks:
                block.seen.clear()
        with contexts[mode]():
            expected, got = resident(x), streamed(x)
        assert torch.equal(got, expected), mode
        assert [b.seen for b in streamed.blocks] == [b.seen for b in resident.blocks], mode
    handle.disable()


# --- 5b. module mode swaps in on the methods pipelines call ------------------------------------------------------


class TinyAutoencoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(4, 2)
        self.dec = nn.Linear(2, 4)
        self.devices_seen: list[torch.device] = []

    def encode(self, x):
        self.devices_seen.append(self.enc.weight.device)
        return self.enc(x)

    def decode(self, z):
        self.devices_seen.append(self.dec.weight.device)
        return self.dec(z)


class VaePipeline(nn.Module):
    _vae_modules = ["vae"]
    _dit_modules = ["transformer"]

    def __init__(self):
        super().__init__()
        self.transformer = ToyDiT(dim=8, num_blocks=2)
        self.vae = TinyAutoencoder()


def test_module_mode_swaps_a_vae_in_for_encode_and_decode():
    pipe = VaePipeline()
    z = torch.randn(3, 4)
    with torch.no_grad():
        expected = pipe.vae.decode(pipe.vae.encode(z))
    handle = enable_offload(pipe, {"mode": "module", "components": ["dit", "vae"]}, device="cpu")
    with torch.no_grad():
        got = pipe.vae.decode(pipe.vae.encode(z))
    assert torch.equal(got, expected)
    assert handle.stats().per_component["vae"].num_transfers == 2  # one swap-in per call, counted
    handle.disable()
    assert "decode" not in pipe.vae.__dict__ and "encode" not in pipe.vae.__dict__


# --- 6. an interrupt inside a block -------------------------------------------------------------------------------


def test_a_keyboard_interrupt_inside_a_block_leaves_the_model_usable():
    resident, streamed, inputs = _pair(_toy)
    handle = enable_offload(streamed, DIT, device="cpu")
    x = (inputs["x"],)
    expected = run(resident, x)
    interrupt = {"armed": True}

    def ctrl_c(module, args):
        if interrupt["armed"]:
            raise KeyboardInterrupt

    hook = streamed.blocks[2].register_forward_pre_hook(ctrl_c)
    for _ in range(4):  # more interrupts than there are slots
        with pytest.raises(KeyboardInterrupt):
            run(streamed, x)
    interrupt["armed"] = False
    hook.remove()
    assert torch.equal(run(streamed, x), expected)
    # no thread owns it any more: another thread runs it, compared with the resident model run on a new thread
    assert torch.equal(on_new_thread(lambda: run(streamed, x)), on_new_thread(lambda: run(resident, x)))
    assert handle.stats().max_materialized_blocks <= handle.stats().num_slots
    handle.disable()
