"""Tiny models for the distributed tests: a DiT with 4 blocks and a pipeline with a replicated text encoder.

The blocks mix dtypes (float32, bfloat16, int64) and their packed size is not a multiple of the shard
alignment, so shard boundaries cut through tensors and the last shard is padded.
"""

from __future__ import annotations

import torch
from torch import nn

from layerstream import OffloadPlan


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, 2 * dim)
        self.out = nn.Linear(2 * dim, dim)
        self.gate = nn.Parameter(torch.rand(dim).to(torch.bfloat16))
        self.register_buffer("perm", torch.randperm(dim))

    def forward(self, x):
        h = self.out(torch.nn.functional.gelu(self.proj(self.norm(x))))
        return x + (h[..., self.perm] * self.gate.float()).to(x.dtype)  # a bfloat16 pipeline stays bfloat16


class TinyDiT(nn.Module):
    def __init__(self, dim: int, num_blocks: int = 4):
        super().__init__()
        self.embed = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(num_blocks))
        self.head = nn.Linear(dim, dim)

    def forward(self, x, skip: tuple[int, ...] = ()):
        h = self.embed(x)
        for i, block in enumerate(self.blocks):
            if i in skip:
                continue
            h = block(h)
        return self.head(h)


class TinyEncoder(nn.Module):
    def __init__(self, dim: int, vocab: int = 40, num_layers: int = 3):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(Block(dim) for _ in range(num_layers))
        self.final_norm = nn.LayerNorm(dim)

    def forward(self, ids):
        h = self.embed_tokens(ids)
        for layer in self.encoder.layers:
            h = layer(h)
        return self.final_norm(h)


_PLAN = dict(
    block_attrs={"transformer": ("blocks",)},
    resident_dit_paths=frozenset({"transformer"}),
    encoder_component_types={"prompt_model": "text_encoder"},
    encoder_block_attrs={"prompt_model": ("encoder.layers",)},
)


class ReplicatedPipeline(nn.Module):
    """Both components may use allgather: the encoder is declared replicated."""

    _offload_plan = OffloadPlan(**_PLAN, encoder_dlo_weight_replication=frozenset({"prompt_model"}))

    def __init__(self, dim: int = 24):
        super().__init__()
        self.prompt_model = TinyEncoder(dim)
        self.transformer = TinyDiT(dim)

    def forward(self, ids, x, skip: tuple[int, ...] = ()):
        context = self.prompt_model(ids).mean(dim=1, keepdim=True)
        return self.transformer(x + context, skip)


class UnreplicatedPipeline(ReplicatedPipeline):
    """The same pipeline whose encoder is not declared replicated: allgather on it is refused."""

    _offload_plan = OffloadPlan(**_PLAN)


def make_pipeline(dim: int = 24, cls=ReplicatedPipeline) -> nn.Module:
    torch.manual_seed(0)  # every rank builds the same weights, as if loaded from the same files
    return cls(dim).eval()


def make_inputs(seed: int, dim: int = 24):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 40, (2, 5), generator=g), torch.randn(2, 7, dim, generator=g)


def run(pipe, inputs, skip: tuple[int, ...] = ()):
    with torch.no_grad():
        return pipe(*inputs, skip).clone()


def snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def config(components=("dit", "text_encoder"), transfer: str = "allgather", **dit_options) -> dict:
    options = {c: {"weight_transfer": transfer} for c in components}
    if dit_options:
        options["dit"] = {**options.get("dit", {}), **dit_options}
    return {"mode": "layer", "components": list(components), "layer_options": options}
