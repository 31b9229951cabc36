"""Helpers every subcommand shares: one-line errors with exit code 2, argument checks made before any work
(values, the device, the output path), config parsing, logging set-up."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from layerstream.errors import LayerstreamError
from layerstream.json_object import JsonLimitError, read_json_text
from layerstream.models.request_fields import FIELD_BOUNDS, FieldBound

EXIT_USAGE = 2


class CliError(LayerstreamError):
    """A user error the command line reports as one line and exit code 2."""


def fail(message: str) -> int:
    print(f"layerstream: error: {message}", file=sys.stderr)
    return EXIT_USAGE


DEFAULT_CONFIG = {"mode": "layer", "components": ["dit"]}
"""The offload config of a command given no --diffusion-offload-config (and no default of its own)."""


def parse_config_arg(text: str | None, default: dict | None = None):
    """Parse --diffusion-offload-config (JSON text) into an OffloadConfig; CliError on any problem."""
    from layerstream.config.offload_config import OffloadConfigError, parse_offload_config

    try:
        return parse_offload_config(text if text is not None else (default or DEFAULT_CONFIG))
    except OffloadConfigError as e:
        raise CliError(f"--diffusion-offload-config: {e}") from e


def parse_config_args(args: argparse.Namespace, default: dict | None = None):
    """--diffusion-offload-config with --vae-use-tiling and --vae-use-slicing folded in (`with_vae_settings`)."""
    from layerstream.config.offload_config import OffloadConfigError, with_vae_settings

    config = parse_config_arg(args.diffusion_offload_config, default)
    given = {key: getattr(args, key, None) for key in ("vae_use_tiling", "vae_use_slicing")}
    try:
        return with_vae_settings(config, **given)
    except OffloadConfigError as e:
        flag = "--" + e.key_path.replace("_", "-")
        raise CliError(f"{flag}: {e}") from e


def add_vae_arguments(parser: argparse.ArgumentParser) -> None:
    """--vae-use-tiling and --vae-use-slicing (vllm-omni's flags), each true, false or auto."""
    parser.add_argument(
        "--vae-use-tiling", type=vae_setting, default=None, metavar="{true,false,auto}",
        help='decode in tiles: always, never (a decode that cannot fit is refused before the first step), or '
        '"auto" (the default): only where the untiled decode would not fit the device memory left; tiling blends '
        "tile edges (not bit-identical), and the summary says which was done and why",
    )  # fmt: skip
    parser.add_argument(
        "--vae-use-slicing", type=vae_setting, default=None, metavar="{true,false,auto}",
        help='decode a batch one sample at a time: always, never, or "auto" (the default): only a batch that would not fit whole',
    )  # fmt: skip


def vae_setting(text: str) -> bool | str:
    """true, false or auto, as --vae-use-tiling takes them."""
    values = {"true": True, "false": False, "auto": "auto"}
    if text not in values:
        raise _not_allowed(repr(text), "true, false or auto")
    return values[text]


def add_config_argument(parser: argparse.ArgumentParser) -> None:
    """--diffusion-offload-config, read by `parse_config_arg`."""
    parser.add_argument(
        "--diffusion-offload-config", metavar="JSON", default=None,
        help=f"offload config as JSON text (default: {json.dumps(DEFAULT_CONFIG)})",
    )  # fmt: skip


MODEL_SOURCES = "a Hugging Face Hub id (org/name, downloaded into its cache), a local diffusers folder, or an embedded tiny model"
"""What a command's model may be, as its help words it."""


def add_model_arguments(parser: argparse.ArgumentParser, model_help: str) -> None:
    """The positional MODEL (`model_help`: what the subcommand does with it), and the Hub arguments."""
    parser.add_argument("model", help=model_help)
    add_hub_arguments(parser)


def add_model_first_argument(parser: argparse.ArgumentParser, model_help: str, default: str, *older: str) -> None:
    """MODEL as the first argument, optional (`default`), as `plan` and `serve` take it; `older` (--model) are
    earlier spellings still accepted. The model given twice, differently, is refused."""
    parser.add_argument("model", nargs="?", default=argparse.SUPPRESS, action=_OneModel, metavar="MODEL", help=f"{model_help} (default: {default})")  # fmt: skip
    parser.add_argument(*older, dest="model", default=default, action=_OneModel, metavar="MODEL", help="the same as MODEL")


class _OneModel(argparse.Action):
    """Stores the model, refusing a second, different one (given both as MODEL and as --model)."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = getattr(namespace, "_model_given", None)
        if given is not None and given != values:
            raise argparse.ArgumentError(self, f"the model is given twice ({given!r} and {values!r}); give it once, as MODEL")
        namespace._model_given = values
        namespace.model = values


def add_hub_arguments(parser: argparse.ArgumentParser) -> None:
    """--revision and --variant, for a model given as a Hugging Face Hub id."""
    parser.add_argument(
        "--revision", default=None, metavar="REV",
        help="Hub ids only: the branch, tag or commit to download (default: main); reported in the summary",
    )  # fmt: skip
    parser.add_argument(
        "--variant", default=None, metavar="NAME",
        help='weights variant as diffusers names it, e.g. "fp16" (default: the plain weights)',
    )  # fmt: skip
    parser.add_argument(
        "--component", action="append", default=None, metavar="NAME=FILE",
        help="load component NAME (transformer, transformer_2) from FILE, a .gguf or .safetensors file or "
        "hf://owner/repo/path/file.gguf[@revision]; repeatable (docs/python.md, \"A component from a file\")",
    )  # fmt: skip


def component_files(args: argparse.Namespace) -> dict[str, str]:
    """--component NAME=FILE (repeatable) as `Omni`'s `components`; CliError naming a malformed one."""
    from layerstream.models.component_files import check_component_specs, parse_component_flags
    from layerstream.models.folder_check import ModelLoadError

    try:
        return check_component_specs(parse_component_flags(getattr(args, "component", None)))
    except ModelLoadError as e:
        raise CliError(str(e)) from e


def fetch_before_ranks(args: argparse.Namespace) -> dict[str, str]:
    """With --nproc and a Hub id: download the snapshot here, once, before any rank starts (a download can take
    far longer than the ranks' collective timeout); the environment that makes every rank read that one commit."""
    from layerstream.models.hub import names_hub_repo

    if not names_hub_repo(args.model):
        return {}
    from layerstream.models.loading import ModelLoadError, resolve_model

    try:
        resolve_model(args.model, revision=args.revision, variant=args.variant, from_files=frozenset(component_files(args)))
    except ModelLoadError as e:
        raise CliError(" ".join(str(e).split())) from e
    return {"HF_HUB_OFFLINE": "1"}


def configure_logging(verbose: bool = False) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if not verbose:
        # the libraries' own load/save progress bars and advisories would drown layerstream's progress lines
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


# argparse `type=` functions: argparse reports a value error as "argument --steps: <message>", naming the flag
# as the user typed it; our parser words that as one line, "--steps: 0 is not allowed (an integer >= 1)",
# with exit code 2, before `run` is reached.


def bounded_value(bound: FieldBound, name: str):
    """The argparse type of a number within `bound` (`name`: what argparse calls the type in some messages)."""

    def parse(text: str) -> int | float:
        try:
            value = bound.kind(text)
        except ValueError:
            raise _not_allowed(repr(text), bound.allowed()) from None
        if not bound.admits(value):
            raise _not_allowed(text, bound.allowed())
        return value

    parse.__name__ = name
    return parse


positive_int = bounded_value(FieldBound(int, ge=1), "positive_int")
non_negative_float = bounded_value(FieldBound(float, ge=0.0), "non_negative_float")
positive_float = bounded_value(FieldBound(float, gt=0.0), "positive_float")


def request_value(name: str):
    """The argparse type of the flag of `GenerationRequest` field `name`: its bounds in the request's table, so a
    flag takes what `Omni.generate` and the HTTP bodies take."""
    return bounded_value(FIELD_BOUNDS[name], name)


def prompt_text(text: str) -> str:
    """A prompt of at most `MAX_PROMPT_CHARS` characters, the server's limit as well; the error gives its
    length rather than echoing it."""
    from layerstream.models.output_limits import MAX_PROMPT_CHARS

    if len(text) > MAX_PROMPT_CHARS:
        allowed = f"at most {MAX_PROMPT_CHARS:,} characters, as the server takes"
        raise argparse.ArgumentTypeError(f"a text of {len(text):,} characters is not allowed ({allowed})")
    return text


def json_object_text(text: str) -> dict:
    """A JSON object given as its text (--extra-params): not JSON, or JSON that is not an object, is refused
    naming what was wrong, as the server's 400 does."""
    try:
        value = read_json_text(text)
    except JsonLimitError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}); expected a JSON object such as '{{\"sample_solver\": \"euler\"}}'") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object; expected one such as '{{\"sample_solver\": \"euler\"}}'")
    return value


def _not_allowed(shown: str, allowed: str) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(f"{shown} is not allowed ({allowed})")


def check_device_arg(flag: str, text: str | None) -> None:
    """Refuse a device this torch cannot use, in one line naming `flag`, before anything loads or binds a port
    (else ``--device cuda`` on a CPU-only torch fails inside the first copy, an ``AssertionError``)."""
    if text is None:
        return
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        expected = "cpu, cuda or cuda:N (or another accelerator this torch has)"
        raise CliError(f"{flag} {text!r} is not a device; expected {expected}") from None
    if device.type == "cpu":
        return
    backend = getattr(torch, device.type, None)  # torch.cuda, torch.xpu, torch.mps ...
    is_available = getattr(backend, "is_available", None)
    if not callable(is_available) or not is_available():
        raise CliError(f"{flag} {text!r}: {_unavailable(torch, device.type)}")
    device_count = getattr(backend, "device_count", None)
    if device.index is not None and callable(device_count) and device.index >= device_count():
        count, kind = device_count(), device.type
        raise CliError(f"{flag} {text!r}: there are {count} {kind} device(s); expected {kind}:0 to {kind}:{count - 1}")


def _unavailable(torch, kind: str) -> str:
    """Why this torch cannot run on devices of `kind`, and what to do instead."""
    if kind != "cuda":
        return f"this torch cannot run on {kind}; use cpu or cuda"
    if torch.version.cuda is not None or torch.version.hip is not None:
        why = "no CUDA device is visible (check CUDA_VISIBLE_DEVICES and the driver)"
    else:
        why = f"this torch ({torch.__version__}) was built without CUDA"
    return f"{why}; use --device cpu, or install a torch build for your CUDA"


def check_output_path(flag: str, path: Path) -> None:
    """Refuse an output file that could not be written, before any work rather than after every step: by a probe
    file, since permission bits do not tell (root passes ``os.access`` everywhere; /proc refuses files anyway)."""
    path = path.expanduser().absolute()
    if path.is_dir():
        raise CliError(f"{flag} {path} is a folder; expected a file name inside it")
    folder = path.parent
    while not folder.exists():  # save creates missing folders; what matters is the first one that exists
        folder = folder.parent
    if not folder.is_dir():
        raise CliError(f"{flag} {path}: {folder} is a file, not a folder")
    try:
        handle, probe = tempfile.mkstemp(prefix=".layerstream-write-check-", dir=folder)
    except OSError as e:
        raise CliError(f"{flag} {path}: cannot create files in {folder} ({e.strerror or e})") from None
    try:
        os.close(handle)
    finally:  # even on Ctrl-C: the probe must not stay behind beside the output
        os.unlink(probe)
    if path.exists() and not os.access(path, os.W_OK):
        raise CliError(f"{flag} {path} exists and is not writable")


def add_work_cap_argument(
    parser: argparse.ArgumentParser, *, value_type: Callable[[str], int] = positive_int, refusal: str = "refused",
    note: str = "",
) -> None:  # fmt: skip
    """--max-work, as `serve`, `generate` and `plan` take it: the largest price (`models.work.price_request`);
    `serve` parses a plain int, its settings naming the flag, and words its refusal as its answer."""
    from layerstream.server.settings import ACCELERATOR_STEPS, CPU_MAX_WORK

    parser.add_argument(
        "--max-work", type=value_type, default=None,
        help="largest price of one request (width x height x frames x steps x passes x n, plus text tokens, "
        f"docs/serving.md); more is {refusal} (default: from the device: {CPU_MAX_WORK:,} on a CPU, minutes of a "
        f"2-core host; on an accelerator whatever --max-size and --max-frames allow at {ACCELERATOR_STEPS} steps, "
        f"or the model's default steps if more{note})",
    )  # fmt: skip


def work_cap(rules, *, max_work: int | None, max_side: int, max_frames: int, device) -> int:
    """--max-work, else the server's default for `device` (`server.limits.default_max_work`, the caps lowered to
    what the model can position)."""
    from layerstream.server.limits import default_max_work

    if max_work is not None:
        return max_work
    side, frames = rules.geometry.max_side_pixels, rules.geometry.max_frames
    return default_max_work(rules, min(max_side, side or max_side), min(max_frames, frames or max_frames), device)


def check_work(price, rules, **caps) -> int:
    """The cap (`work_cap`) `price` (a `models.work.WorkPrice`) is held to; over it is one line naming the price,
    the cap and --max-work. Returns the cap."""
    max_work = work_cap(rules, **caps)
    if price.work > max_work:
        raise CliError(
            f"the request's work {price.describe()} is more than the cap of {max_work:,}: lower the size, frames, "
            "steps or n, or raise the cap with --max-work"
        )
    return max_work
