"""Starting a multi-rank server for the tests: `layerstream serve --nproc N`, or torchrun running a test script.

Each server runs in a session of its own, so that teardown can kill torchrun and every rank with it (killing
the launcher alone would leave its ranks behind). Ranks print ``layerstream serve: rank R of N (pid P)``;
`RankServer.rank_pids` reads those lines, so a test can signal one rank.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from layerstream.distributed.launch import free_port
from layerstream.models.tiny import TINY_MODELS, ensure_tiny_model
from serve_harness import ServerProcess, _wait_for_ready

HERE = Path(__file__).parent
RANK_LINE = re.compile(r"layerstream serve: rank (\d+) of \d+ \(pid (\d+)\)")


@dataclass
class RankServer(ServerProcess):
    master_port: int | None = None
    """torchrun's store (under `script`): a test may read it as the ranks do, e.g. count its keys."""
    rebuild_gate: Path | None = None
    """Under `serve_ranks_with_fault.py`, the file whose creation lets a rebuild after a fault go on."""

    def rank_pids(self) -> dict[int, int]:
        return {int(rank): int(pid) for rank, pid in RANK_LINE.findall(self.log())}

    def send_stop_signal(self) -> None:
        """SIGTERM as `layerstream serve --nproc` passes it on: to rank 0 alone, which drains and stops the group
        (torchrun itself, signalled, would end its ranks and exit nonzero)."""
        if self.master_port is None:
            self.process.send_signal(signal.SIGTERM)  # the launcher passes it to rank 0
        else:
            os.kill(self.rank_pids()[0], signal.SIGTERM)

    def kill(self) -> None:
        """Kill the launcher, torchrun and every rank (all in the server's session)."""
        self.ended_by_test = True
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait(10)
        for pid in self.rank_pids().values():  # a rank that outlived its launcher would hold a core
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def num_store_keys(self) -> int:
        """Keys in torchrun's store now, every rank's and torchrun's own (a client of its own, as each rank has)."""
        import datetime

        import torch.distributed as dist

        assert self.master_port is not None, "started without a script: the launcher chose its own port"
        store = dist.TCPStore("127.0.0.1", self.master_port, is_master=False, timeout=datetime.timedelta(seconds=30))
        return store.num_keys()

    def wait_exit(self, timeout: float) -> int:
        """The exit code, for the caller to check (after it ended the server some way of its own)."""
        self.ended_by_test = True
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise


def start_rank_server(
    model: str, *args: str, folder: Path, nproc: int = 2, script: str | None = None, env: dict[str, str] | None = None
) -> RankServer:
    """``layerstream serve MODEL --port 0 --nproc N ARGS``, or with `script`, ``torchrun ... script serve MODEL
    --port 0 ARGS`` (a test script in this folder that runs the command line with a fault switch)."""
    if model in TINY_MODELS:
        # built here, before any rank starts: rank 0 building it on a cold cache would outlast a short
        # --collective-timeout-s while rank 1 waits (conftest builds them first only under xdist)
        ensure_tiny_model(model)
    log_path = folder / "server.log"
    # each server its own job history: one folder holds one server's (a second is refused)
    data_dir = [] if "--data-dir" in args else ["--data-dir", str(folder / "data")]
    args = (*data_dir, *args)
    pythonpath = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
    full_env = {**os.environ, "PYTHONPATH": pythonpath, **(env or {})}
    master_port = None if script is None else free_port()
    if script is None:
        command = [sys.executable, "-m", "layerstream", "serve", model, "--port", "0", "--nproc", str(nproc), *args]
    else:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--nnodes", "1",
            "--master-addr", "127.0.0.1", "--master-port", str(master_port), str(HERE / script),
            "serve", model, "--port", "0", *args,
        ]  # fmt: skip
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
    server = RankServer(process, "", log_path, master_port=master_port)
    try:
        server.url = _wait_for_ready(process, log_path)
        deadline = time.monotonic() + 30
        while len(server.rank_pids()) < nproc:  # every rank has printed its line by the time rank 0 is ready
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.05)
        return server
    except BaseException:
        server.kill()
        raise
