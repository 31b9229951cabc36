"""Helpers for the server tests: starting `layerstream serve` as a real subprocess on a free loopback port, and talking to it.

Servers are started with ``--port 0`` (the kernel picks a free port, so there is no race between finding a
port and binding it) and found through their ready line. Output goes to a log file, never a pipe: a pipe
nobody reads fills up and blocks the server. Every fixture stops its servers in teardown (`stop_all`) and holds
each to its exit code: 0 after the SIGTERM it sends, unless a test ended the server and checked the code itself.
"""

from __future__ import annotations

import base64
import io
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

from fault_injection import FAULT_PROMPT_ENV

IMAGES = "/v1/images/generations"
EDITS = "/v1/images/edits"
VIDEOS = "/v1/videos/generations"
READY = re.compile(r"layerstream serve: ready on (http://\S+)")
STARTUP_TIMEOUT_S = 120.0


@dataclass
class ServerProcess:
    process: subprocess.Popen
    url: str
    log_path: Path
    ended_by_test: bool = False
    """A test ended the server itself (`terminate`, `kill`, `wait_exit`) and checked its exit code there."""

    def client(self, timeout: float = 60.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM, then wait for exit: the exit code, for the caller to check; kills it if it does not stop in
        time (and raises)."""
        self.ended_by_test = True
        if self.process.poll() is None:
            self.send_stop_signal()
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def send_stop_signal(self) -> None:
        self.process.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.ended_by_test = True
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def begin_stop(self) -> None:
        """Fixture teardown, first half: SIGTERM to a server no test ended, which drains and exits."""
        if not self.ended_by_test and self.process.poll() is None:
            self.send_stop_signal()

    def finish_stop(self, timeout: float = 60.0) -> None:
        """Fixture teardown, second half: the server must exit 0 (a crash between tests, or a stop that fails,
        shows here); one a test ended is only made sure of."""
        if self.ended_by_test:
            self.kill()
            return
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        assert code == 0, f"the server exited {code} at teardown (0 expected after its SIGTERM):\n{self.log()[-6000:]}"


def stop_all(servers: Iterable[ServerProcess]) -> None:
    """Stop every server, all signalled first so that they exit side by side (an idle tiny server takes ~5 s
    from SIGTERM to its exit, most of it after `serve` returned), each held to exit 0; every one is stopped even
    when one fails, then the first failure is raised."""
    servers, failures = list(servers), []
    for server in servers:
        server.begin_stop()
    for server in servers:
        try:
            server.finish_stop()
        except BaseException as e:
            server.kill()
            failures.append(e)
    if failures:
        raise failures[0]


def start_server(
    model: str, *args: str, folder: Path, env: dict[str, str] | None = None, fault_prompt: str | None = None
) -> ServerProcess:
    """Start ``layerstream serve MODEL --port 0 ARGS`` and return once /health answers.

    With `fault_prompt`, the server runs through `serve_with_fault.py`: that prompt raises inside a block.
    """
    log_path = folder / "server.log"
    # the test worker's intra-op thread count comes with os.environ (tests/conftest.py)
    full_env = {**os.environ, **(env or {})}
    if fault_prompt is None:
        launcher = [sys.executable, "-m", "layerstream"]
    else:
        launcher = [sys.executable, str(Path(__file__).with_name("serve_with_fault.py"))]
        full_env[FAULT_PROMPT_ENV] = fault_prompt
    # each server its own job history: one folder holds one server's (a second is refused)
    data_dir = [] if "--data-dir" in args else ["--data-dir", str(folder / "data")]
    command = [*launcher, "serve", model, "--port", "0", *data_dir, *args]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=full_env)
    server = None
    try:
        url = _wait_for_ready(process, log_path)
        server = ServerProcess(process, url, log_path)
        with server.client(timeout=5.0) as client:
            assert client.get("/health").status_code == 200
        return server
    except BaseException:
        if process.poll() is None:
            process.kill()
            process.wait(10)
        raise


def _wait_for_ready(process: subprocess.Popen, log_path: Path) -> str:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        match = READY.search(log_path.read_text(errors="replace"))
        if match:
            return match.group(1)
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{log_path.read_text(errors='replace')}")
        time.sleep(0.05)
    raise TimeoutError(f"server not ready after {STARTUP_TIMEOUT_S} s:\n{log_path.read_text(errors='replace')}")


def decode_png(data: str | bytes) -> np.ndarray:
    """The pixels of a PNG, given as its bytes or as base64 text (a response's b64_json)."""
    from PIL import Image

    png = base64.b64decode(data) if isinstance(data, str) else data
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


def metric(client: httpx.Client, name: str, labels: str = "") -> float:
    """One sample of /metrics, e.g. ``metric(c, "layerstream_requests_total", 'endpoint="/health",status="200"')``."""
    text = client.get("/metrics").text
    pattern = "^" + re.escape(name) + (r"\{" + re.escape(labels) + r"\}" if labels else "") + r" (\S+)$"
    match = re.search(pattern, text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def closed_by_server(s: socket.socket) -> bool:
    """Whether the server has closed the client socket `s` (read without waiting)."""
    s.setblocking(False)
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def wait_until(condition: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.02)
