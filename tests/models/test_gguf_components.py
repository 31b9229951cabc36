"""Transformers from GGUF files (`components=`), streamed as their quantized bytes: the tiny Wan 2.2's two
experts each from its own file in the original checkpoint's key names, K-quants on a wider Wan, outputs
bit-identical to diffusers' resident pipeline built from the same files."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")

from layerstream import Omni  # noqa: E402
from layerstream.models import ensure_tiny_model  # noqa: E402
from tests.models.single_files import stored_tensors, wan_original_keys, write_gguf  # noqa: E402

DIT = {"mode": "layer", "components": ["dit"]}
QUICK = dict(num_inference_steps=2, height=32, width=32, num_frames=5, seed=3, keep_raw=True)


def _expert_files(tmp_path, folder, kinds_by_expert):
    """A GGUF file per expert of the pipeline in `folder`, in the original key names; name -> (path, types)."""
    from diffusers import WanTransformer3DModel

    out = {}
    for name, kinds in kinds_by_expert.items():
        state = WanTransformer3DModel.from_pretrained(folder, subfolder=name).state_dict()
        path = tmp_path / f"{name}.gguf"
        out[name] = (path, write_gguf(path, wan_original_keys(state), kinds))
    return out


def _generate(model, components, offload):
    omni = Omni(model=model, diffusion_offload_config=DIT, device="cpu", components=components, offload=offload)
    result = omni.generate("a cat", **QUICK)
    stats = omni.handle.stats() if omni.handle is not None else None
    return omni, result.raw, stats


def test_wan22_experts_from_q8_0_and_q4_0_files_stream_bit_identically(tmp_path):
    folder = ensure_tiny_model("tiny-wan")
    files = _expert_files(tmp_path, folder, {"transformer": {"": "Q8_0"}, "transformer_2": {".ffn.": "Q8_0", "": "Q4_0"}})
    assert set(files["transformer_2"][1].values()) == {"Q8_0", "Q4_0"}
    components = {name: str(path) for name, (path, _) in files.items()}
    resident, expected, _ = _generate("tiny-wan", components, offload=False)
    streamed, raw, stats = _generate("tiny-wan", components, offload=True)
    assert np.array_equal(raw, expected)
    # the weights are the file's, converted from the original names by diffusers, and stay quantized
    for name, (path, types) in files.items():
        stored = stored_tensors(path)
        expert = getattr(resident.pipeline, name)
        q = expert.blocks[1].attn1.to_q.weight
        assert type(q).__name__ == "GGUFParameter" and q.quant_type.name == types["blocks.1.self_attn.q.weight"]
        assert torch.equal(q.view(torch.uint8), stored["blocks.1.self_attn.q.weight"])  # the file's bytes
        assert torch.equal(expert.blocks[2].norm2.weight, stored["blocks.2.norm3.weight"])  # norm2/norm3 swapped
        # host bytes are the file's (quantized), not float32's
        streamed_bytes = stats.per_component[name].host_bytes
        block_bytes = sum(w.numel() * 4 for k, w in expert.state_dict().items() if k.startswith("blocks."))
        assert streamed_bytes < 0.5 * block_bytes, (streamed_bytes, block_bytes)


def _wide_wan(tmp_path):
    """The tiny Wan with 256-wide blocks (two 128-wide heads), so that K-quant super-blocks fit its rows: the
    folder is a copy of tiny-wan whose transformers' configs are wider (their weights come from the files)."""
    folder = tmp_path / "wide-wan"
    shutil.copytree(ensure_tiny_model("tiny-wan"), folder)
    (folder / "layerstream-manifest.json").unlink()
    from diffusers import WanTransformer3DModel

    states = {}
    for name in ("transformer", "transformer_2"):
        config_path = folder / name / "config.json"
        config = json.loads(config_path.read_text())
        config.update(attention_head_dim=128, ffn_dim=256)
        config_path.write_text(json.dumps(config))
        torch.manual_seed(len(name))
        states[name] = WanTransformer3DModel.from_config(config).state_dict()
    return folder, states


def test_k_quant_experts_stream_bit_identically(tmp_path):
    folder, states = _wide_wan(tmp_path)
    components = {}
    for name, kinds in (("transformer", {".ffn.": "Q6_K", "": "Q4_K"}), ("transformer_2", {"": "Q5_K"})):
        path = tmp_path / f"{name}.gguf"
        written = write_gguf(path, wan_original_keys(states[name]), kinds)
        assert set(written.values()) == set(kinds.values()), written
        components[name] = str(path)
    _, expected, _ = _generate(str(folder), components, offload=False)
    _, raw, _ = _generate(str(folder), components, offload=True)
    assert np.isfinite(expected).all() and np.array_equal(raw, expected)


def test_flux_from_a_gguf_file_streams_bit_identically(tmp_path):
    """Flux in diffusers' names (diffusers' Flux converter splits the original fused projections at the real
    model's width, 3072, so a tiny Flux cannot be written in the original names)."""
    from diffusers import FluxTransformer2DModel

    state = FluxTransformer2DModel.from_pretrained(ensure_tiny_model("tiny-flux"), subfolder="transformer").state_dict()
    path = tmp_path / "flux.gguf"
    written = write_gguf(path, state, {"ff": "Q4_0", "": "Q8_0"}, arch="flux")
    assert set(written.values()) == {"Q8_0", "Q4_0"}
    components = {"transformer": str(path)}
    size = dict(num_inference_steps=2, height=32, width=32, seed=3, keep_raw=True)
    expected = Omni("tiny-flux", DIT, device="cpu", components=components, offload=False).generate("a cat", **size).raw
    streamed = Omni("tiny-flux", DIT, device="cpu", components=components)
    assert np.array_equal(streamed.generate("a cat", **size).raw, expected)
    assert type(streamed.pipeline.transformer.transformer_blocks[0].ff.net[2].weight).__name__ == "GGUFParameter"


def test_gguf_and_fp8_scaled_experts_stream_from_the_disk_tier_bit_identically(tmp_path):
    """One expert from a GGUF file, the other from an fp8_scaled file, with a host budget that keeps some blocks
    on disk: the same output as with every block in host memory."""
    from diffusers import WanTransformer3DModel

    from tests.models.single_files import write_fp8_scaled

    folder = ensure_tiny_model("tiny-wan")
    gguf_path, fp8_path = tmp_path / "high.gguf", tmp_path / "low.safetensors"
    write_gguf(gguf_path, wan_original_keys(WanTransformer3DModel.from_pretrained(folder, subfolder="transformer").state_dict()), {"": "Q4_0"})
    write_fp8_scaled(fp8_path, WanTransformer3DModel.from_pretrained(folder, subfolder="transformer_2").state_dict(), spelling="weight_scale", original_names=True)
    components = {"transformer": str(gguf_path), "transformer_2": str(fp8_path)}
    _, expected, _ = _generate("tiny-wan", components, offload=True)
    tiered = {**DIT, "host_budget_gb": 40_000 / 1e9, "disk_dir": str(tmp_path / "spill")}
    omni = Omni(model="tiny-wan", diffusion_offload_config=tiered, device="cpu", components=components)
    assert np.array_equal(omni.generate("a cat", **QUICK).raw, expected)
    stats = omni.handle.stats()
    assert stats.disk_bytes_read > 0, stats


def test_a_peft_adapter_on_a_streamed_gguf_expert_matches_resident(tmp_path):
    peft = pytest.importorskip("peft")
    files = _expert_files(tmp_path, ensure_tiny_model("tiny-wan"), {"transformer": {"": "Q8_0"}})
    components = {"transformer": str(files["transformer"][0])}
    outputs = []
    for offload in (False, True):
        omni = Omni(model="tiny-wan", diffusion_offload_config=DIT, device="cpu", components=components, offload=offload)
        torch.manual_seed(3)
        omni.pipeline.transformer.add_adapter(peft.LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k"], init_lora_weights=False))
        outputs.append(omni.generate("a cat", **QUICK).raw)
    assert np.array_equal(*outputs)
