"""The lossless form's stored fraction on a checkpoint's own weights, estimated from a sample of their bytes: what
`layerstream plan` prices a skeleton's lossless blocks at where the checkpoint's files can be read (a folder, a
downloaded snapshot). Each 16-bit tensor of the components sampled gives a few runs of its elements; their coded
bytes' histogram, scaled to the tensor, is planned as the form plans a tensor (`plan_code_from_counts`), so the
estimate follows the code's tiers and each tensor's own spread.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Collection
from pathlib import Path

import torch

from layerstream.models.saved_dtypes import SafetensorsHeaderError, loaded_safetensors, read_safetensors_header
from layerstream.runtime.packing.lossless_code import CodedFraction, count_coded, plan_code_from_counts

logger = logging.getLogger(__name__)

CODED_DTYPES = {"BF16": "bfloat16", "F16": "float16"}
"""Safetensors dtypes the lossless form codes."""
MIN_ELEMENTS = 2048
"""Smaller tensors stay raw in the lossless form (`runtime.forms.lossless.MIN_CODED_BYTES`, 4 KiB)."""
RUNS = 4
RUN_ELEMENTS = 1 << 14
"""Each tensor gives `RUNS` runs of this many elements, spread through it (128 KiB of a tensor at most)."""
MAX_TENSORS = 512
"""Tensors sampled at most, spread over the components' tensors in file order (64 MiB read at most)."""


def sample_coded_fraction(folder: Path, components: Collection[str], variant: str | None = None) -> CodedFraction | None:
    """The stored fraction of the 16-bit tensors of `components` (folders of the pipeline folder `folder`),
    estimated from a sample; None where none of their files can be read (then the planner keeps its estimate)."""
    tensors = [t for name in sorted(components) for t in _coded_tensors(folder / name, variant)]
    if not tensors:
        return None
    picked = tensors[:: max(1, -(-len(tensors) // MAX_TENSORS))]
    stored = total = read = 0
    for path, start, dtype, num_elements in picked:
        try:
            sample = _read_runs(path, start, num_elements)
        except OSError as e:  # a file that went away or is still downloading: sample the others
            logger.debug("lossless sample: cannot read %s: %s", path, e)
            continue
        counts = count_coded(sample, dtype)
        scaled = (counts.double() * (num_elements / sample.numel())).round().long()
        code = plan_code_from_counts(scaled, num_elements, dtype)
        stored += code.nbytes if code is not None else 2 * num_elements
        total += 2 * num_elements
        read += 2 * sample.numel()
    if total == 0:
        return None
    source = (
        f"sampled from the checkpoint's weights ({read / 2**20:.1f} MiB of {len(picked)} of the "
        f"{len(tensors)} 16-bit tensors of {', '.join(sorted(components))})"
    )
    return CodedFraction(stored / total, True, source)


def _coded_tensors(component: Path, variant: str | None) -> list[tuple[Path, int, str, int]]:
    """(file, byte offset of the tensor's data, coded dtype name, elements) of each tensor the lossless form
    codes in one component folder, read from the headers (unreadable files are left out)."""
    out = []
    for path in loaded_safetensors(component, variant) if component.is_dir() else []:
        try:
            header = read_safetensors_header(path)
            with open(path, "rb") as f:
                data_start = 8 + struct.unpack("<Q", f.read(8))[0]
            size = path.stat().st_size
        except (OSError, SafetensorsHeaderError) as e:
            logger.debug("lossless sample: cannot read the header of %s: %s", path, e)
            continue
        for name, entry in header.items():
            dtype = CODED_DTYPES.get(entry.get("dtype")) if isinstance(entry, dict) else None
            begin, end = (entry.get("data_offsets") or (0, 0)) if dtype else (0, 0)
            num_elements = (int(end) - int(begin)) // 2
            if dtype and num_elements >= MIN_ELEMENTS and data_start + int(end) <= size:
                out.append((path, data_start + int(begin), dtype, num_elements))
    return out


def _read_runs(path: Path, start: int, num_elements: int) -> torch.Tensor:
    """`RUNS` runs of `RUN_ELEMENTS` elements spread through the tensor (all of it where it is smaller): int16."""
    if num_elements <= RUNS * RUN_ELEMENTS:
        spans = [(0, num_elements)]
    else:
        step = (num_elements - RUN_ELEMENTS) // (RUNS - 1)
        spans = [(k * step, RUN_ELEMENTS) for k in range(RUNS)]
    parts = []
    with open(path, "rb") as f:
        for first, count in spans:
            f.seek(start + 2 * first)
            data = f.read(2 * count)
            if len(data) != 2 * count:
                raise OSError(f"{path}: {len(data)} of {2 * count} bytes at {start + 2 * first}")
            parts.append(torch.frombuffer(bytearray(data), dtype=torch.int16))
    return torch.cat(parts)
