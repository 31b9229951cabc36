"""Real-size models as meta-device skeletons, from the package's catalogue of their published dimensions
(`layerstream.models.published`: Wan 2.2 T2V-A14B and TI2V-5B, Flux.1-dev, Qwen-Image and HunyuanVideo, each
as the diffusers-format folder of its Hub repository describes it). `skeleton(name)` builds one as `layerstream
plan <hub id>` does: nothing is downloaded, no weight exists. Used by `machines.py`.
"""

from __future__ import annotations

from typing import Any

from layerstream.models.published import MODELS, PublishedModel, published_skeleton

__all__ = ["MODELS", "PublishedModel", "skeleton"]


def skeleton(name: str) -> Any:
    """The pipeline `name` names (a key of `MODELS`) as a meta-device skeleton."""
    return published_skeleton(MODELS[name])
