"""`layerstream` for one rank of several, with a fault switch on one rank: run it under torchrun.

``python -m torch.distributed.run --nproc-per-node 2 serve_ranks_with_fault.py serve tiny-flux --port 0``: on
the rank named by $LAYERSTREAM_TEST_FAULT_RANK, the prompt in $LAYERSTREAM_TEST_FAULT_PROMPT raises inside a
DiT block (`fault_injection.FaultInjectingOmni`). The other ranks, and everything but the fault, are the
product as shipped: this swaps the runtime class `serve` builds, and the product carries no test hook.
"""

from __future__ import annotations

import logging
import os
import sys

import layerstream.server.ranks as ranks_module
from fault_injection import FAULT_PROMPT_ENV, FaultInjectingOmni
from layerstream.cli.main import main

FAULT_RANK_ENV = "LAYERSTREAM_TEST_FAULT_RANK"
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


if __name__ == "__main__":
    ranks_module.RankRuntime = FaultInjectingRuntime  # serve_cmd imports it when a rank starts
    sys.exit(main())
