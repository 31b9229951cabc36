"""Built-in offload plans for diffusers pipelines that do not declare `_offload_plan` themselves.

Per-model knowledge is data: each `PipelineFamily` names its pipeline classes (by name: no diffusers import),
the DiT block lists in the order the transformer runs them, and the text encoders, whose block lists depend on
the encoder's own class (`TEXT_ENCODER_BLOCK_ATTRS`: Flux2 ships a Mistral3 or a Qwen3 encoder). Every path was
read from diffusers 0.42 and transformers 5.x and is exercised by `tests/plan/test_builtin_plans.py`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from torch import nn

from layerstream.plan.offload_plan import OffloadPlan
from layerstream.plan.resolved import lookup

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PipelineFamily:
    """Pipelines that share one layout of DiT and text encoders."""

    pipelines: tuple[str, ...]
    """diffusers pipeline class names (subclasses are found through the MRO)."""
    dit: OffloadPlan
    """The DiT part of the plan: ``block_attrs`` and ``resident_dit_paths``."""
    text_encoders: tuple[str, ...] = ()
    """Component names of the pipeline's text encoders; their block lists come from `TEXT_ENCODER_BLOCK_ATTRS`."""
    alternating_dits: tuple[str, ...] = ()
    """DiTs of which each denoising step runs one, never two (Wan 2.2's experts split the steps at a boundary
    timestep): under `host_budget_gb` they share one host pool. A layerstream extension, outside `OffloadPlan`."""


def _family(
    pipelines: str, blocks: tuple[str, ...], *, encoders: int = 1, dits: tuple[str, ...] = ("transformer",)
) -> PipelineFamily:
    """The family of the space-separated `pipelines`: every built-in DiT runs its block lists front to back, so
    its leading blocks may stay resident; two DiTs are Wan 2.2's alternating experts."""
    dit = OffloadPlan(block_attrs={p: blocks for p in dits}, resident_dit_paths=frozenset(dits))
    text_encoders = ("text_encoder",) + tuple(f"text_encoder_{i}" for i in range(2, encoders + 1))
    return PipelineFamily(tuple(pipelines.split()), dit, text_encoders, dits if len(dits) > 1 else ())


_WAN_BLOCKS = ("blocks",)
# Flux, Flux2 and HunyuanVideo run the dual-stream blocks, then the single-stream blocks.
_DUAL_THEN_SINGLE = ("transformer_blocks", "single_transformer_blocks")
_TRANSFORMER_BLOCKS = ("transformer_blocks",)
_EXPERTS = ("transformer", "transformer_2")

FAMILIES: tuple[PipelineFamily, ...] = (
    # Wan 2.1 has one transformer; Wan 2.2 A14B adds transformer_2 (low-noise expert), None otherwise. A step
    # runs `transformer` at timesteps from the boundary up and `transformer_2` below it, never both.
    _family("WanPipeline WanImageToVideoPipeline", _WAN_BLOCKS, dits=_EXPERTS),
    _family("WanVideoToVideoPipeline", _WAN_BLOCKS),
    # WanVACE runs every vace block (building the control hints) before the main blocks.
    _family("WanVACEPipeline", ("vace_blocks", "blocks"), dits=_EXPERTS),
    # WanAnimate's face adapters run between main blocks; they stay resident.
    _family("WanAnimatePipeline", _WAN_BLOCKS),
    _family(
        "FluxPipeline FluxImg2ImgPipeline FluxInpaintPipeline FluxFillPipeline FluxKontextPipeline "
        "FluxKontextInpaintPipeline FluxControlPipeline FluxControlImg2ImgPipeline FluxControlInpaintPipeline",
        _DUAL_THEN_SINGLE, encoders=2,
    ),  # fmt: skip
    _family("Flux2Pipeline Flux2KleinPipeline Flux2KleinInpaintPipeline Flux2KleinKVPipeline", _DUAL_THEN_SINGLE),
    _family(
        "QwenImagePipeline QwenImageImg2ImgPipeline QwenImageInpaintPipeline QwenImageEditPipeline "
        "QwenImageEditInpaintPipeline QwenImageEditPlusPipeline QwenImageLayeredPipeline",
        _TRANSFORMER_BLOCKS,
    ),
    _family(
        "HunyuanVideoPipeline HunyuanVideoImageToVideoPipeline HunyuanSkyreelsImageToVideoPipeline "
        "HunyuanVideoFramepackPipeline",
        _DUAL_THEN_SINGLE, encoders=2,
    ),  # fmt: skip
    _family(
        "LTXPipeline LTXImageToVideoPipeline LTXConditionPipeline LTXI2VLongMultiPromptPipeline", _TRANSFORMER_BLOCKS
    ),
    _family(
        "StableDiffusion3Pipeline StableDiffusion3Img2ImgPipeline StableDiffusion3InpaintPipeline",
        _TRANSFORMER_BLOCKS, encoders=3,
    ),  # fmt: skip
    # HiDream wraps each block in a HiDreamBlock; the wrappers are what the transformer calls, so they stream.
    # The double-stream blocks run first, then the single-stream blocks. text_encoder_4 is Llama 3.1.
    _family("HiDreamImagePipeline", ("double_stream_blocks", "single_stream_blocks"), encoders=4),
    _family(
        "CogVideoXPipeline CogVideoXImageToVideoPipeline CogVideoXVideoToVideoPipeline CogVideoXFunControlPipeline",
        _TRANSFORMER_BLOCKS,
    ),
)

TEXT_ENCODER_BLOCK_ATTRS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "UMT5EncoderModel": ("encoder.block",),  # Wan
        "T5EncoderModel": ("encoder.block",),  # Flux, SD3, LTX, CogVideoX, HiDream
        "CLIPTextModel": ("encoder.layers",),  # Flux, HunyuanVideo (transformers 5 dropped the text_model level)
        "CLIPTextModelWithProjection": ("text_model.encoder.layers",),  # SD3, HiDream
        "LlamaModel": ("layers",),  # HunyuanVideo
        "LlamaForCausalLM": ("model.layers",),  # HiDream (the lm_head stays resident)
        "LlavaForConditionalGeneration": ("model.language_model.layers",),  # HunyuanVideo image-to-video
        "Mistral3ForConditionalGeneration": ("model.language_model.layers",),  # Flux2 (the vision tower stays)
        "Qwen3ForCausalLM": ("model.layers",),  # Flux2 Klein
        "Qwen2_5_VLForConditionalGeneration": ("model.language_model.layers",),  # Qwen-Image (the ViT stays)
    }
)


def _index_families(families: tuple[PipelineFamily, ...]) -> Mapping[str, PipelineFamily]:
    index: dict[str, PipelineFamily] = {}
    for family in families:
        for name in family.pipelines:
            assert name not in index, f"pipeline class {name} is registered twice"
            index[name] = family
    return MappingProxyType(index)


BUILTIN_FAMILIES: Mapping[str, PipelineFamily] = _index_families(FAMILIES)
"""Pipeline class name -> its family."""


def builtin_family_for(pipeline: Any) -> PipelineFamily | None:
    """The family registered for the pipeline's class or its nearest registered base class, or None."""
    for cls in type(pipeline).__mro__:
        family = BUILTIN_FAMILIES.get(cls.__name__)
        if family is not None:
            return family
    return None


def builtin_plan_for(pipeline: Any) -> OffloadPlan | None:
    """layerstream's built-in `OffloadPlan` for a known diffusers pipeline, or None for an unknown class.

    The DiT part comes from the pipeline's family. A text encoder enters the plan (typed ``"text_encoder"``,
    replicated on every rank because each rank loads it whole) when its class is in `TEXT_ENCODER_BLOCK_ATTRS`
    and the listed paths are block lists on this instance; otherwise the resolver discovers it like any other
    encoder (class attribute, then automatic), so an unexpected encoder class or library layout never breaks a
    pipeline that only streams its DiT. Reads attributes only.
    """
    family = builtin_family_for(pipeline)
    if family is None:
        return None
    encoder_block_attrs: dict[str, tuple[str, ...]] = {}
    for path in family.text_encoders:
        encoder = getattr(pipeline, path, None)
        if encoder is None:
            continue  # an optional encoder that is not loaded
        attrs = _known_encoder_layout(encoder)
        if attrs is None:
            logger.debug("%s: no built-in layout for %s (%s)", type(pipeline).__name__, path, type(encoder).__name__)
            continue
        encoder_block_attrs[path] = attrs
    return OffloadPlan(
        block_attrs=family.dit.block_attrs,
        resident_dit_paths=family.dit.resident_dit_paths,
        encoder_component_types={path: "text_encoder" for path in encoder_block_attrs},
        encoder_block_attrs=encoder_block_attrs,
        encoder_dlo_weight_replication=frozenset(encoder_block_attrs),
    )


def _known_encoder_layout(encoder: Any) -> tuple[str, ...] | None:
    attrs = TEXT_ENCODER_BLOCK_ATTRS.get(type(encoder).__name__)
    if attrs is None:
        return None
    for attr in attrs:
        try:
            blocks = lookup(encoder, attr)
        except AttributeError:
            return None
        if not isinstance(blocks, (nn.ModuleList, nn.Sequential)) or len(blocks) == 0:
            return None
    return attrs


__all__ = [
    "BUILTIN_FAMILIES",
    "FAMILIES",
    "TEXT_ENCODER_BLOCK_ATTRS",
    "PipelineFamily",
    "builtin_family_for",
    "builtin_plan_for",
]
