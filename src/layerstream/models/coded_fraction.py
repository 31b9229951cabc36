"""The lossless form's stored fraction on a checkpoint's own weights, estimated from a sample of their bytes, for
`layerstream plan` (a Hub file's by ranged reads: `models.hub_sample`). Each tensor picked gives a few runs;
their histogram, scaled to the tensor, is planned as the form plans a tensor (`plan_code_from_counts`)."""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from layerstream.models.saved_dtypes import SafetensorsHeaderError, file_reader, loaded_safetensors, parse_safetensors_header
from layerstream.runtime.packing.lossless_code import CodedFraction, count_coded, plan_code_from_counts
from layerstream.wording import format_bytes

logger = logging.getLogger(__name__)

CODED_DTYPES = {"BF16": "bfloat16", "F16": "float16"}
MIN_ELEMENTS = 2048
"""Smaller tensors stay raw in the lossless form (`runtime.forms.lossless.MIN_CODED_BYTES`, 4 KiB)."""


@dataclass(frozen=True)
class SampleBudget:
    """How much of a component's weights a sample reads."""

    tensors_per_component: int
    """Tensors sampled at most in each component, spread over its tensors in file order."""
    runs: int
    run_elements: int
    """Each tensor gives `runs` runs of this many elements, spread through it (all of it where it is smaller)."""


LOCAL_SAMPLE = SampleBudget(256, 4, 1 << 14)
"""From files on this machine: 128 KiB of a tensor, 32 MiB of a component at most."""
HUB_SAMPLE = SampleBudget(64, 2, 1 << 14)
"""By ranged reads from the Hub, a request a run: 64 KiB of a tensor, 4 MiB of a component at most."""


class CodedTensor(NamedTuple):
    """A tensor the lossless form codes, where its bytes are in its file."""

    file: str
    """The file's path (a local file), or its name in the repository (a Hub file)."""
    start: int
    dtype: str
    num_elements: int


class SampleTally(NamedTuple):
    """What a sample priced: the bytes the code would store and the 16-bit bytes of the tensors sampled."""

    stored_bytes: int
    coded_bytes: int
    read_bytes: int
    num_sampled: int

    def which(self, per_component: list[list[CodedTensor]], components: Collection[str]) -> str:
        """Which tensors were sampled, in words: "k of the n 16-bit tensors of transformer, transformer_2"."""
        return f"{self.num_sampled} of the {sum(map(len, per_component))} 16-bit tensors of {', '.join(sorted(components))}"


def sample_coded_fraction(
    folder: Path, components: Collection[str], variant: str | None = None, budget: SampleBudget = LOCAL_SAMPLE
) -> CodedFraction | None:
    """The stored fraction of `components`' 16-bit tensors from a sample; None where none is readable."""
    per_component = [_coded_tensors(folder / name, variant) for name in sorted(components)]
    picked = picked_tensors(per_component, budget)
    tally = tally_samples((t, _read_runs(t, budget)) for t in picked)
    if tally.coded_bytes == 0:
        return None
    source = f"sampled from the checkpoint's weights ({format_bytes(tally.read_bytes)} of {tally.which(per_component, components)})"
    return CodedFraction(tally.stored_bytes / tally.coded_bytes, True, source)


def coded_entries(header: dict, data_start: int, file_size: int, file: str) -> list[CodedTensor]:
    """The header's tensors the lossless form codes: 16-bit, large enough, all their bytes in the file."""
    out = []
    for entry in header.values():
        dtype = CODED_DTYPES.get(entry.get("dtype")) if isinstance(entry, dict) else None
        begin, end = (entry.get("data_offsets") or (0, 0)) if dtype else (0, 0)
        num_elements = (int(end) - int(begin)) // 2
        if dtype and num_elements >= MIN_ELEMENTS and data_start + int(end) <= file_size:
            out.append(CodedTensor(file, data_start + int(begin), dtype, num_elements))
    return out


def picked_tensors(per_component: Iterable[list[CodedTensor]], budget: SampleBudget) -> list[CodedTensor]:
    """At most `budget.tensors_per_component` of each component's tensors, spread through them in file order."""
    limit = budget.tensors_per_component
    return [t for tensors in per_component for t in tensors[:: max(1, -(-len(tensors) // limit))]]


def run_spans(tensor: CodedTensor, budget: SampleBudget) -> list[tuple[int, int]]:
    """(offset, bytes) of each run the sample reads of `tensor`, spread through it (all of a small one)."""
    if tensor.num_elements <= budget.runs * budget.run_elements:
        return [(tensor.start, 2 * tensor.num_elements)]
    step = (tensor.num_elements - budget.run_elements) // max(1, budget.runs - 1)
    return [(tensor.start + 2 * k * step, 2 * budget.run_elements) for k in range(budget.runs)]


def tally_samples(samples: Iterable[tuple[CodedTensor, torch.Tensor | None]]) -> SampleTally:
    """Each tensor's sample (int16, None: unreadable, left out) priced as the form plans the whole tensor."""
    stored = coded = read = num_sampled = 0
    for tensor, sample in samples:
        if sample is None:
            continue
        n = tensor.num_elements
        scaled = (count_coded(sample, tensor.dtype).double() * (n / sample.numel())).round().long()
        code = plan_code_from_counts(scaled, n, tensor.dtype)
        stored += code.nbytes if code is not None else 2 * n
        coded += 2 * n
        read += 2 * sample.numel()
        num_sampled += 1
    return SampleTally(stored, coded, read, num_sampled)


def runs_tensor(runs: Iterable[bytes]) -> torch.Tensor:
    """The runs' bytes as one int16 tensor (the coded dtypes' bit patterns)."""
    return torch.cat([torch.frombuffer(bytearray(data), dtype=torch.int16) for data in runs])


def _coded_tensors(component: Path, variant: str | None) -> list[CodedTensor]:
    """The tensors the lossless form codes in one component folder (unreadable files left out)."""
    out = []
    for path in loaded_safetensors(component, variant) if component.is_dir() else []:
        try:
            with open(path, "rb") as f:
                header, data_start = parse_safetensors_header(file_reader(f), str(path))
            size = path.stat().st_size
        except (OSError, SafetensorsHeaderError) as e:
            logger.debug("lossless sample: cannot read the header of %s: %s", path, e)
            continue
        out += coded_entries(header, data_start, size, str(path))
    return out


def _read_runs(tensor: CodedTensor, budget: SampleBudget) -> torch.Tensor | None:
    """The runs of `tensor` from its local file; None where they cannot be read (the others are sampled)."""
    try:
        with open(tensor.file, "rb") as f:
            read_at = file_reader(f)
            runs = [read_at(offset, count) for offset, count in run_spans(tensor, budget)]
    except OSError as e:
        logger.debug("lossless sample: cannot read %s: %s", tensor.file, e)
        return None
    if any(len(data) != count for data, (_, count) in zip(runs, run_spans(tensor, budget))):
        logger.debug("lossless sample: %s is shorter than its header says", tensor.file)
        return None
    return runs_tensor(runs)
