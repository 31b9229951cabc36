"""`run_bench`: set every strategy up on its own copy of one model, then time them round robin.

The flow:
1. build the weights once (a `SyntheticDiT` on the CPU) and the inputs;
2. set `resident` up first, warm it up and time each block's compute (the ideal and `--link-ratio` need it);
3. choose the simulated link (CPU) or measure the real one (GPU);
4. set every other strategy up on its own copy of the weights, timing the enable (cold start) and sampling
   host memory while it runs;
5. time forwards round robin: every repetition gives each strategy one turn, so drift (thermal, other
   load) hits all of them alike. A turn runs two forwards back to back and times the second, which starts in
   the steady state of a denoising loop: the last block has just prefetched block 0, rather than block 0
   having arrived at leisure during other strategies' turns (see `timed_turn`; a row with blocks on disk runs
   one more untimed forward first, `disk_settle_forwards`);
6. optionally capture the trace of one forward of a layerwise strategy.
"""

from __future__ import annotations

import copy
import gc
import importlib.util
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from strategy_bench.config import BenchConfig, BenchConfigError
from strategy_bench.measure import (
    BlockTimings,
    DeviceMemory,
    PeakRssSampler,
    measure_block_compute,
    measure_link_gbps,
)
from strategy_bench.results import BenchResult, RunInfo, StrategyResult
from strategy_bench.run_setup import BenchRun, Log
from strategy_bench.strategies import (
    PreparedStrategy,
    StrategyContext,
    StrategySpec,
    TransferSnapshot,
    import_dependencies,
    parse_strategies,
    prepare_strategy,
)
from strategy_bench.synthetic import activation_bytes_estimate
from layerstream.timing import ideal
from layerstream.timing.block_timer import synchronize

@dataclass
class StrategyRow:
    """What the run collects for one strategy."""

    prepared: PreparedStrategy
    host_rss_peak_bytes: int = 0
    host_enable_delta_bytes: int = 0
    times_s: list[float] = field(default_factory=list)
    transfers: list[TransferSnapshot] = field(default_factory=list)
    device_peak_over_base: list[int] = field(default_factory=list)
    matches_resident: bool | None = None
    max_abs_diff: float | None = None
    block_transfers: dict[str, int] | None = None
    """Layerwise: transfers of each streamed block during the timed forwards."""



def run_bench(config: BenchConfig, log: Log = lambda message: None) -> BenchResult:
    """Run the benchmark `config` describes; `log` receives progress lines (for stderr)."""
    device = bench_device(config)
    run = BenchRun.size(config, device)
    num_blocks = run.num_blocks

    specs = _with_resident(parse_strategies_or_raise(config.strategies, num_blocks))
    check_disk_tier_rows(config, specs)
    notes: list[str] = []
    if "resident" not in [s.strip() for s in config.strategies.split(",")]:
        notes.append("resident was added: every ratio is against it")
    specs, skipped = _skip_unavailable(specs)
    notes += [f"{spec.name} skipped: {why}" for spec, why in skipped]

    run.build_(len(specs), log)
    prototype = run.prototype
    block_paths = [f"blocks.{i}" for i in range(num_blocks)]
    block_bytes = run.block_bytes
    forward = run.forward

    # --- resident first: the reference output, per-block compute and the link ----------------------------------
    rows: dict[str, StrategyRow] = {}
    remaining = list(specs)
    resident_spec = remaining.pop(0)
    ctx = StrategyContext(device=device, prefetch_depth=config.prefetch_depth)
    model = copy_for(prototype, last=not remaining)
    rows["resident"] = prepare_row(resident_spec, model, ctx, config.warmup, forward, log)
    resident = rows["resident"].prepared
    calibration = measure_block_compute(lambda: forward(resident), list(resident.model.blocks), device)
    block_compute_s = calibration.block_medians()
    reference = forward(resident)
    synchronize(device)

    link_gbps, measured_link_gbps = run.simulated_link_gbps(block_compute_s, log), None
    if device.type == "cuda":
        measured_link_gbps = measure_link_gbps(device, max(block_bytes))
        log(f"measured host-to-device link: {measured_link_gbps:.1f} GB/s (pinned)")

    budget_gb = config.device_budget_gb
    if budget_gb is None and any(s.resident_layers == "auto" for s in remaining):
        budget_gb = default_auto_budget_gb(run.weight_bytes, run.raw_block_bytes, run.placement.ring_nbytes)
        notes.append(f"layerwise-auto budget {budget_gb:.4g} GB: non-block modules + slots + half the blocks")

    traced_name = _traced_strategy(specs) if config.trace_dir else None
    rows.update(_prepare_others(remaining, prototype, config, device, link_gbps, budget_gb, traced_name, forward, log))
    del prototype
    gc.collect()

    _timed_rounds(rows, config.repeats, forward, device, reference, log)

    # time the blocks again after the timed loop: the ideal then rests on compute measured at both ends of the
    # run, not only at its start (the link, chosen before, keeps the first measurement)
    calibration += measure_block_compute(lambda: forward(resident), list(resident.model.blocks), device)
    resident_median = statistics.median(rows["resident"].times_s)
    block_compute_s = as_timed(calibration, resident_median)

    traced_row = rows.get(traced_name) if traced_name else None
    trace_files, trace_summary = _write_trace(config, traced_row, forward, device, notes, log)

    info = run.run_info(
        block_compute_seconds=block_compute_s,
        other_compute_seconds=calibration.other_median(),
        link_gbps=link_gbps,
        measured_link_gbps=measured_link_gbps,
        device_budget_gb=budget_gb,
        trace_files=trace_files,
        trace_summary=trace_summary,
        notes=notes,
    )
    activations = activation_bytes_estimate(run.shape, **run.sizes_kw, element_size=run.dtype.itemsize)
    results = [_result(row, info, resident_median, block_paths, activations) for row in rows.values()]
    results += [StrategyResult.for_skipped(spec.name, spec.kind, why) for spec, why in skipped]
    for row in rows.values():
        row.prepared.close()
        gc.collect()  # the closed model's tensors go before the next one is restored
    return BenchResult(run=info, strategies=results)


def _prepare_others(remaining, prototype, config: BenchConfig, device, link_gbps, budget_gb, traced_name, forward, log: Log) -> dict[str, StrategyRow]:
    """The rows of every strategy after resident, each on its own copy of the prototype (the last takes it)."""
    rows = {}
    for spec in remaining:
        ctx = StrategyContext(
            device=device,
            link_gbps=link_gbps,
            prefetch_depth=config.prefetch_depth,
            device_budget_gb=budget_gb,
            trace=spec.name == traced_name,
            host_budget_gb=config.host_budget_gb,
            disk_gbps=config.disk_gbps,
        )
        model = copy_for(prototype, last=spec is remaining[-1])
        rows[spec.name] = prepare_row(spec, model, ctx, config.warmup, forward, log)
    return rows


def _timed_rounds(rows: dict[str, StrategyRow], repeats: int, forward, device, reference, log: Log) -> None:
    """The timed forwards, round robin over the strategies: times, transfers, device peaks, whether each matches
    the resident output, and each streamed block's transfers during them."""
    memory = DeviceMemory(device)
    transfers_before = {name: row.prepared.block_transfer_counts() for name, row in rows.items()}
    for rep in range(repeats):
        for row in rows.values():
            settle = disk_settle_forwards(row.prepared)
            seconds, transfers, peak_over_base, out = timed_turn(row.prepared, forward, device, memory, settle)
            row.times_s.append(seconds)
            if transfers is not None:
                row.transfers.append(transfers)
            if peak_over_base is not None:
                row.device_peak_over_base.append(peak_over_base)
            if row.matches_resident is None:
                row.matches_resident = bool(torch.equal(out, reference))
                row.max_abs_diff = float((out.float() - reference.float()).abs().max()) if out.numel() else 0.0
        log(f"repetition {rep + 1}/{repeats} done")
    for name, row in rows.items():
        before, after = transfers_before[name], row.prepared.block_transfer_counts()
        if before is not None and after is not None:
            row.block_transfers = {p: n - before.get(p, 0) for p, n in after.items()}


def as_timed(calibration: BlockTimings, resident_median: float) -> list[float]:
    """Per-block compute as it runs in the timed loop: the calibrated blocks' shares, scaled so that with the time
    outside the blocks they add up to the resident's median timed forward.

    The calibration forwards run back to back on warm caches; the timed ones run after other strategies have
    evicted them (a few percent slower on a CPU). Unscaled, the ideal would sit below what resident achieves.
    """
    medians = calibration.block_medians()
    total = sum(medians)
    if total <= 0:
        return medians
    scale = max(resident_median - calibration.other_median(), 0.0) / total
    return [m * scale for m in medians]


def timed_turn(prepared: PreparedStrategy, forward, device: torch.device, memory: DeviceMemory, num_settle: int = 1):
    """One strategy's turn: `num_settle` forwards (one, or more for the disk tier) and one more, timed, back to back.

    The first forward puts the strategy in the steady state of a denoising loop: its last block prefetches
    block 0 while the forward ends, so the timed forward pays whatever of that copy is not hidden, as every
    step of a real loop does. On a GPU the host must not synchronize between them (that would let the copy
    finish for free), so the timed forward is bounded by events on the compute stream.
    Returns (seconds, transfers per forward, device peak bytes above the starting allocation, output).
    """
    before = prepared.counters()
    base = memory.allocated()
    memory.reset_peak()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(num_settle):
            forward(prepared)
        start.record()
        out = forward(prepared)
        end.record()
        end.synchronize()  # the elapsed time is readable once the timed forward's last kernel has run
        seconds = start.elapsed_time(end) / 1e3
    else:
        for _ in range(num_settle):
            forward(prepared)
        begin = time.perf_counter()
        out = forward(prepared)
        seconds = time.perf_counter() - begin
    peak = memory.peak()
    after = prepared.counters()
    transfers = (after - before).per_forward(num_settle + 1) if before is not None and after is not None else None
    peak_over_base = peak - base if peak is not None and base is not None else None
    return seconds, transfers, peak_over_base, out


def parse_strategies_or_raise(text: str, num_blocks: int) -> tuple[StrategySpec, ...]:
    from strategy_bench.strategies import StrategyError

    try:
        return parse_strategies(text, num_blocks=num_blocks)
    except StrategyError as e:
        raise BenchConfigError(f"--strategies: {e}") from e


def default_auto_budget_gb(model_bytes: int, block_bytes: list[int], ring_nbytes: int) -> float:
    """A budget that lets layerwise-auto keep about half the blocks: the non-block modules, the slot ring (as
    the placement sizes it) and half the blocks (`block_bytes`: each block's own bytes, as resident)."""
    non_block = model_bytes - sum(block_bytes)
    keep = len(block_bytes) // 2
    return (non_block + ring_nbytes + keep * max(block_bytes)) / 1e9


def bench_device(config: BenchConfig) -> torch.device:
    """The device `config` names (cuda:N with its index), or the default one; a bad name is a `BenchConfigError`."""
    if config.device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(config.device)
    except RuntimeError as e:
        raise BenchConfigError(f"--device {config.device!r} is not a device: {e}") from e
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise BenchConfigError(f"--device {config.device!r}: CUDA is not available in this torch ({torch.__version__})")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    elif device.type != "cpu":
        raise BenchConfigError(f"--device {config.device!r} is not supported; use cpu or cuda[:N]")
    return device


def _with_resident(specs: tuple[StrategySpec, ...]) -> list[StrategySpec]:
    resident = [s for s in specs if s.kind == "resident"] or [StrategySpec("resident", "resident")]
    return resident + [s for s in specs if s.kind != "resident"]


def _skip_unavailable(specs: list[StrategySpec]) -> tuple[list[StrategySpec], list[tuple[StrategySpec, str]]]:
    kept, skipped = [], []
    for spec in specs:
        if spec.kind == "diffusers-group" and importlib.util.find_spec("diffusers") is None:
            skipped.append((spec, "diffusers is not installed"))
        else:
            kept.append(spec)
    return kept, skipped


def copy_for(prototype, *, last: bool):
    """Each strategy owns its weights; the last one takes the prototype itself (one copy less at peak)."""
    return prototype if last else copy.deepcopy(prototype)


def prepare_row(spec: StrategySpec, model, ctx: StrategyContext, warmup: int, forward, log: Log) -> StrategyRow:
    log(f"setting up {spec.name}")
    import_dependencies(spec)  # outside the sampler: imported modules are not the strategy's host memory
    with PeakRssSampler() as enable_rss:
        prepared = prepare_strategy(spec, model, ctx)
    with PeakRssSampler() as warm_rss:
        for _ in range(warmup):
            forward(prepared)
        synchronize(ctx.device)
    return StrategyRow(
        prepared,
        host_rss_peak_bytes=max(enable_rss.peak_bytes, warm_rss.peak_bytes),
        host_enable_delta_bytes=enable_rss.peak_bytes - enable_rss.start_bytes,
    )


def _traced_strategy(specs: list[StrategySpec]) -> str | None:
    """The strategy whose forward is traced: plain layerwise if selected, else the first layerwise one."""
    layerwise = [s.name for s in specs if s.kind == "layerwise"]
    if "layerwise" in layerwise:
        return "layerwise"
    return layerwise[0] if layerwise else None


def _write_trace(
    config: BenchConfig, row: StrategyRow | None, forward, device, notes: list[str], log: Log
) -> tuple[list[str], dict | None]:
    """Capture one forward of the traced strategy and export it; returns the files and the trace's summary."""
    if config.trace_dir is None:
        return [], None
    if row is None:
        notes.append("--trace: no layerwise strategy selected, so no trace was written")
        return [], None
    from strategy_bench.capture import capture_forward_trace
    from layerstream.runtime.reporting.trace_export import summarize_trace, write_chrome_trace, write_timeline_png

    prepared = row.prepared
    forward(prepared)  # settle, as the timed forwards do
    trace = capture_forward_trace(prepared.handle, lambda: forward(prepared), device)
    folder = Path(config.trace_dir)
    files = [str(write_chrome_trace(trace, folder / "trace.json"))]
    title = f"{prepared.name}: {config.model}, {len(trace.lane('compute'))} streamed blocks"
    if prepared.link_gbps is not None:
        title += f", simulated link {prepared.link_gbps:.3g} GB/s"
    try:
        files.append(str(write_timeline_png(trace, folder / "timeline.png", title=title)))
    except ModuleNotFoundError as e:
        notes.append(f"timeline.png not written: {e}")
    if device.type == "cuda":
        notes.append(f"trace: {prepared.name} recorded CUDA timing events in every forward (a few microseconds per block)")
    log(f"trace of {prepared.name} written to {folder}")
    return files, {"strategy": prepared.name, **summarize_trace(trace)}


def _result(row: StrategyRow, info: RunInfo, resident_median: float, block_paths: list[str], activations: int) -> StrategyResult:
    p = row.prepared
    median = statistics.median(row.times_s)
    n = len(row.transfers)
    per_forward = (
        TransferSnapshot(
            sum(t.bytes_transferred for t in row.transfers) // n,
            sum(t.num_transfers for t in row.transfers) // n,
            sum(t.stall_seconds for t in row.transfers) / n,
            sum(t.num_sync_loads for t in row.transfers) // n,
            sum(t.disk_bytes_read for t in row.transfers) // n,
            sum(t.disk_stall_seconds for t in row.transfers) / n,
        )
        if n
        else None
    )

    if row.device_peak_over_base and p.device_setup_bytes is not None:
        device_peak, source = p.device_setup_bytes + max(row.device_peak_over_base), "cuda allocator"
    else:
        accounted = p.accounted_device_bytes()
        device_peak = accounted + activations if accounted is not None else None
        source = "runtime accounting + activation estimate" if accounted is not None else "n/a"

    # the ideal needs the link each block crossed: the simulated one on the CPU, the measured one on a GPU
    link = p.link_gbps if info.device == "cpu" else info.measured_link_gbps
    flags = p.streamed_flags(block_paths, row.block_transfers)
    ideal_s = floor_s = None
    disk_s = _block_disk_seconds(p, block_paths)
    disk = _disk_figures(p, per_forward, disk_s, median)
    if link is not None and flags is not None:
        transfer_s = ideal.block_transfer_seconds(_link_block_bytes(p, info.block_bytes, flags), flags, link)
        ideal_s = ideal.ideal_forward_seconds(info.block_compute_seconds, transfer_s, info.other_compute_seconds)
        floor_s = ideal.transfer_floor_seconds(transfer_s) or None
        if disk:  # a third stage, whose bandwidth is known only where it is simulated
            ideal_s = (
                ideal.ideal_forward_seconds_with_disk(info.block_compute_seconds, transfer_s, disk_s, info.other_compute_seconds)
                if disk_s is not None
                else None
            )

    return StrategyResult(
        strategy=p.name,
        kind=p.spec.kind,
        meaningful=p.meaningful,
        note=p.note,
        median_seconds=median,
        min_seconds=min(row.times_s),
        times_seconds=row.times_s,
        ratio_to_resident=median / resident_median if resident_median > 0 else None,
        enable_seconds=p.enable_seconds,
        device_peak_bytes=device_peak,
        device_peak_source=source,
        host_rss_peak_bytes=row.host_rss_peak_bytes,
        host_enable_delta_bytes=row.host_enable_delta_bytes,
        bytes_streamed_per_forward=per_forward.bytes_transferred if per_forward else None,
        transfers_per_forward=per_forward.num_transfers if per_forward else None,
        stall_seconds_per_forward=per_forward.stall_seconds if per_forward and p.stall_measured() else None,
        sync_loads_per_forward=per_forward.num_sync_loads if per_forward else None,
        link_gbps=link if flags is not None else None,
        ideal_seconds=ideal_s,
        measured_over_ideal=median / ideal_s if ideal_s else None,
        transfer_floor_seconds=floor_s,
        measured_over_floor=median / floor_s if floor_s else None,
        matches_resident=row.matches_resident,
        max_abs_diff=row.max_abs_diff,
        residency=p.residency(),
        **disk,
    )


# --- the disk tier (--host-budget-gb, --disk-gbps) -----------------------------------------------------------


def check_disk_tier_rows(config: BenchConfig, specs) -> None:
    """--host-budget-gb applies to the layerwise rows; refuse up front what the runtime would refuse later."""
    if config.host_budget_gb is None:
        return
    layerwise = [s for s in specs if s.kind == "layerwise"]
    if not layerwise:
        raise BenchConfigError(
            f"--host-budget-gb = {config.host_budget_gb!r} applies to layerwise rows, and --strategies names none"
        )


def disk_settle_forwards(p: PreparedStrategy) -> int:
    """Forwards a turn runs before the timed one: one, and two for a row with blocks on disk. Between turns the
    disk reads ahead at leisure (two blocks), so where the disk sets the pace the first forward of a turn runs
    partly on reads done before it and leaves the disk ahead of the next; the second consumes that lead."""
    return 2 if p.spec.kind == "layerwise" and p.disk_block_paths() else 1


def _disk_figures(p: PreparedStrategy, per_forward: TransferSnapshot | None, disk_s: list[float] | None, median: float) -> dict:
    """The disk columns of a layerwise row with the disk tier (empty for every other row); `disk_s`: each block's
    read time (`_block_disk_seconds`)."""
    on_disk = p.disk_block_paths() if p.spec.kind == "layerwise" else ()
    if not on_disk:
        return {}
    figures = {
        "num_disk_blocks": len(on_disk),
        "disk_bytes_per_forward": per_forward.disk_bytes_read if per_forward else None,
        "disk_stall_seconds_per_forward": per_forward.disk_stall_seconds if per_forward else None,
    }
    if disk_s is not None:
        floor = ideal.transfer_floor_seconds(disk_s)
        figures |= {"disk_gbps": p.disk_gbps, "disk_floor_seconds": floor, "measured_over_disk_floor": median / floor if floor else None}
    return figures


def _block_disk_seconds(p: PreparedStrategy, block_paths: list[str]) -> list[float] | None:
    """Per block, its read time from the simulated disk (0 for blocks in host memory); None where the disk's
    bandwidth is not known (a real disk, on a GPU run) or the row has no disk tier."""
    if p.disk_gbps is None or p.handle is None:
        return None
    on_disk = set(p.disk_block_paths())
    packed = {b.path: b.host.layout.nbytes for b in p.handle.streamer.blocks}  # one read: the packed bytes
    return ideal.block_transfer_seconds([packed.get(path, 0) for path in block_paths], [path in on_disk for path in block_paths], p.disk_gbps)


def _link_block_bytes(p: PreparedStrategy, block_bytes: list[int], streamed: list[bool]) -> list[int]:
    """The bytes each block moves over the link: its own bytes, or for a low-precision row (`-fp8`) its bytes
    scaled by the store's stored / full ratio (the ideal and floor of an fp8 row are its own, not bf16's)."""
    if p.spec.storage_dtype is None or p.handle is None:
        return block_bytes
    full = sum(b for b, s in zip(block_bytes, streamed) if s)
    if not full:
        return block_bytes
    ratio = p.handle.stats().host_bytes / full
    return [round(b * ratio) for b in block_bytes]
