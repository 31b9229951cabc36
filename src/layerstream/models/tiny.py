"""The embedded tiny models: real diffusers pipelines at toy sizes, built once per machine from configs in code
with fixed-seed weights, and saved as a diffusers-format folder under ``<cache>/models/<name>-v<N>/``; from then
on loaded as any downloaded model is. diffusers and transformers are imported only when a model is built.
"""

from __future__ import annotations

import importlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from layerstream.models.cache import cache_root, discard_folder, publish_folder
from layerstream.models.geometry import PipelineKind
from layerstream.models.manifest import CorruptFolderError, verify_manifest, write_manifest
from layerstream.models.optional_imports import quiet_library_noise

logger = logging.getLogger(__name__)

# Bump when a tiny model's configs, weights or tokenizers change: the folder name changes with it, so a
# cache built by an older layerstream is never mistaken for the current model.
TINY_MODEL_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class TinyModelSpec:
    """What a caller needs to know to generate with one tiny model."""

    name: str
    pipeline_class: str
    kind: PipelineKind
    """``"video"`` (takes ``num_frames``, returns frames) or ``"image"``."""
    default_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Pipeline call arguments for a quick, representative generation (size, steps, guidance); read-only."""
    size_multiple: int
    builder: str
    """Name of the function in `layerstream.models.tiny_components` that builds the pipeline's components."""

    def __post_init__(self) -> None:
        if self.kind not in ("video", "image"):
            raise ValueError(f"{self.name}: kind must be 'video' or 'image', got {self.kind!r}")
        if self.size_multiple <= 0:
            raise ValueError(f"{self.name}: size_multiple must be positive, got {self.size_multiple}")
        object.__setattr__(self, "default_kwargs", MappingProxyType(dict(self.default_kwargs)))


def _tiny(name: str, pipeline_class: str, builder: str, **defaults: Any) -> TinyModelSpec:
    """A tiny model: 64x64 (an input image sets the size, rounded down to 16), 4 steps; a video with frames."""
    kind = "video" if "num_frames" in defaults else "image"
    defaults = {"height": 64, "width": 64, "num_inference_steps": 4, **defaults}
    return TinyModelSpec(
        name=name, pipeline_class=pipeline_class, kind=kind, default_kwargs=defaults, size_multiple=16, builder=builder
    )


# Wan: guidance > 1 runs classifier-free guidance; with two experts, two steps on each (WAN_BOUNDARY_RATIO).
_WAN_DEFAULTS = {"num_frames": 9, "guidance_scale": 4.0}
# Qwen-Image's own recipe: classifier-free guidance through true_cfg_scale and a blank negative.
_QWEN_DEFAULTS = {"true_cfg_scale": 4.0, "negative_prompt": " "}
TINY_MODELS: Mapping[str, TinyModelSpec] = MappingProxyType(
    {
        spec.name: spec
        for spec in (
            _tiny("tiny-wan", "WanPipeline", "build_wan_components", **_WAN_DEFAULTS),
            _tiny("tiny-wan-i2v", "WanImageToVideoPipeline", "build_wan_i2v_components", **_WAN_DEFAULTS),
            # Wan 2.2 I2V A14B's structure: two experts, the image as latent channels
            _tiny("tiny-wan22-i2v", "WanImageToVideoPipeline", "build_wan22_i2v_components", **_WAN_DEFAULTS),
            # Flux.1-dev is guidance-distilled: guidance_scale is an input of the transformer, one pass per step.
            # Classifier-free guidance is `true_cfg_scale` > 1 with a `negative_prompt`.
            _tiny("tiny-flux", "FluxPipeline", "build_flux_components", guidance_scale=3.5),
            _tiny("tiny-qwen-image", "QwenImagePipeline", "build_qwen_image_components", **_QWEN_DEFAULTS),
        )
    }
)


def is_tiny_model_name(name: object) -> bool:
    """Whether `name` names an embedded tiny model (``"tiny-wan"``, ``"tiny-flux"``, ``"tiny-qwen-image"``)."""
    return isinstance(name, str) and name in TINY_MODELS


def get_tiny_model_spec(name: str) -> TinyModelSpec:
    """The spec of tiny model `name`; ValueError naming the known models if there is none."""
    try:
        return TINY_MODELS[name]
    except KeyError:
        raise ValueError(f"unknown tiny model {name!r}; known: {', '.join(TINY_MODELS)}") from None


def tiny_model_dir(name: str) -> Path:
    """The folder tiny model `name` lives in (whether or not it is built yet)."""
    get_tiny_model_spec(name)
    return cache_root() / "models" / f"{name}-v{TINY_MODEL_VERSION}"


def build_tiny_pipeline_components(name: str) -> dict[str, Any]:
    """Freshly built components (and config values) of tiny model `name`: its pipeline's keyword arguments."""
    spec = get_tiny_model_spec(name)
    components_module = importlib.import_module("layerstream.models.tiny_components")
    return getattr(components_module, spec.builder)()


def build_tiny_pipeline(name: str) -> Any:
    """Tiny model `name` as an in-memory pipeline, built from scratch (not saved, not loaded from disk)."""
    import diffusers

    spec = get_tiny_model_spec(name)
    pipeline_class = getattr(diffusers, spec.pipeline_class)
    return pipeline_class(**build_tiny_pipeline_components(name))


def ensure_tiny_model(name: str) -> Path:
    """Return the folder of tiny model `name`, building and saving it first if it is not there yet (complete or
    absent: `publish_folder`). A folder that fails its checksums, or has none, is discarded and rebuilt."""
    folder = tiny_model_dir(name)

    def write(build_folder: Path) -> None:
        with quiet_library_noise():  # a sub-megabyte model: transformers' "Writing model shards" bar is noise
            build_tiny_pipeline(name).save_pretrained(build_folder, safe_serialization=True)
        write_manifest(build_folder)

    started = time.perf_counter()
    if publish_folder(folder, write, marker="model_index.json"):
        logger.info("built tiny model %s in %s (%.2f s)", name, folder, time.perf_counter() - started)
        return folder
    try:
        verify_manifest(folder)
    except CorruptFolderError as e:
        logger.warning("tiny model %s failed its check (%s); rebuilding it", name, "; ".join(e.problems))
        discard_folder(folder)
        publish_folder(folder, write, marker="model_index.json")
        verify_manifest(folder)  # what this process (or a racing one) just built must check out
        logger.info("rebuilt tiny model %s in %s (%.2f s)", name, folder, time.perf_counter() - started)
    return folder
