"""`layerstream serve MODEL`: serve one offloaded pipeline over HTTP (OpenAI-style images and videos APIs).

Order of work, so that mistakes cost seconds, not a model load: parse and check every argument (including
--diffusion-offload-config), bind the port, load the model and enable offload, then serve. The ready line
("layerstream serve: ready on http://127.0.0.1:8000") goes to stderr once requests are accepted.
"""

from __future__ import annotations

import argparse
import logging
import sys

from layerstream.cli.common import CliError, parse_config_arg
from layerstream.server.settings import (  # plain data: no serve extra
    DEFAULT_BATCH_WAIT_MS,
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_MAX_IMAGE_BYTES,
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_MAX_WORK,
    DEFAULT_SHUTDOWN_TIMEOUT_S,
)

READY_PREFIX = "layerstream serve: ready on "


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of the ``serve`` subcommand."""
    parser.add_argument("model", help='an embedded tiny model ("tiny-wan", "tiny-flux", ...) or a diffusers folder')
    parser.add_argument(
        "--diffusion-offload-config",
        metavar="JSON",
        default=None,
        help='offload config as JSON text (default: {"mode": "layer", "components": ["dit"]})',
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, loopback only)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port (default: 8000; 0 picks a free port)")
    parser.add_argument("--device", default=None, help="device (default: cuda if available, else cpu)")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: as saved)")
    parser.add_argument(
        "--max-queue", type=int, default=16, help="requests that may wait behind the running one; more get 429 (default: 16)"
    )
    parser.add_argument("--max-frames", type=int, default=129, help="largest num_frames of a video request (default: 129)")
    parser.add_argument(
        "--max-size", type=int, default=2048, dest="max_side_pixels", help="largest width or height (default: 2048)"
    )
    parser.add_argument(
        "--max-work",
        type=int,
        default=DEFAULT_MAX_WORK,
        help="largest width x height x frames x steps x n of one request; more is a 400 "
        f"(default: {DEFAULT_MAX_WORK:,}, sized for a 24 GB host; raise it on a GPU server)",
    )
    parser.add_argument(
        "--max-body-bytes", type=int, default=1 << 20,
        help="largest request body, not counting an input image (default: 1 MiB)",
    )
    parser.add_argument(
        "--max-image-bytes", type=int, default=DEFAULT_MAX_IMAGE_BYTES,
        help=f"largest input image file of /v1/images/edits and image-to-video requests (default: {DEFAULT_MAX_IMAGE_BYTES >> 20} MiB)",
    )
    parser.add_argument(
        "--max-image-pixels", type=int, default=DEFAULT_MAX_IMAGE_PIXELS,
        help=f"largest input image in pixels, width x height (default: {DEFAULT_MAX_IMAGE_PIXELS:,}, 4096 x 4096)",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=DEFAULT_SHUTDOWN_TIMEOUT_S,
        metavar="SECONDS",
        help="after SIGTERM, how long the running generation may go on before it is stopped at its next step "
        f"(default: {DEFAULT_SHUTDOWN_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--max-batch-size",
        type=int,
        default=DEFAULT_MAX_BATCH_SIZE,
        metavar="N",
        help="run up to N queued requests that share a size, frames, steps, guidance and negative prompt as one "
        "pipeline call, each streamed block serving all of them (default: 1, every request alone)",
    )
    parser.add_argument(
        "--batch-wait-ms",
        type=float,
        default=DEFAULT_BATCH_WAIT_MS,
        metavar="MS",
        help=f"longest a request waits for others to join its batch (default: {DEFAULT_BATCH_WAIT_MS:g})",
    )
    parser.add_argument("--link-gbps", type=float, default=None, help="CPU only: simulated host link bandwidth in GB/s")
    parser.add_argument("--no-access-log", dest="access_log", action="store_false", help="no log line per request")


def run(args: argparse.Namespace) -> int:
    """Check arguments, bind, load, serve until SIGTERM/SIGINT; 0 after a graceful stop, CliError on user errors."""
    config = parse_config_arg(args.diffusion_offload_config)  # before anything loads
    if args.link_gbps is not None and not args.link_gbps > 0:
        raise CliError(f"--link-gbps = {args.link_gbps!r} is not valid; expected a number > 0")
    settings = _settings(args)
    _check_device(args.device)

    try:  # the server's own modules need the serve extra; say so in one line rather than a traceback
        from layerstream.server.runner import bind_socket, run_server
        from layerstream.server.service import GenerationService
    except ModuleNotFoundError as e:
        if e.name and e.name.startswith("layerstream"):
            raise
        raise CliError(f"serving needs the serve extra (pip install 'layerstream[serve]'): {e}") from e
    from layerstream.models.loading import ModelLoadError
    from layerstream.omni import GenerationError, Omni
    from layerstream.runtime.errors import OffloadError

    _configure_server_logging(getattr(args, "verbose", False), args.access_log)
    try:
        sock = bind_socket(settings.host, settings.port)
    except OSError as e:
        raise CliError(f"--host {settings.host} --port {settings.port}: cannot bind: {e.strerror or e}") from e
    try:
        try:
            omni = Omni(
                model=args.model,
                diffusion_offload_config=config,
                device=args.device,
                dtype=args.dtype,
                simulated_link_gbps=args.link_gbps,
            )
        except (ModelLoadError, GenerationError, OffloadError) as e:
            raise CliError(" ".join(str(e).split())) from e
        except RuntimeError as e:
            if "device" in str(e).lower():
                raise CliError(f"--device {args.device}: {e}") from e
            raise
        service = GenerationService(omni, settings)
        run_server(service, sock, on_ready=_print_ready, access_log=args.access_log)
    finally:
        sock.close()
    print("layerstream serve: stopped", file=sys.stderr, flush=True)
    return 0


def _settings(args: argparse.Namespace):
    from layerstream.server.settings import ServeSettings, ServeSettingsError

    flags = {"max_queue": "--max-queue", "max_frames": "--max-frames", "max_side_pixels": "--max-size",
             "max_work": "--max-work", "max_body_bytes": "--max-body-bytes", "shutdown_timeout": "--shutdown-timeout",
             "max_image_bytes": "--max-image-bytes", "max_image_pixels": "--max-image-pixels",
             "max_batch_size": "--max-batch-size", "batch_wait_ms": "--batch-wait-ms",
             "port": "--port", "host": "--host"}  # fmt: skip
    try:
        return ServeSettings(
            host=args.host,
            port=args.port,
            max_queue=args.max_queue,
            max_frames=args.max_frames,
            max_side_pixels=args.max_side_pixels,
            max_work=args.max_work,
            max_body_bytes=args.max_body_bytes,
            max_image_bytes=args.max_image_bytes,
            max_image_pixels=args.max_image_pixels,
            shutdown_timeout=args.shutdown_timeout,
            max_batch_size=args.max_batch_size,
            batch_wait_ms=args.batch_wait_ms,
        )
    except ServeSettingsError as e:
        message = str(e)
        for field, flag in flags.items():  # name the flag the user typed, not the settings field
            if message.startswith(f"{field} = "):
                message = flag + message[len(field):]
                break
        raise CliError(message) from e


def _check_device(text: str | None) -> None:
    """Refuse a --device this torch cannot use, before the port is bound or a weight is read."""
    if text is None:
        return
    import torch

    try:
        device = torch.device(text)
    except RuntimeError as e:
        raise CliError(f"--device {text!r} is not a device: {e}") from e
    if device.type == "cpu":
        return
    backend = getattr(torch, device.type, None)  # torch.cuda, torch.xpu, torch.mps ...
    is_available = getattr(backend, "is_available", None)
    if not callable(is_available):
        raise CliError(f"--device {text!r} is not supported; use cpu or cuda[:N]")
    if not is_available():
        if device.type == "cuda" and torch.version.cuda is None:
            raise CliError(f"--device {text!r}: this torch ({torch.__version__}) is built without CUDA; use --device cpu")
        raise CliError(f"--device {text!r}: no {device.type} device is available; use --device cpu")
    device_count = getattr(backend, "device_count", None)
    if device.index is not None and callable(device_count) and device.index >= device_count():
        count, kind = device_count(), device.type
        raise CliError(f"--device {text!r}: this machine has {count} {kind} device(s), {kind}:0 to {kind}:{count - 1}")


def _configure_server_logging(verbose: bool, access_log: bool) -> None:
    # the root logger stays at WARNING (common.configure_logging); the server's lifecycle lines are INFO
    level = logging.DEBUG if verbose else logging.INFO
    logging.getLogger("layerstream.server").setLevel(level)
    logging.getLogger("uvicorn.error").setLevel(level)
    if access_log:
        logging.getLogger("uvicorn.access").setLevel(logging.INFO)


def _print_ready(url: str) -> None:
    print(f"{READY_PREFIX}{url}", file=sys.stderr, flush=True)
