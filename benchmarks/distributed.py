"""Rank-local layerwise against `weight_transfer: "allgather"`, in N data-parallel ranks on this machine.

    python benchmarks/distributed.py --nproc 2 --smoke --device cpu     # seconds: the tiny stack, 2 ranks
    python benchmarks/distributed.py --nproc 2 --model small --link-ratio 2 --repeats 10

The synthetic stack and its flags are benchmarks/strategies.py's (`add_stack_arguments`). `--nproc N` starts N ranks
with torchrun, each running this script without `--nproc`; each runs `run_distributed_bench`:
1. join the group (`init_distributed`: gloo on the CPU, NCCL plus gloo on CUDA) and build the synthetic model
   from the same seed, so that every rank holds identical weights, as data-parallel ranks loading the same
   files do;
2. set up `resident` (the reference output and the block compute `--link-ratio` needs, taken from rank 0 so
   every rank simulates the same link), `layerwise` (rank-local: every rank keeps a full host copy of every
   block) and `layerwise-allgather` (each rank keeps 1/N of every block and the block is all-gathered into
   the device slot), each on its own copy of the weights, through the harness's own set-up;
3. time forwards round robin as the harness does (two forwards back to back, the second timed), with a
   barrier before every turn so that every rank runs the turn at the same time, as data-parallel ranks do;
4. gather every rank's rows on rank 0, which returns the result; the other ranks return None.

Host bytes and link bytes are the runtime's own accounting: `handle.stats().host_bytes`, and
`bytes_transferred`, which counts the bytes over this rank's host link only (under allgather the other
ranks' shards arrive through the gather and are not counted).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from strategy_bench.report import MIB, run_header
from strategy_bench.results import BenchResult, RunInfo

# torch, and what imports it, is imported where it is used: a command line that argparse refuses is answered
# without the seconds torch's import takes
if TYPE_CHECKING:
    import torch

    from strategy_bench.config import BenchConfig
    from strategy_bench.harness import StrategyRow
    from strategy_bench.run_setup import Log
    from strategy_bench.strategies import StrategySpec

SCHEMA = "layerstream.bench.distributed/1"


def rank_strategies() -> tuple[StrategySpec, ...]:
    """What every rank runs, in this order (the set-up and the closing of allgather are collectives)."""
    from strategy_bench.strategies import StrategySpec

    return (
        StrategySpec("resident", "resident"),
        StrategySpec("layerwise", "layerwise"),
        StrategySpec("layerwise-allgather", "layerwise", weight_transfer="allgather"),
    )


@dataclass(frozen=True, kw_only=True)
class RankRow:
    """One strategy's measurements on one rank."""

    rank: int
    strategy: str
    weight_transfer: str | None
    """"rank-local" or "allgather"; None for resident."""
    host_bytes: int | None
    """Host bytes this rank keeps for its streamed blocks (`stats().host_bytes`); None for resident."""
    link_bytes_per_forward: int | None
    """Bytes over this rank's own host link per forward (`stats().bytes_transferred`)."""
    transfers_per_forward: int | None
    stall_seconds_per_forward: float | None
    """Time compute waited for a block (measured by the CPU copy engine; on a GPU the wait is on the device)."""
    median_seconds: float
    """Median timed forward, in the back-to-back steady state."""
    min_seconds: float
    times_seconds: list[float] = field(default_factory=list)
    ratio_to_resident: float | None = None
    """Against this rank's resident median."""
    enable_seconds: float
    host_enable_delta_bytes: int
    """RSS peak during this strategy's set-up minus RSS right before it (this rank's process)."""
    accounted_device_bytes: int | None
    """Device bytes by the strategy's own accounting (weights and slots, no activations)."""
    matches_resident: bool | None
    """Whether the first timed output equals this rank's resident output bit for bit."""


@dataclass(frozen=True, kw_only=True)
class RankRatios:
    """allgather / rank-local on one rank."""

    rank: int
    host_bytes: float | None
    link_bytes_per_forward: float | None
    median_seconds: float
    min_seconds: float


@dataclass(frozen=True)
class DistributedBenchResult:
    run: RunInfo
    """The run's facts, as rank 0 measured them (block compute and link are rank 0's on every rank)."""
    world_size: int
    backend: str
    rows: list[RankRow]
    """Every rank's rows, in rank order, each rank's in `rank_strategies()` order."""

    def row(self, rank: int, strategy: str) -> RankRow:
        for r in self.rows:
            if r.rank == rank and r.strategy == strategy:
                return r
        raise KeyError((rank, strategy))

    def ratios(self) -> list[RankRatios]:
        out = []
        for rank in range(self.world_size):
            local, gathered = self.row(rank, "layerwise"), self.row(rank, "layerwise-allgather")
            out.append(
                RankRatios(
                    rank=rank,
                    host_bytes=_ratio(gathered.host_bytes, local.host_bytes),
                    link_bytes_per_forward=_ratio(gathered.link_bytes_per_forward, local.link_bytes_per_forward),
                    median_seconds=gathered.median_seconds / local.median_seconds,
                    min_seconds=gathered.min_seconds / local.min_seconds,
                )
            )
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "world_size": self.world_size,
            "backend": self.backend,
            "run": asdict(self.run),
            "rows": [asdict(r) for r in self.rows],
            "ratios": [asdict(r) for r in self.ratios()],
        }


def _ratio(a: int | None, b: int | None) -> float | None:
    return a / b if a is not None and b else None


def run_distributed_bench(config: BenchConfig, log: Log = lambda message: None) -> DistributedBenchResult | None:
    """Run the comparison in this rank; a collective: every rank of the group calls it with the same `config`.

    Under torchrun (WORLD_SIZE > 1) the rank joins the default group unless it already has, and leaves it at
    the end if it joined. Without one, the process is a group of one and allgather copies plainly. Returns the
    result on rank 0, None on the other ranks."""
    import torch.distributed as dist

    from strategy_bench.harness import bench_device
    from layerstream.distributed.launch import gather_objects, rank_info
    from layerstream.distributed.process_group import destroy_distributed, init_distributed

    device = bench_device(config)  # validates --device before joining anything
    joined = False
    if rank_info()[1] > 1 and not dist.is_initialized():
        # each rank computes on its own device: cuda:LOCAL_RANK (NCCL refuses two ranks on one GPU), or the CPU
        device = init_distributed(device.type)
        joined = True
    rank, world_size = rank_info()
    backend = str(dist.get_backend()) if dist.is_initialized() else "none (one process)"
    try:
        # the bench's own barriers and broadcasts run on a group of their own: allgather's copy thread issues
        # its collectives on the default group, and two threads sharing one group could interleave differently
        # on different ranks
        bench_group = dist.new_group(backend="gloo") if world_size > 1 else None
        rows, info = _measure(config, device, rank, world_size, bench_group, lambda m: log(f"rank {rank}: {m}"))
        # every handle is closed (no copy thread left), so the default group is free for this collective
        gathered = gather_objects(rows)
    finally:
        if joined:
            destroy_distributed()
    if rank != 0:
        return None
    return DistributedBenchResult(info, world_size, backend, [row for rank_rows in gathered for row in rank_rows])


def _measure(
    config: BenchConfig, device: torch.device, rank: int, world_size: int, bench_group, log: Log
) -> tuple[list[RankRow], RunInfo]:
    """This rank's rows and the run's facts; `bench_group` carries the bench's own barriers (None: one rank)."""
    import torch

    # the harness's own sizing, set-up and timed turn: these figures are measured as benchmarks/strategies.py measures
    from strategy_bench.harness import as_timed, copy_for, prepare_row, timed_turn
    from strategy_bench.measure import DeviceMemory, measure_block_compute, measure_link_gbps
    from strategy_bench.run_setup import BenchRun
    from strategy_bench.strategies import StrategyContext
    from layerstream.timing.block_timer import synchronize

    run = BenchRun.size(config, device, world_size)
    strategies = rank_strategies()
    # the same seed on every rank: identical weights, which allgather requires (it shards one model's bytes)
    run.build_(len(strategies), log)
    prototype, block_bytes, forward = run.prototype, run.block_bytes, run.forward

    resident_spec, *streamed_specs = strategies
    rows: dict[str, StrategyRow] = {}
    ctx = StrategyContext(device=device, prefetch_depth=config.prefetch_depth)
    rows["resident"] = prepare_row(resident_spec, copy_for(prototype, last=False), ctx, config.warmup, forward, log)
    resident = rows["resident"].prepared
    _barrier(bench_group)  # every rank calibrates at once: compute as it runs beside the other ranks'
    calibration = measure_block_compute(lambda: forward(resident), list(resident.model.blocks), device)
    reference = forward(resident)
    synchronize(device)
    # rank 0's compute on every rank: one simulated link for all, so their transfers last alike
    block_compute_s = _from_rank_zero(calibration.block_medians(), bench_group)

    link_gbps = run.simulated_link_gbps(block_compute_s, log)
    measured_link_gbps = measure_link_gbps(device, max(block_bytes)) if device.type == "cuda" else None

    for spec in streamed_specs:
        ctx = StrategyContext(device=device, link_gbps=link_gbps, prefetch_depth=config.prefetch_depth)
        model = copy_for(prototype, last=spec is streamed_specs[-1])
        rows[spec.name] = prepare_row(spec, model, ctx, config.warmup, forward, log)  # allgather: a collective
    del prototype

    memory = DeviceMemory(device)
    for rep in range(config.repeats):
        for row in rows.values():
            # every rank starts the turn together: N ranks computing at once, as data-parallel generation runs
            _barrier(bench_group)
            seconds, transfers, _, out = timed_turn(row.prepared, forward, device, memory)
            row.times_s.append(seconds)
            if transfers is not None:
                row.transfers.append(transfers)
            if row.matches_resident is None:
                row.matches_resident = bool(torch.equal(out, reference))
        log(f"repetition {rep + 1}/{config.repeats} done")

    resident_median = statistics.median(rows["resident"].times_s)
    # as the harness does: compute measured at both ends of the run, scaled to the resident's timed forwards
    _barrier(bench_group)
    calibration += measure_block_compute(lambda: forward(resident), list(resident.model.blocks), device)
    timed_compute = (as_timed(calibration, resident_median), calibration.other_median())
    block_compute_s, other_s = _from_rank_zero(timed_compute, bench_group)
    results = [_rank_row(rank, row, resident_median) for row in rows.values()]
    for row in rows.values():  # in one order on every rank: closing allgather gathers every block back
        row.prepared.close()

    info = run.run_info(
        block_compute_seconds=block_compute_s,
        other_compute_seconds=other_s,
        link_gbps=link_gbps,
        measured_link_gbps=measured_link_gbps,
        device_budget_gb=None,
        notes=[f"{world_size} ranks on one machine, {run.threads} compute thread(s) each; block compute and link from rank 0"],
    )
    return results, info


def _rank_row(rank: int, row: StrategyRow, resident_median: float) -> RankRow:
    p = row.prepared
    stats = p.handle.stats() if p.handle is not None else None
    n = len(row.transfers)
    median = statistics.median(row.times_s)
    return RankRow(
        rank=rank,
        strategy=p.name,
        weight_transfer=p.spec.weight_transfer if p.spec.kind == "layerwise" else None,
        host_bytes=stats.host_bytes if stats is not None else None,
        link_bytes_per_forward=sum(t.bytes_transferred for t in row.transfers) // n if n else None,
        transfers_per_forward=sum(t.num_transfers for t in row.transfers) // n if n else None,
        stall_seconds_per_forward=sum(t.stall_seconds for t in row.transfers) / n if n and p.stall_measured() else None,
        median_seconds=median,
        min_seconds=min(row.times_s),
        times_seconds=row.times_s,
        ratio_to_resident=median / resident_median if resident_median > 0 else None,
        enable_seconds=p.enable_seconds,
        host_enable_delta_bytes=row.host_enable_delta_bytes,
        accounted_device_bytes=p.accounted_device_bytes(),
        matches_resident=row.matches_resident,
    )


def _from_rank_zero(value, group):
    """Rank 0's `value` on every rank (a collective on `group`; the value itself without a group)."""
    if group is None:
        return value
    import torch.distributed as dist

    holder = [value]
    dist.broadcast_object_list(holder, src=0, group=group)
    return holder[0]


def _barrier(group) -> None:
    if group is not None:
        import torch.distributed as dist

        dist.barrier(group=group)


# --- report ------------------------------------------------------------------------------------------------------

COLUMNS = (
    "rank",
    "strategy",
    "host MiB",
    "link MiB/fwd",
    "transfers/fwd",
    "stall ms/fwd",
    "ms/fwd",
    "min ms",
    "x resident",
    "enable s",
    "= resident",
)
RATIO_COLUMNS = ("rank", "host bytes", "link bytes/fwd", "ms/fwd (median)", "min ms")


def format_distributed_report(result: DistributedBenchResult) -> str:
    """Run header, the rows of every rank and the allgather / rank-local ratios, as markdown."""
    header = run_header(BenchResult(run=result.run, strategies=[]))
    header += f"\n- {result.world_size} ranks, backend {result.backend}"
    lines = [_table_row(COLUMNS), _table_row(["---"] * len(COLUMNS))]
    for r in result.rows:
        lines.append(
            _table_row(
                [
                    str(r.rank),
                    r.strategy,
                    _mib(r.host_bytes),
                    _mib(r.link_bytes_per_forward),
                    "-" if r.transfers_per_forward is None else str(r.transfers_per_forward),
                    "-" if r.stall_seconds_per_forward is None else f"{r.stall_seconds_per_forward * 1e3:.2f}",
                    f"{r.median_seconds * 1e3:.2f}",
                    f"{r.min_seconds * 1e3:.2f}",
                    _num(r.ratio_to_resident),
                    f"{r.enable_seconds:.3f}",
                    "-" if r.matches_resident is None else ("yes" if r.matches_resident else "NO"),
                ]
            )
        )
    lines += ["", "allgather / rank-local:", "", _table_row(RATIO_COLUMNS), _table_row(["---"] * len(RATIO_COLUMNS))]
    for q in result.ratios():
        cells = [str(q.rank), _num(q.host_bytes), _num(q.link_bytes_per_forward), _num(q.median_seconds), _num(q.min_seconds)]
        lines.append(_table_row(cells))
    return f"{header}\n\n" + "\n".join(lines) + "\n"


def _table_row(cells) -> str:
    return "| " + " | ".join(cells) + " |"


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / MIB:,.3f}"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


# --- the command line ----------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, BenchConfig]:
    """The command line and the `BenchConfig` it describes, checked before any rank starts."""
    from strategy_bench.command_line import add_stack_arguments, build_config
    from layerstream.cli.common import CliError

    parser = argparse.ArgumentParser(prog="distributed.py", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    add_stack_arguments(parser)
    parser.add_argument(
        "--nproc", type=int, default=None, metavar="N",
        help="ranks on this machine, started with torchrun (default: the group this process was launched in, else 1)",
    )  # fmt: skip
    # every rank runs `rank_strategies()`, without a trace, a device budget or the disk tier
    parser.set_defaults(strategies=None, trace=None, device_budget_gb=None, host_budget_gb=None, disk_gbps=None)
    args = parser.parse_args(argv)
    if args.nproc is not None and args.nproc < 1:
        parser.error(f"--nproc = {args.nproc} is not valid; expected an integer >= 1")
    try:
        return args, build_config(args)
    except CliError as e:
        parser.error(str(e))


def main(argv: list[str] | None = None) -> int:
    """--nproc N: relaunch this script in N ranks (torchrun); inside them, run the comparison and print its
    results from rank 0. --nproc 1 runs it in this process (allgather then copies plainly)."""
    from layerstream.cli.bench_cmd import print_results
    from layerstream.config.offload_config import OffloadConfigError
    from layerstream.distributed.launch import in_launched_rank, rank_info, without_nproc
    from layerstream.errors import OffloadError

    argv = sys.argv[1:] if argv is None else argv
    args, config = parse_args(argv)
    from strategy_bench.config import BenchConfigError  # with torch: once the command line is accepted

    if args.nproc is not None and args.nproc > 1 and not in_launched_rank():
        # the same command without --nproc (torchrun's parser would take it for an abbreviated --nproc-per-node);
        # the ranks know they are ranks from WORLD_SIZE
        return _launch(args.nproc, without_nproc(argv))
    world_size = rank_info()[1]
    if args.nproc is not None and world_size != args.nproc:
        print(f"distributed.py: error: --nproc {args.nproc} but this rank was launched in a group of {world_size}", file=sys.stderr)
        return 2
    try:
        result = run_distributed_bench(config, log=lambda line: print(f"distributed: {line}", file=sys.stderr, flush=True))
    except (BenchConfigError, OffloadConfigError, OffloadError) as e:
        print(f"distributed.py: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    if result is not None:  # rank 0 reports for every rank
        print_results(args, json.dumps(result.to_dict(), indent=2), format_distributed_report(result))
    return 0


def _launch(nproc: int, argv: list[str]) -> int:
    """Run this script with `argv` in `nproc` ranks under torchrun; its exit code (0 when every rank exited 0)."""
    from layerstream.distributed.launch import LAUNCHED_ENV, free_port

    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--nnodes", "1",
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()), os.path.abspath(__file__), *argv,
    ]  # fmt: skip
    env = dict(os.environ, **{LAUNCHED_ENV: str(nproc)})
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))  # the ranks share the cores
    return subprocess.run(command, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
