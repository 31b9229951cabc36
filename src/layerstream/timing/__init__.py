"""Time models and timers that the planner and the benchmarks share (torch only): `ideal`, what a perfect
streamer would achieve; `block_timer`, per-block compute times from forward hooks."""
