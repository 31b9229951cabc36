"""Fixtures of the server tests: servers started per module, always killed in teardown."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from serve_harness import ServerProcess, start_server


@pytest.fixture(scope="module")
def server_factory(tmp_path_factory, layerstream_cache) -> Iterator[Callable[..., ServerProcess]]:
    """Start servers for one module; all of them are killed when the module is done."""
    started: list[ServerProcess] = []

    def start(model: str, *args: str, env: dict[str, str] | None = None, fault_prompt: str | None = None) -> ServerProcess:
        folder = tmp_path_factory.mktemp("serve")
        server = start_server(model, *args, folder=folder, env=env, fault_prompt=fault_prompt)
        started.append(server)
        return server

    try:
        yield start
    finally:
        for server in started:
            server.kill()
