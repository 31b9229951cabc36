"""Deprecated import path, kept until 0.2: the ideal lives in `layerstream.timing.ideal`, below both the planner
(`layerstream.machine`) and the benchmarks. Importing this module warns, naming the new path."""

import warnings

from layerstream.timing.ideal import (  # noqa: F401 - re-exported as they were
    GB,
    block_disk_seconds,
    block_transfer_seconds,
    disk_floor_seconds,
    ideal_forward_seconds,
    ideal_forward_seconds_with_disk,
    link_gbps_for_ratio,
    transfer_floor_seconds,
    transfer_seconds,
)

warnings.warn(
    "layerstream.bench.ideal is deprecated and will be removed in 0.2; import it from layerstream.timing.ideal",
    DeprecationWarning,
    stacklevel=2,
)
