"""A reference computed under the same threading as the value it checks.

A thread that did not call `torch.set_num_threads` computes its first matrix products with one OpenMP thread
per core (docs/testing.md says why, and where MKL then rounds differently): a value computed on a new thread is
compared with a reference computed on a new thread too, and a child process computes with the test worker's
thread count (`tests/conftest.py` hands it on through ``OMP_NUM_THREADS``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def on_new_thread(fn: Callable[[], T], timeout: float = 120) -> T:
    """`fn()` run on a thread started for it; its exception re-raised here; a hang fails after `timeout`."""
    out: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            error.append(e)

    thread = threading.Thread(target=target, name="test-new-thread")
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"{fn!r} did not finish in {timeout} s on its thread"
    if error:
        raise error[0]
    return out[0]
