"""The host's memory as `host_budget_gb: "auto"` sees it, below `enable_offload` and the planner alike:

- `memory`: how much host memory this process may still take (MemAvailable and memory cgroups);
- `reserve`: what a generation allocates in host memory beside the host store (`host_reserve_gb`, or an
  estimate for the generation's size).

Both are read when enabling (`offload.resolve_host_budget`) and by `layerstream plan` (`machine.planner`), so
they live here rather than in `machine/`, which sits above `offload`. The reserve reads a model's generation
(`models.generation_estimates`) and the plan's units, so this package sits over `models` and `plan`.
"""
