"""`layerstream` for one rank of several, with a fault switch on one rank: run it under torchrun.

``python -m torch.distributed.run --nproc-per-node 2 serve_ranks_with_fault.py serve tiny-flux --port 0``: on
the rank named by $LAYERSTREAM_TEST_FAULT_RANK, the prompt in $LAYERSTREAM_TEST_FAULT_PROMPT raises inside a
DiT block (`fault_injection.FaultInjectingOmni`). With $LAYERSTREAM_TEST_REBUILD_GATE set, every rank's rebuild
after a failed wave waits until that file exists, so a test orders what it does during the rebuild. The other
ranks, and everything but the fault, are the product as shipped: this swaps the runtime class `serve` builds, and
the product carries no test hook.
"""

from __future__ import annotations

import logging
import os
import sys
import time

import layerstream.server.ranks as ranks_module
from fault_injection import FAULT_PROMPT_ENV, FaultInjectingOmni
from layerstream.cli.main import main

FAULT_RANK_ENV = "LAYERSTREAM_TEST_FAULT_RANK"
REBUILD_GATE_ENV = "LAYERSTREAM_TEST_REBUILD_GATE"
GATE_TIMEOUT_S = 120
"""A gate never opened (a test that failed before opening it) holds the rebuild no longer than this."""
logger = logging.getLogger("layerstream.server.test_fault")


class FaultInjectingRuntime(ranks_module.RankRuntime):
    def __init__(self, setup, load):
        def load_with_fault(group):
            omni = load(group)
            if setup.rank != int(os.environ[FAULT_RANK_ENV]):
                return omni
            faulty = FaultInjectingOmni(omni, os.environ[FAULT_PROMPT_ENV])
            logger.warning("test fault switch on rank %d: the prompt %r raises in %s", setup.rank, faulty.fault_prompt,
                           faulty.block_path)  # fmt: skip
            return faulty

        super().__init__(setup, load_with_fault)

    def rebuild(self) -> None:
        gate = os.environ.get(REBUILD_GATE_ENV)
        if gate:  # every rank waits, so no rank's new offload group waits on a held one past its timeout
            logger.warning("test rebuild gate on rank %d: waiting for %s", self.setup.rank, gate)
            deadline = time.monotonic() + GATE_TIMEOUT_S
            while not os.path.exists(gate) and time.monotonic() < deadline:
                time.sleep(0.05)
        super().rebuild()


if __name__ == "__main__":
    ranks_module.RankRuntime = FaultInjectingRuntime  # serve_cmd imports it when a rank starts
    sys.exit(main())
