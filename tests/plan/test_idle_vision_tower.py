"""Only blocks that run are streamed (issue 36 item 4): a vision-language text encoder's vision tower streams only
where the pipeline hands its encoder an image (`hands_encoder_images`); elsewhere automatic discovery keeps it
out, it stays on the device, and `plan` says so. EasyAnimate uses Qwen2-VL as a text-only encoder."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from layerstream import enable_offload
from layerstream.plan.discovery import hands_encoder_images, vision_tower_paths
from layerstream.plan.resolver import resolve_offload_plan
from tests.runtime.runtime_toys import ToyDiT

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast

LAYER = {"mode": "layer", "components": ["dit", "text_encoder"]}
HIDDEN = 16
LANGUAGE = "text_encoder.model.language_model.layers"
VISION = "text_encoder.model.visual.blocks"
# one 4 x 4 image of 2 x 2 patches: 4 patches, merged 2 x 2 into one image token
IMAGE_GRID = torch.tensor([[1, 2, 2]])


def qwen2_vl(vocab_size: int, special_id) -> nn.Module:
    """A tiny Qwen2-VL (3 language layers, 2 vision blocks), random weights."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    config = Qwen2VLConfig(
        text_config={
            "vocab_size": vocab_size, "hidden_size": HIDDEN, "intermediate_size": 2 * HIDDEN, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 2, "pad_token_id": 0, "bos_token_id": 0,
            "eos_token_id": special_id("<|im_end|>"),
            # multimodal RoPE: the sections (t, h, w) add up to half the head size (4 / 2)
            "rope_parameters": {"rope_type": "default", "mrope_section": [1, 1, 0], "rope_theta": 1e6},
        },
        vision_config={
            "depth": 2, "embed_dim": 16, "hidden_size": HIDDEN, "num_heads": 2, "mlp_ratio": 2, "patch_size": 2,
            "spatial_merge_size": 2, "temporal_patch_size": 1, "in_channels": 3,
        },
        image_token_id=special_id("<|image_pad|>"),
        video_token_id=special_id("<|video_pad|>"),
        vision_start_token_id=special_id("<|vision_start|>"),
        vision_end_token_id=special_id("<|vision_end|>"),
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen2VLForConditionalGeneration(config).eval()


@pytest.fixture(scope="module")
def easyanimate():
    """diffusers' EasyAnimatePipeline with Qwen2-VL as its text encoder, every part tiny and built in code."""
    from diffusers import AutoencoderKLMagvit, EasyAnimatePipeline, EasyAnimateTransformer3DModel
    from diffusers import FlowMatchEulerDiscreteScheduler

    from layerstream.models.tokenizers import build_qwen2_tokenizer

    tokenizer = build_qwen2_tokenizer()
    # EasyAnimate wraps each prompt in a chat message; the tiny tokenizer ships no template of its own
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for c in m['content'] %}{{ c['text'] }}{% endfor %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    text_encoder = qwen2_vl(len(tokenizer), tokenizer.convert_tokens_to_ids)
    torch.manual_seed(1)
    transformer = EasyAnimateTransformer3DModel(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, time_embed_dim=2,
        text_embed_dim=HIDDEN, num_layers=2, sample_width=16, sample_height=16, patch_size=2,
    ).eval()  # fmt: skip
    torch.manual_seed(2)
    vae = AutoencoderKLMagvit(
        in_channels=3, out_channels=3, down_block_types=("SpatialDownBlock3D", "SpatialTemporalDownBlock3D"),
        up_block_types=("SpatialUpBlock3D", "SpatialTemporalUpBlock3D"), block_out_channels=(8, 8), latent_channels=4,
        layers_per_block=1, norm_num_groups=2, spatial_group_norm=False,
    ).eval()  # fmt: skip
    pipe = EasyAnimatePipeline(
        vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(),
    )  # fmt: skip
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate(pipe) -> torch.Tensor:
    # classifier-free guidance: the encoder runs twice (prompt, negative prompt) before the denoising loop
    out = pipe(
        prompt="a red cat", negative_prompt="blurry", num_inference_steps=2, guidance_scale=5.0, height=16, width=16,
        num_frames=1, output_type="latent", generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    return out.frames.clone()


def test_easyanimate_streams_only_the_language_layers_of_its_qwen2_vl_encoder(easyanimate):
    assert not hands_encoder_images(easyanimate)  # its encode_prompt takes text alone
    assert vision_tower_paths(easyanimate.text_encoder) == ("model.visual",)
    encoder = resolve_offload_plan(easyanimate, LAYER).component("text_encoder")
    assert (encoder.action, encoder.source) == ("stream", "auto")
    assert [s.qualified_name for s in encoder.stacks] == [LANGUAGE]
    # the reason names what really stays on the device, the idle tower first among what it is
    assert "model.visual (a vision tower, with model.visual.blocks (2 blocks)" in encoder.reason
    assert "never runs" in encoder.reason and "lm_head" in encoder.reason
    assert "embeddings, norms, a vision tower" not in encoder.reason
    # the tower is part of the component, not of its blocks: its bytes are counted as staying on the device
    tower_bytes = sum(t.numel() * t.element_size() for t in easyanimate.text_encoder.model.visual.parameters())
    assert encoder.total_bytes - encoder.block_bytes >= tower_bytes


def test_the_first_generation_loads_nothing_for_the_idle_tower_and_matches_resident(easyanimate):
    expected = generate(easyanimate)
    handle = enable_offload(easyanimate, LAYER, device="cpu")
    try:
        assert torch.equal(generate(easyanimate), expected)
        transfers = handle.block_transfers()
        assert not any(path.startswith(VISION) for path in transfers)
        assert all(transfers[f"{LANGUAGE}.{i}"] > 0 for i in range(3))
        encoder = handle.stats().per_component["text_encoder"]
        # the one synchronous load is the very first block of the first forward (nothing prefetches at enable);
        # the negative prompt's call finds layer 0 prefetched by layer 2, not a vision block that never runs
        assert encoder.num_sync_loads == 1
        assert [i.label for i in handle.trace().intervals if i.lane == "compute" and i.sync_load][0] == f"{LANGUAGE}.0"
    finally:
        handle.disable()
    assert torch.equal(generate(easyanimate), expected)


class EditLikePipeline:
    """A stand-in for an edit pipeline (Qwen-Image-Edit): its encode_prompt hands the encoder an image, so the
    vision tower runs and may stream."""

    def __init__(self):
        self.text_encoder = qwen2_vl(64, {"<|im_end|>": 1, "<|image_pad|>": 60, "<|video_pad|>": 61,
                                          "<|vision_start|>": 62, "<|vision_end|>": 63}.__getitem__)  # fmt: skip
        torch.manual_seed(3)
        self.transformer = ToyDiT(dim=HIDDEN, num_blocks=3).eval()

    @property
    def components(self) -> dict[str, nn.Module]:
        return {"text_encoder": self.text_encoder, "transformer": self.transformer}

    def encode_prompt(self, prompt_ids: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        kinds = (prompt_ids == self.text_encoder.config.image_token_id).long()  # 1 marks an image token (M-RoPE)
        out = self.text_encoder(
            input_ids=prompt_ids, pixel_values=image, image_grid_thw=IMAGE_GRID, mm_token_type_ids=kinds,
            output_hidden_states=True,
        )  # fmt: skip
        return out.hidden_states[-1]

    @torch.no_grad()
    def __call__(self, prompt_ids: torch.Tensor, image: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        context = self.encode_prompt(prompt_ids, image).mean(dim=1, keepdim=True)
        return self.transformer(x + context)


def test_an_edit_pipeline_runs_the_tower_so_it_streams_and_matches_resident():
    pipe = EditLikePipeline()
    assert hands_encoder_images(pipe)
    encoder = resolve_offload_plan(pipe, LAYER).component("text_encoder")
    assert [s.qualified_name for s in encoder.stacks] == [VISION, LANGUAGE]
    g = torch.Generator().manual_seed(4)
    ids = torch.tensor([[5, 62, 60, 63, 7, 9]])  # one image token between the vision markers
    image, x = torch.randn(4, 12, generator=g), torch.randn(1, 5, HIDDEN, generator=g)  # 4 patches of 3 x 2 x 2
    expected = pipe(ids, image, x)
    handle = enable_offload(pipe, LAYER, device="cpu")
    try:
        assert torch.equal(pipe(ids, image, x), expected)
        assert handle.block_transfers()[f"{VISION}.0"] > 0  # it ran, from its slot
    finally:
        handle.disable()


def test_qwen_image_edit_keeps_its_running_tower_resident_and_says_so(tiny):
    # the built-in plan streams the language layers only; the tower runs (encode_prompt takes the image) and
    # stays on the device, which the reason says without calling it idle
    pipe = tiny.pipeline("QwenImageEditPipeline", transformer="qwenimage", text_encoder="qwen25_vl")
    assert hands_encoder_images(pipe)
    encoder = resolve_offload_plan(pipe, LAYER).component("text_encoder")
    assert "model.visual (a vision tower)" in encoder.reason and "never runs" not in encoder.reason
    # img2img takes an image too, but encodes the prompt from text alone: what decides is what the encoder is handed
    img2img = tiny.pipeline("QwenImageImg2ImgPipeline", transformer="qwenimage", text_encoder="qwen25_vl")
    assert not hands_encoder_images(img2img)
    assert "never runs" not in resolve_offload_plan(img2img, LAYER).component("text_encoder").reason  # built-in lists


def test_a_dit_reason_names_its_own_resident_parts():
    class Pipe(nn.Module):
        def __init__(self):
            super().__init__()
            self.transformer = ToyDiT()

    reason = resolve_offload_plan(Pipe(), {"mode": "layer", "components": ["dit"]}).component("transformer").reason
    assert reason.endswith("its other parts stay on the device: embed, head")
    assert "vision tower" not in reason
