"""`layerstream serve` startup errors: one line, exit code 2, before any model loads or any rank starts.

The first test runs a real process (its exit status, its stderr holding the one line and no traceback); the
others run the command line in this process, where loading a model, starting ranks or serving raises instead
(`serve`), which shows that each error came before them.
"""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
import torch


class Started(AssertionError):
    """What `serve` raises where the command went past its checks: a model loaded, ranks or a server started."""


@pytest.fixture
def serve(layerstream_cli, monkeypatch):
    import layerstream.distributed.launch
    import layerstream.omni
    import layerstream.server.http_server

    def refuse(what: str):
        def started(*args, **kwargs):
            raise Started(f"{what} before the error")

        return started

    monkeypatch.setattr(layerstream.omni, "Omni", refuse("a model loaded"))
    monkeypatch.setattr(layerstream.distributed.launch, "start_torchrun", refuse("ranks started"))
    monkeypatch.setattr(layerstream.server.http_server, "run_server", refuse("the server started"))
    return lambda *args: layerstream_cli("serve", *args)


def _error_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("layerstream: error:")]


def test_bad_offload_config_is_one_line_and_exit_2_before_loading():
    result = subprocess.run(
        [sys.executable, "-m", "layerstream", "serve", "tiny-wan", "--diffusion-offload-config", '{"mode": "layer", "components": ["dit"], "colour": 1}'],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    assert _error_lines(result) == result.stderr.strip().splitlines()  # nothing but the error line
    assert "--diffusion-offload-config" in result.stderr and "colour" in result.stderr
    assert "Loading pipeline" not in result.stderr and "Traceback" not in result.stderr


def test_bad_flags_name_the_flag(serve):
    result = serve("tiny-wan", "--max-queue", "-1")
    assert result.returncode == 2 and _error_lines(result) == ["layerstream: error: --max-queue = -1 is not valid; expected an integer from 0 to 1000000"]
    result = serve("tiny-wan", "--link-gbps", "0")
    assert result.returncode == 2 and "--link-gbps" in result.stderr


def test_a_busy_port_is_reported_before_loading(serve):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        result = serve("tiny-wan", "--port", str(taken.getsockname()[1]))
    assert result.returncode == 2
    assert len(_error_lines(result)) == 1 and "cannot bind" in result.stderr
    assert "Loading pipeline" not in result.stderr


@pytest.mark.parametrize(
    "flag, value, allowed",
    [("--shutdown-timeout", "-1", "seconds from 0 to 86400"), ("--shutdown-timeout", "nan", "seconds from 0"),
     ("--max-work", "0", "an integer from 1"), ("--max-batch-size", "0", "an integer from 1 to 64")],
)  # fmt: skip
def test_bad_limits_name_the_flag(serve, flag, value, allowed):
    result = serve("tiny-wan", flag, value)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == _error_lines(result)
    assert f"layerstream: error: {flag} = " in result.stderr and allowed in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch that cannot use CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_a_cuda_device_on_a_torch_without_it_is_one_line_before_loading(serve, device):
    result = serve("tiny-wan", "--device", device, "--port", "0")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == _error_lines(result)  # no traceback, no log line, nothing loaded
    assert f"--device '{device}'" in result.stderr and "--device cpu" in result.stderr


@pytest.mark.parametrize(
    "flag, value, allowed",
    [("--nproc", "0", "an integer from 1 to 64"), ("--nproc", "65", "an integer from 1 to 64"),
     ("--collective-timeout-s", "0", "seconds > 0 and at most 86400"),
     ("--collective-timeout-s", "nan", "seconds > 0 and at most 86400")],
)  # fmt: skip
def test_bad_rank_flags_name_the_flag_before_anything_starts(serve, flag, value, allowed):
    result = serve("tiny-wan", "--nproc", "2", flag, value) if flag != "--nproc" else serve("tiny-wan", flag, value)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == _error_lines(result)  # no rank started, nothing loaded
    assert f"layerstream: error: {flag} = {value} is not valid; expected {allowed}" in result.stderr


def test_a_bad_config_with_nproc_is_refused_before_any_rank_starts(serve):
    result = serve("tiny-wan", "--nproc", "2", "--diffusion-offload-config", '{"mode": "layer", "components": ["dit"], "colour": 1}')
    assert result.returncode == 2 and result.stderr.strip().splitlines() == _error_lines(result)
    assert "colour" in result.stderr


def test_a_device_index_with_several_ranks_is_refused(serve):
    result = serve("tiny-wan", "--nproc", "2", "--device", "cpu:0")
    assert result.returncode == 2 and result.stderr.strip().splitlines() == _error_lines(result)
    assert "--device 'cpu:0' with 2 ranks is not valid" in result.stderr and "pass --device cpu" in result.stderr
