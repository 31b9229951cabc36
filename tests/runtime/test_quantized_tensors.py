"""Quantized weights in streamed blocks: a tensor subclass layerstream cannot pack is refused at enable, naming
the tensor and its type, before anything changes."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("diffusers")

from layerstream import OffloadError, UnsupportedTensorError, enable_offload  # noqa: E402
from tests.models.single_files import write_gguf  # noqa: E402
from tests.runtime.tiny_pipelines import DIT, load  # noqa: E402


def _tensors(pipe) -> dict[str, tuple[torch.Tensor, object]]:
    named = [*pipe.transformer.named_parameters(), *pipe.transformer.named_buffers()]
    return {f"transformer.{n}": (t, type(t)) for n, t in named}


class Opaque(torch.Tensor):
    """A wrapper subclass without `__tensor_flatten__`: nothing tells layerstream where its bytes are."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)

    def __init__(self, inner):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_map

        def unwrap(x):
            return x.inner if isinstance(x, Opaque) else x

        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))


def test_an_unpackable_tensor_subclass_is_refused_before_anything_changes():
    pipe = load("flux")
    to_q = pipe.transformer.transformer_blocks[1].attn.to_q
    to_q.register_buffer("opaque", Opaque(torch.zeros(4)))
    before = _tensors(pipe)
    devices = {n: t.device for n, (t, _) in before.items()}
    with pytest.raises(UnsupportedTensorError, match=r"transformer\.transformer_blocks\.1\.attn\.to_q\.opaque is a \S*Opaque") as info:
        enable_offload(pipe, DIT, device="cpu")
    assert isinstance(info.value, OffloadError) and isinstance(info.value, TypeError)
    after = _tensors(pipe)
    assert after.keys() == before.keys()
    for name, (tensor, cls) in before.items():
        assert after[name][0] is tensor and type(after[name][0]) is cls and tensor.device == devices[name]
    assert getattr(pipe.transformer, "_layerstream_offload", None) is None


def _torchao_config(scheme: str):
    torchao = pytest.importorskip("torchao.quantization")
    return torchao, torchao.Int8WeightOnlyConfig() if scheme == "int8" else torchao.Float8WeightOnlyConfig()


@pytest.mark.parametrize("scheme", ["int8", "float8"])
def test_torchao_weight_only_blocks_stream_bit_identically(scheme):
    from tests.runtime.tiny_pipelines import generate

    torchao, config = _torchao_config(scheme)
    resident, streamed = load("flux"), load("flux")
    for pipe in (resident, streamed):
        torchao.quantize_(pipe.transformer, config)  # every Linear, resident ones included
    weight = streamed.transformer.transformer_blocks[0].attn.to_q.weight
    inner_names = weight.__tensor_flatten__()[0]
    before = {n: getattr(weight, n).clone() for n in inner_names}
    state_before = {k: v for k, v in streamed.transformer.state_dict().items()}
    with torch.no_grad():
        expected = generate(resident, "flux")
        handle = enable_offload(streamed, DIT, device="cpu")
        assert torch.equal(generate(streamed, "flux"), expected)
        assert torch.equal(generate(streamed, "flux"), expected)
        assert getattr(weight, inner_names[0]).numel() == 0  # evicted between calls: placeholders
        state = streamed.transformer.state_dict()  # the same subclass, over the store's inner tensors
        for key, value in state_before.items():
            assert type(state[key]) is type(value), key
        assert torch.equal(state["transformer_blocks.0.attn.to_q.weight"].qdata, before["qdata"])
        stats = handle.stats().per_component["transformer"]
        handle.disable()
        assert torch.equal(generate(streamed, "flux"), expected)
    assert streamed.transformer.transformer_blocks[0].attn.to_q.weight is weight
    for name, value in before.items():
        assert torch.equal(getattr(weight, name), value), name
    float32_block_bytes = sum(
        m.weight.numel() * 4 for n, m in resident.transformer.named_modules() if "blocks." in n and isinstance(m, torch.nn.Linear)
    )
    assert stats.host_bytes < 0.5 * float32_block_bytes  # one byte per weight, plus scales, biases and norms


FLUX_256 = dict(
    patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=64, num_attention_heads=4,
    joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(16, 24, 24),
)
"""A tiny Flux transformer whose block Linear rows hold whole 256-value GGUF super-blocks (for Q4_K)."""


def _gguf_transformer(path, folder):
    from diffusers import FluxTransformer2DModel, GGUFQuantizationConfig

    return FluxTransformer2DModel.from_single_file(
        str(path), quantization_config=GGUFQuantizationConfig(compute_dtype=torch.float32), config=str(folder),
        torch_dtype=torch.float32,
    )


def _flux_inputs(model):
    g = torch.Generator().manual_seed(0)
    cfg = model.config
    return dict(
        hidden_states=torch.randn(1, 16, cfg.in_channels, generator=g),
        encoder_hidden_states=torch.randn(1, 8, cfg.joint_attention_dim, generator=g),
        pooled_projections=torch.randn(1, cfg.pooled_projection_dim, generator=g),
        timestep=torch.tensor([0.5]),
        img_ids=torch.zeros(16, 3),
        txt_ids=torch.zeros(8, 3),
        return_dict=False,
    )


def test_gguf_q8_0_and_q4_k_blocks_stream_bit_identically(tmp_path):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    folder = tmp_path / "transformer"
    FluxTransformer2DModel(**FLUX_256).save_pretrained(folder)
    path = tmp_path / "tiny-flux-transformer.gguf"
    pytest.importorskip("gguf")
    # Q8_0 for the key and value projections, Q4_K for the other block Linears (rows of whole 256-value blocks)
    state = FluxTransformer2DModel.from_pretrained(folder).state_dict()
    kinds = write_gguf(path, state, {".to_k.": "Q8_0", ".to_v.": "Q8_0", "": "Q4_K"}, arch="flux")
    assert {"Q4_K", "Q8_0"} <= set(kinds.values()), kinds  # both present
    resident, streamed = _gguf_transformer(path, folder), _gguf_transformer(path, folder)
    q4k = streamed.transformer_blocks[0].ff.net[2].weight
    assert type(q4k).__name__ == "GGUFParameter" and int(q4k.quant_type) == 12
    before = {k: (type(v), getattr(v, "quant_type", None), v.detach().clone()) for k, v in streamed.state_dict().items()}
    with torch.no_grad():
        expected = resident(**_flux_inputs(resident))[0]
        handle = enable_offload(streamed, DIT, device="cpu")
        assert torch.equal(streamed(**_flux_inputs(streamed))[0], expected)
        assert torch.equal(streamed(**_flux_inputs(streamed))[0], expected)
        for key, value in streamed.state_dict().items():  # while enabled: the same classes and quantization types
            assert type(value) is before[key][0] and getattr(value, "quant_type", None) == before[key][1], key
            assert torch.equal(value, before[key][2]), key
        stats = handle.stats()
        # the quantized bytes stream: far fewer than the float32 blocks would be
        float32_bytes = sum(
            math.prod(getattr(v, "quant_shape", v.shape)) * 4 for k, v in resident.state_dict().items() if "blocks." in k
        )
        assert stats.host_bytes < 0.4 * float32_bytes, (stats.host_bytes, float32_bytes)
        handle.disable()
        assert torch.equal(streamed(**_flux_inputs(streamed))[0], expected)
    after = streamed.state_dict()
    for key, (cls, quant_type, value) in before.items():
        assert type(after[key]) is cls and getattr(after[key], "quant_type", None) == quant_type, key
        assert torch.equal(after[key], value), key


def test_input_gradients_through_torchao_blocks_match_resident():
    torchao, config = _torchao_config("int8")
    from tests.runtime.runtime_toys import ToyDiT

    def make():
        torch.manual_seed(0)
        model = ToyDiT(dim=256, num_blocks=4).eval()
        torchao.quantize_(model, config)
        return model.requires_grad_(False)

    resident, streamed = make(), make()
    handle = enable_offload(streamed, DIT, device="cpu")
    grads = []
    for model in (resident, streamed):
        x = torch.randn(2, 8, 256, generator=torch.Generator().manual_seed(0), requires_grad=True)
        model(x).square().sum().backward()
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1])
    handle.disable()
