"""`layerstream` command line: generate, plan, bench and serve. Each subcommand lives in its own module."""

from __future__ import annotations

import argparse
import importlib
import sys

from layerstream.cli.common import CliError, configure_logging, fail

# subcommand -> module exposing add_arguments(parser) and run(args) -> int; imported only when used
SUBCOMMANDS = {
    "generate": ("layerstream.cli.generate_cmd", "Generate images or video with offload enabled (the main job)"),
    "plan": ("layerstream.cli.plan_cmd", "Print what would stream for a model and config"),
    "bench": ("layerstream.cli.bench_cmd", "Measure offload strategies against resident"),
    "serve": ("layerstream.cli.serve_cmd", "Serve a pipeline with offload over HTTP"),
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own exit code for usage errors is 2 as well
        self.print_usage(sys.stderr)
        raise SystemExit(fail(message))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="layerstream", description="Layerwise weight offloading for diffusion pipelines.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=_version_text(), help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if not e.name or not e.name.startswith("layerstream"):
                raise
            continue  # subcommand not built yet
        module.add_arguments(sub_parser)
        sub_parser.set_defaults(_run=module.run)
    return parser


def _version_text() -> str:
    """layerstream's version, and torch's with its CUDA build: the first thing a bug report needs."""
    import torch

    from layerstream import __version__

    cuda = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA"
    return f"layerstream {__version__} (torch {torch.__version__}, {cuda})"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.verbose)
    if not hasattr(args, "_run"):
        return fail(f"the {args.command} subcommand is not available in this build")
    try:
        return int(args._run(args) or 0)
    except CliError as e:
        return fail(str(e))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
