"""Helpers every subcommand shares: one-line errors with exit code 2, config parsing, logging set-up."""

from __future__ import annotations

from layerstream.errors import LayerstreamError
import logging
import sys

EXIT_USAGE = 2


class CliError(LayerstreamError):
    """A user error the command line reports as one line and exit code 2."""


def fail(message: str) -> int:
    print(f"layerstream: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def parse_config_arg(text: str | None, default: dict | None = None):
    """Parse --diffusion-offload-config (JSON text) into an OffloadConfig; CliError on any problem."""
    from layerstream.config.offload_config import OffloadConfigError, parse_offload_config

    try:
        return parse_offload_config(text if text is not None else (default or {"mode": "layer", "components": ["dit"]}))
    except OffloadConfigError as e:
        raise CliError(f"--diffusion-offload-config: {e}") from e


def configure_logging(verbose: bool = False) -> None:
    import os

    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if not verbose:
        # the libraries' own load/save progress bars and advisories would drown layerstream's progress lines
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
