"""`layerstream` with a fault switch: the prompt in $LAYERSTREAM_TEST_FAULT_PROMPT raises inside a DiT block.

Run in place of ``python -m layerstream`` (``python serve_with_fault.py serve tiny-flux --port 0``). It hands
`GenerationService` a `FaultInjectingOmni` and then runs the real command line, so everything but the fault
is the product as shipped, and the product itself carries no test hook.
"""

from __future__ import annotations

import logging
import os
import sys

import layerstream.server.service as service_module
from fault_injection import FAULT_PROMPT_ENV, FaultInjectingOmni
from layerstream.cli.main import main

logger = logging.getLogger("layerstream.server.test_fault")


class FaultInjectingService(service_module.GenerationService):
    def __init__(self, omni, settings, **kwargs):
        faulty = FaultInjectingOmni(omni, os.environ[FAULT_PROMPT_ENV])
        logger.warning("test fault switch on: the prompt %r raises in %s", faulty.fault_prompt, faulty.block_path)
        super().__init__(faulty, settings, **kwargs)


if __name__ == "__main__":
    service_module.GenerationService = FaultInjectingService  # serve_cmd imports it when it runs
    sys.exit(main())
