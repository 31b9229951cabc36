"""Synthetic DiT block stacks with the shapes of real models, in plain torch, for the benchmarks.

A block is a real transformer block (norms, qkv and output projections, attention through
`F.scaled_dot_product_attention`, an MLP) with the parameter count of the model it stands for, so that both
its compute and its bytes on the link are realistic. Two kinds cover the models benchmarked:

- `WanLikeBlock`: self-attention, cross-attention to text tokens and an FFN, modulated by a learned table plus
  the conditioning vector (Wan 2.x).
- `JointAttentionBlock`: a Flux double-stream block approximated by one joint attention over image and text
  tokens, each stream with its own modulation, projections and MLP (the right parameter count, 36 dim^2).

`SyntheticDiT` stacks them. It names its blocks through diffusers' `_repeated_blocks` (found automatically)
rather than `_layerwise_offload_blocks_attrs`: the resolver allows resident layers only for automatically
discovered DiTs or ones a plan lists in `resident_dit_paths`, and the benchmarks need `resident_layers`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The shape of one benchmarked model's blocks."""

    name: str
    dim: int
    """Hidden size."""
    num_heads: int
    ffn_dim: int
    """Hidden size of the MLP."""
    block_kind: str
    """"wan" (`WanLikeBlock`) or "joint" (`JointAttentionBlock`)."""
    cross_attention: bool = True
    """Wan blocks only: attend to the text tokens after self-attention."""
    num_real_blocks: int = 0
    """How many blocks the real model has (for the report; the benchmark runs --blocks of them)."""

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads


MODEL_SHAPES: dict[str, ModelShape] = {
    "tiny": ModelShape(name="tiny", dim=64, num_heads=4, ffn_dim=256, block_kind="wan", cross_attention=False),
    # a light stack sized for CPU runs: compute per block well above the hooks' cost, few MB per block
    "small": ModelShape(name="small", dim=512, num_heads=8, ffn_dim=2048, block_kind="wan"),
    "wan1.3b": ModelShape(name="wan1.3b", dim=1536, num_heads=12, ffn_dim=8960, block_kind="wan", num_real_blocks=30),
    "wan14b": ModelShape(name="wan14b", dim=5120, num_heads=40, ffn_dim=13824, block_kind="wan", num_real_blocks=40),
    # Flux.1: 19 double-stream blocks of 3072 with mlp ratio 4 (plus 38 single-stream blocks, not modelled)
    "flux12b": ModelShape(name="flux12b", dim=3072, num_heads=24, ffn_dim=4 * 3072, block_kind="joint", num_real_blocks=19),
}


@dataclass(frozen=True)
class DefaultSizes:
    num_blocks: int
    num_tokens: int
    num_context_tokens: int


def default_sizes(shape: ModelShape, device_type: str) -> DefaultSizes:
    """Sizes that run in seconds to minutes: real token counts on an accelerator, small ones on a CPU.

    On a CPU a 14B-shaped block is 1.4 GB of float32 and tens of GFLOP per 100 tokens, so the defaults keep
    three blocks and a few hundred tokens; every strategy holds its own copy of the weights in host memory.
    """
    if shape.name == "tiny":
        return DefaultSizes(num_blocks=8, num_tokens=64, num_context_tokens=0)
    if device_type == "cpu":
        return DefaultSizes(num_blocks=6 if shape.dim <= 2048 else 3, num_tokens=256, num_context_tokens=64)
    return DefaultSizes(num_blocks=8, num_tokens=4096, num_context_tokens=512)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(batch, tokens, dim) queries/keys/values -> (batch, tokens, dim), heads split and merged around SDPA."""
    b, tq, d = q.shape
    tk = k.shape[1]
    q = q.view(b, tq, num_heads, d // num_heads).transpose(1, 2)
    k = k.view(b, tk, num_heads, d // num_heads).transpose(1, 2)
    v = v.view(b, tk, num_heads, d // num_heads).transpose(1, 2)
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, tq, d)


def _modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale) + shift


class SyntheticBlock(nn.Module):
    """Base class of the synthetic blocks: `forward(x, context, cond) -> (x, context)`."""


class WanLikeBlock(SyntheticBlock):
    """Self-attention, optional cross-attention to `context`, and an FFN, with a Wan-style modulation table."""

    def __init__(self, shape: ModelShape):
        super().__init__()
        dim = shape.dim
        self.num_heads = shape.num_heads
        self.modulation = nn.Parameter(torch.zeros(1, 6, dim))
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.norm_q = nn.RMSNorm(dim, eps=1e-6)
        self.norm_k = nn.RMSNorm(dim, eps=1e-6)
        self.attn_out = nn.Linear(dim, dim)
        self.cross_attention = shape.cross_attention
        if shape.cross_attention:
            self.norm_cross = nn.LayerNorm(dim, eps=1e-6)
            self.cross_q = nn.Linear(dim, dim)
            self.cross_kv = nn.Linear(dim, 2 * dim)
            self.cross_out = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.ffn_in = nn.Linear(dim, shape.ffn_dim)
        self.ffn_out = nn.Linear(shape.ffn_dim, dim)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None, cond: torch.Tensor):
        shift1, scale1, gate1, shift2, scale2, gate2 = (self.modulation + cond[:, None, :]).unbind(dim=1)
        h = _modulate(self.norm1(x), shift1[:, None], scale1[:, None])
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        x = x + gate1[:, None] * self.attn_out(_attention(self.norm_q(q), self.norm_k(k), v, self.num_heads))
        if self.cross_attention and context is not None:
            k, v = self.cross_kv(context).chunk(2, dim=-1)
            x = x + self.cross_out(_attention(self.cross_q(self.norm_cross(x)), k, v, self.num_heads))
        h = _modulate(self.norm2(x), shift2[:, None], scale2[:, None])
        x = x + gate2[:, None] * self.ffn_out(F.gelu(self.ffn_in(h), approximate="tanh"))
        return x, context


class _Stream(nn.Module):
    """One stream (image or text) of a joint-attention block: its modulation, projections and MLP."""

    def __init__(self, shape: ModelShape):
        super().__init__()
        dim = shape.dim
        self.mod = nn.Linear(dim, 6 * dim)
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.norm_q = nn.RMSNorm(shape.head_dim, eps=1e-6)
        self.norm_k = nn.RMSNorm(shape.head_dim, eps=1e-6)
        self.attn_out = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.mlp_in = nn.Linear(dim, shape.ffn_dim)
        self.mlp_out = nn.Linear(shape.ffn_dim, dim)


class JointAttentionBlock(SyntheticBlock):
    """Flux double-stream block: image and text tokens keep their own weights and attend jointly."""

    def __init__(self, shape: ModelShape):
        super().__init__()
        self.num_heads = shape.num_heads
        self.head_dim = shape.head_dim
        self.image = _Stream(shape)
        self.text = _Stream(shape)

    def _qkv(self, stream: _Stream, x: torch.Tensor, shift, scale):
        b, t, _ = x.shape
        q, k, v = stream.qkv(_modulate(stream.norm1(x), shift, scale)).chunk(3, dim=-1)
        # per-head RMS norm of queries and keys, as Flux does
        q = stream.norm_q(q.view(b, t, self.num_heads, self.head_dim)).view(b, t, -1)
        k = stream.norm_k(k.view(b, t, self.num_heads, self.head_dim)).view(b, t, -1)
        return q, k, v

    def forward(self, x: torch.Tensor, context: torch.Tensor, cond: torch.Tensor):
        cond = F.silu(cond)
        img = [m[:, None] for m in self.image.mod(cond).chunk(6, dim=-1)]
        txt = [m[:, None] for m in self.text.mod(cond).chunk(6, dim=-1)]
        iq, ik, iv = self._qkv(self.image, x, img[0], img[1])
        tq, tk, tv = self._qkv(self.text, context, txt[0], txt[1])
        num_text = context.shape[1]
        joint = _attention(torch.cat([tq, iq], 1), torch.cat([tk, ik], 1), torch.cat([tv, iv], 1), self.num_heads)
        text_attn, image_attn = joint[:, :num_text], joint[:, num_text:]
        x = x + img[2] * self.image.attn_out(image_attn)
        x = x + img[5] * self._mlp(self.image, x, img[3], img[4])
        context = context + txt[2] * self.text.attn_out(text_attn)
        context = context + txt[5] * self._mlp(self.text, context, txt[3], txt[4])
        return x, context

    @staticmethod
    def _mlp(stream: _Stream, x: torch.Tensor, shift, scale) -> torch.Tensor:
        return stream.mlp_out(F.gelu(stream.mlp_in(_modulate(stream.norm2(x), shift, scale)), approximate="tanh"))


_BLOCK_KINDS = {"wan": WanLikeBlock, "joint": JointAttentionBlock}


class SyntheticDiT(nn.Module):
    """A DiT: conditioning and input projections, a stack of synthetic blocks, an output projection."""

    _repeated_blocks = ["SyntheticBlock"]  # automatic discovery; see the module docstring for why not the class attr

    def __init__(self, shape: ModelShape, num_blocks: int):
        super().__init__()
        dim = shape.dim
        self.shape = shape
        self.time_embed = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.proj_in = nn.Linear(dim, dim)  # stands in for the patch embedding
        self.context_proj = nn.Linear(dim, dim)
        block_class = _BLOCK_KINDS[shape.block_kind]
        self.blocks = nn.ModuleList(block_class(shape) for _ in range(num_blocks))
        self.norm_out = nn.LayerNorm(dim, eps=1e-6)
        self.proj_out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None, timestep: torch.Tensor) -> torch.Tensor:
        cond = self.time_embed(timestep)
        h = self.proj_in(x)
        c = self.context_proj(context) if context is not None else None
        for block in self.blocks:
            h, c = block(h, c, cond)
        return self.proj_out(self.norm_out(h))


def build_synthetic_dit(
    shape: ModelShape, num_blocks: int, *, dtype: torch.dtype, seed: int = 0, init_device: torch.device | str = "cpu"
) -> SyntheticDiT:
    """A `SyntheticDiT` with deterministic weights, returned on the CPU (the host copy every strategy starts from).

    The module is built on the meta device and its weights are drawn on `init_device`: on an accelerator that
    takes a fraction of a second even for tens of GB, where drawing them on the CPU would take minutes.
    """
    if num_blocks < 1:
        raise ValueError(f"num_blocks = {num_blocks!r} is not valid; expected an integer >= 1")
    with torch.device("meta"):
        model = SyntheticDiT(shape, num_blocks).to(dtype)  # the dtype is set on meta: no full-precision copy
    model = model.to_empty(device=init_device)
    generator = torch.Generator(device=init_device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim >= 2 and not name.endswith("modulation"):
                param.normal_(0.0, param.shape[-1] ** -0.5, generator=generator)  # keeps activations O(1) through depth
            elif name.endswith("modulation"):
                param.normal_(0.0, 0.02, generator=generator)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.fill_(1.0)  # norm weights
    return model.to("cpu").eval()


def make_inputs(
    shape: ModelShape,
    *,
    num_tokens: int,
    num_context_tokens: int,
    batch_size: int = 1,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int = 1,
) -> dict[str, torch.Tensor | None]:
    """Keyword inputs of `SyntheticDiT.forward`: hidden states, text context (or None) and timestep features."""
    generator = torch.Generator().manual_seed(seed)

    def draw(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=generator).to(device=device, dtype=dtype)

    if shape.block_kind == "joint" and num_context_tokens < 1:
        raise ValueError(f"{shape.name} blocks attend jointly over text tokens; num_context_tokens must be >= 1")
    use_context = num_context_tokens > 0 and (shape.block_kind == "joint" or shape.cross_attention)
    return {
        "x": draw(batch_size, num_tokens, shape.dim),
        "context": draw(batch_size, num_context_tokens, shape.dim) if use_context else None,
        "timestep": draw(batch_size, shape.dim),
    }


def block_param_count(shape: ModelShape) -> int:
    """Parameters of one block of `shape` (computed on the meta device: no memory, no time)."""
    with torch.device("meta"):
        block = _BLOCK_KINDS[shape.block_kind](shape)
    return sum(p.numel() for p in block.parameters())


def model_bytes(shape: ModelShape, num_blocks: int, dtype: torch.dtype) -> int:
    """Bytes of a `SyntheticDiT`'s weights, computed on the meta device (before deciding to build it)."""
    with torch.device("meta"):
        model = SyntheticDiT(shape, num_blocks)
    return sum(p.numel() for p in model.parameters()) * dtype.itemsize


def activation_bytes_estimate(
    shape: ModelShape, *, num_tokens: int, num_context_tokens: int, batch_size: int, element_size: int
) -> int:
    """Rough peak activation bytes of one block's forward: the residual stream, q/k/v, attention output and the
    MLP hidden layer, for every token attended over. An estimate, used only where no allocator can be read."""
    tokens = num_tokens + (num_context_tokens if shape.block_kind == "joint" else 0)
    per_token = 6 * shape.dim + shape.ffn_dim
    return batch_size * tokens * per_token * element_size
