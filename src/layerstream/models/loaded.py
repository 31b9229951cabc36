"""`load_model`: a pipeline found (a tiny model, a folder or a Hub id) and loaded on the host, with what is read
of it before offload is enabled (its kind, its components' dtypes, its rules)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from layerstream.models.hub import ModelSource
from layerstream.models.loading import component_dtypes, load_pipeline, pipeline_kind, resolve_model
from layerstream.models.model_rules import ModelRules, read_model_rules
from layerstream.models.tiny import PipelineKind


@dataclass(frozen=True)
class LoadedModel:
    """A pipeline loaded on the host, and what is read of it before offload is enabled."""

    name: str
    """The model as asked for (a Hub id, a folder, a tiny model's name)."""
    source: ModelSource
    """Where its files came from (a Hub id's revision and commit, or the folder)."""
    pipeline: Any
    kind: PipelineKind
    component_dtypes: dict[str, str]
    """The dtype each component computes in, read before enabling (the streamed blocks still hold weights)."""
    rules: ModelRules
    """What the model accepts and its defaults."""


def load_model(
    model: str | ModelSource, *, dtype: torch.dtype | None, revision: str | None = None, variant: str | None = None
) -> LoadedModel:
    """Find `model` (`resolve_model`, with `revision` and `variant`; a `ModelSource` as it is) and load it on the
    host with its rules; its progress bars off (layerstream reports progress itself, per step)."""
    name = model.model if isinstance(model, ModelSource) else model
    source = model if isinstance(model, ModelSource) else resolve_model(model, revision=revision, variant=variant)
    pipeline = load_pipeline(source, dtype=dtype)
    if hasattr(pipeline, "set_progress_bar_config"):
        pipeline.set_progress_bar_config(disable=True)
    kind, dtypes = pipeline_kind(pipeline), component_dtypes(pipeline)
    return LoadedModel(name, source, pipeline, kind, dtypes, read_model_rules(pipeline, name))
