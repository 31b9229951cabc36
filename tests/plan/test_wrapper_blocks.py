"""Wrapper blocks: list items that wrap exactly one declared block are the blocks (HiDream's ``HiDreamBlock``).

Automatic discovery looks one level into list items, and HiDream also has a built-in plan; a tiny
`HiDreamImagePipeline` (all four text encoders, Llama included, built from configs in code) streams
bit-exactly against the resident pipeline either way.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from layerstream import enable_offload
from layerstream.models.tokenizers import build_clip_tokenizer, build_qwen2_tokenizer, build_t5_tokenizer
from layerstream.plan.discovery import find_block_lists
from layerstream.plan.resolver import resolve_offload_plan

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast

DIT = {"mode": "layer", "components": ["dit"]}
DIT_AND_TEXT = {"mode": "layer", "components": ["dit", "text_encoder"]}


# --- toys: the rule itself --------------------------------------------------------------------------------


class Layer(nn.Linear):
    def __init__(self):
        super().__init__(4, 4)


class Wrapper(nn.Module):
    """Holds one declared block and, like an adapter might, a tensor of its own."""

    def __init__(self, *inner: nn.Module):
        super().__init__()
        self.inner = nn.ModuleList(inner) if len(inner) != 1 else None
        self.block = inner[0] if len(inner) == 1 else None
        self.gain = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return self.block(x) * self.gain


class Model(nn.Module):
    _repeated_blocks = ["Layer"]

    def __init__(self, items):
        super().__init__()
        self.items = nn.ModuleList(items)

    def forward(self, x):
        for item in self.items:
            x = item(x)
        return x


def test_a_list_of_wrappers_around_one_declared_block_each_is_found():
    assert find_block_lists(Model([Wrapper(Layer()) for _ in range(3)])) == ("items",)


def test_a_list_mixing_plain_and_wrapped_blocks_is_found():
    assert find_block_lists(Model([Layer(), Wrapper(Layer()), Layer()])) == ("items",)


@pytest.mark.parametrize(
    "item",
    [
        lambda: Wrapper(Layer(), Layer()),  # two blocks in one wrapper would merge them into one streamed unit
        lambda: Wrapper(nn.Identity()),  # wraps no declared block
        lambda: nn.Sequential(Wrapper(Layer())),  # two levels down: only one level is looked into
    ],
    ids=["two_blocks", "no_block", "two_levels"],
)
def test_items_that_do_not_wrap_exactly_one_block_one_level_down_are_not_blocks(item):
    model = Model([Wrapper(Layer()), item()])
    assert "items" not in find_block_lists(model)


def test_wrapped_toy_blocks_stream_bit_exactly():
    torch.manual_seed(0)
    resident = Model([Wrapper(Layer()) for _ in range(4)])
    model = Model([Wrapper(Layer()) for _ in range(4)])
    model.load_state_dict(resident.state_dict())
    x = torch.randn(3, 4)
    with torch.no_grad():
        expected = resident(x)
        handle = enable_offload(model, DIT, device="cpu")
        try:
            assert torch.equal(model(x), expected)
            assert handle.stats().num_streamed_blocks == 4
        finally:
            handle.disable()
        assert torch.equal(model(x), expected)


# --- HiDream ----------------------------------------------------------------------------------------------

_WIDTH = 8  # every text encoder's hidden size, the T5 and Llama caption channels
_NUM_LAYERS = 2


def _hidream_pipeline():
    """A tiny `HiDreamImagePipeline`: two CLIPs with projection, T5, Llama, a 2x VAE, 2 + 2 wrapped blocks."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        HiDreamImagePipeline,
        HiDreamImageTransformer2DModel,
    )
    from transformers import (
        CLIPTextConfig,
        CLIPTextModelWithProjection,
        LlamaConfig,
        LlamaForCausalLM,
        T5Config,
        T5EncoderModel,
    )

    max_length = 16
    clip_tokenizer = build_clip_tokenizer(model_max_length=128)  # the pipeline pads CLIP prompts to 128 tokens
    t5_tokenizer = build_t5_tokenizer(model_max_length=max_length)
    llama_tokenizer = build_qwen2_tokenizer(model_max_length=max_length)  # a byte-level BPE, as Llama 3's

    def clip():
        return CLIPTextModelWithProjection(
            CLIPTextConfig(
                vocab_size=len(clip_tokenizer), hidden_size=_WIDTH, intermediate_size=16,
                num_hidden_layers=_NUM_LAYERS, num_attention_heads=2, max_position_embeddings=128,
                projection_dim=_WIDTH, bos_token_id=clip_tokenizer.bos_token_id,
                eos_token_id=clip_tokenizer.eos_token_id, pad_token_id=clip_tokenizer.pad_token_id,
            )
        )  # fmt: skip

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        text_encoder, text_encoder_2 = clip(), clip()
        text_encoder_3 = T5EncoderModel(
            T5Config(
                vocab_size=len(t5_tokenizer), d_model=_WIDTH, d_kv=4, d_ff=16, num_layers=_NUM_LAYERS, num_heads=2,
                relative_attention_num_buckets=4, pad_token_id=t5_tokenizer.pad_token_id,
                eos_token_id=t5_tokenizer.eos_token_id, decoder_start_token_id=t5_tokenizer.pad_token_id,
            )
        )  # fmt: skip
        text_encoder_4 = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=len(llama_tokenizer), hidden_size=_WIDTH, intermediate_size=16,
                num_hidden_layers=_NUM_LAYERS, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                max_position_embeddings=max_length, eos_token_id=llama_tokenizer.eos_token_id,
                pad_token_id=llama_tokenizer.pad_token_id,
                attn_implementation="eager",  # the pipeline asks Llama for its attentions
            )
        )  # fmt: skip
        transformer = HiDreamImageTransformer2DModel(
            patch_size=2, in_channels=4, out_channels=4, num_layers=_NUM_LAYERS, num_single_layers=_NUM_LAYERS,
            attention_head_dim=8, num_attention_heads=2, caption_channels=[_WIDTH, _WIDTH], text_emb_dim=2 * _WIDTH,
            num_routed_experts=2, num_activated_experts=1, axes_dims_rope=(4, 2, 2), max_resolution=(8, 8),
            llama_layers=list(range(_NUM_LAYERS)) * _NUM_LAYERS,  # one Llama hidden state per block
        )  # fmt: skip
        vae = AutoencoderKL(
            in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(4, 4), layers_per_block=1,
            latent_channels=4, norm_num_groups=2, shift_factor=0.0, scaling_factor=1.0,
        )  # fmt: skip
    for model in (text_encoder, text_encoder_2, text_encoder_3, text_encoder_4, transformer, vae):
        model.eval()  # from_pretrained would; HiDream's transformer unpatchifies differently in training mode
    pipe = HiDreamImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=clip_tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=clip_tokenizer,
        text_encoder_3=text_encoder_3,
        tokenizer_3=t5_tokenizer,
        text_encoder_4=text_encoder_4,
        tokenizer_4=llama_tokenizer,
        transformer=transformer,
    )
    # The pipeline rescales every request to default_sample_size * vae_scale_factor pixels a side (256 here);
    # 8 gives 16x16 images, 8x8 latents, 16 image tokens.
    pipe.default_sample_size = 8
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _generate(pipe) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return pipe(
        prompt="a red cat",
        num_inference_steps=2,
        guidance_scale=2.0,  # classifier-free guidance: every block runs on a batch of two
        max_sequence_length=16,
        output_type="pt",
        generator=generator,
    ).images


@pytest.fixture(scope="module")
def hidream_resident_images() -> torch.Tensor:
    return _generate(_hidream_pipeline())


def test_hidream_pipeline_resolves_wrapped_blocks_from_its_builtin_plan():
    resolved = resolve_offload_plan(_hidream_pipeline(), DIT_AND_TEXT)
    transformer = resolved.component("transformer")
    assert (transformer.source, transformer.action) == ("builtin", "stream")
    assert [s.attr_path for s in transformer.stacks] == ["double_stream_blocks", "single_stream_blocks"]
    double = transformer.stacks[0]
    assert double.block_paths == ("transformer.double_stream_blocks.0", "transformer.double_stream_blocks.1")
    expected_encoders = {
        "text_encoder": ["text_model.encoder.layers"],
        "text_encoder_2": ["text_model.encoder.layers"],
        "text_encoder_3": ["encoder.block"],
        "text_encoder_4": ["model.layers"],
    }
    for path, attrs in expected_encoders.items():
        comp = resolved.component(path)
        assert (comp.category, comp.source, comp.action) == ("text_encoder", "builtin", "stream"), path
        assert [s.attr_path for s in comp.stacks] == attrs, path


def test_automatic_discovery_finds_the_same_wrapped_blocks_as_the_builtin_plan():
    transformer = _hidream_pipeline().transformer
    assert find_block_lists(transformer) == ("double_stream_blocks", "single_stream_blocks")
    comp = resolve_offload_plan(transformer, DIT).component("")
    assert (comp.source, comp.action, comp.num_blocks) == ("auto", "stream", 2 * _NUM_LAYERS)
    assert [s.attr_path for s in comp.stacks] == ["double_stream_blocks", "single_stream_blocks"]


@pytest.mark.parametrize("config", [DIT, DIT_AND_TEXT], ids=["dit", "dit_and_text_encoders"])
def test_hidream_pipeline_streams_bit_exactly(hidream_resident_images, config):
    pipe = _hidream_pipeline()
    handle = enable_offload(pipe, config, device="cpu")
    try:
        images = _generate(pipe)
        stats = handle.stats()
        assert stats.per_component["transformer"].num_streamed_blocks == 2 * _NUM_LAYERS
        assert stats.max_materialized_blocks <= stats.num_slots
        assert stats.per_component["transformer"].bytes_transferred > 0
    finally:
        handle.disable()
    assert torch.equal(images, hidream_resident_images)
    assert torch.equal(_generate(pipe), hidream_resident_images)  # disable() restores a resident pipeline


def test_bare_hidream_transformer_streams_its_wrapped_blocks_bit_exactly():
    pipe = _hidream_pipeline()
    transformer, resident = pipe.transformer, _hidream_pipeline().transformer
    generator = torch.Generator().manual_seed(1)
    inputs = dict(
        hidden_states=torch.randn(2, 4, 8, 8, generator=generator),
        timesteps=torch.tensor([500.0, 250.0]),
        encoder_hidden_states_t5=torch.randn(2, 5, _WIDTH, generator=generator),
        encoder_hidden_states_llama3=torch.randn(_NUM_LAYERS, 2, 6, _WIDTH, generator=generator),
        pooled_embeds=torch.randn(2, 2 * _WIDTH, generator=generator),
        return_dict=False,
    )
    with torch.no_grad():
        expected = resident(**inputs)[0]
        handle = enable_offload(transformer, DIT, device="cpu")
        try:
            assert handle.stats().num_streamed_blocks == 2 * _NUM_LAYERS
            for _ in range(2):  # the second call finds block 0 prefetched by the last block of the first
                assert torch.equal(transformer(**inputs)[0], expected)
        finally:
            handle.disable()
