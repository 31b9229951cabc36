"""The headline scenario at a scale: Wan 2.2 A14B at 720p x 81 frames, its parts built at 1/w of every width
(`Scenario.width_divisor`), its denoising loop, and the calibration that makes a block's forward on this machine
last the published compute over the scale. `headline.py` beside it runs it through the runtime and reports
(it lives with the benchmarks: nothing in the package uses it).

The pipeline is a `WanPipeline` (so layerstream's built-in Wan plan pairs its experts into one host pool) holding
two experts of 40 Wan-shaped blocks (`bench.synthetic`), switched at the boundary timestep of Wan 2.2's own
schedule, two forwards a step (classifier-free guidance), and transformers' `UMT5EncoderModel` with UMT5-XXL's 24
layers, run once per video.

Compute source (an assumption, stated): Morphic measured Wan 2.2 I2V-A14B (the same DiT blocks and token count
as T2V) at 1280x720, 81 frames, 40 steps, on 8 H100 with Ulysses sequence parallelism and FlashAttention 3:
195.13 s a video (M. A. Afridi, "Boosting Wan2.2 I2V Inference on 8 H100s", Morphic, November 2025,
https://dev.to/muhammad_aliafridi_35ece/boosting-wan22-i2v-inference-on-8-h100s-25-faster-with-sequence-parallelism-magcache-4pfn).
8 GPUs x 195.13 s / 40 steps / (2 forwards x 40 blocks) = 0.488 s per block forward on one H100. This counts the
8-GPU run's parallel overheads, the text encoder and the VAE decode as block compute, so it overstates an H100's
block time by some percent; an RTX 4090 (a 24 GB card) computes a block several times slower, which would hide
the link and the disk even more: H100 compute on a 24 GB device is the harder case for offload.

Needs the `diffusers` extra (diffusers' scheduler, transformers' UMT5).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch
from diffusers import UniPCMultistepScheduler
from torch import nn
from transformers import UMT5Config, UMT5EncoderModel

from strategy_bench.synthetic import MODEL_SHAPES, ModelShape, SyntheticDiT, WanLikeBlock, build_synthetic_dit

GB = 1e9
DTYPE = torch.bfloat16
PUBLISHED_BLOCK_SECONDS = 8 * 195.13 / 40 / (2 * 40)
"""One H100's compute per block forward at 720p x 81 frames (the source is in the module docstring)."""


@dataclass(frozen=True, kw_only=True)
class Scenario:
    """The real model and machine, and how far the run scales them down."""

    width_divisor: int = 8
    """Every width of the model divided by this (bytes by its square)."""
    blocks_per_expert: int = 40
    """Wan 2.2 A14B: 40 blocks per expert."""
    text_layers: int = 24
    """UMT5-XXL: 24 encoder layers."""
    steps: int = 40
    """Wan 2.2 A14B's default (`sample_steps`), flow shift 12, boundary 0.875, guidance 4.0 then 3.0."""
    text_tokens: int = 16
    """Prompt tokens (512 in Wan; the encoder runs once per video and is reported apart from the steps)."""
    video_tokens: int = 21 * 45 * 80
    """720p x 81 frames: 21 latent frames of 90 x 160, in 2 x 2 patches. Used as is on a GPU (width 1); on a CPU
    the token count is calibrated instead (see `Scale.num_tokens`)."""
    device_gb: float = 24.0
    host_gb: float = 32.0
    """The whole process's memory, Python and libraries included (the planner's `--host-memory`)."""
    link_gbps: float = 25.0
    """PCIe 4.0 x16, as measured pinned host-to-device."""
    disks_gbps: tuple[float, ...] = (3.0, 7.0)
    """A PCIe 3.0 and a PCIe 4.0 NVMe."""
    block_compute_s: float = PUBLISHED_BLOCK_SECONDS
    boundary_ratio: float = 0.875
    flow_shift: float = 12.0
    guidance: tuple[float, float] = (4.0, 3.0)
    """High-noise expert, low-noise expert (Wan 2.2's `sample_guide_scale` is listed low, high)."""


FULL = Scenario()
SMOKE = Scenario(width_divisor=16, blocks_per_expert=8, text_layers=2, steps=4, text_tokens=8)
REAL_SIZES = replace(FULL, width_divisor=1)
"""The real model's sizes, which the scale is computed from."""


def dit_shape(s: Scenario) -> ModelShape:
    real = MODEL_SHAPES["wan14b"]
    w = s.width_divisor
    return ModelShape(name=f"wan14b/{w}", dim=real.dim // w, num_heads=real.num_heads // w, ffn_dim=real.ffn_dim // w, block_kind="wan")


def text_config(s: Scenario) -> UMT5Config:
    w = s.width_divisor
    return UMT5Config(
        vocab_size=256384 // w, d_model=4096 // w, d_kv=64, d_ff=10240 // w, num_heads=64 // w,
        num_layers=s.text_layers, feed_forward_proj="gated-gelu",
    )  # fmt: skip


class WanPipeline(nn.Module):
    """Wan 2.2 A14B's denoising loop on the scaled parts: encode once, then each step runs the expert its
    timestep selects twice (prompt and negative prompt), as diffusers' `WanPipeline` does."""

    def __init__(self, text_encoder: nn.Module, transformer: nn.Module, transformer_2: nn.Module, scenario: Scenario):
        super().__init__()
        self.text_encoder = text_encoder
        self.transformer = transformer
        self.transformer_2 = transformer_2
        # Wan's DiT projects the 4096-wide text states to its width; a resident part of the pipeline here
        self.text_proj = nn.Linear(text_encoder.config.d_model, transformer.shape.dim).to(DTYPE)
        self.scenario = scenario

    def scheduler(self) -> UniPCMultistepScheduler:
        scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=self.scenario.flow_shift)
        scheduler.set_timesteps(self.scenario.steps)
        return scheduler

    def expert_for(self, timestep: float) -> tuple[nn.Module, float]:
        high = timestep >= self.scenario.boundary_ratio * 1000
        return (self.transformer, self.scenario.guidance[0]) if high else (self.transformer_2, self.scenario.guidance[1])

    @torch.no_grad()
    def encode(self, prompt_ids: torch.Tensor, negative_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(self.text_proj(self.text_encoder(input_ids=ids).last_hidden_state) for ids in (prompt_ids, negative_ids))

    def forward_pair(self, expert: nn.Module, latents: torch.Tensor, context, negative, timestep: float, guidance: float):
        t = torch.full((1, expert.shape.dim), timestep / 1000, dtype=DTYPE, device=latents.device)
        x = latents.to(DTYPE)
        cond, uncond = expert(x, context, t).float(), expert(x, negative, t).float()
        return uncond + guidance * (cond - uncond)

    @torch.no_grad()
    def denoise(self, latents: torch.Tensor, context: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
        scheduler = self.scheduler()
        for timestep in scheduler.timesteps:
            expert, guidance = self.expert_for(float(timestep))
            noise = self.forward_pair(expert, latents, context, negative, float(timestep), guidance)
            latents = scheduler.step(noise, timestep, latents).prev_sample
        return latents

    @torch.no_grad()
    def warm_up(self, latents, context, negative) -> None:
        """One step of each expert, in the order a video runs them: the streamer learns the order, and the host
        pool ends holding the low-noise expert, as after a video (so a timed video starts in its steady state)."""
        for expert in (self.transformer, self.transformer_2):
            self.forward_pair(expert, latents, context, negative, 500.0, 1.0)


@dataclass(frozen=True)
class Inputs:
    prompt_ids: torch.Tensor
    negative_ids: torch.Tensor
    latents: torch.Tensor


def build_pipeline(s: Scenario, device: torch.device) -> WanPipeline:
    """The pipeline on the CPU (the host copy offload starts from); weights are drawn on `device` (fast on a GPU)."""
    shape = dit_shape(s)
    experts = [build_synthetic_dit(shape, s.blocks_per_expert, dtype=DTYPE, seed=seed, init_device=device) for seed in (0, 1)]
    with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []), torch.device(device):
        torch.manual_seed(2)
        text_encoder = UMT5EncoderModel(text_config(s)).to(DTYPE).eval()
    return WanPipeline(text_encoder.to("cpu"), *experts, s).eval()


def meta_pipeline(s: Scenario) -> WanPipeline:
    """The pipeline at `s`'s sizes on the meta device (no memory, no time): what the planner plans."""
    with torch.device("meta"):
        experts = [SyntheticDiT(dit_shape(s), s.blocks_per_expert).to(DTYPE) for _ in range(2)]
        return WanPipeline(UMT5EncoderModel(text_config(s)).to(DTYPE), *experts, s)


def block_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def real_streamed_bytes() -> tuple[int, int]:
    """(bytes of one real Wan 2.2 expert block, bytes of every real streamed block: 80 DiT + 24 UMT5 layers),
    in bfloat16, counted on the meta device."""
    with torch.device("meta"):
        block = WanLikeBlock(MODEL_SHAPES["wan14b"])
        text = UMT5EncoderModel(text_config(REAL_SIZES))
    dit_block = sum(p.numel() for p in block.parameters()) * DTYPE.itemsize
    text_blocks = sum(p.numel() for p in text.encoder.block.parameters()) * DTYPE.itemsize
    return dit_block, 2 * REAL_SIZES.blocks_per_expert * dit_block + text_blocks


def streamed_blocks(pipe: WanPipeline) -> list[nn.Module]:
    return [*pipe.transformer.blocks, *pipe.transformer_2.blocks, *pipe.text_encoder.encoder.block]


@dataclass(frozen=True)
class Scale:
    """How the run maps onto the real machine."""

    time_and_bytes: float
    """S: a real block's bytes over a built one's; times and per-block bytes measured here, times S, are real."""
    memory: float
    """Real streamed bytes over built ones: memory sizes (the host budget, device and host use) scale by this
    (S itself in the full scenario; more where a smoke run builds fewer blocks)."""
    num_tokens: int
    """Tokens of the scaled video, chosen so that a block's forward lasts the published compute / S."""
    block_compute_s: float
    """What one block's forward measured at that token count (target: block_compute_s / S)."""


def calibrate_tokens(pipe: WanPipeline, target_s: float, context: torch.Tensor) -> tuple[int, float]:
    """The token count at which a block's forward lasts `target_s` on this CPU. A forward costs about a + b x tokens
    at these sizes; the fastest of several forwards at two token counts gives a and b (the fastest is the one
    least disturbed by other load on a shared machine: a median there once drove the count down to 1 token)."""
    block, dim = pipe.transformer.blocks[0], pipe.transformer.shape.dim
    cond = torch.zeros(1, dim, dtype=DTYPE)

    def fastest(tokens: int) -> float:
        x = torch.randn(1, tokens, dim, generator=torch.Generator().manual_seed(0)).to(DTYPE)
        with torch.no_grad():
            block(x, context, cond)  # warm the allocator and caches at this size
            times = []
            for _ in range(9):
                start = time.perf_counter()
                block(x, context, cond)
                times.append(time.perf_counter() - start)
        return min(times)

    low, high = 16, 256
    low_s, high_s = fastest(low), fastest(high)
    per_token = max((high_s - low_s) / (high - low), 1e-9)
    tokens = max(1, min(16384, round(low + (target_s - low_s) / per_token)))
    return tokens, fastest(tokens)


def make_inputs(s: Scenario, num_tokens: int, dim: int, vocab: int, device: torch.device) -> Inputs:
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (2, s.text_tokens), generator=generator).to(device)
    latents = torch.randn(1, num_tokens, dim, generator=generator).to(device)
    return Inputs(ids[:1], ids[1:], latents)
