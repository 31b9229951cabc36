"""The strategies a benchmark compares, and how each is set up on its own copy of the model.

Names (`--strategies`):
- `resident`: the whole model on the device; every ratio is against it.
- `layerwise`: `enable_offload` in layer mode, every block streamed.
- `layerwise-resident-N`: layer mode with the first N blocks kept on the device (`resident_layers` N).
- `layerwise-auto`: layer mode with `resident_layers` "auto" under `device_budget_gb`.
  Any layerwise name may end in `-depth-D` to override `--prefetch-depth` for that row.
- `module`: `enable_offload` in module mode (the whole model moves on and off around each forward).
- `diffusers-group`: diffusers' `apply_group_offloading`, block level, one block per group, with a stream where
  the device has streams.
- `layerwise-fp8` (any layerwise name may end in `-fp8`): layer mode with `storage_dtype` "float8_e4m3fn".
- `diffusers-group-fp8`: diffusers' layerwise casting (float8_e4m3fn storage) under its group offloading, the
  peer of `layerwise-fp8`. Both are lossy: the `max |diff|` column says how far the output moves.
- `naive`: synchronous load-then-compute per block (see `naive.py`).
"""

from __future__ import annotations

import importlib
import re
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from strategy_bench.measure import DeviceMemory, tensor_bytes
from strategy_bench.naive import NaiveBlockLoader
from layerstream.errors import LayerstreamError
from layerstream.timing.block_timer import synchronize

KINDS = ("resident", "layerwise", "module", "diffusers-group", "naive")
DEFAULT_STRATEGIES = (
    "resident",
    "layerwise",
    "layerwise-resident-1",
    "layerwise-auto",
    "module",
    "diffusers-group",
    "naive",
)
_LAYERWISE = re.compile(
    r"^layerwise(?:-resident-(?P<resident>\d+)|-(?P<auto>auto))?(?:-depth-(?P<depth>\d+))?(?P<fp8>-fp8)?(?P<compiled>-compiled)?$"
)
COMPILED_SUFFIX = "-compiled"
"""`resident-compiled`, `layerwise...-compiled`: every block compiled (regional compilation) after set-up."""
FP8_STORAGE = "float8_e4m3fn"
"""The storage dtype of the `-fp8` rows."""


class StrategyError(LayerstreamError, ValueError):
    """A strategy name or combination that cannot run; the message names it and what is allowed."""


@dataclass(frozen=True)
class StrategySpec:
    """One parsed `--strategies` entry."""

    name: str
    """As the user wrote it (the row's label)."""
    kind: str
    """One of `KINDS`."""
    resident_layers: int | str = 0
    """Layerwise only: an int, or "auto"."""
    prefetch_depth: int | None = None
    """Layerwise only: overrides the run's prefetch depth."""
    weight_transfer: str = "rank-local"
    """Layerwise only: `layer_options.dit.weight_transfer`; "allgather" is run by benchmarks/distributed.py (ranks)."""
    storage_dtype: str | None = None
    """Layerwise: `layer_options.dit.storage_dtype`; diffusers-group: the storage dtype of its layerwise casting."""
    compiled: bool = False
    """Resident and layerwise: compile each block with `torch.compile` after set-up (regional compilation, as
    diffusers' `compile_repeated_blocks`); the warm-up forwards pay the compilation."""


def parse_strategies(text: str, *, num_blocks: int) -> tuple[StrategySpec, ...]:
    """Parse a comma-separated strategy list; `StrategyError` names the first entry that is not valid."""
    specs: list[StrategySpec] = []
    for raw in text.split(","):
        name = raw.strip()
        if not name:
            continue
        spec = _parse_one(name, num_blocks)
        if any(s.name == name for s in specs):
            raise StrategyError(f"strategy {name!r} is listed twice")
        specs.append(spec)
    if not specs:
        raise StrategyError(f"--strategies {text!r} names no strategy; allowed: {allowed_names()}")
    return tuple(specs)


def allowed_names() -> str:
    return (
        "resident, resident-compiled, layerwise, layerwise-resident-N, layerwise-auto (layerwise ones may end in "
        "-depth-D, then -fp8, then -compiled), module, diffusers-group, diffusers-group-fp8, naive"
    )


def _parse_one(name: str, num_blocks: int) -> StrategySpec:
    if name in ("resident", "module", "diffusers-group", "naive"):
        return StrategySpec(name, name)
    if name == "resident" + COMPILED_SUFFIX:
        return StrategySpec(name, "resident", compiled=True)
    if name == "diffusers-group-fp8":
        return StrategySpec(name, "diffusers-group", storage_dtype=FP8_STORAGE)
    match = _LAYERWISE.match(name)
    if match is None:
        raise StrategyError(f"unknown strategy {name!r}; allowed: {allowed_names()}")
    depth = int(match["depth"]) if match["depth"] else None
    if depth is not None and not 1 <= depth <= 8:
        raise StrategyError(f"strategy {name!r}: prefetch depth {depth} is not valid; allowed: 1 to 8")
    resident: int | str = 0
    if match["auto"]:
        resident = "auto"
    elif match["resident"]:
        resident = int(match["resident"])
        # layer mode needs at least two streamed blocks: one computing, one arriving
        if resident > num_blocks - 2:
            raise StrategyError(
                f"strategy {name!r}: {resident} resident blocks of {num_blocks} leave fewer than 2 to stream; "
                f"allowed: 0 to {max(num_blocks - 2, 0)}"
            )
    return StrategySpec(
        name, "layerwise", resident, depth, storage_dtype=FP8_STORAGE if match["fp8"] else None, compiled=bool(match["compiled"])
    )


@dataclass(frozen=True, kw_only=True)
class StrategyContext:
    """What every strategy's set-up needs from the run."""

    device: torch.device
    link_gbps: float | None = None
    """Simulated link (CPU only) for the strategies that stream per block."""
    prefetch_depth: int = 1
    device_budget_gb: float | None = None
    """For layerwise-auto."""
    trace: bool = False
    """Record accelerator timing events (the strategy whose trace is exported)."""
    host_budget_gb: float | None = None
    """Layerwise rows: run with the disk tier under this host budget."""
    disk_gbps: float | None = None
    """Simulated disk (CPU only) of the disk tier."""


@dataclass(frozen=True)
class TransferSnapshot:
    """Cumulative transfer counters of one strategy; subtract two to get one forward's."""

    bytes_transferred: int
    num_transfers: int
    stall_seconds: float
    num_sync_loads: int
    disk_bytes_read: int = 0
    disk_stall_seconds: float = 0.0

    def __sub__(self, other: "TransferSnapshot") -> "TransferSnapshot":
        return TransferSnapshot(
            self.bytes_transferred - other.bytes_transferred,
            self.num_transfers - other.num_transfers,
            self.stall_seconds - other.stall_seconds,
            self.num_sync_loads - other.num_sync_loads,
            self.disk_bytes_read - other.disk_bytes_read,
            self.disk_stall_seconds - other.disk_stall_seconds,
        )

    def per_forward(self, num_forwards: int) -> "TransferSnapshot":
        """These counters spread evenly over `num_forwards` forwards."""
        return TransferSnapshot(
            self.bytes_transferred // num_forwards,
            self.num_transfers // num_forwards,
            self.stall_seconds / num_forwards,
            self.num_sync_loads // num_forwards,
            self.disk_bytes_read // num_forwards,
            self.disk_stall_seconds / num_forwards,
        )


class PreparedStrategy:
    """A strategy set up on its own model: what the harness runs, times and asks for counters."""

    def __init__(self, spec: StrategySpec, model: nn.Module, *, meaningful: bool = True, note: str = ""):
        self.spec = spec
        self.model = model
        self.meaningful = meaningful
        self.note = note
        self.enable_seconds = 0.0
        self.link_gbps: float | None = None
        self.disk_gbps: float | None = None
        """The simulated disk of a row with the disk tier (CPU)."""
        self.device_setup_bytes: int | None = None
        """Device bytes the set-up allocated (read from the CUDA allocator)."""
        self.handle = None  # OffloadHandle for the layerstream strategies
        self.naive: NaiveBlockLoader | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    def counters(self) -> TransferSnapshot | None:
        """Transfer counters so far, or None where the strategy does not report them."""
        if self.handle is not None:
            s = self.handle.stats()
            return TransferSnapshot(
                s.bytes_transferred, s.num_transfers, s.stall_seconds, s.num_sync_loads, s.disk_bytes_read, s.disk_stall_seconds
            )
        if self.naive is not None:
            c = self.naive.counters
            return TransferSnapshot(c.bytes_transferred, c.num_transfers, c.stall_seconds, 0)
        return None

    def stall_measured(self) -> bool:
        """Whether `counters().stall_seconds` is a measurement (the accelerator engine waits on the GPU, unseen)."""
        if self.naive is not None:
            return True
        return self.handle is not None and self.handle.stats().engine == "cpu-thread"

    def accounted_device_bytes(self) -> int | None:
        """Device bytes by the strategy's own accounting (weights, slots), without activations."""
        if self.handle is not None:
            return self.handle.stats().device_bytes
        if self.spec.kind == "resident":
            return tensor_bytes(self.model)
        if self.naive is not None:
            non_block = tensor_bytes(self.model)  # evicted blocks hold empty placeholders and count 0
            return non_block + self.naive.max_block_bytes
        return None

    def block_transfer_counts(self) -> dict[str, int] | None:
        """Transfers so far per streamed block path (layerwise strategies only)."""
        if self.handle is None or self.spec.kind != "layerwise":
            return None
        return self.handle.block_transfers()

    def streamed_flags(self, block_paths: list[str], transfers_during_run: dict[str, int] | None) -> list[bool] | None:
        """Per block, whether it crossed the link during the timed forwards; None where blocks do not stream one
        by one. A layerwise block that streams but never needs a copy (the streamed blocks fit in the slot ring
        and stay there) counts as resident, as it is."""
        if self.spec.kind == "layerwise":
            return [transfers_during_run.get(p, 0) > 0 for p in block_paths] if transfers_during_run is not None else None
        if self.spec.kind in ("naive", "diffusers-group"):
            return [True] * len(block_paths)
        return None

    def disk_block_paths(self) -> tuple[str, ...]:
        """The blocks a layerwise row with the disk tier reads from disk (empty without it)."""
        placement = self.handle.placement if self.handle is not None else None
        tier = placement.host_tier if placement is not None else None
        return tier.disk_block_paths if tier is not None else ()

    def residency(self) -> str | None:
        if self.handle is None:
            return None
        described = self.handle.stats().residency
        return "; ".join(described.values()) or None

    def close(self) -> None:
        """Undo the strategy (stopping its copy thread) and drop its model, device memory included.

        Undoing puts the weights back on the device; dropping them at once keeps the run's device peak at one
        restored model at a time while the strategies are closed one after another.
        """
        if self.handle is not None and self.handle.enabled:
            self.handle.disable()
        if self.naive is not None:
            self.naive.disable()
        self.handle = self.naive = self.model = None


def import_dependencies(spec: StrategySpec) -> None:
    """Import what setting `spec` up needs, so that neither its timing nor its host memory counts imports."""
    importlib.import_module(_IMPORTS.get(spec.kind, "torch"))


def prepare_strategy(spec: StrategySpec, model: nn.Module, ctx: StrategyContext) -> PreparedStrategy:
    """Set `spec` up on `model` (a CPU copy of the weights this strategy owns) and time the set-up."""
    import_dependencies(spec)  # a cold start times the set-up, not imports
    memory = DeviceMemory(ctx.device)
    before = memory.allocated()
    start = time.perf_counter()
    prepared = _SETUP[spec.kind](spec, model, ctx)
    if spec.compiled:
        compile_blocks_(model)
    synchronize(ctx.device)  # an enable that queued copies is not done before they are
    prepared.enable_seconds = time.perf_counter() - start
    after = memory.allocated()
    if before is not None and after is not None:
        prepared.device_setup_bytes = after - before
    return prepared


def compile_blocks_(model: nn.Module) -> None:
    """Regional compilation: each block's forward compiled in place (one graph for all the blocks, which share
    code and shapes). layerstream's block entry is compile-safe: the binding runs outside the graph."""
    for block in model.blocks:
        block.compile()


def _resident(spec: StrategySpec, model: nn.Module, ctx: StrategyContext) -> PreparedStrategy:
    model.to(ctx.device)
    return PreparedStrategy(spec, model)


def layer_config(spec: StrategySpec, ctx: StrategyContext) -> dict[str, Any]:
    """The `diffusion_offload_config` of a layerwise strategy."""
    options: dict[str, Any] = {"prefetch_depth": spec.prefetch_depth or ctx.prefetch_depth}
    if spec.resident_layers == "auto":
        options["resident_layers"] = "auto"
        if ctx.device_budget_gb is not None:
            options["device_budget_gb"] = ctx.device_budget_gb
    elif spec.resident_layers:
        options["resident_layers"] = spec.resident_layers
    if spec.weight_transfer != "rank-local":
        options["weight_transfer"] = spec.weight_transfer
    if spec.storage_dtype is not None:
        options["storage_dtype"] = spec.storage_dtype
    return {"mode": "layer", "components": ["dit"], "layer_options": {"dit": options}}


def _layerwise(spec: StrategySpec, model: nn.Module, ctx: StrategyContext) -> PreparedStrategy:
    from layerstream.offload import enable_offload

    prepared = PreparedStrategy(spec, model)
    config = with_disk_tier(layer_config(spec, ctx), ctx)
    prepared.handle = enable_offload(
        model, config, ctx.device, simulated_link_gbps=ctx.link_gbps, simulated_disk_gbps=ctx.disk_gbps, trace=ctx.trace
    )
    prepared.link_gbps = ctx.link_gbps
    prepared.disk_gbps = ctx.disk_gbps if ctx.host_budget_gb is not None else None
    return prepared


def with_disk_tier(config: dict[str, Any], ctx: StrategyContext) -> dict[str, Any]:
    """A layerwise config with the disk tier of the run (`--host-budget-gb`): the blocks beyond the budget are
    spilled once to files under the default `disk_dir` and read from them at every use."""
    if ctx.host_budget_gb is None:
        return config
    return {**config, "host_budget_gb": ctx.host_budget_gb}


def _module(spec: StrategySpec, model: nn.Module, ctx: StrategyContext) -> PreparedStrategy:
    from layerstream.offload import enable_offload

    on_cpu = ctx.device.type == "cpu"
    prepared = PreparedStrategy(
        spec,
        model,
        meaningful=not on_cpu,
        note="not meaningful on CPU: nothing moves, and the simulated link does not apply to module mode" if on_cpu else "",
    )
    prepared.handle = enable_offload(model, {"mode": "module", "components": ["dit"]}, ctx.device)
    return prepared


def _diffusers_group(spec: StrategySpec, model: nn.Module, ctx: StrategyContext) -> PreparedStrategy:
    try:
        from diffusers.hooks import apply_group_offloading
    except ModuleNotFoundError as e:
        raise StrategyError(f"strategy 'diffusers-group' needs diffusers, which is not installed ({e})") from e
    if spec.storage_dtype is not None:
        from diffusers.hooks import apply_layerwise_casting

        compute_dtype = next(model.parameters()).dtype
        # the same rule layerwise-fp8 follows (diffusers' default skip patterns), cast before the groups form
        apply_layerwise_casting(model, getattr(torch, spec.storage_dtype), compute_dtype, skip_modules_pattern="auto")
    has_streams = ctx.device.type == "cuda"
    apply_group_offloading(
        model,
        onload_device=ctx.device,
        offload_device=torch.device("cpu"),
        offload_type="block_level",
        num_blocks_per_group=1,
        use_stream=has_streams,
    )
    on_cpu = ctx.device.type == "cpu"
    note = "not meaningful on CPU: onload and offload device are both the CPU (a no-op baseline)" if on_cpu else ""
    return PreparedStrategy(spec, model, meaningful=not on_cpu, note=note)


def _naive(spec: StrategySpec, model: nn.Module, ctx: StrategyContext) -> PreparedStrategy:
    blocks = model.blocks
    for name, child in model.named_children():
        if child is not blocks:
            child.to(ctx.device)
    prepared = PreparedStrategy(spec, model)
    prepared.naive = NaiveBlockLoader(list(blocks), ctx.device, link_gbps=ctx.link_gbps)
    prepared.naive.enable_()
    prepared.link_gbps = ctx.link_gbps
    return prepared


_IMPORTS = {
    "layerwise": "layerstream.offload",
    "module": "layerstream.runtime.modes.module_mode",
    "diffusers-group": "diffusers.hooks",
}
_SETUP = {
    "resident": _resident,
    "layerwise": _layerwise,
    "module": _module,
    "diffusers-group": _diffusers_group,
    "naive": _naive,
}
