"""The command line of the synthetic strategy comparison: the stack, how it is timed and where the results go,
shared by benchmarks/strategies.py and benchmarks/distributed.py, and the `BenchConfig` it describes."""

from __future__ import annotations

import argparse

from layerstream.cli.common import CliError

SMOKE = {"model": "tiny", "repeats": 3, "warmup": 1, "link_ratio": 0.5}
"""--smoke: a few seconds on the tiny model; on a CPU the link is simulated at half a block's compute."""


def add_stack_arguments(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The synthetic stack and how it is timed, and where the results go: the flags benchmarks/strategies.py
    shares with benchmarks/distributed.py. Returns the output group (for flags of the caller's own)."""
    model = parser.add_argument_group("model")
    model.add_argument("--model", default=None, help="tiny, small, wan1.3b, wan14b or flux12b (default: tiny)")
    model.add_argument("--blocks", type=int, default=None, help="blocks in the stack (default: 8; 3-6 big ones on CPU)")
    model.add_argument("--tokens", type=int, default=None, help="tokens per sample (default: 64 tiny; 256 CPU, 4096 GPU)")
    model.add_argument("--context-tokens", type=int, default=None, help="text tokens (default: 0 tiny; 64 CPU, 512 GPU)")
    model.add_argument("--batch-size", type=int, default=1)
    model.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: float32 on CPU, bfloat16 on GPU)")

    run = parser.add_argument_group("run")
    run.add_argument("--repeats", type=int, default=None, help="timed forwards per strategy, round robin (default: 5)")
    run.add_argument("--warmup", type=int, default=None, help="untimed forwards per strategy after set-up (default: 2)")
    run.add_argument("--prefetch-depth", type=int, default=1, help="layer_options.dit.prefetch_depth (default: 1)")
    run.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if available)")
    run.add_argument("--threads", type=int, default=None, help="CPU only: torch threads (default: cores - 1, a core for the copy thread)")
    run.add_argument("--seed", type=int, default=0)
    link = run.add_mutually_exclusive_group()
    link.add_argument("--link-gbps", type=float, default=None, metavar="GBPS", help="CPU only: simulated host link in GB/s")
    link.add_argument(
        "--link-ratio", type=float, default=None, metavar="R", help="CPU only: simulated link at which a block's transfer lasts R x its compute"
    )
    run.add_argument("--smoke", action="store_true", help="a run of a few seconds on the tiny model (CPU: --link-ratio 0.5)")

    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print the results as JSON on stdout (and nothing else)")
    out.add_argument("--out", metavar="DIR", default=None, help="also write results.json and results.md to DIR")
    return out


def build_config(args: argparse.Namespace):
    """The `BenchConfig` the arguments describe (--smoke fills what was not given)."""
    from strategy_bench.config import BenchConfig, BenchConfigError

    smoke = SMOKE if args.smoke else {}
    values = {
        "model": args.model or smoke.get("model", "tiny"),
        "num_blocks": args.blocks,
        "num_tokens": args.tokens,
        "num_context_tokens": args.context_tokens,
        "batch_size": args.batch_size,
        "dtype": args.dtype,
        "device": args.device,
        "repeats": args.repeats if args.repeats is not None else smoke.get("repeats", 5),
        "warmup": args.warmup if args.warmup is not None else smoke.get("warmup", 2),
        "prefetch_depth": args.prefetch_depth,
        "link_gbps": args.link_gbps,
        "link_ratio": args.link_ratio,
        "device_budget_gb": args.device_budget_gb,
        "threads": args.threads,
        "seed": args.seed,
        "trace_dir": args.trace,
        "host_budget_gb": args.host_budget_gb,
        "disk_gbps": args.disk_gbps,
    }
    if args.strategies is not None:
        values["strategies"] = args.strategies
    if args.smoke and args.link_gbps is None and args.link_ratio is None and _on_cpu(args.device):
        values["link_ratio"] = smoke["link_ratio"]
    try:
        return BenchConfig(**values)
    except BenchConfigError as e:
        raise CliError(str(e)) from e


def _on_cpu(device: str | None) -> bool:
    if device is not None:
        return device.startswith("cpu")
    import torch

    return not torch.cuda.is_available()


