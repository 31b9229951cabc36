"""`layerstream` command line: generate, plan, bench and serve. Each subcommand lives in its own module."""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings
from typing import NoReturn

from layerstream.cli.common import CliError, configure_logging, fail
from layerstream.errors import missing_extra
from layerstream.cli.interrupt import EXIT_INTERRUPTED, PhaseLog, exit_after_command, report_interrupt
from layerstream.models.optional_imports import torchao_deferred

# subcommand -> module exposing add_arguments(parser) and run(args) -> int; imported only when used
SUBCOMMANDS = {
    "generate": ("layerstream.cli.generate_cmd", "Generate images or video with offload enabled (the main job)"),
    "plan": ("layerstream.cli.plan_cmd", "Print what would stream for a model and config"),
    "bench": ("layerstream.cli.bench_cmd", "Measure what float8 storage does to a model's output (benchmarks/ has the others)"),
    "serve": ("layerstream.cli.serve_cmd", "Serve a pipeline with offload over HTTP"),
}


class _Parser(argparse.ArgumentParser):
    subcommand_parsers: dict[str, argparse.ArgumentParser]
    """The top-level parser's subcommands by name, to word an unknown flag as its subcommand's mistake."""

    def error(self, message: str):
        """One line and exit code 2 (argparse's own code), never the usage block: a flag's value as
        ``--steps: 0 is not allowed (an integer >= 1)``, any other mistake with a pointer to --help."""
        if message.startswith("argument "):
            raise SystemExit(fail(message.removeprefix("argument ")))
        raise SystemExit(fail(f"{message} (see {self.prog} --help)"))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="layerstream", description="Layerwise weight offloading for diffusion pipelines.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action=_VersionAction, help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    parser.subcommand_parsers = {}
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub_parser = parser.subcommand_parsers[name] = sub.add_parser(name, help=help_text, description=help_text)
        module = importlib.import_module(module_name)
        module.add_arguments(sub_parser)
        sub_parser.set_defaults(_run=module.run)
    return parser


class _VersionAction(argparse.Action):
    """--version, worded only when asked for: building the parser (every --help) imports no torch."""

    def __init__(self, option_strings, dest, help=None):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        """layerstream's version, and torch's with its CUDA build: the first thing a bug report needs."""
        import torch

        from layerstream import __version__

        cuda = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA"
        print(f"layerstream {__version__} (torch {torch.__version__}, {cuda})")  # on stdout, as argparse's own
        parser.exit()


def main(argv: list[str] | None = None) -> int:
    # torch without numpy (a core install) warns on import that numpy is missing: the command names the extra
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    try:
        parser = build_parser()
        args, unknown = parser.parse_known_args(argv)
    except KeyboardInterrupt:
        return report_interrupt(PhaseLog())
    if unknown:  # argparse would blame the top-level parser; the flags were given to the subcommand
        parser.subcommand_parsers.get(args.command, parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    configure_logging(args.verbose)
    try:
        # stderr holds layerstream's lines: torchao (and its import warnings) only for a model that needs it
        with torchao_deferred(getattr(args, "model", None)):
            return int(args._run(args) or 0)
    except CliError as e:
        return fail(str(e))
    except ModuleNotFoundError as e:  # a core install (torch alone): the command's extra, in one line
        if (error := missing_extra(e, args.command)) is None:
            raise
        return fail(str(error))
    except KeyboardInterrupt:  # a subcommand without phases of its own (generate words its own, up to its return)
        print("layerstream: interrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED


def entry() -> NoReturn:
    """The `layerstream` program: the command, then the process's end in its own hands (`exit_after_command`)."""
    exit_after_command(main())


if __name__ == "__main__":
    entry()
