"""`layerstream bench`: measurements a user runs on their own machine and model. `--quality` measures how far
float8 storage moves the output of a pipeline (`layerstream.bench.quality`).

The synthetic strategy comparison measures layerstream itself, not the user's model: it is the script
benchmarks/strategies.py of a source checkout (benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from layerstream.cli.common import CliError

STRATEGY_SCRIPT = "python benchmarks/strategies.py"
"""Where the synthetic strategy comparison, once `layerstream bench`'s default mode, now runs."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of the ``bench`` subcommand (no heavy import here: the CLI builds every parser at start)."""
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
    quality.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if available)")
    quality.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: the model's own)")
    quality.add_argument("--seed", type=int, default=0)
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print the results as JSON on stdout (and nothing else)")
    out.add_argument("--out", metavar="DIR", default=None, help="also write results.json and results.md to DIR")


def run(args: argparse.Namespace) -> int:
    """Run the measurement and print a table (or JSON); user errors raise `CliError` (exit code 2)."""
    if not args.quality and (args.quality_model is not None or args.quality_steps is not None):
        raise CliError("--quality-model and --quality-steps need --quality")
    if not args.quality:
        raise CliError(
            "layerstream bench measures your own model: add --quality (and --quality-model MODEL); the synthetic "
            f"offload strategy comparison is `{STRATEGY_SCRIPT}` in a source checkout"
        )
    return _run_quality(args)


def print_results(args: argparse.Namespace, payload: str, report: str) -> None:
    """The report on stdout (the JSON `payload` with --json), and both into --out's folder."""
    if args.out:
        folder = Path(args.out)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "results.json").write_text(payload + "\n")
        (folder / "results.md").write_text(report)
    print(payload if args.json else report)


def _run_quality(args: argparse.Namespace) -> int:
    """--quality: one pipeline generated with full-precision storage and with each float8 storage dtype."""
    from layerstream.bench.quality import measure_quality
    from layerstream.errors import LayerstreamError

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
