"""`Omni` with `weight_transfer: "allgather"` under torchrun, as a one-process script is written: each rank joins
the group by itself (nothing calls `init_distributed`), keeps half of each block, and makes the output of one
process bit for bit. One torchrun launch of two CPU ranks (gloo) on loopback. An explicit `init_distributed`
before `Omni` is what `generate --nproc` does, tested there (`tests/cli/test_generate_cli.py`, the
data-parallel ranks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from layerstream.distributed.launch import free_port

# ranks on loopback ports chosen by free_port, timeouts sized for a 2-core machine: one group at a time
pytestmark = pytest.mark.xdist_group("ranks")

HERE = Path(__file__).parent
RUN_TIMEOUT_S = 240


def test_omni_joins_torchrun_group_by_itself_and_matches_one_process(tmp_path, monkeypatch):
    sys.path.insert(0, str(HERE))
    try:
        from omni_rank import CONFIG, REQUEST
    finally:
        sys.path.remove(str(HERE))
    from layerstream import Omni

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    one = Omni(model="tiny-wan", diffusion_offload_config=CONFIG)  # one process: allgather is a plain copy
    try:
        expected = np.asarray(one.generate(**REQUEST, keep_raw=True).raw)
        one_process_host_bytes = one.stats().host_bytes
    finally:
        one.close()

    env = dict(os.environ, LAYERSTREAM_COLLECTIVE_TIMEOUT="60")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--nnodes", "1",
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(HERE / "omni_rank.py"), str(tmp_path),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    for rank in range(2):
        run = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert run["initialized_before"] is False and run["initialized_after"] is True  # it joined by itself
        assert run["world_size"] == 2 and run["device"] == "cpu"
        got = np.asarray(run["raw"], dtype=run["dtype"])
        assert got.dtype == expected.dtype and np.array_equal(got, expected)  # bit for bit, as one process
        assert run["host_bytes"] < 0.6 * one_process_host_bytes  # each rank keeps its half of the blocks
