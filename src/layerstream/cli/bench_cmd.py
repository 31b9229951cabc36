"""`layerstream bench`: time offload strategies against resident on synthetic DiT block stacks.

Everything is measured in one process, round robin; see `layerstream.bench.harness` for the method and
benchmarks/README.md for measured figures and the command lines that produced them. `--quality` instead
measures how far float8 storage moves the output of a pipeline (`layerstream.bench.quality`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from layerstream.cli.common import CliError

SMOKE = {"model": "tiny", "repeats": 3, "warmup": 1, "link_ratio": 0.5}
"""--smoke: a few seconds on the tiny model; on a CPU the link is simulated at half a block's compute."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of the ``bench`` subcommand (no heavy import here: the CLI builds every parser at start)."""
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

    quality = parser.add_argument_group("quality")
    quality.add_argument(
        "--quality",
        action="store_true",
        help="measure how far float8 storage moves a pipeline's output: PSNR of the pictures and largest latent "
        "difference against full precision, and link bytes, on --quality-model",
    )
    quality.add_argument(
        "--quality-model", metavar="MODEL", default=None, help="with --quality: a Hugging Face Hub id (downloaded into its cache), a tiny model name or a local diffusers folder (default: tiny-flux)"
    )
    quality.add_argument("--quality-steps", type=int, default=None, metavar="N", help="with --quality: denoising steps (default: 4)")


def add_stack_arguments(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The synthetic stack and how it is timed, and where the results go: the flags `layerstream bench` shares
    with benchmarks/distributed.py. Returns the output group (for flags of the caller's own)."""
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
    from layerstream.bench.config import BenchConfig, BenchConfigError

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


def run(args: argparse.Namespace) -> int:
    """Run the benchmark and print a table (or JSON); user errors raise `CliError` (exit code 2)."""
    if args.quality:
        return _run_quality(args)
    if args.quality_model is not None or args.quality_steps is not None:
        raise CliError("--quality-model and --quality-steps need --quality")
    from layerstream.bench.config import BenchConfigError
    from layerstream.bench.harness import run_bench
    from layerstream.bench.report import format_report
    from layerstream.bench.strategies import StrategyError
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


def print_results(args: argparse.Namespace, payload: str, report: str) -> None:
    """The report on stdout (the JSON `payload` with --json), and both into --out's folder."""
    if args.out:
        folder = Path(args.out)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "results.json").write_text(payload + "\n")
        (folder / "results.md").write_text(report)
    print(payload if args.json else report)


_NOT_WITH_QUALITY = (
    ("model", "--model"), ("blocks", "--blocks"), ("tokens", "--tokens"), ("context_tokens", "--context-tokens"),
    ("strategies", "--strategies"), ("repeats", "--repeats"), ("warmup", "--warmup"), ("link_gbps", "--link-gbps"),
    ("link_ratio", "--link-ratio"), ("device_budget_gb", "--device-budget-gb"), ("trace", "--trace"),
    ("threads", "--threads"), ("host_budget_gb", "--host-budget-gb"), ("disk_gbps", "--disk-gbps"),
)  # fmt: skip


def _run_quality(args: argparse.Namespace) -> int:
    """--quality: one pipeline generated with full-precision storage and with each float8 storage dtype."""
    from layerstream.bench.quality import measure_quality
    from layerstream.errors import LayerstreamError

    for name, flag in _NOT_WITH_QUALITY:
        if getattr(args, name) is not None:
            raise CliError(f"{flag} does not apply with --quality (it measures one pipeline; see --quality-model)")
    steps = 4 if args.quality_steps is None else args.quality_steps
    if steps < 1:
        raise CliError(f"--quality-steps = {steps} is not valid; expected an integer >= 1")
    model = args.quality_model or "tiny-flux"
    request = {"prompt": "a red fox in the snow", "num_inference_steps": steps, "seed": args.seed}
    print(f"bench: quality of float8 storage on {model}", file=sys.stderr, flush=True)
    try:
        result = measure_quality(model, device=args.device, dtype=args.dtype, request=request)
    except (LayerstreamError, ValueError) as e:
        raise CliError(" ".join(str(e).split())) from e
    print_results(args, json.dumps(result.to_json(), indent=2), result.to_markdown())
    return 0
