"""Data-parallel runs on this machine: start N ranks with torchrun (`launch_torchrun`; `start_torchrun` for a
caller that waits itself, as `serve` does to pass SIGTERM to rank 0 alone), and the helpers those ranks use.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from typing import Any

logger = logging.getLogger(__name__)

LAUNCHED_ENV = "LAYERSTREAM_LAUNCHED_NPROC"  # set (to N) in every rank `launch_torchrun` starts: none launches again


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the OS picks it; another process could take it before use)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def torchrun_command(nproc: int, module_args: list[str], *, master_port: int) -> list[str]:
    """The command `launch_torchrun` runs: N ranks of ``python -m layerstream <module_args>`` on this machine."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--nnodes", "1",
        "--master-addr", "127.0.0.1", "--master-port", str(master_port), "-m", "layerstream", *module_args,
    ]  # fmt: skip


def without_nproc(argv: list[str]) -> list[str]:
    """`argv` less its `--nproc N` (or `--nproc=N`): the command each launched rank runs."""
    kept: list[str] = []
    skip_value = False
    for arg in argv:
        if skip_value:
            skip_value = False
        elif arg == "--nproc":
            skip_value = True
        elif not arg.startswith("--nproc="):
            kept.append(arg)
    return kept


def launch_torchrun(nproc: int, module_args: list[str], *, extra_env: dict[str, str] | None = None) -> int:
    """Run ``python -m layerstream <module_args>`` in `nproc` ranks under torchrun; return its exit code (0 when
    every rank exited 0; 130 after a Ctrl-C, which torchrun passes on to the ranks)."""
    process = start_torchrun(nproc, module_args, extra_env=extra_env)
    try:
        return process.wait()
    except KeyboardInterrupt:
        # torchrun got the same SIGINT from the terminal and stops its ranks; wait so none outlives us
        process.wait()
        return 130


def start_torchrun(nproc: int, module_args: list[str], *, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start `launch_torchrun`'s ranks and return at once (ValueError for `nproc` < 1, RuntimeError in a rank)."""
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc = {nproc!r} is not valid; expected an int >= 1")
    if in_launched_rank():
        raise RuntimeError("launch_torchrun was called inside a rank it launched; ranks must not launch again")
    command = torchrun_command(nproc, list(module_args), master_port=free_port())
    env = dict(os.environ, **{LAUNCHED_ENV: str(nproc)}, **(extra_env or {}))
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))  # ranks share the cores
    logger.info("launching %d ranks: %s", nproc, " ".join(command))
    return subprocess.Popen(command, env=env)


def in_launched_rank() -> bool:
    """True inside a rank started by `launch_torchrun` (or by torchrun itself)."""
    return bool(os.environ.get(LAUNCHED_ENV) or os.environ.get("TORCHELASTIC_RUN_ID"))


def rank_info() -> tuple[int, int]:
    """(rank, world_size): of the initialized default group, else torchrun's environment, else (0, 1)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    try:
        return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError as e:
        raise ValueError(f"RANK / WORLD_SIZE in the environment are not integers: {e}") from e


def gather_objects(obj: Any) -> list[Any] | None:
    """Every rank's `obj` (picklable), in rank order, on rank 0; None on the others. A collective; without an
    initialized group of several ranks, returns [obj]."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    rank, world_size = dist.get_rank(), dist.get_world_size()
    gathered: list[Any] | None = [None] * world_size if rank == 0 else None
    dist.gather_object(obj, gathered, dst=0)
    return gathered
