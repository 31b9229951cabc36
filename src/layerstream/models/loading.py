"""Finding and loading a pipeline (a tiny model name, a local diffusers-format folder or a Hub id) on the host:
`resolve_model` finds its files (downloading a Hub id), `load_pipeline` loads them with diffusers offline, and
`load_model` does both and reads what is needed before offload is enabled (a `LoadedModel`)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from layerstream.models import component_files as files_of
from layerstream.models.cast_on_load import cast_from_files_, components_to_cast
from layerstream.models.component_headers import header_tensors
from layerstream.models.component_skeleton import file_component_skeleton_
from layerstream.models.readahead import Readahead
from layerstream.models.folder_check import MODEL_INDEX, ModelLoadError, check_model_folder
from layerstream.models.geometry import PipelineKind, pipeline_kind
from layerstream.models.hub import (
    HubUnavailableError, ModelSource, download_snapshot, fetch_plan_metadata, looks_like_hub_id, names_hub_repo,
)  # fmt: skip
from layerstream.models.model_rules import ModelRules, read_model_rules
from layerstream.models.optional_imports import quiet_library_noise
from layerstream.models.published import published_model, published_skeleton
from layerstream.models.saved_dtypes import module_dtype, saved_dtypes
from layerstream.models.skeleton import build_skeleton, folder_tensor_dtypes
from layerstream.models.tiny import TINY_MODELS, ensure_tiny_model, is_tiny_model_name
from layerstream.wording import first_line

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline

logger = logging.getLogger(__name__)

_WHAT_MODEL_IS = "a tiny model name ({}), a local diffusers-format folder, or a Hugging Face Hub id (org/name)"


def resolve_model_folder(
    model: str | os.PathLike[str], *, revision: str | None = None, variant: str | None = None
) -> Path:
    """The diffusers-format folder `model` refers to (see `resolve_model`)."""
    return resolve_model(model, revision=revision, variant=variant).folder


def resolve_model(
    model: str | os.PathLike[str],
    *,
    revision: str | None = None,
    variant: str | None = None,
    offline: bool | None = None,
    from_files: frozenset[str] = frozenset(),
) -> ModelSource:
    """Where `model`'s files are: a tiny model built on first use, a local folder (`check_model_folder`), or a
    Hub snapshot, tried in that order. Raises `ModelLoadError` with one line saying what to do."""
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a tiny model name, a folder path or a Hub id, got {type(model).__name__}")
    for name, value in (("revision", revision), ("variant", variant)):
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise ModelLoadError(f"{name} = {value!r} is not valid; expected a non-empty string or None")
    if is_tiny_model_name(model):
        try:
            return ModelSource(str(model), ensure_tiny_model(model), "tiny", variant=variant)
        except OSError as e:  # unwritable cache, a foreign folder in the way, a full disk
            raise ModelLoadError(f"cannot build tiny model {model}: {first_line(e, with_type=True)}") from e
    text = os.fspath(model)
    if not text:
        raise ModelLoadError(f"model is empty: pass {_WHAT_MODEL_IS.format(', '.join(TINY_MODELS))}")
    folder = Path(text).expanduser()
    if not folder.exists():
        if isinstance(model, str) and looks_like_hub_id(text):
            return download_snapshot(text, revision=revision, variant=variant, offline=offline, from_files=from_files)
        raise ModelLoadError(
            f"model path {folder} does not exist and is not spelled like a Hub id (org/name); pass "
            f"{_WHAT_MODEL_IS.format(', '.join(TINY_MODELS))}"
        )
    if not folder.is_dir():
        raise ModelLoadError(
            f"model path {folder} is a file; pass the diffusers-format folder that holds {MODEL_INDEX}"
        )
    if not (folder / MODEL_INDEX).is_file():
        raise ModelLoadError(
            f"model folder {folder} has no {MODEL_INDEX}, so it is not a diffusers-format pipeline; pass the folder "
            f"that holds {MODEL_INDEX} (the top of what a Hub download wrote)"
        )
    check_model_folder(folder)
    return ModelSource(text, folder, "folder", variant=variant)


def load_pipeline(
    model: str | os.PathLike[str] | ModelSource,
    *,
    dtype: torch.dtype | None = None,
    revision: str | None = None,
    variant: str | None = None,
    components: Mapping[str, Any] | None = None,
) -> DiffusionPipeline:
    """Load `model` (as `resolve_model` takes it, or a `ModelSource`) on the host, the Hub client offline: in
    `dtype`, or (None) each component as its files store it, its weights lazy views of them; `components` from
    their files (`models.component_files`). Raises `ModelLoadError` for a bad `model` or any failed load."""
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype or None, got {dtype!r}")
    specs = files_of.check_component_specs(components)  # their form before anything is read
    with quiet_library_noise():
        return _load_pipeline(model, dtype, revision, variant, specs)


def _load_pipeline(
    model, dtype: torch.dtype | None, revision: str | None, variant: str | None, specs: dict[str, str]
) -> DiffusionPipeline:
    from diffusers import DiffusionPipeline

    source = model
    if not isinstance(source, ModelSource):
        source = resolve_model(model, revision=revision, variant=variant, from_files=frozenset(specs))
    classes = files_of.component_classes(source.folder, list(specs))
    files = files_of.resolve_component_files(specs)
    load_kwargs: dict[str, Any] = {"local_files_only": True}
    if source.variant is not None:
        load_kwargs["variant"] = source.variant
    with hub_offline():
        folder = source.folder
        # no dtype: each component in the dtype its checkpoint stores (diffusers would upcast to float32)
        saved = saved_dtypes(folder, source.variant)
        cast_here = [n for n in components_to_cast(folder, saved, dtype) if n not in files] if dtype is not None else []
        if dtype is None:
            load_kwargs["dtype"] = saved
        else:  # diffusers models saved in one other dtype load as saved, then are cast from the files below
            load_kwargs["dtype"] = {"default": dtype, **{name: saved[name] for name in cast_here}}
        # a component whose folder holds no weights (a Hub download leaves them out) computes in the narrowest
        # dtype the others are saved in: a DiT is saved as the text encoder is (bfloat16), the VAE is float32
        narrowest = min(saved.values(), key=lambda d: d.itemsize, default=torch.bfloat16)
        logger.info("loading pipeline from %s", folder)
        readahead = Readahead.for_pipeline_folder(folder, skip=files)  # the disk works while diffusers builds the pipeline
        try:
            from_files = {
                name: files_of.load_component_file(name, classes[name], path, folder, dtype or saved.get(name, narrowest))
                for name, path in files.items()
            }  # in place of the folder's weights, which diffusers then leaves unread
            # the pipeline's own class: DiffusionPipeline itself would load an optional component passed in
            loader = files_of.pipeline_class(folder) if from_files else DiffusionPipeline
            pipeline = loader.from_pretrained(folder, **load_kwargs, **from_files)
            assert all(getattr(pipeline, name) is model for name, model in from_files.items())
            for name in cast_here:
                cast_from_files_(getattr(pipeline, name), dtype, what=name)
            return pipeline
        except ModelLoadError:
            raise
        except Exception as e:  # any loader failure becomes one line naming the folder; the cause stays chained
            raise ModelLoadError(f"cannot load the pipeline in {folder}: {first_line(e, with_type=True)}") from e
        finally:
            readahead.stop()


@dataclass(frozen=True)
class LoadedModel:
    """A pipeline loaded on the host, and what is read of it before offload is enabled."""

    name: str
    source: ModelSource
    pipeline: Any
    kind: PipelineKind
    component_dtypes: dict[str, str]
    """The dtype each component computes in, read before enabling (the streamed blocks still hold weights)."""
    rules: ModelRules


def load_model(
    model: str | ModelSource,
    *,
    dtype: torch.dtype | None,
    revision: str | None = None,
    variant: str | None = None,
    components: Mapping[str, Any] | None = None,
) -> LoadedModel:
    """`resolve_model`, `load_pipeline` and what is read before enabling; progress bars off."""
    name = model.model if isinstance(model, ModelSource) else model
    source = model
    with quiet_library_noise():  # a tiny model is built with diffusers here, before its load
        if not isinstance(source, ModelSource):
            source = resolve_model(model, revision=revision, variant=variant, from_files=frozenset(components or ()))
        pipeline = load_pipeline(source, dtype=dtype, components=components)
    source = replace(source, components=tuple(files_of.check_component_specs(components).items()))
    if hasattr(pipeline, "set_progress_bar_config"):
        pipeline.set_progress_bar_config(disable=True)
    kind, dtypes = pipeline_kind(pipeline), component_dtypes(pipeline)
    return LoadedModel(name, source, pipeline, kind, dtypes, read_model_rules(pipeline, name))


def load_skeleton(
    model: str | os.PathLike[str],
    *,
    revision: str | None = None,
    variant: str | None = None,
    components: Mapping[str, Any] | None = None,
) -> tuple[Any, dict[str, Any]]:
    """(`model`'s pipeline skeleton for planning, where its metadata came from), reading no weight: a Hub id's
    from its metadata, or where the Hub cannot be asked from `models.published`'s catalogue (main revision, no
    `components`); `components` from their files at the bytes their headers say they store."""
    specs = files_of.check_component_specs(components)
    if names_hub_repo(model):
        try:
            meta = fetch_plan_metadata(model, revision=revision, variant=variant)
        except HubUnavailableError as e:
            described_here = revision is None and variant is None and not specs
            published = published_model(str(model)) if described_here else None
            if published is None:
                raise
            why = first_line(e).removeprefix(f"model {model}: ")
            described = f"layerstream's catalogue of its published dimensions ({why})"
            origin = {"model": published.hub_id, "origin": "catalogue", "from": described}
            return published_skeleton(published), origin
        origin = {
            **meta.source.to_dict(),
            "from": "the Hub's metadata (configs and safetensors headers)",
            "total_download_bytes": meta.total_nbytes,
            "download_bytes": meta.download_nbytes,
        }
        folder, skeleton = meta.source.folder, build_skeleton(meta.source.folder, meta.tensor_dtypes)
    else:
        source = resolve_model(model, revision=revision, variant=variant)
        origin, folder = source.to_dict(), source.folder
        skeleton = build_skeleton(source.folder, folder_tensor_dtypes(source.folder, source.variant))
    files_of.component_classes(folder, list(specs))
    local = files_of.resolve_component_files({n: s for n, s in specs.items() if not s.startswith(files_of.HUB_FILE_PREFIX)})
    for name, spec in specs.items():  # a Hub file's header by ranged reads: nothing downloaded
        tensors = header_tensors(name, spec, local.get(name) or files_of.HubFile.parse(name, spec))
        file_component_skeleton_(name, getattr(skeleton, name), tensors, Path(spec.partition("@")[0]).name)
    return skeleton, {**origin, **({"components": specs} if specs else {})}


def model_kind(model: str | os.PathLike[str]) -> PipelineKind | None:
    """What `model` makes, told without loading it; None where it cannot be told (the load will say)."""
    if is_tiny_model_name(model):
        return TINY_MODELS[model].kind
    try:
        index = json.loads((Path(model).expanduser() / MODEL_INDEX).read_text())
    except (OSError, ValueError, TypeError):
        return None
    class_name = index.get("_class_name") if isinstance(index, dict) else None
    if not isinstance(class_name, str):
        return None
    import diffusers

    pipeline_class = getattr(diffusers, class_name, None)
    if not isinstance(pipeline_class, type):
        return None
    # a class's __call__ attribute is its instances' (the class comes before type's own), so the rule applies
    return pipeline_kind(pipeline_class)


@contextlib.contextmanager
def hub_offline() -> Iterator[None]:
    """Hold the Hub client offline (``HF_HUB_OFFLINE=1``, and its module flag, read once at its import); both
    restored on exit. Process-wide: do not run a load concurrently with code that needs the Hub online."""
    from huggingface_hub import constants

    previous_env, previous_flag = os.environ.get("HF_HUB_OFFLINE"), constants.HF_HUB_OFFLINE
    os.environ["HF_HUB_OFFLINE"] = "1"
    constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = previous_flag
        if previous_env is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = previous_env


def component_dtypes(pipeline) -> dict[str, str]:
    """The dtype each torch component of `pipeline` computes in (`saved_dtypes.module_dtype`), by name."""
    out = {}
    for name, component in getattr(pipeline, "components", {}).items():
        dtype = module_dtype(component) if isinstance(component, torch.nn.Module) else None
        if dtype is not None:
            out[name] = str(dtype).removeprefix("torch.")
    return out
