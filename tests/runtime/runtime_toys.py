"""Tiny models for the runtime tests: pure-torch toys and tiny diffusers/transformers models built from configs."""

from __future__ import annotations

import torch
from torch import nn

from layerstream import OffloadPlan


class ToyBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, 2 * dim)
        self.out = nn.Linear(2 * dim, dim)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, dim))

    def forward(self, x):
        return x + self.out(torch.nn.functional.gelu(self.proj(self.norm(x)))) * self.scale


class ToyDiT(nn.Module):
    _layerwise_offload_blocks_attrs = ["blocks"]

    def __init__(self, dim: int = 32, num_blocks: int = 4):
        super().__init__()
        self.embed = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(ToyBlock(dim) for _ in range(num_blocks))
        self.head = nn.Linear(dim, dim)
        self.order: list[int] | None = None  # run blocks in this order instead of the declared one

    def forward(self, x, skip: tuple[int, ...] = ()):
        h = self.embed(x)
        order = self.order if self.order is not None else range(len(self.blocks))
        for i in order:
            if i not in skip:
                h = self.blocks[i](h)
        return self.head(h)


class ToyEncoderStack(nn.Module):
    def __init__(self, dim: int, num_layers: int):
        super().__init__()
        self.layers = nn.ModuleList(ToyBlock(dim) for _ in range(num_layers))


class ToyTextEncoder(nn.Module):
    def __init__(self, vocab: int = 50, dim: int = 32, num_layers: int = 3):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.encoder = ToyEncoderStack(dim, num_layers)
        self.final_norm = nn.LayerNorm(dim)

    def forward(self, ids):
        h = self.embed_tokens(ids)
        for layer in self.encoder.layers:
            h = layer(h)
        return self.final_norm(h)


class MyPipeline(nn.Module):
    """The vllm-omni-style custom pipeline of the foundation issue."""

    _encoder_modules = ["prompt_model"]
    _offload_plan = OffloadPlan(
        encoder_component_types={"prompt_model": "text_encoder"},
        encoder_block_attrs={"prompt_model": ("encoder.layers",)},
    )

    def __init__(self, dim: int = 32):
        super().__init__()
        self.prompt_model = ToyTextEncoder(dim=dim)
        self.transformer = ToyDiT(dim=dim)

    def forward(self, ids, x):
        context = self.prompt_model(ids).mean(dim=1, keepdim=True)
        return self.transformer(x + context)


def make_my_pipeline(seed: int = 0, dim: int = 32) -> MyPipeline:
    torch.manual_seed(seed)
    return MyPipeline(dim).eval()


def toy_inputs(seed: int = 1, dim: int = 32):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50, (2, 5), generator=g), torch.randn(2, 7, dim, generator=g)


def tiny_wan_transformer():
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=16, ffn_dim=32, num_layers=3, rope_max_seq_len=32,
    ).eval()
    g = torch.Generator().manual_seed(1)
    inputs = dict(
        hidden_states=torch.randn(1, 4, 2, 8, 8, generator=g),
        timestep=torch.tensor([500]),
        encoder_hidden_states=torch.randn(1, 6, 16, generator=g),
        return_dict=False,
    )
    return model, inputs


def tiny_flux_transformer():
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(
        patch_size=1, in_channels=8, num_layers=2, num_single_layers=2, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, pooled_projection_dim=16, axes_dims_rope=(2, 2, 4),
    ).eval()
    g = torch.Generator().manual_seed(1)
    inputs = dict(
        hidden_states=torch.randn(1, 16, 8, generator=g),
        encoder_hidden_states=torch.randn(1, 6, 16, generator=g),
        pooled_projections=torch.randn(1, 16, generator=g),
        timestep=torch.tensor([0.5]),
        img_ids=torch.zeros(16, 3),
        txt_ids=torch.zeros(6, 3),
        return_dict=False,
    )
    return model, inputs


def tiny_flux2_transformer():
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(0)
    model = Flux2Transformer2DModel(
        patch_size=1, in_channels=8, num_layers=2, num_single_layers=2, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, timestep_guidance_channels=16, axes_dims_rope=(2, 2, 2, 2), guidance_embeds=False,
    ).eval()
    g = torch.Generator().manual_seed(1)
    inputs = dict(
        hidden_states=torch.randn(1, 16, 8, generator=g),
        encoder_hidden_states=torch.randn(1, 6, 16, generator=g),
        timestep=torch.tensor([0.5]),
        img_ids=torch.zeros(1, 16, 4),
        txt_ids=torch.zeros(1, 6, 4),
        return_dict=False,
    )
    return model, inputs


def tiny_umt5_encoder():
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(0)
    config = UMT5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=3, num_heads=2, relative_attention_num_buckets=8)
    model = UMT5EncoderModel(config).eval()
    ids = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(1))
    return model, dict(input_ids=ids, attention_mask=torch.ones_like(ids))


def run(model, inputs):
    with torch.no_grad():
        out = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
    if isinstance(out, (tuple, list)):
        out = out[0]
    if hasattr(out, "last_hidden_state"):
        out = out.last_hidden_state
    return out.clone()


def snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def observe_bound_blocks(handle, check) -> list:
    """Call `check(streamer)` each time a streamed block has just been bound to its slot: a forward pre-hook
    registered after layerstream's own, so it runs once the block holds real tensors. Returns the hook handles."""
    streamer = handle.streamer
    return [b.module.register_forward_pre_hook(lambda m, a: check(streamer)) for b in streamer.blocks]
