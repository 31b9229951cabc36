"""Time models and timers that the planner and the benchmarks share, below both (torch only, nothing else of
the package):

- `ideal`: what a perfect streamer would achieve (per block the longest of compute, link and disk), which the
  planner predicts with and the benchmarks judge a measured forward against;
- `block_timer`: per-block compute times from forward hooks (perf_counter on the CPU, CUDA events on a GPU).
"""
