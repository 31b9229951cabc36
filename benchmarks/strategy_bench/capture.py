"""Capture the trace of one forward from an `OffloadHandle`.

`handle.trace()` puts both lanes on one clock: on the CPU the copy thread and the hooks read `perf_counter`;
on a GPU (handle enabled with `trace=True`) copies and compute are both timed by CUDA events, relative to an
origin event recorded at enable, and resolved when the trace is read. Two cares remain, both here:
- earlier forwards' records must go before the traced forward (`reset_trace`), and on a GPU their pending
  timing events are flushed first by reading the trace once;
- the copies issued during the forward must be complete before reading: the last block prefetches block 0
  for the next forward, and that copy may still be running when the forward returns.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from layerstream.runtime.reporting.stats import OffloadTrace
from layerstream.timing.block_timer import synchronize

DRAIN_TIMEOUT_S = 60.0


def capture_forward_trace(handle, forward: Callable[[], object], device: torch.device) -> OffloadTrace:
    """Run `forward` once and return the copy and compute intervals recorded during it.

    The trace holds one compute interval per streamed block and one copy per transfer issued during the
    forward (in the steady state one per streamed block, block 0's being the prefetch for the next forward).
    """
    synchronize(device)  # earlier copies' timing events must be complete before they are flushed
    handle.trace()  # flush: resolves the timing events of earlier forwards, which reset_trace then drops
    handle.reset_trace()
    issued_before = handle.stats().num_transfers
    forward()
    issued = handle.stats().num_transfers - issued_before
    synchronize(device)  # every copy of this forward has landed and its events can be read
    deadline = time.perf_counter() + DRAIN_TIMEOUT_S
    while True:
        trace = handle.trace()
        # the CPU copy thread records a copy when it completes; wait for the ones this forward issued
        if len(trace.lane("copy")) >= issued or time.perf_counter() > deadline:
            return trace
        time.sleep(0.001)

