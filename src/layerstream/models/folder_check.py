"""Checks of a diffusers-format folder before diffusers reads it, so that a broken download or a damaged
copy is reported by name ("component transformer: no transformer/ folder") rather than by whatever
diffusers happens to trip over first ("no file named config.json found in directory ...")."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from layerstream.errors import LayerstreamError
from layerstream.models.manifest import MANIFEST_NAME, CorruptFolderError, has_manifest, verify_manifest

MODEL_INDEX = "model_index.json"


class ModelLoadError(LayerstreamError, ValueError):
    """A model that cannot be loaded: not a tiny model name nor a diffusers-format folder, or a failed load."""


_REDOWNLOAD_HINT = "download the model again (or copy it again from a complete folder)"


def check_model_folder(folder: Path) -> None:
    """Raise ``ModelLoadError`` for an unreadable index, a component without its folder, a bad checksum."""
    components = pipeline_components(folder)
    missing = [name for name in components if not (folder / name).is_dir()]
    if missing:
        names = ", ".join(f"{name} ({'.'.join(components[name])})" for name in missing)
        raise ModelLoadError(
            f"model folder {folder}: {MODEL_INDEX} names {names} but there is no {', '.join(f'{n}/' for n in missing)} "
            f"folder beside it; the folder is incomplete: {_REDOWNLOAD_HINT}"
        )
    if has_manifest(folder):  # only folders layerstream built (or copies of them) carry checksums
        try:
            verify_manifest(folder)
        except CorruptFolderError as e:
            raise ModelLoadError(
                f"model folder {folder} is damaged: {'; '.join(e.problems)} (see {MANIFEST_NAME}); "
                f"{_REDOWNLOAD_HINT}, or delete {MANIFEST_NAME} to load it unchecked"
            ) from e


def pipeline_components(folder: Path) -> dict[str, tuple[str, str]]:
    """Component name -> (library, class), as ``model_index.json`` lists them (``[null, null]`` left out)."""
    try:
        index = json.loads((folder / MODEL_INDEX).read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"model folder {folder}: cannot read {MODEL_INDEX}: {type(e).__name__}: {e}") from e
    if not isinstance(index, dict):
        raise ModelLoadError(f"model folder {folder}: {MODEL_INDEX} is not a JSON object")
    return index_components(index)


def index_components(index: Mapping[str, Any]) -> dict[str, tuple[str, str]]:
    """Component name -> (library, class) of a parsed ``model_index.json``."""
    return {
        name: (value[0], value[1])
        for name, value in index.items()
        if not name.startswith("_")
        and isinstance(value, list)
        and len(value) == 2
        and all(isinstance(part, str) and part for part in value)
    }
