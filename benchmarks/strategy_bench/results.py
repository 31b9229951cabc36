"""What a benchmark run produces: the run's facts and one row per strategy, as plain data (JSON-ready)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

SCHEMA = "layerstream.bench/1"


@dataclass(frozen=True, kw_only=True)
class RunInfo:
    """The model, sizes, device and link one run measured with."""

    model: str
    dim: int
    num_heads: int
    ffn_dim: int
    num_blocks: int
    num_tokens: int
    num_context_tokens: int
    batch_size: int
    dtype: str
    device: str
    device_name: str
    torch_version: str
    threads: int
    repeats: int
    warmup: int
    prefetch_depth: int
    model_bytes: int
    block_bytes: list[int]
    """Bytes one transfer of each block moves."""
    block_compute_seconds: list[float]
    """Compute of each block: medians measured on the resident model (hooks on its blocks, separate forwards
    before and after the timed loop), scaled so that with `other_compute_seconds` they add up to the resident's
    median timed forward."""
    other_compute_seconds: float
    """Median time of a resident forward outside its blocks, from the same forwards."""
    link_gbps: float | None
    """The simulated link (CPU), if any."""
    link_ratio: float | None
    measured_link_gbps: float | None
    """GPU: host-to-device bandwidth of one pinned block-sized copy."""
    device_budget_gb: float | None
    process_rss_bytes: int
    host_budget_gb: float | None = None
    """The layerwise rows' host budget (`--host-budget-gb`): the blocks beyond it are read from disk."""
    disk_gbps: float | None = None
    """The simulated disk (CPU, `--disk-gbps`), if any."""
    trace_files: list[str] = field(default_factory=list)
    trace_summary: dict | None = None
    """Of the traced forward: strategy, copies, computes, busy times and stalls (see `summarize_trace`)."""
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class StrategyResult:
    """One strategy's measurements. None: not measured, or not meaningful for this strategy."""

    strategy: str
    kind: str
    meaningful: bool = True
    """False where the comparison says nothing on this device (offload from the CPU to the CPU)."""
    note: str = ""
    skipped: bool = False
    median_seconds: float | None = None
    """Median time of one forward, in the back-to-back steady state."""
    min_seconds: float | None = None
    """Fastest timed forward: on a shared machine, the figure least disturbed by other load."""
    times_seconds: list[float] = field(default_factory=list)
    ratio_to_resident: float | None = None
    enable_seconds: float | None = None
    """Cold start: set-up time (enable_offload, apply_group_offloading, .to(device) ...)."""
    device_peak_bytes: int | None = None
    device_peak_source: str = "n/a"
    """"cuda allocator" (set-up bytes + peak over the timed forwards), or the runtime's own accounting plus an
    activation estimate where there is no allocator to read (the CPU)."""
    host_rss_peak_bytes: int | None = None
    """Process RSS peak sampled while this strategy was set up and warmed up (process-wide: it includes every
    strategy set up before it)."""
    host_enable_delta_bytes: int | None = None
    """RSS peak during this strategy's set-up minus RSS right before it: the host memory enabling it costs."""
    bytes_streamed_per_forward: int | None = None
    transfers_per_forward: int | None = None
    stall_seconds_per_forward: float | None = None
    """Time compute waited for weights (CPU engine and naive only: on a GPU the wait happens on the device)."""
    sync_loads_per_forward: int | None = None
    link_gbps: float | None = None
    """The link the ideal and floor were computed with."""
    ideal_seconds: float | None = None
    measured_over_ideal: float | None = None
    transfer_floor_seconds: float | None = None
    measured_over_floor: float | None = None
    matches_resident: bool | None = None
    """Whether the first timed output equals the resident output bit for bit."""
    max_abs_diff: float | None = None
    """The largest absolute difference of the first timed output from the resident output (0 where equal)."""
    residency: str | None = None
    # the disk tier (--host-budget-gb); None for rows without it
    num_disk_blocks: int | None = None
    """Blocks the host budget left on disk."""
    disk_bytes_per_forward: int | None = None
    """Bytes read from disk per forward (`stats().disk_bytes_read`)."""
    disk_stall_seconds_per_forward: float | None = None
    """Of the stall, the time compute waited on disk reads (`stats().disk_stall_seconds`)."""
    disk_gbps: float | None = None
    """The disk bandwidth the ideal and the disk floor were computed with (the simulated disk)."""
    disk_floor_seconds: float | None = None
    """The disk's busy time for one forward: the disk blocks' bytes over the disk bandwidth."""
    measured_over_disk_floor: float | None = None

    @classmethod
    def for_skipped(cls, strategy: str, kind: str, why: str) -> "StrategyResult":
        """The row of a strategy that could not run here (diffusers missing, say)."""
        return cls(strategy=strategy, kind=kind, meaningful=False, note=f"skipped: {why}", skipped=True)


@dataclass(frozen=True)
class BenchResult:
    run: RunInfo
    strategies: list[StrategyResult]

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "run": asdict(self.run), "strategies": [asdict(s) for s in self.strategies]}

    def row(self, strategy: str) -> StrategyResult:
        for s in self.strategies:
            if s.strategy == strategy:
                return s
        raise KeyError(strategy)
