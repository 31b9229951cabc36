"""Planning for a machine: what it allows and what a model will do on it.

- `planner`: `layerstream plan MODEL --device-memory --host-memory`: the configuration a machine given by its
  figures should run, its bytes per tier and per step, and the predicted seconds per step (the benchmarks'
  ideal, `layerstream.timing.ideal`).

It sits above `enable_offload` (it prices the stores through the composition root); what enabling reads of the
host itself (its free memory, a generation's reserve) is below both, in `layerstream.host`.
"""
