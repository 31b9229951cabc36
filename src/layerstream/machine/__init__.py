"""Planning for a machine: what it allows and what a model will do on it.

- `memory`: how much host memory this process may still take (MemAvailable and memory cgroups), read by
  `host_budget_gb: "auto"` when enabling;
- `planner`: `layerstream plan MODEL --device-memory --host-memory`: the configuration a machine given by its
  figures should run, its bytes per tier and per step, and the predicted seconds per step (the benchmarks'
  ideal, `layerstream.timing.ideal`).
"""
