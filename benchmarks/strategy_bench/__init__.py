"""The synthetic strategy comparison of benchmarks/strategies.py: offload strategies timed against resident on
synthetic DiT block stacks. It measures layerstream itself, not a user's model, so it lives beside the scripts.

- `synthetic`: the block stacks (real transformer blocks with Wan and Flux shapes, in plain torch);
- `strategies`: the strategies compared and how each is set up; `naive`: the load-then-compute baseline;
- `config`: `BenchConfig`; `harness`: `run_bench`, the round-robin measurement;
- `measure`: per-block compute over forwards, memory readings, link bandwidth (the block timer and the ideal
  forward are `layerstream.timing`'s, which the planner shares); `results` and `report`: the output as data and
  as tables;
- `capture`: one forward's trace (exported by `layerstream.runtime.reporting.trace_export` as Chrome JSON and a
  PNG timeline).

Imported with benchmarks/ on `sys.path`, as the scripts import their modules; nothing runs at import time.
"""
