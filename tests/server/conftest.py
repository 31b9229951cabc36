"""Fixtures of the server tests: servers started per module or shared by every module, always stopped in
teardown and held to their exit code there (`serve_harness.stop_all`); a tiny Kontext folder."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from serve_harness import ServerProcess, start_server, stop_all


@pytest.fixture(scope="session")
def kontext_folder(tmp_path_factory) -> Path:
    """A tiny Flux Kontext saved as a model folder: the image model that takes an input image (edits)."""
    from diffusers import FluxKontextPipeline

    from layerstream.models.tiny import build_tiny_pipeline_components

    folder = tmp_path_factory.mktemp("tiny-flux-kontext")
    FluxKontextPipeline(**build_tiny_pipeline_components("tiny-flux")).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def server_factory(tmp_path_factory, layerstream_cache) -> Iterator[Callable[..., ServerProcess]]:
    """Start servers for one module; all of them are stopped when the module is done, each exiting 0."""
    started: list[ServerProcess] = []

    def start(model: str, *args: str, env: dict[str, str] | None = None, fault_prompt: str | None = None) -> ServerProcess:
        folder = tmp_path_factory.mktemp("serve")
        server = start_server(model, *args, folder=folder, env=env, fault_prompt=fault_prompt)
        started.append(server)
        return server

    try:
        yield start
    finally:
        stop_all(started)


@pytest.fixture(scope="session")
def shared_server(tmp_path_factory, layerstream_cache) -> Iterator[Callable[[str], ServerProcess]]:
    """``shared_server(MODEL)``: the server ``layerstream serve MODEL`` starts with its defaults, one per model
    for every module (of this xdist worker) that asks, stopped when the session ends (each exiting 0). Each start
    costs an interpreter, torch and a model load; a test on a shared server reads only what its own requests return
    (outputs, errors, how a list changed), never the whole job history or a counter's absolute value."""
    started: dict[str, ServerProcess] = {}

    def get(model: str) -> ServerProcess:
        if model not in started:
            started[model] = start_server(model, folder=tmp_path_factory.mktemp("shared-serve"))
        server = started[model]
        assert server.process.poll() is None, f"the shared {model} server exited, after an earlier test:\n{server.log()}"
        return server

    try:
        yield get
    finally:
        stop_all(started.values())
