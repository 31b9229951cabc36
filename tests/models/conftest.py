"""Fixtures for the model tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def single_intra_op_thread() -> Iterator[None]:
    """Run the tiny models on one intra-op thread.

    Their tensors are far too small to gain from more, and on a busy machine spinning worker threads made a
    generation ten times slower; one thread keeps these tests fast and steady. The setting is restored after.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
