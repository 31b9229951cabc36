"""`load_model`: a pipeline loaded on the host with what is read of it before offload is enabled (its kind,
its components' dtypes, its rules)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from layerstream.models.hub import ModelSource
from layerstream.models.loading import component_dtypes, load_pipeline, pipeline_kind
from layerstream.models.model_rules import ModelRules, read_model_rules
from layerstream.models.tiny import PipelineKind


@dataclass(frozen=True)
class LoadedModel:
    """A pipeline loaded on the host, and what is read of it before offload is enabled."""

    pipeline: Any
    kind: PipelineKind
    component_dtypes: dict[str, str]
    """The dtype each component computes in, read before enabling (the streamed blocks still hold weights)."""
    rules: ModelRules
    """What the model accepts and its defaults."""


def load_model(source: ModelSource, *, dtype: torch.dtype | None, name: str) -> LoadedModel:
    """Load `source` on the host (named `name` in errors) with its rules; its progress bars off (layerstream
    reports progress itself, per step)."""
    pipeline = load_pipeline(source, dtype=dtype)
    if hasattr(pipeline, "set_progress_bar_config"):
        pipeline.set_progress_bar_config(disable=True)
    return LoadedModel(pipeline, pipeline_kind(pipeline), component_dtypes(pipeline), read_model_rules(pipeline, name))
