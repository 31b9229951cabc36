"""LoRA with offload enabled (issue 15, item 2): PEFT's `add_adapter` and diffusers' `load_lora_weights`,
`set_adapters`, `fuse_lora`, `unfuse_lora`, `delete_adapters` and `unload_lora_weights` on tiny Wan 2.2 and
tiny Flux pipelines give the resident pipeline's outputs bit for bit at every stage, unfuse and unload
included. Adapter weights stay resident on the device (counted in device bytes); fusing writes into the host
store. With ``lora_exact_unfuse`` it keeps a host copy of the original bytes (counted in host bytes) so that
unfusing restores them exactly, where PEFT's unmerge (resident, and streamed by default) rounds."""

from __future__ import annotations

import pytest
import torch

from layerstream import enable_offload
from tiny_pipelines import DIT, KINDS, LORA_TARGETS, generate, load, write_lora_file

peft = pytest.importorskip("peft")


def _base_weights(model) -> dict[str, torch.Tensor]:
    """The model's weights under their pre-LoRA names (PEFT moves a Linear's weights under `base_layer`)."""
    return {k.replace(".base_layer", ""): v.clone() for k, v in model.state_dict().items() if "lora_" not in k}


@pytest.mark.parametrize("kind", KINDS)
def test_peft_add_adapter_after_enable_matches_the_resident_adapter(kind):
    resident, streamed = load(kind), load(kind)
    handle = enable_offload(streamed, DIT, device="cpu")
    device_bytes = handle.stats().device_bytes
    config = peft.LoraConfig(r=4, lora_alpha=4, target_modules=LORA_TARGETS, init_lora_weights=False)
    for pipe in (resident, streamed):
        torch.manual_seed(3)
        pipe.transformer.add_adapter(config)
    assert torch.equal(generate(streamed, kind), generate(resident, kind))
    adapter_bytes = sum(p.numel() * p.element_size() for n, p in streamed.transformer.named_parameters() if "lora_" in n)
    assert adapter_bytes > 0 and handle.stats().device_bytes == device_bytes + adapter_bytes  # resident on the device
    assert all("lora_" not in e.name for b in handle.streamer.blocks for e in b.host.layout.entries)  # never streamed
    handle.disable()
    assert torch.equal(generate(streamed, kind), generate(resident, kind))


def _lifecycle_until_fused(kind, tmp_path, config):
    """(resident, streamed, handle, host bytes before fusing, original weights, both): two adapters loaded,
    weighted and fused on both pipelines, every stage checked bit for bit against resident."""
    resident, streamed = load(kind), load(kind)
    first, second = write_lora_file(resident, tmp_path, seed=1), write_lora_file(resident, tmp_path, seed=2)
    original = _base_weights(resident.transformer)
    handle = enable_offload(streamed, config, device="cpu")
    host_bytes = handle.stats().host_bytes
    base = generate(resident, kind)
    assert torch.equal(generate(streamed, kind), base)

    def both(operation):
        for pipe in (resident, streamed):
            operation(pipe)
        out = generate(streamed, kind)
        assert torch.equal(out, generate(resident, kind))
        return out

    both(lambda p: p.load_lora_weights(str(first), adapter_name="first"))
    loaded = both(lambda p: p.load_lora_weights(str(second), adapter_name="second"))
    assert not torch.equal(loaded, base)
    weighted = both(lambda p: p.set_adapters(["first", "second"], [0.7, 0.3]))
    assert not torch.equal(weighted, loaded)
    assert handle.stats().host_bytes == host_bytes

    fused = both(lambda p: p.fuse_lora(adapter_names=["first", "second"], lora_scale=0.8))
    assert not torch.equal(fused, weighted)
    assert _base_weights(streamed.transformer).keys() == original.keys()
    assert not all(torch.equal(v, original[k]) for k, v in _base_weights(streamed.transformer).items())  # the store holds fused weights
    assert handle.stats().per_component["transformer"].num_streamed_blocks > 0
    return resident, streamed, handle, host_bytes, original, both


@pytest.mark.parametrize("kind", KINDS)
def test_diffusers_lora_lifecycle_matches_the_resident_pipeline_at_every_stage(kind, tmp_path):
    resident, streamed, handle, host_bytes, original, both = _lifecycle_until_fused(kind, tmp_path, DIT)
    assert handle.stats().host_bytes == host_bytes  # no pre-fuse copy by default
    both(lambda p: p.unfuse_lora())  # PEFT's unmerge on both: the same rounding
    assert all(torch.equal(v, _base_weights(resident.transformer)[k]) for k, v in _base_weights(streamed.transformer).items())
    both(lambda p: p.delete_adapters("second"))
    both(lambda p: p.fuse_lora())
    both(lambda p: p.unfuse_lora())
    unloaded = both(lambda p: p.unload_lora_weights())
    assert all("lora_" not in n for n, _ in streamed.transformer.named_parameters())
    handle.disable()
    assert torch.equal(generate(streamed, kind), unloaded) and torch.equal(generate(resident, kind), unloaded)


@pytest.mark.parametrize("kind", KINDS)
def test_lora_exact_unfuse_restores_the_original_bytes(kind, tmp_path):
    config = {**DIT, "lora_exact_unfuse": True}
    resident, streamed, handle, host_bytes, original, both = _lifecycle_until_fused(kind, tmp_path, config)
    assert handle.stats().host_bytes > host_bytes  # the pre-fuse bytes of the fused blocks, until unfused

    for pipe in (resident, streamed):
        pipe.unfuse_lora()
    # PEFT's unmerge subtracts the delta again, which rounds; the host store gets the original bytes back exactly
    assert all(torch.equal(v, original[k]) for k, v in _base_weights(streamed.transformer).items())
    rounded = sum(not torch.equal(v, original[k]) for k, v in _base_weights(resident.transformer).items())
    for k, v in _base_weights(resident.transformer).items():
        with torch.no_grad():
            dict(resident.transformer.named_parameters())[_peft_name(resident.transformer, k)].copy_(original[k])
    assert handle.stats().host_bytes == host_bytes
    assert torch.equal(generate(streamed, kind), generate(resident, kind))

    both(lambda p: p.delete_adapters("second"))
    both(lambda p: p.fuse_lora())
    fused_kept = both(lambda p: p.unload_lora_weights())  # fused weights stay, the adapters go
    assert handle.stats().host_bytes == host_bytes  # nothing left to unfuse: the pre-fuse copy is gone
    assert all("lora_" not in n for n, _ in streamed.transformer.named_parameters())
    handle.disable()
    assert torch.equal(generate(streamed, kind), fused_kept)
    print(f"{kind}: resident unfuse left {rounded} of {len(original)} tensors off their original bytes")


def _peft_name(model, name: str) -> str:
    """`name` as it is after PEFT put a LoRA layer around its Linear (`...to_q.weight` -> `...to_q.base_layer.weight`)."""
    params = dict(model.named_parameters())
    if name in params:
        return name
    head, _, leaf = name.rpartition(".")
    return f"{head}.base_layer.{leaf}"
