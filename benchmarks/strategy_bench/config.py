"""`BenchConfig`: the settings of one benchmark run, validated when built."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strategy_bench.strategies import DEFAULT_STRATEGIES
from strategy_bench.synthetic import MODEL_SHAPES
from layerstream.errors import LayerstreamError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HOST_MEMORY_HEADROOM = 0.85
"""Fraction of available host memory the weight copies may take before the run is refused up front."""


class BenchConfigError(LayerstreamError, ValueError):
    """A benchmark setting that cannot run; the message names the setting, the value and what is allowed."""


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """Everything one benchmark run needs. None means "the default for this model and device"."""

    model: str = "tiny"
    """A key of `MODEL_SHAPES`."""
    num_blocks: int | None = None
    num_tokens: int | None = None
    """Image/video tokens per sample."""
    num_context_tokens: int | None = None
    """Text tokens (cross-attention for Wan shapes, joint attention for Flux)."""
    batch_size: int = 1
    dtype: str | None = None
    """float32, bfloat16 or float16; default float32 on the CPU, bfloat16 on an accelerator."""
    device: str | None = None
    """Default: the current CUDA device, else the CPU."""
    strategies: str = ",".join(DEFAULT_STRATEGIES)
    repeats: int = 5
    """Timed forwards per strategy (one per round-robin repetition)."""
    warmup: int = 2
    """Untimed forwards per strategy right after its set-up."""
    prefetch_depth: int = 1
    """`layer_options.dit.prefetch_depth` of the layerwise strategies (unless a name says -depth-D)."""
    link_gbps: float | None = None
    """CPU only: simulated link bandwidth (GB/s) for the layerwise and naive strategies."""
    link_ratio: float | None = None
    """CPU only: choose the link so one block's transfer lasts this many times its measured compute."""
    device_budget_gb: float | None = None
    """Budget of layerwise-auto; default: room for the non-block modules, the slots and half the blocks."""
    threads: int | None = None
    """CPU only: torch intra-op threads (set for the whole process); default: all cores but one, which the copy
    thread gets."""
    seed: int = 0
    trace_dir: str | None = None
    """Write trace.json and timeline.png of one forward of a layerwise strategy here."""
    host_budget_gb: float | None = None
    """The layerwise rows run with the disk tier: `host_budget_gb` of host memory for streamed blocks, the other
    blocks read from spill files at every use (the synthetic model is built in memory)."""
    disk_gbps: float | None = None
    """CPU only, with `host_budget_gb`: every disk-tier read lasts as long as on a disk of this bandwidth (GB/s)."""

    def __post_init__(self) -> None:
        if self.model not in MODEL_SHAPES:
            raise BenchConfigError(f"--model {self.model!r} is not known; allowed: {', '.join(MODEL_SHAPES)}")
        for name in ("num_blocks", "num_tokens", "batch_size", "repeats", "threads"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise BenchConfigError(f"{_flag(name)} = {value!r} is not valid; expected an integer >= 1")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise BenchConfigError(f"--blocks = {self.num_blocks} is not valid; layer mode streams at least 2 blocks")
        if self.num_context_tokens is not None and self.num_context_tokens < 0:
            raise BenchConfigError(f"--context-tokens = {self.num_context_tokens!r} is not valid; expected an integer >= 0")
        if self.warmup < 0:
            raise BenchConfigError(f"--warmup = {self.warmup!r} is not valid; expected an integer >= 0")
        if not 1 <= self.prefetch_depth <= 8:
            raise BenchConfigError(f"--prefetch-depth = {self.prefetch_depth!r} is not valid; allowed: 1 to 8")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise BenchConfigError(f"--dtype {self.dtype!r} is not valid; allowed: {', '.join(DTYPES)}")
        if self.link_gbps is not None and self.link_ratio is not None:
            raise BenchConfigError("--link-gbps and --link-ratio both set the link; give one of them")
        _check_disk_tier(self)
        for name in ("link_gbps", "link_ratio", "device_budget_gb"):
            value = getattr(self, name)
            if value is not None and not (value > 0 or (name == "device_budget_gb" and value == 0)):
                raise BenchConfigError(f"{_flag(name)} = {value!r} is not valid; expected a number > 0")


def _check_disk_tier(config: BenchConfig) -> None:
    """--host-budget-gb and --disk-gbps: numbers > 0; a simulated disk needs blocks on disk to read."""
    for name in ("host_budget_gb", "disk_gbps"):
        value = getattr(config, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
            raise BenchConfigError(f"{_flag(name)} = {value!r} is not valid; expected a number > 0")
    if config.disk_gbps is not None and config.host_budget_gb is None:
        raise BenchConfigError(
            f"--disk-gbps = {config.disk_gbps!r} needs --host-budget-gb: without a host budget no block is read "
            "from disk"
        )


def _flag(field_name: str) -> str:
    return {"num_blocks": "--blocks", "num_tokens": "--tokens", "num_context_tokens": "--context-tokens"}.get(
        field_name, "--" + field_name.replace("_", "-")
    )
