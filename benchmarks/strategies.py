"""The synthetic strategy comparison: offload strategies timed against resident on synthetic DiT block stacks
with the shapes of real models, in one process, round robin (see `strategy_bench.harness` for the method and
benchmarks/README.md for measured figures).

    python benchmarks/strategies.py --smoke          # a few seconds: tiny model, every strategy, simulated link
    python benchmarks/strategies.py --model flux12b --json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# the modules beside this script, found also when a test loads it from its file
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from layerstream.cli.bench_cmd import print_results  # noqa: E402
from layerstream.cli.common import CliError  # noqa: E402
from strategy_bench.command_line import add_stack_arguments, build_config  # noqa: E402


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of the strategy comparison."""
    output = add_stack_arguments(parser)
    output.add_argument("--trace", metavar="DIR", default=None, help="write trace.json and timeline.png of one layerwise forward")
    run = parser.add_argument_group("strategies")
    run.add_argument(
        "--strategies",
        default=None,
        help="comma list of resident, layerwise, layerwise-resident-N, layerwise-auto (layerwise ones may end in "
        "-depth-D), module, diffusers-group, naive (default: all, with layerwise-resident-1)",
    )
    run.add_argument(
        "--device-budget-gb", type=float, default=None, help="layerwise-auto budget (default: non-block + slots + half the blocks)"
    )
    disk = parser.add_argument_group("disk tier")
    disk.add_argument(
        "--host-budget-gb",
        type=float,
        default=None,
        metavar="GB",
        help="run the layerwise rows with the disk tier: this much host memory for streamed blocks, the other "
        "blocks read from spill files at every use",
    )
    disk.add_argument(
        "--disk-gbps", type=float, default=None, metavar="GBPS", help="CPU only, with --host-budget-gb: simulated disk in GB/s"
    )


def run(args: argparse.Namespace) -> int:
    """Run the comparison and print a table (or JSON); user errors raise `CliError`."""
    from strategy_bench.config import BenchConfigError
    from strategy_bench.harness import run_bench
    from strategy_bench.report import format_report
    from strategy_bench.strategies import StrategyError
    from layerstream.config.offload_config import OffloadConfigError
    from layerstream.plan.resolved import OffloadPlanResolutionError
    from layerstream.errors import OffloadError

    config = build_config(args)
    try:
        result = run_bench(config, log=lambda line: print(f"bench: {line}", file=sys.stderr, flush=True))
    except (BenchConfigError, StrategyError, OffloadConfigError, OffloadPlanResolutionError, OffloadError) as e:
        raise CliError(" ".join(str(e).split())) from e

    print_results(args, json.dumps(result.to_dict(), indent=2), format_report(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    """The command line, run; a user error prints one line and returns 2."""
    parser = argparse.ArgumentParser(prog="strategies.py", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except CliError as e:
        print(f"strategies.py: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
