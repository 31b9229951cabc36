"""torchao, imported only for a model that needs it: diffusers and transformers would import it regardless.

Where torchao is installed, diffusers' and transformers' torchao quantizers import it as soon as any of their
model classes is imported, whether a model is quantized or not. On a CPU-only machine that import logs five
warnings (extensions it cannot load, no triton, torch's pytree deprecations) and takes over a second. The
command line promises layerstream's own lines on stderr, so it runs each command inside
`torchao_deferred(model)`: unless the model's folder was saved quantized by torchao, torchao counts as not
installed for the command's length (its `sys.modules` entry is None, Python's own way of saying a module is
absent: `importlib.util.find_spec` returns None and an import raises `ImportError`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from layerstream.models.tiny import TINY_MODELS

_TORCHAO = "torchao"
_LOOKERS = ("diffusers", "transformers")
"""The libraries that record whether torchao is installed (diffusers once at import, transformers at its first
look) and import it by that record: torchao is hidden only from a process where none of them has looked yet,
or one would later import a torchao it recorded as present."""


def folder_needs_torchao(folder: Path) -> bool:
    """Whether a component of the diffusers-format `folder` was saved quantized by torchao (its config.json
    holds a `quantization_config` whose `quant_method` is "torchao", as diffusers and transformers write it)."""
    for config_path in folder.glob("*/config.json"):
        try:
            config = json.loads(config_path.read_text())
        except (OSError, ValueError):
            continue  # unreadable: the load reports it
        quantization = config.get("quantization_config") if isinstance(config, dict) else None
        if isinstance(quantization, dict) and quantization.get("quant_method") == _TORCHAO:
            return True
    return False


def model_needs_torchao(model: str | os.PathLike[str] | None) -> bool:
    """Whether loading `model` (a tiny model name, a folder path, or None for none) needs torchao."""
    if model is None or (isinstance(model, str) and model in TINY_MODELS):
        return False  # the tiny models are never quantized
    folder = Path(model).expanduser()
    return folder.is_dir() and folder_needs_torchao(folder)


@contextlib.contextmanager
def torchao_deferred(model: str | os.PathLike[str] | None) -> Iterator[None]:
    """Inside, torchao counts as not installed, unless `model` needs it, or torchao, diffusers or transformers
    is imported already (see `_LOOKERS`).

    On leaving, torchao can be imported again, but diffusers and transformers imported inside keep what they
    found (torchao absent) for the process's life: the command line, not the library, uses this."""
    hide = (
        not any(name in sys.modules for name in (_TORCHAO, *_LOOKERS))
        and importlib.util.find_spec(_TORCHAO) is not None
        and not model_needs_torchao(model)
    )
    if hide:
        sys.modules[_TORCHAO] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        if hide and _TORCHAO in sys.modules and sys.modules[_TORCHAO] is None:
            del sys.modules[_TORCHAO]
