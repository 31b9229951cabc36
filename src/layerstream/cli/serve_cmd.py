"""`layerstream serve MODEL`: serve one offloaded pipeline over HTTP (OpenAI-style images and videos APIs).
Every argument is checked and the port bound before the model loads, so that mistakes cost seconds; the ready
line ("layerstream serve: ready on http://127.0.0.1:8000") goes to stderr once requests are accepted."""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
import tempfile
from pathlib import Path

from layerstream.cli.common import (
    MODEL_SOURCES,
    CliError,
    add_config_argument,
    add_model_arguments,
    add_vae_arguments,
    add_work_cap_argument,
    check_device_arg,
    component_files,
    fetch_before_ranks,
    parse_config_args,
)
from layerstream.cli.serve_access import access_settings, add_access_arguments, flag_error
from layerstream.server.settings import (  # plain data: no serve extra
    DEFAULT_BATCH_WAIT_MS,
    DEFAULT_HOST,
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_FRAMES,
    DEFAULT_MAX_IMAGE_BYTES,
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_MAX_QUEUE,
    DEFAULT_MAX_SIDE_PIXELS,
    DEFAULT_PORT,
    DEFAULT_SHUTDOWN_TIMEOUT_S,
)
from layerstream.wording import format_bytes

READY_PREFIX = "layerstream serve: ready on "
MAX_NPROC = 64
# shorter than a process group's 300 s: a lost or stuck rank is answered 503 within a minute (a gather takes far less)
DEFAULT_SERVE_COLLECTIVE_TIMEOUT_S = 60.0
MAX_COLLECTIVE_TIMEOUT_S = 86_400.0
# where rank 0 writes its pid (set by the launcher), so that a SIGTERM to the launcher reaches rank 0 alone
RANK0_PID_ENV = "LAYERSTREAM_SERVE_RANK0_PID_FILE"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, f'{MODEL_SOURCES} ("tiny-wan", "tiny-flux", ...)')
    add_vae_arguments(parser)
    parser.add_argument(
        "--omni", action="store_true",
        help="accepted for vllm-omni's command line (vllm serve MODEL --omni) and ignored: layerstream always serves "
        "the offloaded diffusion pipeline",
    )  # fmt: skip
    add_config_argument(parser)
    parser.add_argument("--host", default=DEFAULT_HOST, help=f"address to bind (default: {DEFAULT_HOST}, loopback only)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"TCP port (default: {DEFAULT_PORT}; 0 picks a free port)")
    parser.add_argument("--device", default=None, help="device (default: cuda if available, else cpu)")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: as saved)")
    add_work_cap_argument(parser, value_type=int, refusal="a 400", note="; /health states it")
    for flag, kind, default, metavar, help_text in (
        ("--max-queue", int, DEFAULT_MAX_QUEUE, None,
         f"requests that may wait behind the running one; more get 429 (default: {DEFAULT_MAX_QUEUE})"),
        ("--max-frames", int, DEFAULT_MAX_FRAMES, None,
         f"largest num_frames of a video request (default: {DEFAULT_MAX_FRAMES})"),
        ("--max-size", int, DEFAULT_MAX_SIDE_PIXELS, None,
         f"largest width or height (default: {DEFAULT_MAX_SIDE_PIXELS})"),
        ("--max-body-bytes", int, DEFAULT_MAX_BODY_BYTES, None,
         f"largest request body, not counting an input image (default: {format_bytes(DEFAULT_MAX_BODY_BYTES)})"),
        ("--max-image-bytes", int, DEFAULT_MAX_IMAGE_BYTES, None, "largest input image file of /v1/images/edits and "
         f"image-to-video requests (default: {format_bytes(DEFAULT_MAX_IMAGE_BYTES)})"),
        ("--max-image-pixels", int, DEFAULT_MAX_IMAGE_PIXELS, None,
         f"largest input image in pixels, width x height (default: {DEFAULT_MAX_IMAGE_PIXELS:,}, 4096 x 4096)"),
        ("--shutdown-timeout", float, DEFAULT_SHUTDOWN_TIMEOUT_S, "SECONDS", "after SIGTERM, how long the running "
         f"generation may go on before it is stopped at its next step (default: {DEFAULT_SHUTDOWN_TIMEOUT_S:g})"),
        ("--max-batch-size", int, DEFAULT_MAX_BATCH_SIZE, "N", "run up to N queued requests that share a size, "
         "frames, steps, guidance and negative prompt as one pipeline call, each streamed block serving all of them "
         "(default: 1, every request alone)"),
        ("--batch-wait-ms", float, DEFAULT_BATCH_WAIT_MS, "MS",
         f"longest a request waits for others to join its batch (default: {DEFAULT_BATCH_WAIT_MS:g})"),
        ("--nproc", int, None, "N", "serve with N data-parallel ranks on this machine (torchrun), one device each; "
         "rank 0 answers HTTP and hands out waves of up to N requests. Without a config the DiT uses allgather: "
         "each rank keeps 1/N of its blocks' host bytes"),
        ("--collective-timeout-s", float, DEFAULT_SERVE_COLLECTIVE_TIMEOUT_S, "SECONDS", "with several ranks: how "
         "long a rank waits for the others in one collective before the server answers 503 and exits non-zero "
         f"(default: {DEFAULT_SERVE_COLLECTIVE_TIMEOUT_S:g})"),
        ("--data-dir", Path, None, "FOLDER", "where the job history (SQLite) and its outputs are kept; one server "
         "per folder (default: <layerstream cache>/server)"),
        ("--max-jobs", int, None, "N", "keep at most N finished jobs; the oldest go first (default: no limit)"),
        ("--max-output-bytes", int, None, "BYTES",
         "keep at most BYTES of job outputs; the oldest finished jobs go first (default: no limit)"),
    ):  # fmt: skip
        dest = "max_side_pixels" if flag == "--max-size" else None  # the setting's name
        parser.add_argument(flag, type=kind, default=default, metavar=metavar, dest=dest, help=help_text)
    parser.add_argument("--link-gbps", type=float, default=None, help="CPU only: simulated host link bandwidth in GB/s")
    parser.add_argument("--no-access-log", dest="access_log", action="store_false", help="no log line per request")
    parser.add_argument("--no-ui", dest="ui", action="store_false", help="no web page at / (the API only)")
    add_access_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Check arguments, bind, load, serve until SIGTERM/SIGINT; 0 after a graceful stop, CliError on user errors."""
    world_size = _world_size()
    _check_rank_flags(args)
    num_ranks = max(args.nproc or 1, world_size)
    from layerstream.cli.generate_cmd import DATA_PARALLEL_CONFIG

    default = DATA_PARALLEL_CONFIG if num_ranks > 1 else None
    config = parse_config_args(args, default)  # before anything loads
    component_files(args)  # a malformed --component, before binding
    if args.link_gbps is not None and not args.link_gbps > 0:
        raise CliError(f"--link-gbps = {args.link_gbps!r} is not valid; expected a number > 0")
    settings = _settings(args)
    args.access = access_settings(args, settings.host)
    history = _history_settings(args)
    check_device_arg("--device", args.device)
    if num_ranks > 1 and args.device is not None and ":" in args.device:
        kind = args.device.split(":")[0]
        message = f"--device {args.device!r} with {num_ranks} ranks is not valid: each rank takes its own device"
        raise CliError(f"{message} ({kind}:LOCAL_RANK); pass --device {kind}")
    if num_ranks > 1 and world_size == 1:
        return _launch_ranks(args, settings)
    if world_size > 1:
        return _serve_rank(args, config, settings, history)

    # the server's own modules need the serve extra: the command line names it in one line (cli/main.py)
    from layerstream.server.jobs.manager import JobManager
    from layerstream.server.http_server import run_server
    from layerstream.server.service import GenerationService
    from layerstream.models.generation_size import server_requests
    from layerstream.models.loading import ModelLoadError
    from layerstream.omni import GenerationError, Omni
    from layerstream.errors import OffloadError

    _configure_server_logging(getattr(args, "verbose", False), args.access_log)
    sock = _bind(settings)
    store = None
    try:
        store = _open_history(history)  # a folder in use is one line now, not after a long load
        try:
            omni = Omni(
                model=args.model, diffusion_offload_config=config, device=args.device, dtype=args.dtype,
                simulated_link_gbps=args.link_gbps, revision=args.revision, variant=args.variant,
                components=component_files(args),
                requests=server_requests(settings),  # the host reserve of "auto" is sized to the largest allowed
            )  # fmt: skip
        except (ModelLoadError, GenerationError, OffloadError) as e:
            raise CliError(" ".join(str(e).split())) from e
        except RuntimeError as e:
            if "device" in str(e).lower():
                raise CliError(f"--device {args.device}: {e}") from e
            raise
        service = GenerationService(omni, settings)
        jobs = JobManager(service, store)
        store = None  # the app closes it, through the manager, when it stops
        run_server(service, sock, on_ready=_print_ready, access_log=args.access_log, jobs=jobs, ui=args.ui, access=args.access)
    finally:
        sock.close()
        if store is not None:
            store.close()
    print("layerstream serve: stopped", file=sys.stderr, flush=True)
    return 0


# each setting's flag; every one but the names is read from the argument of its own name
_SETTINGS_FLAGS = {
    "max_queue": "--max-queue", "max_frames": "--max-frames", "max_side_pixels": "--max-size", "max_work": "--max-work",
    "max_body_bytes": "--max-body-bytes", "shutdown_timeout": "--shutdown-timeout",
    "max_image_bytes": "--max-image-bytes", "max_image_pixels": "--max-image-pixels",
    "max_batch_size": "--max-batch-size", "batch_wait_ms": "--batch-wait-ms", "port": "--port", "host": "--host",
    "served_model_names": "--served-model-name",
}  # fmt: skip


def _settings(args: argparse.Namespace):
    from layerstream.server.settings import ServeSettings, ServeSettingsError

    fields = {field: getattr(args, field) for field in _SETTINGS_FLAGS if field != "served_model_names"}
    try:
        return ServeSettings(**fields, served_model_names=tuple(args.served_model_name))
    except ServeSettingsError as e:
        raise flag_error(e, _SETTINGS_FLAGS) from e


def _history_settings(args: argparse.Namespace):
    from layerstream.models.cache import cache_root
    from layerstream.server.jobs.settings import HistorySettings, HistorySettingsError

    data_dir = args.data_dir if args.data_dir is not None else cache_root() / "server"
    try:
        return HistorySettings(
            data_dir=data_dir.expanduser(), max_jobs=args.max_jobs, max_output_bytes=args.max_output_bytes
        )
    except HistorySettingsError as e:
        raise flag_error(e, {"max_jobs": "--max-jobs", "max_output_bytes": "--max-output-bytes"}) from e


def _bind(settings):
    from layerstream.server.http_server import bind_socket

    try:
        return bind_socket(settings.host, settings.port)
    except OSError as e:
        raise CliError(f"--host {settings.host} --port {settings.port}: cannot bind: {e.strerror or e}") from e


def _open_history(history):
    from layerstream.server.jobs.store import JobStore, JobStoreError

    try:
        return JobStore(history)
    except JobStoreError as e:
        raise CliError(str(e).replace("data_dir = ", "--data-dir ", 1)) from e


def _configure_server_logging(verbose: bool, access_log: bool) -> None:
    # the root logger stays at WARNING (common.configure_logging); the server's lifecycle lines are INFO
    level = logging.DEBUG if verbose else logging.INFO
    logging.getLogger("layerstream.server").setLevel(level)
    logging.getLogger("uvicorn.error").setLevel(level)
    if access_log:
        logging.getLogger("uvicorn.access").setLevel(logging.INFO)


def _print_ready(url: str) -> None:
    print(f"{READY_PREFIX}{url}", file=sys.stderr, flush=True)


def _check_rank_flags(args: argparse.Namespace) -> None:
    if args.nproc is not None and not 1 <= args.nproc <= MAX_NPROC:
        raise CliError(f"--nproc = {args.nproc} is not valid; expected an integer from 1 to {MAX_NPROC}")
    timeout = args.collective_timeout_s
    if not (math.isfinite(timeout) and 0 < timeout <= MAX_COLLECTIVE_TIMEOUT_S):
        raise CliError(
            f"--collective-timeout-s = {timeout:g} is not valid; expected seconds > 0 and at most {MAX_COLLECTIVE_TIMEOUT_S:g}"
        )


def _world_size() -> int:
    """WORLD_SIZE under torchrun, else 1, without importing torch.distributed."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError as e:
        raise CliError(f"WORLD_SIZE = {os.environ['WORLD_SIZE']!r} in the environment is not an integer") from e


def _launch_ranks(args: argparse.Namespace, settings) -> int:
    """Run this command without --nproc in N ranks under torchrun; SIGTERM and SIGINT go to rank 0 alone,
    which drains and stops the others, so that every rank exits 0."""
    from layerstream.distributed.launch import start_torchrun, without_nproc

    if settings.port != 0:  # a busy port is one line now, not an error in rank 0 after the others started
        _bind(settings).close()
    forwarded = without_nproc(sys.argv[1:])
    with tempfile.TemporaryDirectory(prefix="layerstream-serve-") as folder:
        pid_file = Path(folder) / "rank0.pid"
        extra_env = {RANK0_PID_ENV: str(pid_file), **fetch_before_ranks(args)}
        process = start_torchrun(args.nproc, forwarded, extra_env=extra_env)

        def pass_on(signum: int, frame: object) -> None:
            try:
                os.kill(int(pid_file.read_text()), signal.SIGTERM)
            except (OSError, ValueError):  # rank 0 not up yet (or gone): torchrun stops every rank
                process.send_signal(signal.SIGTERM)

        previous = {sig: signal.signal(sig, pass_on) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            return process.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


class _RankModel:
    """The model of one serving rank: rank 0 fetches (or builds) it while the others wait, then each loads
    what it fetched from the cache, so every rank loads the same commit."""

    def __init__(self, args: argparse.Namespace, config, settings):
        self.args, self.config, self.settings = args, config, settings
        self.source = None

    def prepare(self) -> None:  # on rank 0, before the others go on
        from layerstream.models.hub import looks_like_hub_id
        from layerstream.models.loading import resolve_model
        from layerstream.models.tiny import is_tiny_model_name

        args = self.args
        if is_tiny_model_name(args.model) or looks_like_hub_id(args.model):
            self.source = resolve_model(args.model, revision=args.revision, variant=args.variant, from_files=frozenset(component_files(args)))

    def load(self, setup, group):
        from layerstream.models.generation_size import server_requests
        from layerstream.models.hub import names_hub_repo
        from layerstream.models.loading import resolve_model
        from layerstream.omni import Omni

        args, model = self.args, self.source or self.args.model
        if self.source is None and names_hub_repo(args.model):
            model = resolve_model(args.model, revision=args.revision, variant=args.variant, offline=True, from_files=frozenset(component_files(args)))
        return Omni(model=model, diffusion_offload_config=self.config, device=setup.device, dtype=args.dtype,
                    simulated_link_gbps=args.link_gbps, process_group=group, requests=server_requests(self.settings),
                    components=component_files(args))  # fmt: skip


def _follow(runtime, channel, rank: int) -> int:
    """A rank other than 0: run the waves rank 0 sends until it says to leave (0) or the group is lost (1)."""
    from layerstream.server.ranks import RankGroupError, serve_follower

    try:
        serve_follower(runtime, channel)
    except RankGroupError as e:
        print(f"layerstream serve: rank {rank}: {e}", file=sys.stderr, flush=True)
        return 1
    print(f"layerstream serve: rank {rank} stopped", file=sys.stderr, flush=True)
    return 0


def _serve_rank(args: argparse.Namespace, config, settings, history) -> int:
    """One rank of several: rank 0 serves HTTP and the history and leads the waves; the others run them."""
    from layerstream.distributed.process_group import destroy_distributed
    from layerstream.models.loading import ModelLoadError
    from layerstream.omni import GenerationError
    from layerstream.errors import OffloadError
    from layerstream.server.jobs.manager import JobManager
    from layerstream.server.ranks import ControlChannel, RankRuntime, join_serving_ranks
    from layerstream.server.http_server import run_server
    from layerstream.server.service import GenerationService, RankGroup

    _configure_server_logging(getattr(args, "verbose", False), args.access_log)
    rank = int(os.environ.get("RANK", "0"))
    sock = store = None
    if rank == 0:
        sock = _bind(settings)
        try:
            store = _open_history(history)  # the history lives with the HTTP rank; a folder in use is one line now
        except CliError:
            sock.close()
            raise
    else:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches rank 0, which stops us
    timeout = args.collective_timeout_s
    channel = None

    model = _RankModel(args, config, settings)
    try:
        setup = join_serving_ranks(args.device, timeout, model.prepare)
        print(f"layerstream serve: rank {setup.rank} of {setup.world_size} (pid {os.getpid()}) on {setup.device}",
              file=sys.stderr, flush=True)  # fmt: skip
        if rank == 0 and os.environ.get(RANK0_PID_ENV):
            Path(os.environ[RANK0_PID_ENV]).write_text(str(os.getpid()))

        try:
            runtime = RankRuntime(setup, lambda group: model.load(setup, group))
        except (ModelLoadError, GenerationError, OffloadError) as e:
            raise CliError(" ".join(str(e).split())) from e
        channel = ControlChannel(setup)
        if rank != 0:
            return _follow(runtime, channel, rank)
        assert sock is not None and store is not None
        ranks = RankGroup(runtime, channel, idle_seconds=min(timeout / 4, 5.0))
        service = GenerationService(runtime.omni, settings, ranks=ranks)
        jobs = JobManager(service, store)
        store = None  # the app closes it, through the manager, when it stops

        def keep_stopper(stop) -> None:
            service.on_fatal = stop
            if service.fatal_error is not None:  # a rank was lost before the server started
                stop()

        run_server(
            service, sock, on_ready=_print_ready, access_log=args.access_log, on_stopper=keep_stopper, jobs=jobs,
            ui=args.ui, access=args.access,
        )
        if service.fatal_error is not None or not service.queue.join(0) or not service.runner.leave():
            print(f"layerstream serve: stopped: {service.fatal_error or 'the ranks could not be stopped'}",
                  file=sys.stderr, flush=True)  # fmt: skip
            return 1
        print("layerstream serve: stopped", file=sys.stderr, flush=True)
        return 0
    finally:
        if sock is not None:
            sock.close()
        if store is not None:
            store.close()
        if channel is not None:
            channel.close()
        destroy_distributed()
