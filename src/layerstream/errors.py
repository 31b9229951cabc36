"""The package's error base (every error layerstream defines derives from `LayerstreamError`) and the runtime's
errors. Errors a user caused also derive from ``ValueError`` or ``TypeError``, those of a running transfer from
``RuntimeError``; out of memory and ``KeyboardInterrupt`` are never wrapped."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class LayerstreamError(Exception):
    """Base of every error the layerstream package defines."""


class OffloadError(LayerstreamError, ValueError):
    """Offload cannot be enabled on this pipeline as configured; nothing was changed."""


class UnsupportedTensorError(OffloadError, TypeError):
    """A streamed block holds a tensor whose bytes layerstream cannot pack (a tensor subclass without storage of
    its own, such as a quantized weight); raised at enable, before anything changes. Names the tensor and type."""


class ConcurrentUseError(LayerstreamError, RuntimeError):
    """A second thread entered a streamed model while another thread was running it."""


class TransferError(LayerstreamError, RuntimeError):
    """A weight transfer failed (a copy job raised, or a collective of the allgather transfer failed)."""


class UnsupportedUseError(LayerstreamError, RuntimeError):
    """A PyTorch operation on a streamed model that layerstream cannot make exact; refused before it changes
    anything (the message says what to do instead, usually `handle.disable()` first)."""


class MissingExtraError(LayerstreamError, ModuleNotFoundError):
    """A feature needs an optional extra (pyproject's ``[project.optional-dependencies]``) that is not
    installed: a core install (torch alone) says so in one line naming the pip command, never a traceback."""


EXTRA_OF_MODULE = {
    **dict.fromkeys(
        ("numpy", "diffusers", "transformers", "huggingface_hub", "safetensors", "sentencepiece", "accelerate",
         "imageio", "imageio_ffmpeg", "PIL", "tqdm", "ftfy", "httpx"),
        "diffusers",
    ),
    **dict.fromkeys(("fastapi", "uvicorn", "pydantic", "multipart", "python_multipart", "prometheus_client"), "serve"),
    **dict.fromkeys(("matplotlib", "psutil"), "bench"),
    "peft": "lora",
    "cache_dit": "cache",
    "gguf": "gguf",
    "torchao": "torchao",
}  # fmt: skip


def missing_extra(error: ModuleNotFoundError, what: str) -> MissingExtraError | None:
    """The one-line error saying that `what` needs the extra of `error`'s module; None if none has it."""
    extra = EXTRA_OF_MODULE.get((error.name or "").partition(".")[0])
    if extra is None:
        return None
    return MissingExtraError(
        f'{what} needs the {extra} extra ({error.name} is not installed): pip install "layerstream[{extra}]"', name=error.name
    )


@contextlib.contextmanager
def extra_needed(what: str) -> Iterator[None]:
    """Inside, an import of a module an extra provides fails as one `MissingExtraError` saying that `what`
    needs that extra; the import's own chain, which only repeats which module is missing, is dropped."""
    try:
        yield
    except ModuleNotFoundError as e:
        if (error := missing_extra(e, what)) is None:
            raise
        raise error from None
