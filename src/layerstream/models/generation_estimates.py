"""What one generation holds: the latent tokens a DiT block sees at its size, a block's activations, and each
phase's own transient on the device: estimates the planner, residency "auto" and the host reserve share (pure,
nothing runs; the VAE decode's peak is `models.decode.vae_decode`'s)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from torch import nn

from layerstream.models.geometry import pipeline_frame_multiple, pipeline_size_multiple

if TYPE_CHECKING:
    from layerstream.models.size import GenerationSize

TEXT_TOKENS = 512
"""Text tokens a text encoder runs over and a cross-attention attends to (UMT5's and T5's maximum in Wan and Flux)."""
TEXT_ENCODER_NAMES = ("text_encoder", "text_encoder_2", "text_encoder_3")
DEVICE_ALLOWANCE_GB = 0.5
"""Device memory beside the estimates in every phase: a CUDA context's own (0.3-0.5 GB on recent drivers; the
free memory enabling reads has it taken already), the caching allocator's rounding and the kernels' workspaces
(an allowance, not measured here; 0 for a CPU device)."""
PhaseName = Literal["prompt encoding", "image encoding", "denoising", "VAE decode"]
PHASES: tuple[PhaseName, ...] = ("prompt encoding", "image encoding", "denoising", "VAE decode")
"""A generation's phases in the order they run."""


@dataclass(frozen=True)
class Transient:
    """What one phase allocates on the device beside the weights that stay there: the phase's own peak."""

    phase: PhaseName
    what: str
    """What it is, as a phrase ("a DiT block's forward at 32760 tokens")."""
    nbytes: int


def latent_tokens(pipeline: Any, size: Mapping[str, int]) -> int:
    """Latent tokens a DiT block sees at `size` ({"height", "width", "num_frames"}: `GenerationSize.as_size()`)."""
    side = pipeline_size_multiple(pipeline)
    temporal = pipeline_frame_multiple(pipeline)
    frames = (size["num_frames"] - 1) // temporal + 1 if temporal else 1
    return max(size["height"] // side, 1) * max(size["width"] // side, 1) * frames


def block_activation_nbytes(block: nn.Module, tokens: int) -> int:
    """An estimate of the activations one forward of `block` holds at its peak over `tokens` tokens, in its
    dtype: the residual stream and its normed copy, beside either the attention's query, key, value and output
    (four of the hidden width: fused attention keeps no tokens x tokens matrix) or the widest layer's output and
    its activation. The hidden width is the input width most of the block's linear layers share."""
    linears = [m for m in block.modules() if isinstance(m, nn.Linear)]
    if not linears:
        return 0
    hidden = Counter(m.in_features for m in linears).most_common(1)[0][0]
    widest = max(m.out_features for m in linears)
    return tokens * max(6 * hidden, 2 * hidden + 2 * widest) * linears[0].weight.dtype.itemsize


def text_output_nbytes(pipeline: Any) -> int:
    """The prompt's and the negative prompt's hidden states of every text encoder: 2 x tokens x width x dtype."""
    total = 0
    for name in TEXT_ENCODER_NAMES:
        encoder = getattr(pipeline, name, None)
        config = getattr(encoder, "config", None)
        width = getattr(config, "d_model", None) or getattr(config, "hidden_size", None)
        if isinstance(encoder, nn.Module) and isinstance(width, int):
            itemsize = next((p.dtype.itemsize for p in encoder.parameters()), 4)
            total += 2 * TEXT_TOKENS * width * itemsize
    return total


def image_encoder_tokens(encoder: nn.Module) -> int:
    """Tokens a vision tower sees: its patches and a class token (CLIP ViT-H at 224 px, 14 px patches: 257)."""
    config = getattr(encoder, "config", None)
    config = getattr(config, "vision_config", None) or config
    size, patch = getattr(config, "image_size", None), getattr(config, "patch_size", None)
    if isinstance(size, int) and isinstance(patch, int) and patch > 0:
        return (size // patch) ** 2 + 1
    return TEXT_TOKENS  # a tower that does not say: as many as a prompt's


def phase_transients(pipeline: Any, generation: GenerationSize, blocks: Any) -> tuple[Transient, ...]:
    """Each phase's own transient on the device at `generation` (its `tokens`, else counted from its size; the
    decode aside): the widest text encoder block's forward at `TEXT_TOKENS` (one encoder runs at a time), the
    vision tower's, and the largest DiT block's forward at the generation's tokens; the prompts' hidden states
    stay on the device throughout. `blocks`: `plan.phase_blocks.PhaseBlocks`, the modules each phase is priced on."""
    tokens = generation.tokens if generation.tokens is not None else latent_tokens(pipeline, generation.as_size())
    dit_blocks, text_encoder_blocks = blocks.dit_blocks, blocks.text_encoder_blocks
    prompts = text_output_nbytes(pipeline)
    text = max((block_activation_nbytes(b, TEXT_TOKENS) for b in text_encoder_blocks), default=0)
    out = [Transient("prompt encoding", f"a text encoder block's forward at {TEXT_TOKENS} tokens and the prompts' states", text + prompts)]
    image_encoder = getattr(pipeline, "image_encoder", None)
    if isinstance(image_encoder, nn.Module):
        image_tokens = image_encoder_tokens(image_encoder)
        what = f"the image encoder's forward at {image_tokens} tokens and the prompts' states"
        out.append(Transient("image encoding", what, block_activation_nbytes(image_encoder, image_tokens) + prompts))
    dit = max((block_activation_nbytes(b, tokens) for b in dit_blocks), default=0)
    out.append(Transient("denoising", f"a DiT block's forward at {tokens} tokens and the prompts' states", dit + prompts))
    return tuple(out)


def activation_reserve_nbytes(transients: Sequence[Transient], allowance_nbytes: int) -> int:
    """The device memory residency "auto" leaves beside the weights kept on the device and the slot ring: the
    largest phase's transient and the allowance (every phase then fits beside them)."""
    return max((t.nbytes for t in transients), default=0) + allowance_nbytes


def decode_transient(pipeline: Any, generation: GenerationSize, *, tiled: bool, device_type: str = "cuda") -> Transient | None:
    """The VAE decode's transient at `generation`'s size, tiled or not, on a device of `device_type`, its weights
    apart (they stay on the device with the other resident modules); None where the pipeline has no VAE."""
    from layerstream.models.decode.vae_decode import estimate_decode_peak

    if not decodes(pipeline):
        return None
    vae = pipeline.vae
    dtype = next(p.dtype for p in vae.parameters() if p.is_floating_point())
    peak = estimate_decode_peak(vae, **generation.as_size(), tiled=tiled, dtype=dtype, device_type=device_type)
    frames = f" x {generation.num_frames} frames" if (generation.num_frames or 1) > 1 else ""
    what = f"the VAE's decode at {generation.height}x{generation.width}{frames}, {'tiled' if tiled else 'untiled'}"
    return Transient("VAE decode", what, peak.nbytes)


def decodes(pipeline: Any) -> bool:
    """Whether the pipeline decodes its latents with a VAE of its own (floating-point weights to size it by)."""
    vae = getattr(pipeline, "vae", None)
    return isinstance(vae, nn.Module) and any(p.is_floating_point() for p in vae.parameters())


def block_flops(block: nn.Module, tokens: int) -> int:
    """An estimate of one forward's FLOPs: two per weight of every linear layer per token, and per attention
    four per query-key pair and head dimension (self-attention over the tokens, cross-attention over
    `TEXT_TOKENS`). Norms, activations and rotary embeddings are left out (a few percent)."""
    # in x out, not the weight's numel: a GGUF weight is stored as its quantized blocks (uint8, a narrower row)
    flops = 2 * tokens * sum(m.in_features * m.out_features for m in block.modules() if isinstance(m, nn.Linear))
    for name, m in block.named_modules():
        to_q = getattr(m, "to_q", None)
        if isinstance(to_q, nn.Linear):
            cross = bool(getattr(m, "is_cross_attention", False)) or name.endswith("attn2")
            flops += 4 * tokens * (TEXT_TOKENS if cross else tokens) * to_q.out_features
    return flops


def decode_steps(pipeline: Any, size: Mapping[str, int], forwards: int) -> float | None:
    """The VAE decode's work in denoising steps at `size` ({"height", "width", "num_frames"}): its convolutions'
    FLOPs (traced untiled) over a step's, `forwards` forwards of the transformer at the size's tokens; None
    without a VAE or a transformer. Times a step's seconds it is the decode's: the plan's, and a job's ETA before
    a server has timed a decode (with a step's copies in: longer than it will be)."""
    from layerstream.models.decode.vae_decode import estimate_decode_peak

    transformer = getattr(pipeline, "transformer", None)
    if not decodes(pipeline) or not isinstance(transformer, nn.Module):
        return None
    dtype = next(p.dtype for p in pipeline.vae.parameters() if p.is_floating_point())
    decode = estimate_decode_peak(pipeline.vae, **size, tiled=False, dtype=dtype)
    step = forwards * block_flops(transformer, latent_tokens(pipeline, size))
    return decode.flops / step if step else None
