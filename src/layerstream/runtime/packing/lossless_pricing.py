"""What the lossless form is priced at where a tensor's values are not there to code (a skeleton's, on the meta
device): the stored fraction of a checkpoint's own weights where `layerstream plan` sampled them
(`models.coded_fraction`, `models.hub_sample`), else a fixed estimate. `pricing_at` sets it for the planning
inside its block.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass

ESTIMATED_CODED_FRACTION = 0.69
"""Stored bytes per 16-bit byte assumed where the values are not there to code and no sample of them could be read
(a skeleton on the meta device: `layerstream plan` of a model whose weights are not on this machine). An
estimate, from the trained weights measured: 0.673-0.696 a model, 0.680 over seven models in bfloat16
(`benchmarks/lossless.py --weights`, docs/storage.md), rounded up; initial weights code smaller (0.650)."""


@dataclass(frozen=True)
class CodedFraction:
    """Stored bytes per 16-bit byte that the lossless form is priced at where the values are not there to code,
    and where the figure comes from."""

    value: float
    sampled: bool
    """True: estimated from a sample of the checkpoint's own weights; False: the fixed estimate."""
    source: str
    """How it was reached, in words (a plan's notes say it)."""

    def describe(self) -> str:
        return f"{self.value:.3f}x, {self.source}"


ESTIMATED = CodedFraction(
    ESTIMATED_CODED_FRACTION, False, "an estimate for weights that could not be read (measured on trained weights)"
)
_priced: contextvars.ContextVar[CodedFraction | None] = contextvars.ContextVar("lossless_priced_fraction", default=None)


def priced_fraction() -> CodedFraction:
    """What a lossless span with no values is priced at here: the fraction `pricing_at` set, or `ESTIMATED`."""
    return _priced.get() or ESTIMATED


@contextlib.contextmanager
def pricing_at(fraction: CodedFraction) -> Iterator[CodedFraction]:
    """Price the lossless spans that have no values (a skeleton's) at `fraction` inside the block: the planner
    prices a checkpoint it has sampled at its own figure."""
    token = _priced.set(fraction)
    try:
        yield fraction
    finally:
        _priced.reset(token)
