"""`layerstream bench MODEL`: what float8 storage does to a model's output, measured on the user's machine
(`layerstream.bench.quality`); layerstream's own benchmarks are scripts in a source checkout's benchmarks/."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from layerstream.cli.common import MODEL_SOURCES, CliError, add_model_first_argument

DESCRIPTION = (
    "Measure how far float8 storage moves MODEL's output: one generation with full-precision storage and one "
    "with each float8 storage dtype, with the pictures' PSNR, the largest latent difference and the bytes "
    "streamed. The benchmarks of layerstream itself (offload strategies: `python benchmarks/strategies.py`, cold "
    "start, the disk tier, several ranks) are scripts in a source checkout's benchmarks/ (benchmarks/README.md)."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of the ``bench`` subcommand (no heavy import here: the CLI builds every parser at start)."""
    parser.description = DESCRIPTION
    add_model_first_argument(parser, MODEL_SOURCES, "tiny-flux", "--quality-model", "--model")
    parser.add_argument("--quality", action="store_true", help="what bench measures (accepted, as before; it changes nothing)")
    parser.add_argument("--quality-steps", "--steps", type=int, default=None, metavar="N", help="denoising steps (default: 4)")
    parser.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if available)")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: the model's own)")
    parser.add_argument("--seed", type=int, default=0)
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print the results as JSON on stdout (and nothing else)")
    out.add_argument("--out", metavar="DIR", default=None, help="also write results.json and results.md to DIR")


def print_results(args: argparse.Namespace, payload: str, report: str) -> None:
    """The report on stdout (the JSON `payload` with --json), and both into --out's folder."""
    if args.out:
        folder = Path(args.out)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "results.json").write_text(payload + "\n")
        (folder / "results.md").write_text(report)
    print(payload if args.json else report)


def run(args: argparse.Namespace) -> int:
    """Measure, print a table (or JSON); user errors raise `CliError` (exit code 2)."""
    from layerstream.bench.quality import measure_quality
    from layerstream.errors import LayerstreamError

    steps = 4 if args.quality_steps is None else args.quality_steps
    if steps < 1:
        raise CliError(f"--quality-steps = {steps} is not valid; expected an integer >= 1")
    model = args.model
    request = {"prompt": "a red fox in the snow", "num_inference_steps": steps, "seed": args.seed}
    print(f"bench: quality of float8 storage on {model}", file=sys.stderr, flush=True)
    try:
        result = measure_quality(model, device=args.device, dtype=args.dtype, request=request)
    except (LayerstreamError, ValueError) as e:
        raise CliError(" ".join(str(e).split())) from e
    print_results(args, json.dumps(result.to_json(), indent=2), result.to_markdown())
    return 0
