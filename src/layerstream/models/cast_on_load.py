"""Casting a diffusers model to another dtype while its weights are read from the files: diffusers' own cast
faults the mapping in page by page (a few hundred MB/s); here a component loaded as stored is cast tensor by
tensor from `preadv` reads on several threads, the next batch read while one is cast. The result is exactly
diffusers' (its dtype rule, `_keep_in_fp32_modules` included, and `Tensor.to` rounding).
"""

from __future__ import annotations

import contextlib
import itertools
from pathlib import Path

import torch
from torch import nn

from layerstream.errors import LayerstreamError
from layerstream.models.folder_check import pipeline_components
from layerstream.models.saved_dtypes import SAFETENSORS_DTYPES, SafetensorsHeaderError, read_safetensors_header
from layerstream.runtime.packing.file_reads import FileReader, MappedFiles
from layerstream.runtime.reporting.progress import StagingProgress

CASTABLE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""Target dtypes cast here; any other (float8, float64) is left to diffusers' own load."""

BATCH_BYTES = 64 * 2**20
"""Bytes of stored weights read at once (in flight together on the reader's threads) before they are cast."""


class CastReadError(LayerstreamError, OSError):
    """A checkpoint file that could not be read while casting (truncated, removed); the message names it."""


def components_to_cast(folder: Path, saved: dict[str, torch.dtype], dtype: torch.dtype) -> list[str]:
    """The diffusers models of the folder whose files store one floating dtype, other than `dtype`."""
    if dtype not in CASTABLE_DTYPES:
        return []
    library = {name: library for name, (library, _) in pipeline_components(folder).items()}
    return [
        name
        for name, stored in saved.items()
        if library.get(name) == "diffusers" and stored != dtype and _floating_dtypes_in(folder / name) == {stored}
    ]


def _floating_dtypes_in(component_folder: Path) -> set[torch.dtype]:
    found: set[torch.dtype] = set()
    for path in sorted(component_folder.glob("*.safetensors")):
        try:
            header = read_safetensors_header(path)
        except (OSError, SafetensorsHeaderError):
            return set()  # diffusers names the unreadable file when it loads it
        for name, entry in header.items():
            if name != "__metadata__" and isinstance(entry, dict):
                if entry.get("dtype") in SAFETENSORS_DTYPES:
                    found.add(SAFETENSORS_DTYPES[entry["dtype"]])
                elif str(entry.get("dtype", "")).startswith("F8"):
                    found.add(torch.float8_e4m3fn)  # a float8 checkpoint: not ours to cast
    return found


def target_dtype(name: str, tensor: torch.Tensor, dtype: torch.dtype, keep_in_fp32: tuple[str, ...]) -> torch.dtype:
    """The dtype diffusers' load gives a checkpoint tensor `name` when asked for `dtype`."""
    if not tensor.is_floating_point():
        return tensor.dtype
    if any(module in name.split(".") for module in keep_in_fp32):
        return torch.float32
    return dtype


def cast_from_files_(model: nn.Module, dtype: torch.dtype, *, what: str) -> int:
    """Cast `model` (loaded in its saved dtype) to `dtype` in place, as diffusers' load would have; returns the
    bytes read from files. On `CastReadError` the model is partly cast and must be dropped."""
    keep_in_fp32 = tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
    todo = _tensors_to_cast(model, dtype, keep_in_fp32)
    total = sum(t.nbytes for _, _, _, t, _ in todo)
    progress = StagingProgress(f"casting {what} to {str(dtype).removeprefix('torch.')}", total, len(todo), unit="tensors")
    files, reader = MappedFiles.snapshot(), FileReader()
    scratches = [torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.uint8)]
    from_files = 0
    pending = None  # (batch, its reads, the function that waits for them)
    try:
        # the next batch is read on the reader's threads while this one is cast: two scratch buffers in turn
        for i, batch in enumerate(itertools.chain(_batches(todo, files), [None])):
            started = _start_batch(batch, scratches, i % 2, reader) if batch is not None else None
            if pending is not None:
                from_files += _cast_batch(*pending, what=what, progress=progress)
            pending = started
    except BaseException:
        if pending is not None:
            with contextlib.suppress(Exception):
                pending[2]()  # never leave a read writing into a scratch buffer that is being freed
        raise
    finally:
        reader.close()
        files.close()
        progress.close(from_files)
    return from_files


def _start_batch(batch, scratches: list[torch.Tensor], which: int, reader: FileReader):
    batch_bytes = sum(t.nbytes for _, _, _, t, _, source in batch if source is not None)
    if scratches[which].numel() < batch_bytes:
        scratches[which] = torch.empty(batch_bytes, dtype=torch.uint8)
    scratch, reads, offset = scratches[which], [], 0
    for *_, tensor, _, source in batch:
        if source is not None:
            reads.append((scratch[offset : offset + tensor.nbytes], source))
            offset += tensor.nbytes
    return batch, reads, reader.start_reads_(reads)


def _cast_batch(batch, reads, wait, *, what: str, progress: StagingProgress) -> int:
    """Wait for the batch's reads, cast each tensor and rebind it; returns the bytes read from files."""
    try:
        wait()
    except OSError as e:
        raise CastReadError(f"cannot read a checkpoint file while casting {what}: {e}") from e
    raws = iter(raw for raw, _ in reads)
    from_files = 0
    for module, attr, is_param, tensor, target, source in batch:
        nbytes = tensor.nbytes  # as stored (the Parameter object takes the new dtype below)
        if source is None:  # built or changed in memory: cast it as diffusers would
            cast = tensor.to(target)
        else:
            cast = next(raws).view(tensor.dtype).view(tensor.shape).to(target, copy=True)
            from_files += nbytes
        with torch.no_grad():
            if is_param:
                module._parameters[attr].data = cast  # the Parameter object (and any tie to it) stays
            else:
                module._buffers[attr] = cast
        progress.advance(nbytes)
    return from_files


def _batches(todo, files: MappedFiles):
    """`todo` with each tensor's file range (None: not a view of a file), in about `BATCH_BYTES`."""
    batch, nbytes = [], 0
    for module, attr, is_param, tensor, target in todo:
        source = files.file_range(tensor.data_ptr(), tensor.nbytes) if tensor.is_contiguous() else None
        batch.append((module, attr, is_param, tensor, target, source))
        nbytes += tensor.nbytes
        if nbytes >= BATCH_BYTES:
            yield batch
            batch, nbytes = [], 0
    if batch:
        yield batch


def _tensors_to_cast(model: nn.Module, dtype: torch.dtype, keep_in_fp32: tuple[str, ...]):
    """(module, attribute, is_param, tensor, target) per tensor to cast, each once (tied stay tied)."""
    seen: set[int] = set()
    out = []
    for module_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{module_name}." if module_name else ""
        entries = [(n, t, True) for n, t in module._parameters.items()]
        entries += [(n, t, False) for n, t in module._buffers.items() if n not in module._non_persistent_buffers_set]
        for attr, tensor, is_param in entries:
            if tensor is None or id(tensor) in seen:
                continue
            seen.add(id(tensor))
            target = target_dtype(prefix + attr, tensor, dtype, keep_in_fp32)
            if target != tensor.dtype:
                out.append((module, attr, is_param, tensor, target))
    return out
