"""Run a scenario in N ranks on loopback (gloo, CPU) with a hard timeout, and collect what each rank returned.

Each rank is a spawned process that joins the group through `init_distributed` (as a torchrun rank would),
runs `dist_scenarios.<name>(rank, world_size, **kwargs)` and pickles its result (or its exception) to a file.
A rank still alive at the deadline is killed and the test fails: a hang can never stall the suite; so does a
rank that exits other than as its scenario says (0, unless it exits on purpose), an abort at exit included.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import time
import traceback
from pathlib import Path

import pytest

COLLECTIVE_TIMEOUT_S = 3  # short, so that the tests of a stalled peer end quickly
AGREEMENT_TIMEOUT_S = 30
"""For scenarios where no peer stalls: ranks of a loaded 2-core machine can reach a collective seconds apart
(one still importing), which the short timeout above mistook for a dead peer. A result that came from a timeout
rather than the ranks' own vote still shows: its error is a timeout's, not the vote's."""


def run_ranks(
    tmp_path: Path,
    scenario: str,
    world_size: int = 2,
    *,
    timeout_s: float = 45,
    device: str = "cpu",
    backend: str | None = None,
    collective_timeout_s: float = COLLECTIVE_TIMEOUT_S,
    exit_codes: dict[int, int] | None = None,
    **kwargs,
) -> list[dict]:
    """`device` is what each rank joins the group for (``"cuda"``: cuda:LOCAL_RANK); `backend` overrides the
    one `init_distributed` picks for it; `collective_timeout_s` is every collective's timeout in the ranks;
    `kwargs` go to the scenario. `timeout_s` is the hard limit of the whole run (a hang fails the test);
    `exit_codes` the code of each rank that exits on purpose (every other rank must exit 0)."""
    from layerstream.distributed.launch import free_port

    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=_rank_main, args=(scenario, rank, world_size, port, str(tmp_path), device, backend, collective_timeout_s, kwargs), daemon=True)
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    if hung:
        pytest.fail(f"scenario {scenario!r}: rank(s) {hung} still running after {timeout_s} s (a hang)")
    results = []
    for rank, p in enumerate(procs):
        path = tmp_path / f"{scenario}-rank{rank}.pkl"
        result = pickle.loads(path.read_bytes()) if path.exists() else {}
        result["exitcode"] = p.exitcode
        results.append(result)
    exited, expected = [r["exitcode"] for r in results], [(exit_codes or {}).get(rank, 0) for rank in range(world_size)]
    if exited != expected:
        said = "".join(f"\nrank {rank} raised:\n{r['traceback']}" for rank, r in enumerate(results) if "traceback" in r)
        pytest.fail(f"scenario {scenario!r}: ranks exited {exited}, expected {expected}{said}")
    return results


def raise_rank_errors(results: list[dict]) -> None:
    for rank, result in enumerate(results):
        if "traceback" in result:
            pytest.fail(f"rank {rank} raised:\n{result['traceback']}")


def _rank_main(
    scenario: str, rank: int, world_size: int, port: int, out_dir: str, device: str, backend, collective_timeout_s: float, kwargs: dict
) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        LAYERSTREAM_COLLECTIVE_TIMEOUT=str(collective_timeout_s),
    )
    import torch

    torch.set_num_threads(1)  # the ranks share the machine's cores
    import dist_scenarios
    from layerstream.distributed.process_group import destroy_distributed, init_distributed

    out = Path(out_dir) / f"{scenario}-rank{rank}.pkl"
    try:
        device = init_distributed(device, backend=backend)
        result = getattr(dist_scenarios, scenario)(rank, world_size, device=device, **kwargs)
    except BaseException as e:  # reported to the test, which names the rank
        result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    out.write_bytes(pickle.dumps(result))
    try:
        destroy_distributed()
    except Exception:  # a peer may be gone already; the result is written
        pass
