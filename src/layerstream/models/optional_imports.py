"""torchao imported only for a model that needs it (diffusers and transformers import it with any model class:
on a CPU-only machine five warnings and over a second), and the libraries' import-time advisories quieted
while layerstream loads a model. Hidden torchao has a `sys.modules` entry of None: Python's "absent".
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

_TORCHAO = "torchao"
_LOOKERS = ("diffusers", "transformers")
"""The libraries that record whether torchao is installed: it is hidden only where none has looked yet."""


def model_needs_torchao(model: str | os.PathLike[str] | None) -> bool:
    """Whether a component of `model` (a folder; anything else never) was saved quantized by torchao."""
    if model is None:
        return False
    folder = Path(model).expanduser()
    for config_path in folder.glob("*/config.json") if folder.is_dir() else ():
        try:
            config = json.loads(config_path.read_text())
        except (OSError, ValueError):
            continue  # unreadable: the load reports it
        quantization = config.get("quantization_config") if isinstance(config, dict) else None
        if isinstance(quantization, dict) and quantization.get("quant_method") == _TORCHAO:
            return True
    return False


@contextlib.contextmanager
def torchao_deferred(model: str | os.PathLike[str] | None) -> Iterator[None]:
    """Inside, torchao counts as not installed, unless `model` needs it or one of `_LOOKERS` is imported already.
    Libraries imported inside keep what they found for the process's life: for the command line only."""
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


_NOISY_LOGGERS = (
    "torchao",  # "Failed to load .../_C_mxfp8...so": each kernel library this machine's torch cannot load
    "torch.utils._pytree",  # torchao registers its enums with register_constant, deprecated since torch 2.13
    "diffusers.quantizers.torchao.torchao_quantizer",  # "Unable to import `torchao` Tensor objects" (a torchao
    # newer than diffusers' list of its classes)
    "transformers.utils.import_utils",  # "`CLIPImageProcessor` requires torchvision; falling back to ...Pil"
)
"""Loggers that speak at WARNING of the libraries, not the model: 4 lines, 2 more per missing kernel library."""


@contextlib.contextmanager
def errors_only(*names: str) -> Iterator[None]:
    """Inside, the loggers `names` report errors only; as they were on leaving."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


@contextlib.contextmanager
def quiet_library_noise() -> Iterator[None]:
    """Inside, `_NOISY_LOGGERS` say errors only and diffusers' and transformers' progress bars are off."""
    bars = []
    with errors_only(*_NOISY_LOGGERS):  # before diffusers is imported: its import is what speaks
        try:
            import diffusers.utils.logging as diffusers_logging
            import transformers.utils.logging as transformers_logging

            for lib in (diffusers_logging, transformers_logging):
                bars.append((lib, lib.is_progress_bar_enabled()))
                lib.disable_progress_bar()
            yield
        finally:
            for lib, was_enabled in bars:
                if was_enabled:
                    lib.enable_progress_bar()
