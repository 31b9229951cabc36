"""The host's memory as `host_budget_gb: "auto"` sees it, for `enable_offload` and the planner alike: `memory`
(what this process may still take: MemAvailable and memory cgroups) and `reserve` (what a generation allocates
beside the host store). It sits over `models` and `plan`, below `machine/`."""
