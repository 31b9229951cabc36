"""Running the app under uvicorn, with a shutdown that drains the queue before waiting on open requests.
On SIGTERM uvicorn waits for open requests, and queued requests are open too: `DrainingServer` closes the queue
first (waiting requests answered 503), the running generation has --shutdown-timeout seconds, then is stopped
at its next step, and uvicorn waits `STOP_WAIT_SECONDS` more at most. The process exits 0 within the sum."""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
from collections.abc import Callable, Iterator

import uvicorn

from layerstream.server.access import AccessSettings
from layerstream.server.app import create_app
from layerstream.server.connections import guarded_h11
from layerstream.server.jobs.manager import JobManager
from layerstream.server.service import GenerationService
from layerstream.server.settings import STOP_WAIT_SECONDS

logger = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, calling `on_ready(url)` once listening and `on_drain()` first thing on shutdown."""

    def __init__(self, config: uvicorn.Config, *, on_ready: Callable[[], None], on_drain: Callable[[], None]):
        super().__init__(config)
        self._on_ready = on_ready
        self._on_drain = on_drain

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and not self.should_exit:
            self._on_ready()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._on_drain()
        await super().shutdown(sockets=sockets)


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), not yet listening: before the model loads, a busy port costs seconds."""
    addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, address = addresses[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # restart at once after a stop (TIME_WAIT)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def run_server(
    service: GenerationService, sock: socket.socket, *, on_ready: Callable[[str], None], access_log: bool = True,
    on_stopper: Callable[[Callable[[], None]], None] | None = None, jobs: JobManager | None = None, ui: bool = True,
    access: AccessSettings | None = None,
) -> None:
    """Serve on the bound `sock` until SIGTERM or SIGINT, then shut down gracefully. `on_stopper` receives a
    function that starts the same shutdown from any thread (a lost rank)."""
    config = uvicorn.Config(
        create_app(service, jobs, ui=ui, access=access or AccessSettings(bind_host=service.settings.host)),
        http=guarded_h11(),  # closes connections that never send a whole request head
        log_config=None,  # the command line configured logging; uvicorn's loggers propagate to it
        access_log=access_log, lifespan="on",
        # the service stops the running generation after --shutdown-timeout; this bounds the wait for its answer
        timeout_graceful_shutdown=service.settings.shutdown_timeout + STOP_WAIT_SECONDS,
    )
    host, port = sock.getsockname()[:2]
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    server = DrainingServer(config, on_ready=lambda: on_ready(url), on_drain=service.drain)
    if on_stopper is not None:
        on_stopper(lambda: setattr(server, "should_exit", True))  # uvicorn's main loop polls it
    with _exit_quietly_after_signal():
        server.run(sockets=[sock])


@contextlib.contextmanager
def _exit_quietly_after_signal() -> Iterator[None]:
    """Make the signal uvicorn raises again after its graceful shutdown a no-op, so the process exits 0."""
    def ignore(signum: int, frame: object) -> None:
        logger.debug("signal %d after shutdown: ignored", signum)

    previous = {sig: signal.signal(sig, ignore) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
