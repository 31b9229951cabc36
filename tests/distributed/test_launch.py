"""The torchrun launcher and the process-group helpers."""

from __future__ import annotations

import datetime
import sys

import pytest
import torch

from layerstream.distributed import launch
from layerstream.distributed.process_group import backend_for, collective_timeout, init_distributed

# ranks on loopback ports chosen by free_port, timeouts sized for a 2-core machine: on one xdist worker, one group at a time
pytestmark = pytest.mark.xdist_group("ranks")


def test_torchrun_command_runs_the_same_layerstream_command_in_n_ranks_on_loopback():
    command = launch.torchrun_command(3, ["generate", "tiny-wan", "--seed", "5"], master_port=29555)
    assert command[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert command[command.index("--nproc-per-node") + 1] == "3"
    assert command[command.index("--master-addr") + 1] == "127.0.0.1"
    assert command[command.index("--master-port") + 1] == "29555"
    assert command[-6:] == ["-m", "layerstream", "generate", "tiny-wan", "--seed", "5"]


def test_launch_torchrun_runs_every_rank_and_returns_the_exit_code():
    # (0 where every rank succeeds: `generate --nproc 2`, tests/cli/test_generate_cli.py, goes through it)
    assert launch.launch_torchrun(2, ["no-such-subcommand"]) != 0


@pytest.mark.parametrize("nproc", [0, -1, 2.0, True, "2"])
def test_launch_torchrun_rejects_a_bad_nproc(nproc):
    with pytest.raises(ValueError, match="nproc"):
        launch.launch_torchrun(nproc, ["--help"])


def test_a_launched_rank_never_launches_again(monkeypatch):
    monkeypatch.setenv(launch.LAUNCHED_ENV, "2")
    assert launch.in_launched_rank()
    with pytest.raises(RuntimeError, match="inside a rank"):
        launch.launch_torchrun(2, ["--help"])


def test_rank_info_and_gather_objects_without_a_group(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert launch.rank_info() == (0, 1)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert launch.rank_info() == (3, 4)
    assert launch.gather_objects({"a": 1}) == [{"a": 1}]


def test_backend_follows_the_device():
    assert backend_for("cpu") == "gloo"
    assert backend_for(torch.device("cuda", 1)) == "cpu:gloo,cuda:nccl"
    with pytest.raises(ValueError, match="meta"):
        backend_for("meta")


def test_collective_timeout_from_the_environment(monkeypatch):
    monkeypatch.delenv("LAYERSTREAM_COLLECTIVE_TIMEOUT", raising=False)
    assert collective_timeout() == datetime.timedelta(seconds=300)
    monkeypatch.setenv("LAYERSTREAM_COLLECTIVE_TIMEOUT", "12.5")
    assert collective_timeout() == datetime.timedelta(seconds=12.5)
    for bad in ("0", "-3", "soon", "inf", "nan"):
        monkeypatch.setenv("LAYERSTREAM_COLLECTIVE_TIMEOUT", bad)
        with pytest.raises(ValueError, match=f"LAYERSTREAM_COLLECTIVE_TIMEOUT = '{bad}'"):
            collective_timeout()


def test_init_distributed_outside_torchrun_says_how_to_launch(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="torchrun"):
        init_distributed("cpu")


def test_without_nproc_drops_the_flag_and_its_value_only():
    argv = ["generate", "--nproc", "2", "--seed", "3", "--nproc=4", "--model", "tiny-flux"]
    assert launch.without_nproc(argv) == ["generate", "--seed", "3", "--model", "tiny-flux"]
    assert launch.without_nproc(["serve", "m", "--port", "0"]) == ["serve", "m", "--port", "0"]
