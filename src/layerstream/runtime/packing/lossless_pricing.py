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
"""Stored bytes per 16-bit byte where no sample could be read: trained weights measured 0.673-0.696 a model,
0.680 over seven bfloat16 models (`benchmarks/lossless.py --weights`), rounded up; initial weights code 0.650."""


@dataclass(frozen=True)
class CodedFraction:
    """Stored bytes per 16-bit byte that the lossless form is priced at, and where the figure comes from."""

    value: float
    sampled: bool  # from a sample of the checkpoint's own weights, or the fixed estimate
    source: str  # in words (a plan's notes say it)

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
    """Price the lossless spans that have no values (a skeleton's) at `fraction` inside the block."""
    token = _priced.set(fraction)
    try:
        yield fraction
    finally:
        _priced.reset(token)
