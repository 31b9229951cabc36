"""Transformers from fp8_scaled safetensors files (`components=`): recognised by their published layouts, kept
float8 on the host with their per-tensor scales, and streamed; outputs equal to a reference whose weights are the
same file's upcast with their scales, bit for bit. A layout that cannot be placed is refused naming the key."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from layerstream import Omni
from layerstream.models import ModelLoadError, ensure_tiny_model, load_pipeline
from tests.models.single_files import write_fp8_scaled

DIT = {"mode": "layer", "components": ["dit"]}
QUICK = dict(num_inference_steps=2, height=32, width=32, seed=3, keep_raw=True)


def _files(tmp_path, model, cls_name, names, **layout):
    """An fp8_scaled file and a float32 reference file (the same weights upcast with their scales) per name."""
    import diffusers

    fp8, reference = {}, {}
    for name in names:
        state = getattr(diffusers, cls_name).from_pretrained(ensure_tiny_model(model), subfolder=name).state_dict()
        fp8[name] = str(tmp_path / f"{name}-fp8_scaled.safetensors")
        reference[name] = str(tmp_path / f"{name}-reference.safetensors")
        save_file(write_fp8_scaled(fp8[name], state, **layout), reference[name])
    return fp8, reference


def _raw(model, components, offload, **size):
    omni = Omni(model=model, diffusion_offload_config=DIT, device="cpu", components=components, offload=offload)
    return omni, omni.generate("a cat", **QUICK, **size).raw


@pytest.mark.parametrize("spelling", ["scale_weight", "weight_scale"])
def test_wan22_experts_stream_float8_and_match_the_upcast_reference(tmp_path, spelling):
    fp8, reference = _files(tmp_path, "tiny-wan", "WanTransformer3DModel", ["transformer", "transformer_2"], spelling=spelling, original_names=True)
    _, expected = _raw("tiny-wan", reference, offload=False, num_frames=5)
    resident, raw_resident = _raw("tiny-wan", fp8, offload=False, num_frames=5)
    streamed, raw = _raw("tiny-wan", fp8, offload=True, num_frames=5)
    assert np.array_equal(raw_resident, expected) and np.array_equal(raw, expected)
    q = resident.pipeline.transformer_2.blocks[1].attn1.to_q
    assert q.weight.dtype == torch.float8_e4m3fn and q.weight_scale.dtype == torch.float32
    assert resident.pipeline.transformer.dtype == torch.float32  # diffusers reads the compute dtype
    stats = streamed.handle.stats().per_component
    for name in fp8:
        float32_blocks = sum(v.numel() * 4 for k, v in load_file(reference[name]).items() if k.startswith("blocks."))
        assert stats[name].host_bytes < 0.45 * float32_blocks, (stats[name].host_bytes, float32_blocks)


def test_a_plain_float8_file_reads_each_weight_with_a_scale_of_one(tmp_path):
    """float8 weights with no scale and no marker anywhere: a plain cast, each weight upcast as it is."""
    names = ["transformer", "transformer_2"]
    fp8, reference = _files(tmp_path, "tiny-wan", "WanTransformer3DModel", names, spelling=None, original_names=True)
    _, expected = _raw("tiny-wan", reference, offload=False, num_frames=5)
    streamed, raw = _raw("tiny-wan", fp8, offload=True, num_frames=5)
    assert np.array_equal(raw, expected)
    assert streamed.pipeline.transformer.blocks[0].ffn.net[2].weight.dtype == torch.float8_e4m3fn


def test_flux_in_diffusers_names(tmp_path):
    fp8, reference = _files(tmp_path, "tiny-flux", "FluxTransformer2DModel", ["transformer"], spelling="weight_scale", original_names=False)
    _, expected = _raw("tiny-flux", reference, offload=False)
    _, raw = _raw("tiny-flux", fp8, offload=True)
    assert np.array_equal(raw, expected)


def _edited(tmp_path, edit):
    """The tiny Wan's expert as an older-layout fp8_scaled file, with `edit` applied to its tensors."""
    from diffusers import WanTransformer3DModel

    path = tmp_path / "edited.safetensors"
    state = WanTransformer3DModel.from_pretrained(ensure_tiny_model("tiny-wan"), subfolder="transformer").state_dict()
    write_fp8_scaled(path, state, spelling="scale_weight", original_names=True)
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)
    return str(path)


def _drop_scales(tensors, *, and_marker: bool):
    """Every scale of an older-layout file taken out, and its marker with `and_marker` (without, the file still
    says it is scaled)."""
    for key in list(tensors):
        if key.endswith((".scale_weight", ".scale_input")) or (and_marker and key == "scaled_fp8"):
            del tensors[key]


def _plain_with_a_float8_bias(tensors):
    _drop_scales(tensors, and_marker=True)
    tensors["blocks.0.norm3.bias"] = tensors["blocks.0.norm3.bias"].to(torch.float8_e4m3fn)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.pop("blocks.1.self_attn.q.scale_weight"), r"float8 tensor blocks\.1\.self_attn\.q\.weight has no scale \(blocks\.1\.self_attn\.q\.scale_weight or blocks\.1\.self_attn\.q\.weight_scale\)"),
        (lambda t: t.update({"blocks.0.norm3.scale_weight": torch.ones(1)}), r"scale blocks\.0\.norm3\.scale_weight has no float8 weight blocks\.0\.norm3\.weight beside it"),
        (lambda t: t.update({"blocks.0.self_attn.k.scale_weight": torch.ones(4)}), r"scale blocks\.0\.self_attn\.k\.scale_weight holds 4 values; only per-tensor scales"),
        (lambda t: t.update({"blocks.0.self_attn.k.weight_scale": torch.ones(())}), r"weight blocks\.0\.self_attn\.k\.weight has two scales"),
        (lambda t: _drop_scales(t, and_marker=False), r"float8 tensor blocks\.0\.\S+\.weight has no scale"),
        (_plain_with_a_float8_bias, r"float8 tensor blocks\.0\.norm3\.bias is not a weight; only Linear weights"),
        (lambda t: t.update({"patch_embedding.weight": t["patch_embedding.weight"].to(torch.float8_e4m3fn)}), r"float8 tensor patch_embedding\.weight has no scale"),
    ],
)
def test_an_unrecognised_layout_is_refused_naming_the_key(tmp_path, edit, message):
    path = _edited(tmp_path, edit)
    with pytest.raises(ModelLoadError, match=r"^component transformer: edited\.safetensors: " + message) as info:
        load_pipeline("tiny-wan", components={"transformer": path})
    assert "\n" not in str(info.value)


def test_plan_prices_fp8_scaled_blocks_as_enabling_keeps_them(tmp_path, layerstream_cli):
    import json

    fp8, _ = _files(tmp_path, "tiny-wan", "WanTransformer3DModel", ["transformer_2"], spelling="scale_weight", original_names=True)
    result = layerstream_cli("plan", "tiny-wan", "--component", f"transformer_2={fp8['transformer_2']}", "--json")
    assert result.returncode == 0, result.stderr
    planned = {c["path"]: c["block_bytes"] for c in json.loads(result.stdout)["components"]}
    omni = Omni("tiny-wan", DIT, device="cpu", components=fp8)
    kept = omni.handle.stats().per_component["transformer_2"].host_bytes
    assert planned["transformer_2"] < 0.45 * planned["transformer"]
    # the store aligns each tensor: the ten 4-byte scales of a toy block take ~1.2 KiB of its ~16 KiB
    assert abs(planned["transformer_2"] - kept) < 0.1 * kept, (planned, kept)


def test_lora_on_float8_blocks_is_refused_before_anything_changes(tmp_path):
    """PEFT creates a LoRA layer's adapters in its base weight's dtype: float8 adapters cannot compute, so LoRA
    on a streamed fp8_scaled expert is refused, naming why."""
    peft = pytest.importorskip("peft")
    from layerstream import UnsupportedUseError

    fp8, _ = _files(tmp_path, "tiny-wan", "WanTransformer3DModel", ["transformer"], spelling="weight_scale", original_names=True)
    omni = Omni("tiny-wan", DIT, device="cpu", components=fp8)
    config = peft.LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k"], init_lora_weights=False)
    before = {k: v.clone() for k, v in omni.pipeline.transformer.state_dict().items()}
    with pytest.raises(UnsupportedUseError, match=r"transformer\.blocks\.0: LoRA on a block holding float8 weights \(a Linear's weight, as an fp8_scaled file keeps them\) is not supported \(the adapters would be created in float8\)"):
        omni.pipeline.transformer.add_adapter(config)
    after = omni.pipeline.transformer.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())


def test_in_float16_the_modules_diffusers_keeps_in_float32_stay_float32(tmp_path):
    """As diffusers' own loading does (`_keep_in_fp32_modules`): Wan's norms and its shift table would overflow."""
    from diffusers import WanTransformer3DModel

    fp8, _ = _files(tmp_path, "tiny-wan", "WanTransformer3DModel", ["transformer"], spelling="scale_weight", original_names=True)
    pipeline = Omni(model="tiny-wan", device="cpu", dtype="float16", components=fp8, offload=False).pipeline
    kept = WanTransformer3DModel._keep_in_fp32_modules
    assert kept  # the test means something only where the class keeps some
    for key, tensor in pipeline.transformer.state_dict().items():
        if tensor.is_floating_point() and not key.endswith("weight_scale") and tensor.dtype != torch.float8_e4m3fn:
            assert tensor.dtype == (torch.float32 if any(m in key.split(".") for m in kept) else torch.float16), key


class _ScaledToy(torch.nn.Module):
    """Three float8 Linears, each with its own per-tensor scale, as `load_fp8_scaled` leaves them."""

    _layerwise_offload_blocks_attrs = ["blocks"]

    def __init__(self, scales):
        from layerstream.models.fp8_scaled import apply_scaled_float8_

        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in scales)
        for i, (block, scale) in enumerate(zip(self.blocks, scales)):
            float8 = (block.weight.detach() / scale).to(torch.float8_e4m3fn)
            block.weight = torch.nn.Parameter(float8, requires_grad=False)
            apply_scaled_float8_("toy", block, f"blocks.{i}.weight", torch.tensor(scale), torch.float32)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_a_streamed_scaled_weight_is_scaled_exactly_once():
    """Streamed or resident, each Linear computes with its float8 weight upcast and scaled once: the output is the
    reference's bit for bit, and neither the unscaled nor the twice-scaled weights'."""
    from layerstream import enable_offload

    torch.manual_seed(0)
    toy, x = _ScaledToy([0.003, 0.0007, 0.02]), torch.randn(4, 64)

    def reference(times: int) -> torch.Tensor:
        out = x
        for block in toy.blocks:
            weight = block.weight.to(torch.float32) * block.weight_scale**times
            out = torch.nn.functional.linear(out, weight, block.bias)
        return out

    with torch.no_grad():
        resident = toy(x)
        handle = enable_offload(toy, {"mode": "layer", "components": ["dit"]}, device="cpu")
        try:
            streamed = toy(x)
        finally:
            handle.disable()
        expected = reference(1)
    assert torch.equal(resident, expected) and torch.equal(streamed, expected)
    assert not torch.allclose(streamed, reference(0)) and not torch.allclose(streamed, reference(2))
    assert toy.blocks[0].weight.dtype == torch.float8_e4m3fn  # disable gives the float8 weights back


def test_float8_storage_keeps_a_scaled_layer_as_the_file_has_it(tmp_path):
    """The float8 form on an fp8_scaled expert: a scaled Linear's float8 weight streams as it is and its per-tensor
    scale is never rounded to float8 (a rounded scale would bias the whole layer); every block Linear of the tiny
    files is scaled, so the output is the upcast reference's bit for bit and the blocks are kept packed, as
    without a storage form."""
    fp8, reference = _files(
        tmp_path, "tiny-flux", "FluxTransformer2DModel", ["transformer"], spelling="weight_scale", original_names=False
    )
    _, expected = _raw("tiny-flux", reference, offload=False)
    float8 = {"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"storage_dtype": "float8_e4m3fn"}}}
    packed, _ = _raw("tiny-flux", fp8, offload=True)
    omni = Omni(model="tiny-flux", diffusion_offload_config=float8, device="cpu", components=fp8)
    assert np.array_equal(omni.generate("a cat", **QUICK).raw, expected)
    stats = [o.handle.stats() for o in (packed, omni)]
    assert stats[1].per_component["transformer"].host_bytes == stats[0].per_component["transformer"].host_bytes
    assert stats[1].slot_bytes == stats[0].slot_bytes  # nothing cast: kept packed, no staging copy in the slot
