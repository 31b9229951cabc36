"""`BenchRun`: the sizes, weights and inputs of one benchmark run, shared by `run_bench` and
benchmarks/distributed.py (`world_size` ranks, each building its own copies).

Sizing (`BenchRun.size`) checks the config and fixes threads, dtype and sizes without building anything;
`build_` then refuses up front a run whose weight copies cannot fit in host memory, builds the weights once
and makes the inputs; `run_info` turns what the run measured into its `RunInfo`.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from strategy_bench.config import DTYPES, HOST_MEMORY_HEADROOM, BenchConfig, BenchConfigError
from strategy_bench.measure import available_host_bytes, rss_bytes
from strategy_bench.results import RunInfo
from strategy_bench.synthetic import MODEL_SHAPES, ModelShape, build_synthetic_dit, default_sizes, make_inputs, model_bytes
from layerstream.timing import ideal

Log = Callable[[str], None]


@dataclass
class BenchRun:
    config: BenchConfig
    device: torch.device
    shape: ModelShape
    num_blocks: int
    num_tokens: int
    num_context: int
    dtype_name: str
    threads: int
    world_size: int = 1
    prototype: Any = None
    """The weights every strategy copies (`build_`); the last strategy takes it itself."""
    block_bytes: list[int] = field(default_factory=list)
    """Slot bytes of each block as the runtime packs it (aligned tensor spans): what one transfer moves."""
    raw_block_bytes: list[int] = field(default_factory=list)
    """Bytes of each block's own tensors, as they sit on the device when resident."""
    placement: Any = None
    """The runtime's placement of the prototype with every block streamed (`plan.placement.Placement`)."""
    inputs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def size(cls, config: BenchConfig, device: torch.device, world_size: int = 1) -> BenchRun:
        """Check the config against the device and fix sizes, dtype and compute threads; builds nothing."""
        shape = MODEL_SHAPES[config.model]
        sizes = default_sizes(shape, device.type)
        if device.type != "cpu" and (config.link_gbps is not None or config.link_ratio is not None):
            raise BenchConfigError(f"--link-gbps and --link-ratio simulate a link on the CPU; device {device} has a real one")
        if device.type != "cpu" and config.disk_gbps is not None:
            raise BenchConfigError(
                f"--disk-gbps = {config.disk_gbps!r} simulates a disk on the CPU; on device {device} the disk tier "
                "reads the real disk (give --host-budget-gb alone)"
            )
        return cls(
            config=config,
            device=device,
            shape=shape,
            num_blocks=config.num_blocks or sizes.num_blocks,
            num_tokens=config.num_tokens or sizes.num_tokens,
            num_context=sizes.num_context_tokens if config.num_context_tokens is None else config.num_context_tokens,
            dtype_name=config.dtype or ("float32" if device.type == "cpu" else "bfloat16"),
            threads=_set_threads(config, device, world_size),
            world_size=world_size,
        )

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.dtype_name]

    @property
    def weight_bytes(self) -> int:
        return model_bytes(self.shape, self.num_blocks, self.dtype)

    @property
    def sizes_kw(self) -> dict[str, int]:
        return {"num_tokens": self.num_tokens, "num_context_tokens": self.num_context, "batch_size": self.config.batch_size}

    def build_(self, num_strategies: int, log: Log) -> None:
        """Build the weights (the same seed everywhere: allgather ranks need identical weights) and the inputs."""
        _check_host_memory(self.weight_bytes, num_strategies * self.world_size)  # a run that cannot fit never starts
        log(f"building {self.shape.name}-shaped weights: {self.num_blocks} blocks, dim {self.shape.dim}, {self.dtype_name}")
        init_device = self.device if self.device.type == "cuda" else torch.device("cpu")
        self.prototype = build_synthetic_dit(self.shape, self.num_blocks, dtype=self.dtype, seed=self.config.seed, init_device=init_device)
        self.placement = layerwise_placement(self.prototype, self.device, self.config.prefetch_depth)
        self.block_bytes = [self.placement.block_slot_nbytes[p] for p in self.placement.streamed_block_paths]
        self.raw_block_bytes = [sum(t.numel() * t.element_size() for t in block.parameters()) for block in self.prototype.blocks]
        self.inputs = make_inputs(self.shape, **self.sizes_kw, dtype=self.dtype, device=self.device)

    def forward(self, prepared):
        with torch.inference_mode():
            return prepared.model(**self.inputs)

    def simulated_link_gbps(self, block_compute_s: list[float], log: Log) -> float | None:
        """--link-gbps, or the link that makes one block's transfer --link-ratio times its compute."""
        if self.config.link_ratio is None:
            return self.config.link_gbps
        gbps = ideal.link_gbps_for_ratio(
            int(statistics.median(self.block_bytes)), statistics.median(block_compute_s), self.config.link_ratio
        )
        log(f"link ratio {self.config.link_ratio:g}: simulated link {gbps:.3f} GB/s")
        return gbps

    def run_info(self, **measured) -> RunInfo:
        """The run's facts plus what it measured (block compute, link, budget, trace, notes)."""
        shape, config = self.shape, self.config
        return RunInfo(
            model=shape.name,
            dim=shape.dim,
            num_heads=shape.num_heads,
            ffn_dim=shape.ffn_dim,
            num_blocks=self.num_blocks,
            num_tokens=self.num_tokens,
            num_context_tokens=self.num_context,
            batch_size=config.batch_size,
            dtype=self.dtype_name,
            device=str(self.device),
            device_name=device_name(self.device),
            torch_version=torch.__version__,
            threads=self.threads,
            repeats=config.repeats,
            warmup=config.warmup,
            prefetch_depth=config.prefetch_depth,
            model_bytes=self.weight_bytes,
            block_bytes=self.block_bytes,
            link_ratio=config.link_ratio,
            host_budget_gb=config.host_budget_gb,
            disk_gbps=config.disk_gbps,
            process_rss_bytes=rss_bytes(),
            **measured,
        )


def layerwise_placement(model, device: torch.device, prefetch_depth: int):
    """The runtime's own placement of the model with every block streamed: the slot bytes of each block (as
    the store packs it: aligned tensor spans) and the slot ring."""
    from layerstream.offload import plan_placement
    from layerstream.plan.resolver import resolve_offload_plan

    config = {"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"prefetch_depth": prefetch_depth}}}
    return plan_placement(model, resolve_offload_plan(model, config), device)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return platform.processor() or platform.machine() or "cpu"


def _set_threads(config: BenchConfig, device: torch.device, world_size: int) -> int:
    if device.type != "cpu":
        return torch.get_num_threads()
    # each rank gets its share of the cores, less one for its copy thread, as a GPU's copy engine runs beside
    # its compute
    threads = config.threads or max(1, (os.cpu_count() or 2) // world_size - 1)
    torch.set_num_threads(threads)
    return threads


def _check_host_memory(weight_bytes: int, num_copies: int) -> None:
    """Refuse up front a run whose weight copies (one per strategy, in every rank) cannot fit in host memory."""
    available = available_host_bytes()
    needed = weight_bytes * num_copies
    if available is not None and needed > HOST_MEMORY_HEADROOM * available:
        raise BenchConfigError(
            f"{num_copies} copies (strategies x ranks) of {weight_bytes / 1e9:.2f} GB of weights need "
            f"{needed / 1e9:.1f} GB of host memory, but {available / 1e9:.1f} GB is available; lower --blocks, "
            "--strategies (or the ranks), or use --dtype bfloat16"
        )
