"""How diffusers and transformers name weight files: the format, the variant (``fp16``) and the shard of a file
name, read from the name alone."""

from __future__ import annotations

import re

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".msgpack", ".h5", ".onnx", ".onnx_data", ".gguf")
_SHARD = re.compile(r"-\d{5}-of-\d{5}")
WEIGHT_INDEX = re.compile(r"(?P<stem>.+)\.(?P<format>safetensors|bin)\.index(?:\.(?P<variant>[^.]+))?\.json")


def weight_file_key(leaf: str) -> tuple[str, str | None] | None:
    """(format, variant) of a weight file or weight index, None for any other file
    (``"diffusion_pytorch_model.fp16-00001-of-00002.safetensors"`` -> ``(".safetensors", "fp16")``)."""
    match = WEIGHT_INDEX.fullmatch(leaf)
    if match:
        return f".{match['format']}", match["variant"]
    suffix = next((s for s in WEIGHT_SUFFIXES if leaf.endswith(s)), None)
    if suffix is None:
        return None
    stem = _SHARD.sub("", leaf[: -len(suffix)])
    _, dot, tail = stem.rpartition(".")
    return suffix, (tail if dot else None)
