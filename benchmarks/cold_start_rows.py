"""One row of the cold-start benchmark (`cold_start.py`), measured in the process that runs this script (a fresh
one per row).

    python benchmarks/cold_start_rows.py '{"row": "layerstream", "folder": "...", "device": "cpu"}'

imports what the row needs, drops the folder's files from the page cache, then times the row's load from the
files to weights ready in host (or device) memory while a thread samples anonymous and file-backed RSS. It
prints one JSON line. Imports are not timed: they are the same for every loader.

Rows:
- `raw-readinto`: one thread, one `readinto` per file into one preallocated buffer (the plain read), then the
  same read again with the files cached (to show the drop worked);
- `raw-preadv-N`: layerstream's `FileReader` (large `preadv` calls on N threads) into the same buffer;
- `mmap-copy`: the files mapped by safetensors (`load_file`, lazy views, as diffusers holds them) copied tensor
  by tensor into one packed buffer: what layerstream's host store did before it read the files itself;
- `fastsafetensors`: fastsafetensors' file loader (no GDS: `pread` into bounce buffers), all files at once;
- `diffusers`, `diffusers-float32`: `DiffusionPipeline.from_pretrained` in the dtypes the files store (or
  diffusers' default float32), then `.to(device)`. On a CPU diffusers leaves same-dtype weights as lazy views
  of the files; the time includes faulting every page in (what the first forward would pay);
- `diffusers-group`: the same, then `apply_group_offloading` (block level, one block per group, a stream on
  CUDA) on each transformer; other components go to the device;
- `layerstream`: `Omni(model=folder, diffusion_offload_config={"mode": "layer", "components": ["dit"]})`;
- `layerstream-float32`: the same with `dtype="float32"` (the peer of `diffusers-float32`): the bf16
  transformers are cast while read from the files (`models/cast_on_load.py`).
"""

from __future__ import annotations

import itertools
import json
import logging
import mmap
import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

# the modules beside this script, found also when a test or `cold_start.py` imports it
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoint_folders import checkpoint_files  # noqa: E402
from page_cache import cached_fraction, drop_page_cache  # noqa: E402

DIFFUSERS_ROWS = ("diffusers", "diffusers-float32", "diffusers-group", "layerstream", "layerstream-float32")
"""Rows that import diffusers (a few seconds, untimed)."""


@dataclass(kw_only=True)
class Outcome:
    """What a row reports besides its time and memory."""

    host_bytes: int | None = None
    """Bytes of weights held in host memory when the row is done (pinned or not)."""
    load_seconds: float | None = None
    """diffusers on a CPU: `from_pretrained` alone, before the lazy weights are faulted in."""
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    keep: Any = field(default=None, repr=False)
    """What the row loaded, kept alive until memory has been read."""


@dataclass(frozen=True, kw_only=True)
class RowResult:
    row: str
    seconds: float
    checkpoint_bytes: int
    host_bytes: int | None
    load_seconds: float | None
    peak_anon_bytes: int
    """Highest RssAnon seen while loading, above the process's RssAnon just before (after imports)."""
    peak_file_bytes: int
    """The same for RssFile (pages of mapped files: the checkpoint's, where a loader maps it)."""
    peak_rss_bytes: int
    """VmHWM at the end above VmRSS before: the exact peak of the total."""
    cached_fraction_before: float | None
    """Fraction of the checkpoint's pages in the page cache when the timer started (0.0: cold)."""
    drop_ok: bool
    warm_seconds: float | None = None
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


class _StatusSampler:
    """Samples RssAnon and RssFile from /proc/self/status on a thread; keeps the highest of each."""

    def __init__(self, interval_s: float = 0.005):
        self.interval_s = interval_s
        self.peak = _status()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="layerstream-bench-status", daemon=True)

    def __enter__(self) -> _StatusSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def _sample(self) -> None:
        now = _status()
        self.peak = {key: max(value, self.peak.get(key, 0)) for key, value in now.items()}


def _status() -> dict[str, int]:
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("RssAnon", "RssFile", "VmRSS", "VmHWM"):
                    out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


# --- raw reads ------------------------------------------------------------------------------------------------


def _raw_readinto(folder: Path, files: list[Path], device: torch.device) -> Outcome:
    buffer = torch.empty(sum(p.stat().st_size for p in files), dtype=torch.uint8)
    _readinto(files, buffer)
    return Outcome(host_bytes=buffer.numel(), keep=buffer)


def _readinto(files: list[Path], buffer: torch.Tensor) -> None:
    view = memoryview(buffer.numpy())
    offset = 0
    for path in files:
        end = offset + path.stat().st_size
        with open(path, "rb", buffering=0) as f:
            while offset < end:
                n = f.readinto(view[offset:end])
                if not n:
                    raise OSError(f"{path}: ended early")
                offset += n


def _raw_preadv(num_threads: int) -> Callable[[Path, list[Path], torch.device], Outcome]:
    def read(folder: Path, files: list[Path], device: torch.device) -> Outcome:
        from layerstream.runtime.packing.file_reads import FileRange, FileReader

        buffer = torch.empty(sum(p.stat().st_size for p in files), dtype=torch.uint8)
        reader = FileReader(num_threads=num_threads)
        offset = 0
        try:
            for path in files:
                size = path.stat().st_size
                reader.read_into_(buffer[offset : offset + size], FileRange(str(path), 0, size))
                offset += size
        finally:
            reader.close()
        return Outcome(host_bytes=buffer.numel(), keep=buffer)

    return read


def _mmap_copy(folder: Path, files: list[Path], device: torch.device) -> Outcome:
    from safetensors.torch import load_file

    views = [load_file(str(path)) for path in files]  # lazy views of private mappings, as diffusers holds them
    total = sum(t.numel() * t.element_size() for state in views for t in state.values())
    packed = torch.empty(total, dtype=torch.uint8)
    offset = 0
    for state in views:
        for tensor in state.values():
            nbytes = tensor.numel() * tensor.element_size()
            packed[offset : offset + nbytes].copy_(tensor.reshape(-1).view(torch.uint8))  # faults the pages in
            offset += nbytes
    return Outcome(host_bytes=total, keep=(packed, views))


def _fastsafetensors(folder: Path, files: list[Path], device: torch.device) -> Outcome:
    try:
        from fastsafetensors import SafeTensorsFileLoader
    except ModuleNotFoundError as e:
        raise _RowSkipped(f"fastsafetensors is not installed ({e})") from e
    # one loader per component folder: fastsafetensors wants tensor names unique among the files it loads
    by_folder: dict[Path, list[Path]] = {}
    for path in files:
        by_folder.setdefault(path.parent, []).append(path)
    loaded, nbytes = [], 0
    for paths in by_folder.values():
        loader = SafeTensorsFileLoader(None, str(device), nogds=True)  # nogds: pread into bounce buffers, no cuFile
        loader.add_filenames({0: [str(p) for p in paths]})
        buffers = loader.copy_files_to_device()
        tensors = {key: buffers.get_tensor(key) for key in loader.get_keys()}
        nbytes += sum(t.numel() * t.element_size() for t in tensors.values())
        loaded.append((loader, buffers, tensors))
    return Outcome(host_bytes=nbytes if device.type == "cpu" else None, keep=loaded, note="GDS off (nogds=True)")


# --- pipelines ------------------------------------------------------------------------------------------------


def _modules(pipe) -> list[torch.nn.Module]:
    return [value for value in pipe.components.values() if isinstance(value, torch.nn.Module)]


def _host_storages(modules: list[torch.nn.Module]) -> list[torch.UntypedStorage]:
    """The distinct host storages behind the modules' parameters and buffers."""
    seen: dict[int, torch.UntypedStorage] = {}
    for tensor in itertools.chain.from_iterable(itertools.chain(m.parameters(), m.buffers()) for m in modules):
        if tensor.device.type == "cpu" and tensor.untyped_storage().nbytes() > 0:
            seen.setdefault(tensor.untyped_storage().data_ptr(), tensor.untyped_storage())
    return list(seen.values())


def _host_storage_bytes(modules: list[torch.nn.Module]) -> int:
    return sum(storage.nbytes() for storage in _host_storages(modules))


def _fault_in_host_tensors_(modules: list[torch.nn.Module]) -> int:
    """Read one byte of every page of every host tensor's storage (lazy views of the files fault in, as a first
    forward would make them). Returns the bytes of the distinct host storages."""
    nbytes = 0
    for storage in _host_storages(modules):
        whole = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
        whole[:: mmap.PAGESIZE].sum()
        nbytes += storage.nbytes()
    return nbytes


def _pinned_host_bytes(device: torch.device) -> int:
    """Page-locked bytes held by torch's caching host allocator (where `pin_memory()` copies live)."""
    if device.type != "cuda":
        return 0
    try:
        return int(torch.cuda.host_memory_stats().get("active_bytes.current", 0))
    except (AttributeError, RuntimeError):
        return 0


def _from_pretrained(folder: Path, *, saved_dtype: bool):
    from diffusers import DiffusionPipeline

    from layerstream.models.saved_dtypes import saved_dtypes

    kwargs: dict[str, Any] = {"local_files_only": True}
    if saved_dtype:
        kwargs["dtype"] = saved_dtypes(folder)
    return DiffusionPipeline.from_pretrained(folder, **kwargs)


def _diffusers(saved_dtype: bool, group_offload: bool) -> Callable[[Path, torch.device], Outcome]:
    def load(folder: Path, files: list[Path], device: torch.device) -> Outcome:
        start = time.perf_counter()
        pipe = _from_pretrained(folder, saved_dtype=saved_dtype)
        note = ""
        if group_offload:
            from diffusers.hooks import apply_group_offloading

            for name, module in pipe.components.items():
                if not isinstance(module, torch.nn.Module):
                    continue
                if name.startswith("transformer"):
                    apply_group_offloading(
                        module, onload_device=device, offload_device=torch.device("cpu"), offload_type="block_level",
                        num_blocks_per_group=1, use_stream=device.type == "cuda",
                    )  # fmt: skip
                else:
                    module.to(device)
            if device.type == "cpu":
                note = "CPU: onload and offload device are both the CPU, a baseline only"
        else:
            pipe.to(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # timing boundary: the copies to the device count
        load_seconds = time.perf_counter() - start
        if device.type == "cpu":
            host_bytes = _fault_in_host_tensors_(_modules(pipe))
            how = "weights lazy" if saved_dtype else "upcast in memory"
            note = "; ".join(filter(None, [note, f"from_pretrained alone {load_seconds:.2f} s ({how})"]))
        else:  # what stays on the host (group offload: the weights' own storages, plus their pinned copies)
            host_bytes = _host_storage_bytes(_modules(pipe)) + _pinned_host_bytes(device)
        return Outcome(host_bytes=host_bytes, load_seconds=load_seconds, note=note, keep=pipe)

    return load


class _StagingLog(logging.Handler):
    """Collects the host store's one summary line per staged component (bytes and seconds of staging)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.nbytes = 0.0
        self.seconds = 0.0
        self.cast_seconds = 0.0

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.args, tuple) and len(record.args) == 7:  # what, count, unit, GB, s, GB/s, GB from files
            if str(record.args[0]).startswith("casting"):
                self.cast_seconds += record.args[4]
            else:
                self.nbytes += record.args[3] * 1e9
                self.seconds += record.args[4]


def _layerstream(dtype: str | None) -> Callable[[Path, list[Path], torch.device], Outcome]:
    def row(folder: Path, files: list[Path], device: torch.device) -> Outcome:
        from layerstream import Omni

        staging = _StagingLog()
        progress_logger = logging.getLogger("layerstream.runtime.reporting.progress")
        progress_logger.addHandler(staging)
        level = progress_logger.level
        progress_logger.setLevel(logging.INFO)
        try:
            omni = Omni(model=str(folder), dtype=dtype, device=device,
                        diffusion_offload_config={"mode": "layer", "components": ["dit"]})  # fmt: skip
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # timing boundary: resident components' copies count
        finally:
            progress_logger.removeHandler(staging)
            progress_logger.setLevel(level)
        stats = omni.stats()
        notes = []
        if staging.cast_seconds > 0:
            notes.append(f"cast on load {staging.cast_seconds:.2f} s")
        if staging.seconds > 0:
            rate = staging.nbytes / staging.seconds / 1e9
            notes.append(f"of which staging streamed blocks {staging.seconds:.2f} s ({rate:.2f} GB/s)")
        extra = {"host_bytes_from_files": stats.host_bytes_from_files, "staging_seconds": staging.seconds,
                 "staging_bytes": int(staging.nbytes), "cast_seconds": staging.cast_seconds}  # fmt: skip
        return Outcome(host_bytes=stats.host_bytes, extra=extra, note="; ".join(notes), keep=omni)

    return row


class _RowSkipped(Exception):
    """The row cannot run here (a library is missing); reported as a note, not as a failure."""


_PREADV = re.compile(r"raw-preadv-(\d+)$")
_ROWS: dict[str, Callable[[Path, list[Path], torch.device], Outcome]] = {
    "raw-readinto": _raw_readinto,
    "mmap-copy": _mmap_copy,
    "fastsafetensors": _fastsafetensors,
    "diffusers": _diffusers(saved_dtype=True, group_offload=False),
    "diffusers-float32": _diffusers(saved_dtype=False, group_offload=False),
    "diffusers-group": _diffusers(saved_dtype=True, group_offload=True),
    "layerstream": _layerstream(None),
    "layerstream-float32": _layerstream("float32"),
}


def is_known_row(name: str) -> bool:
    match = _PREADV.match(name)
    return name in _ROWS or (match is not None and 1 <= int(match.group(1)) <= 64)


def _row_function(name: str) -> Callable[[Path, list[Path], torch.device], Outcome]:
    match = _PREADV.match(name)
    return _raw_preadv(int(match.group(1))) if match else _ROWS[name]


def _import_pipeline_classes(folder: Path) -> None:
    """Import the classes the folder's model_index.json names (diffusers imports them lazily, on first use)."""
    import importlib

    import diffusers

    index = json.loads((folder / "model_index.json").read_text())
    getattr(diffusers, index["_class_name"])
    for value in index.values():
        if isinstance(value, list) and len(value) == 2 and all(isinstance(v, str) for v in value):
            getattr(importlib.import_module(value[0]), value[1], None)
    import layerstream.offload  # noqa: F401


def measure_row(name: str, folder: Path, device: torch.device) -> RowResult | str:
    """Measure one row in this process; a str is the reason the row was skipped."""
    if name in DIFFUSERS_ROWS:
        _import_pipeline_classes(folder)  # before the timer: every loader pays imports alike
    files = checkpoint_files(folder)
    checkpoint_bytes = sum(p.stat().st_size for p in files)
    run = _row_function(name)
    drop_ok = drop_page_cache(files)
    before_cached = cached_fraction(files)
    before = _status()
    try:
        with _StatusSampler() as sampler:
            start = time.perf_counter()
            outcome = run(folder, files, device)
            seconds = time.perf_counter() - start
    except _RowSkipped as e:
        return str(e)
    end = _status()
    warm_seconds = None
    if name == "raw-readinto":  # the same read with the files now cached: how a failed drop would look
        start = time.perf_counter()
        _readinto(files, outcome.keep)
        warm_seconds = time.perf_counter() - start
    return RowResult(
        row=name, seconds=seconds, checkpoint_bytes=checkpoint_bytes, host_bytes=outcome.host_bytes,
        load_seconds=outcome.load_seconds,
        peak_anon_bytes=max(0, sampler.peak.get("RssAnon", 0) - before.get("RssAnon", 0)),
        peak_file_bytes=max(0, sampler.peak.get("RssFile", 0) - before.get("RssFile", 0)),
        peak_rss_bytes=max(0, end.get("VmHWM", 0) - before.get("VmRSS", 0)),
        cached_fraction_before=before_cached, drop_ok=drop_ok, warm_seconds=warm_seconds, note=outcome.note,
        extra=outcome.extra,
    )  # fmt: skip


def main(argv: list[str]) -> int:
    request = json.loads(argv[1])
    result = measure_row(request["row"], Path(request["folder"]), torch.device(request["device"]))
    payload = {"skipped": result} if isinstance(result, str) else asdict(result)
    print(json.dumps(payload), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
