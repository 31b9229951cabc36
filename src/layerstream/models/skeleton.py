"""A pipeline's skeleton: every model component built from its config on the meta device, in the dtypes its
checkpoint stores, with no weight read.

`layerstream plan` works on skeletons, whether the configs come from a downloaded folder or from the Hub's
metadata (JSON files and safetensors headers, nothing else), so the two plans are equal by construction: the
resolver and the placement only look at module structure, shapes and dtypes. Schedulers are built from their
configs; tokenizers and processors are left out (None), since planning never calls the pipeline.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from layerstream.models.folder_check import MODEL_INDEX, ModelLoadError
from layerstream.models.saved_dtypes import SAFETENSORS_DTYPES, loaded_safetensors, read_safetensors_header

logger = logging.getLogger(__name__)

TensorDtypes = Mapping[str, Mapping[str, str]]
"""Component name -> tensor name -> the safetensors dtype name its header gives (``"BF16"``)."""


def folder_tensor_dtypes(folder: Path, variant: str | None = None) -> dict[str, dict[str, str]]:
    """The dtype of every tensor in the safetensors files diffusers loads from each component of a local
    pipeline folder, read from the headers only."""
    out: dict[str, dict[str, str]] = {}
    for name in pipeline_components(folder):
        dtypes: dict[str, str] = {}
        for path in loaded_safetensors(folder / name, variant):
            dtypes.update(header_dtypes(read_safetensors_header(path)))
        if dtypes:
            out[name] = dtypes
    return out


def header_dtypes(header: Mapping[str, Any]) -> dict[str, str]:
    """Tensor name -> dtype name, from one parsed safetensors header."""
    return {
        name: entry["dtype"]
        for name, entry in header.items()
        if name != "__metadata__" and isinstance(entry, dict) and isinstance(entry.get("dtype"), str)
    }


def pipeline_components(folder: Path) -> dict[str, tuple[str, str]]:
    """Component name -> (library, class name), as ``model_index.json`` lists them (optional components saved as
    ``[null, null]`` and metadata keys left out)."""
    try:
        index = json.loads((folder / MODEL_INDEX).read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"model folder {folder}: cannot read {MODEL_INDEX}: {type(e).__name__}: {e}") from e
    return {
        name: (value[0], value[1])
        for name, value in index.items()
        if not name.startswith("_")
        and isinstance(value, list)
        and len(value) == 2
        and isinstance(value[0], str)
        and isinstance(value[1], str)
    }


def build_skeleton(folder: Path, tensor_dtypes: TensorDtypes) -> Any:
    """The pipeline class ``model_index.json`` names, holding meta-device models built from each component's
    config (dtypes from `tensor_dtypes`) and schedulers from theirs. Raises `ModelLoadError` naming the
    component that cannot be built."""
    import diffusers

    index = json.loads((folder / MODEL_INDEX).read_text())
    pipeline_class = getattr(diffusers, str(index.get("_class_name")), None)
    if not isinstance(pipeline_class, type):
        raise ModelLoadError(f"model folder {folder}: diffusers has no pipeline class {index.get('_class_name')!r}")
    components: dict[str, Any] = {}
    for name, (library, class_name) in pipeline_components(folder).items():
        components[name] = _build_component(folder / name, name, library, class_name, tensor_dtypes.get(name, {}))
    # what the pipeline's __init__ requires and the folder left out (optional components saved as [null, null])
    for name, parameter in inspect.signature(pipeline_class.__init__).parameters.items():
        if name != "self" and parameter.default is parameter.empty and parameter.kind is not parameter.VAR_KEYWORD:
            components.setdefault(name, None)
    try:
        return pipeline_class(**components)
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
        with torch.device("meta"), _quiet_init():
            if hasattr(cls, "load_config") and hasattr(cls, "from_config"):  # a diffusers model
                return cls.from_config(cls.load_config(folder))
            config = cls.config_class.from_pretrained(folder)  # a transformers model
            return cls._from_config(config)
    except Exception as e:
        raise ModelLoadError(f"component {name}: cannot build {cls.__name__} from {folder}: {type(e).__name__}: {e}") from e


@contextlib.contextmanager
def _quiet_init():
    """transformers and diffusers log (and initialise) at construction; on the meta device there is nothing to
    initialise, and planning should print only the plan."""
    loggers = [logging.getLogger(n) for n in ("transformers", "diffusers")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _apply_dtypes_(module: torch.nn.Module, dtypes: Mapping[str, str]) -> None:
    """Give each floating tensor the dtype its checkpoint entry stores; a tensor the checkpoint does not name
    (tied, renamed, or computed at construction) takes the component's most common stored dtype."""
    counts: dict[torch.dtype, int] = {}
    for entry in dtypes.values():
        if entry in SAFETENSORS_DTYPES:
            counts[SAFETENSORS_DTYPES[entry]] = counts.get(SAFETENSORS_DTYPES[entry], 0) + 1
    fallback = max(counts, key=counts.get) if counts else None
    state = dict(module.named_parameters(remove_duplicate=False))
    state.update(dict(module.named_buffers(remove_duplicate=False)))
    for key, tensor in state.items():
        if not tensor.is_floating_point():
            continue
        dtype = SAFETENSORS_DTYPES.get(dtypes.get(key, ""), fallback)
        if dtype is not None and tensor.dtype != dtype:
            tensor.data = tensor.data.to(dtype)
