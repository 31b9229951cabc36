"""LoRA through the model's own API (issue 26 item 11): diffusers' `PeftAdapterMixin` on the transformer itself
(`load_lora_adapter`, `set_adapters`, `fuse_lora`, `unfuse_lora`, `delete_adapters`, `unload_lora`), with offload
enabled on the bare model or on its pipeline, gives the resident model's outputs bit for bit. The adapter
files are PEFT state dicts with random values, written by the test (nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from layerstream import enable_offload
from runtime_toys import run, tiny_wan_transformer
from tiny_pipelines import DIT, LORA_TARGETS, generate, load

peft = pytest.importorskip("peft")


def _write_adapter(model, path: Path, *, seed: int, prefix: str) -> Path:
    """A PEFT adapter for `model`'s attention projections (random, non-zero A and B), keys under `prefix`;
    `model` is left as it is (the adapter is added to a twin built from its config)."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    twin = type(model).from_config(model.config)
    torch.manual_seed(seed)
    twin.add_adapter(peft.LoraConfig(r=4, lora_alpha=4, target_modules=LORA_TARGETS, init_lora_weights=False))
    save_file({f"{prefix}.{k}": v.contiguous() * 0.1 for k, v in get_peft_model_state_dict(twin).items()}, str(path))
    return path


def _bare():
    """The tiny Wan transformer, offload enabled on the model itself."""
    resident, inputs = tiny_wan_transformer()
    streamed, _ = tiny_wan_transformer()
    return resident, streamed, streamed, lambda model: run(model, inputs)


def _in_pipeline():
    """The tiny Wan 2.2 pipeline, offload enabled on the pipeline, LoRA through `pipe.transformer`."""
    resident, streamed = load("wan"), load("wan")
    outputs = {id(resident.transformer): resident, id(streamed.transformer): streamed}
    return resident.transformer, streamed.transformer, streamed, lambda model: generate(outputs[id(model)], "wan")


CASES = {"model": _bare, "pipeline": _in_pipeline}


def _base_weights(model) -> dict[str, torch.Tensor]:
    """The model's weights under their pre-LoRA names (PEFT moves a Linear's weights under `base_layer`)."""
    return {k.replace(".base_layer", ""): v.clone() for k, v in model.state_dict().items() if "lora_" not in k}


def _adapter_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" in n)


def _restore_(model, weights: dict[str, torch.Tensor]) -> None:
    """Put `weights` (pre-LoRA names) back into `model` in place."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            key = name.replace(".base_layer", "")
            if key in weights:
                param.copy_(weights[key])


@pytest.mark.parametrize("exact_unfuse", [False, True])
@pytest.mark.parametrize("where", CASES)
def test_the_model_level_lora_life_cycle_matches_the_resident_model(where, exact_unfuse, tmp_path):
    resident, streamed, owner, output = CASES[where]()
    first = _write_adapter(resident, tmp_path / "first.safetensors", seed=1, prefix="transformer")
    second = _write_adapter(resident, tmp_path / "second.safetensors", seed=2, prefix="transformer")
    original = _base_weights(resident)
    handle = enable_offload(owner, {**DIT, "lora_exact_unfuse": exact_unfuse}, device="cpu")
    start = handle.stats()
    base = output(resident)
    assert torch.equal(output(streamed), base)

    def both(operation):
        for model in (resident, streamed):
            operation(model)
        out = output(streamed)
        assert torch.equal(out, output(resident))
        return out

    both(lambda m: m.load_lora_adapter(str(first), prefix="transformer", adapter_name="first"))
    loaded = both(lambda m: m.load_lora_adapter(str(second), prefix="transformer", adapter_name="second"))
    assert not torch.equal(loaded, base)
    stats = handle.stats()  # adapters stay resident on the device; the host store is unchanged
    assert _adapter_bytes(streamed) > 0 and stats.device_bytes == start.device_bytes + _adapter_bytes(streamed)
    assert stats.host_bytes == start.host_bytes
    weighted = both(lambda m: m.set_adapters(["first", "second"], [0.7, 0.3]))
    assert not torch.equal(weighted, loaded)

    fused = both(lambda m: m.fuse_lora(adapter_names=["first", "second"], lora_scale=0.8))
    assert not torch.equal(fused, weighted)
    if exact_unfuse:
        assert handle.stats().host_bytes > start.host_bytes  # the pre-fuse bytes of the fused blocks, until unfused
        for model in (resident, streamed):
            model.unfuse_lora()
        # the host store gets the pre-fuse bytes back exactly; PEFT's resident unmerge subtracts again and rounds
        assert all(torch.equal(v, original[k]) for k, v in _base_weights(streamed).items())
        _restore_(resident, original)
    else:  # PEFT's unmerge on both: the same arithmetic, the same rounding
        assert handle.stats().host_bytes == start.host_bytes
        both(lambda m: m.unfuse_lora())
        assert all(torch.equal(v, _base_weights(resident)[k]) for k, v in _base_weights(streamed).items())
    assert handle.stats().host_bytes == start.host_bytes
    assert torch.equal(output(streamed), output(resident))

    both(lambda m: m.delete_adapters("second"))
    both(lambda m: m.fuse_lora())
    fused_kept = both(lambda m: m.unload_lora())  # the fused weights stay, the adapters go
    assert not torch.equal(fused_kept, base)
    assert all("lora_" not in n for n, _ in streamed.named_parameters())
    stats = handle.stats()
    assert stats.host_bytes == start.host_bytes and stats.device_bytes == start.device_bytes
    handle.disable()
    assert torch.equal(output(streamed), fused_kept)
    assert torch.equal(output(streamed), output(resident))
