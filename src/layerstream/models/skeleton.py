"""A pipeline's skeleton for `layerstream plan`: every model built from its config on the meta device, in the
dtypes its checkpoint stores (from a folder or the Hub's metadata: the plans are equal by construction);
schedulers from their configs; tokenizers and processors left out, as planning never calls them."""

from __future__ import annotations

import importlib
import inspect
import json
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from layerstream.models.folder_check import MODEL_INDEX, ModelLoadError, pipeline_components
from layerstream.models.optional_imports import errors_only
from layerstream.models.saved_dtypes import SAFETENSORS_DTYPES, loaded_safetensors, read_safetensors_header

TensorDtypes = Mapping[str, Mapping[str, str]]


def folder_tensor_dtypes(folder: Path, variant: str | None = None) -> dict[str, dict[str, str]]:
    """Component name -> tensor name -> the dtype its safetensors header gives, in a local folder."""
    out: dict[str, dict[str, str]] = {}
    for name in pipeline_components(folder):
        dtypes: dict[str, str] = {}
        for path in loaded_safetensors(folder / name, variant):
            for key, entry in read_safetensors_header(path).items():
                if key != "__metadata__" and isinstance(entry, dict) and isinstance(entry.get("dtype"), str):
                    dtypes[key] = entry["dtype"]
        if dtypes:
            out[name] = dtypes
    return out


def build_skeleton(folder: Path, tensor_dtypes: TensorDtypes) -> Any:
    """The pipeline class ``model_index.json`` names, holding its components' skeletons (dtypes from
    `tensor_dtypes`); `ModelLoadError` naming a component that cannot be built."""
    import diffusers

    index = json.loads((folder / MODEL_INDEX).read_text())
    pipeline_class = getattr(diffusers, str(index.get("_class_name")), None)
    if not isinstance(pipeline_class, type):
        raise ModelLoadError(f"model folder {folder}: diffusers has no pipeline class {index.get('_class_name')!r}")
    components: dict[str, Any] = {}
    for name, (library, class_name) in pipeline_components(folder).items():
        components[name] = _build_component(folder / name, name, library, class_name, tensor_dtypes.get(name, {}))
    parameters = inspect.signature(pipeline_class.__init__).parameters
    # what the pipeline's __init__ requires and the folder left out (optional components saved as [null, null])
    for name, parameter in parameters.items():
        if name != "self" and parameter.default is parameter.empty and parameter.kind is not parameter.VAR_KEYWORD:
            components.setdefault(name, None)
    # the pipeline's own settings, as loading passes them (Wan 2.2's boundary_ratio: whether it has two experts)
    settings = {k: v for k, v in index.items() if k in parameters and k not in components and not isinstance(v, list)}
    try:
        return pipeline_class(**components, **settings)
    except Exception as e:  # a pipeline whose __init__ needs what a skeleton leaves out (a tokenizer)
        raise ModelLoadError(
            f"model folder {folder}: cannot build a {pipeline_class.__name__} skeleton for planning: "
            f"{type(e).__name__}: {e}"
        ) from e


def _build_component(folder: Path, name: str, library: str, class_name: str, dtypes: Mapping[str, str]) -> Any:
    try:
        cls = getattr(importlib.import_module(library), class_name)
    except (ImportError, AttributeError) as e:
        raise ModelLoadError(f"component {name}: {library} has no class {class_name}") from e
    if not isinstance(cls, type) or not folder.is_dir():
        return None
    if issubclass(cls, torch.nn.Module):
        module = _meta_model(cls, folder, name)
        _apply_dtypes_(module, dtypes)
        return module
    if hasattr(cls, "from_config") and hasattr(cls, "load_config"):  # a scheduler: cheap and configuration-only
        try:
            return cls.from_config(cls.load_config(folder))
        except Exception:  # noqa: BLE001 - a scheduler plays no part in planning
            return None
    return None  # tokenizers, feature extractors, image processors: planning never calls the pipeline


def _meta_model(cls: type, folder: Path, name: str) -> torch.nn.Module:
    try:
        # transformers and diffusers log at construction; there is nothing to initialise on the meta device
        with torch.device("meta"), errors_only("transformers", "diffusers"):
            if hasattr(cls, "load_config") and hasattr(cls, "from_config"):  # a diffusers model
                return cls.from_config(cls.load_config(folder))
            config = cls.config_class.from_pretrained(folder)  # a transformers model
            return cls._from_config(config)
    except Exception as e:
        raise ModelLoadError(f"component {name}: cannot build {cls.__name__} from {folder}: {type(e).__name__}: {e}") from e


def _apply_dtypes_(module: torch.nn.Module, dtypes: Mapping[str, str]) -> None:
    """Each floating tensor in its stored dtype; one the checkpoint does not name in the commonest."""
    counts = Counter(SAFETENSORS_DTYPES[entry] for entry in dtypes.values() if entry in SAFETENSORS_DTYPES)
    fallback = max(counts, key=counts.get) if counts else None
    state = dict(module.named_parameters(remove_duplicate=False))
    state.update(dict(module.named_buffers(remove_duplicate=False)))
    for key, tensor in state.items():
        if not tensor.is_floating_point():
            continue
        dtype = SAFETENSORS_DTYPES.get(dtypes.get(key, ""), fallback)
        if dtype is not None and tensor.dtype != dtype:
            tensor.data = tensor.data.to(dtype)
