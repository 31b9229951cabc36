"""Pipeline components loaded from one file each instead of the model's folder (``components={"transformer":
F}``, ``--component transformer=F``): a GGUF file or a safetensors single file (fp8_scaled or not), local or in
a Hub repository. The rest of the pipeline, and each replaced component's config, come from the model.

A file is named by its local path, or as ``hf://owner/repo/path/in/repo.gguf[@revision]``: that spelling is
never read as a path, and the file alone is downloaded into huggingface_hub's cache (`revision` a branch, tag
or commit; default ``main``). Loading is diffusers' own single-file loading (`from_single_file`, its
converters from the original key names, `GGUFQuantizationConfig` for GGUF); fp8_scaled files are read by
`layerstream.models.fp8_scaled`.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from layerstream.models.folder_check import ModelLoadError
from layerstream.wording import first_line

logger = logging.getLogger(__name__)

HUB_FILE_PREFIX = "hf://"
FILE_SUFFIXES = (".gguf", ".safetensors")
"""The formats a component file may have, told by its suffix."""


@dataclass(frozen=True)
class HubFile:
    """One file of a Hub repository, as ``hf://owner/repo/path[@revision]`` names it."""

    repo_id: str
    filename: str
    revision: str | None = None

    @classmethod
    def parse(cls, name: str, spec: str) -> HubFile:
        """`spec` (``hf://owner/repo/path/file.gguf@rev``) read for component `name`; one line naming it if bad."""
        rest, at, revision = spec.removeprefix(HUB_FILE_PREFIX).partition("@")
        parts = rest.split("/")
        if len(parts) < 3 or not all(parts) or (at and not revision):
            raise ModelLoadError(
                f"component {name} = {spec!r}: a Hub file is spelled {HUB_FILE_PREFIX}owner/repo/path/to/file"
                "[@revision], with the path inside the repository"
            )
        return cls("/".join(parts[:2]), "/".join(parts[2:]), revision or None)


def parse_component_flags(values: Sequence[str] | None) -> dict[str, str]:
    """``--component NAME=FILE`` (repeatable) as a mapping; one line naming the flag's value if malformed."""
    out: dict[str, str] = {}
    for value in values or ():
        name, eq, spec = value.partition("=")
        if not eq or not name.strip() or not spec.strip():
            raise ModelLoadError(f"--component {value!r}: expected NAME=FILE, e.g. transformer=wan-high-Q4_K_M.gguf")
        if name.strip() in out:
            raise ModelLoadError(f"--component {name.strip()} is given twice; give each component once")
        out[name.strip()] = spec.strip()
    return out


def check_component_specs(components: Mapping[str, Any] | None) -> dict[str, str]:
    """`components` checked for form (names, spellings, suffixes) before anything is read or downloaded."""
    if components is None:
        return {}
    if not isinstance(components, Mapping):
        raise TypeError(f"components must be a dict of component name -> file, got {type(components).__name__}")
    out = {}
    for name, spec in components.items():
        if not isinstance(name, str) or not name:
            raise ModelLoadError(f"components: key {name!r} is not a component name (e.g. 'transformer')")
        if not isinstance(spec, (str, os.PathLike)) or not os.fspath(spec):
            raise ModelLoadError(f"component {name} = {spec!r}: expected a file path or {HUB_FILE_PREFIX}owner/repo/file")
        text = os.fspath(spec)
        path = HubFile.parse(name, text).filename if text.startswith(HUB_FILE_PREFIX) else text
        if not path.endswith(FILE_SUFFIXES):
            raise ModelLoadError(f"component {name} = {text!r}: the file must end in {' or '.join(FILE_SUFFIXES)}")
        out[name] = text
    return out


def resolve_component_files(components: Mapping[str, str], *, offline: bool | None = None) -> dict[str, Path]:
    """Each component's file on this machine: a local path checked to be a file, a Hub file downloaded alone
    into the cache (read from the cache without a request where `offline` or ``HF_HUB_OFFLINE`` says so)."""
    out = {}
    for name, spec in components.items():
        if spec.startswith(HUB_FILE_PREFIX):
            out[name] = _download(name, spec, HubFile.parse(name, spec), offline)
            continue
        path = Path(spec).expanduser()
        if not path.is_file():
            raise ModelLoadError(
                f"component {name} = {spec!r}: {'is not a file' if path.exists() else 'no such file'} (a Hub file "
                f"is spelled {HUB_FILE_PREFIX}owner/repo/path/to/file)"
            )
        out[name] = path
    return out


def _download(name: str, spec: str, hub_file: HubFile, offline: bool | None) -> Path:
    from huggingface_hub import hf_hub_download

    from layerstream.models.hub import HubSettings

    settings = HubSettings.from_environment()
    try:
        return Path(hf_hub_download(
            hub_file.repo_id, hub_file.filename, revision=hub_file.revision, cache_dir=settings.cache_dir,
            endpoint=settings.endpoint, local_files_only=bool(offline or settings.offline),
        ))  # fmt: skip
    except Exception as e:  # not found, gated, offline without a cached copy, no network: one line naming it
        raise ModelLoadError(f"component {name} = {spec!r}: cannot download it: {first_line(e, with_type=True)}") from e


def component_classes(folder: Path, names: Sequence[str]) -> dict[str, type]:
    """The diffusers model class of each named component of the pipeline in `folder`; one line naming a name
    the pipeline does not have, or a component diffusers cannot load from a single file."""
    from layerstream.models.skeleton import pipeline_components

    listed = pipeline_components(folder)
    out = {}
    for name in names:
        if name not in listed:
            have = ", ".join(sorted(listed))
            raise ModelLoadError(f"component {name}: the pipeline in {folder} has no such component (it has {have})")
        library, class_name = listed[name]
        cls = getattr(importlib.import_module(library), class_name, None)
        if not (isinstance(cls, type) and hasattr(cls, "from_single_file")):
            raise ModelLoadError(
                f"component {name} is a {library}.{class_name}, which diffusers cannot load from a single file"
            )
        out[name] = cls
    return out


def pipeline_class(folder: Path) -> type:
    """The diffusers pipeline class ``model_index.json`` names (one diffusers has: the folder loaded before)."""
    import diffusers

    from layerstream.models.folder_check import MODEL_INDEX

    return getattr(diffusers, json.loads((folder / MODEL_INDEX).read_text())["_class_name"])


def load_component_file(name: str, cls: type, path: Path, folder: Path, dtype: torch.dtype) -> torch.nn.Module:
    """Component `name` (a `cls`) from `path`, configured by ``folder/name``, computing in `dtype`: GGUF through
    diffusers' `GGUFQuantizationConfig` (weights stay quantized), a safetensors file by diffusers' single-file
    loading or, where it holds float8 weights, as fp8_scaled. Every weight the model has must be in the file."""
    from layerstream.models.fp8_scaled import is_float8_file, load_fp8_scaled

    options: dict[str, Any] = {"config": str(folder), "subfolder": name, "local_files_only": True, "torch_dtype": dtype}
    try:
        if path.suffix == ".safetensors" and is_float8_file(path):  # its own checks: its layout, then its names
            return load_fp8_scaled(name, cls, path, folder / name, dtype)
        check_file_names(name, cls, path, folder / name)
        if path.suffix == ".gguf":
            from diffusers import GGUFQuantizationConfig

            model = cls.from_single_file(str(path), quantization_config=GGUFQuantizationConfig(compute_dtype=dtype), **options)
            _own_aligned_storages_(model)
        else:
            model = cls.from_single_file(str(path), **options)
    except ModelLoadError:
        raise
    except Exception as e:  # diffusers' own failure (a file it cannot read, shapes that differ): one line
        raise ModelLoadError(f"component {name}: cannot load {path}: {first_line(e, with_type=True)}") from e
    logger.info("component %s loaded from %s", name, path)
    return model


def _own_aligned_storages_(model: torch.nn.Module) -> None:
    """Move each tensor of `model` that diffusers' GGUF loading left in a numpy array (16-byte aligned, at an
    address each process draws anew) into torch's own 64-byte aligned allocation. A block's layout keeps each
    tensor's address mod 64, so ranks sharding one file with allgather would otherwise build different layouts."""
    with torch.no_grad():
        for module in model.modules():
            for tensors in (module._parameters, module._buffers):
                for tensor in tensors.values():
                    if tensor is not None and tensor.untyped_storage().data_ptr() % 64:
                        tensor.data = tensor.data.clone()


def check_file_names(name: str, cls: type, path: Path, config_folder: Path) -> None:
    """Refuse, before loading, a file that lacks a weight the model needs: its names, converted as diffusers'
    single-file converter for `cls` converts them (shapes on the meta device), against the model's."""
    from accelerate import init_empty_weights
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES, _should_convert_state_dict_to_diffusers

    from layerstream.models.component_headers import header_tensors

    config = cls.load_config(config_folder)
    with init_empty_weights():
        wanted = cls.from_config(config).state_dict()
    # each tensor at its logical shape (not a quantized block layout), from the file's header
    checkpoint = {k: torch.empty(t.shape, device="meta") for k, t in header_tensors(name, str(path), path).items()}
    mapping = SINGLE_FILE_LOADABLE_CLASSES.get(cls.__name__, {}).get("checkpoint_mapping_fn")
    if mapping is not None and _should_convert_state_dict_to_diffusers(wanted, checkpoint):
        checkpoint = mapping(checkpoint=checkpoint, config=config)
    missing = [k for k in wanted if k not in checkpoint]
    if missing:
        raise ModelLoadError(
            f"component {name}: {path} lacks {len(missing)} weight(s) the model needs, e.g. {missing[0]} (is it a "
            f"file of this model, {cls.__name__} as configured in {name}/config.json?)"
        )
