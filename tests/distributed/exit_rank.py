"""One rank of a script that follows docs/distributed.md but never calls `destroy_distributed()`.

Run by `test_exit_teardown.py` in each of N processes with torchrun's environment. ``argv[1]``:
- ``disable``: the docs example without its last line: enable allgather, run forwards, disable;
- ``enabled``: the same without `disable()` either: the handle is still enabled at exit;
- ``docs``: the first Python example of docs/distributed.md, exactly as written (its `load_my_pipeline`
  builds the tiny replicated pipeline);
- ``hooks``: a single rank checking the teardown order (prints JSON lines);
- ``threads``: ``disable``, printing the native threads before exit and after the exit teardown (JSON lines).
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import torch
from dist_toys import ReplicatedPipeline

from layerstream import enable_offload
from layerstream.distributed import init_distributed

ALLGATHER = {
    "mode": "layer",
    "components": ["dit", "text_encoder"],
    "layer_options": {"dit": {"weight_transfer": "allgather"}, "text_encoder": {"weight_transfer": "allgather"}},
}


def forget_destroy(disable: bool = True) -> None:
    device = init_distributed()
    torch.manual_seed(0)
    pipe = ReplicatedPipeline().to(device)
    handle = enable_offload(pipe, ALLGATHER, device=device)
    ids, x = torch.randint(0, 40, (2, 5)), torch.randn(2, 3, 24)
    with torch.no_grad():
        for _ in range(2):
            pipe(ids, x)
    if disable:
        handle.disable()
    print("rank done", flush=True)
    # no destroy_distributed(): the atexit teardown init_distributed registered must leave the group; without
    # disable() the last block's prefetch of the first is an all-gather the copy thread may still be in


def docs_example() -> None:
    docs = (Path(__file__).parents[2] / "docs" / "distributed.md").read_text()
    example = re.search(r"```python\n(.*?)```", docs, re.DOTALL).group(1)
    torch.manual_seed(0)
    exec(compile(example, "docs/distributed.md", "exec"), {"load_my_pipeline": ReplicatedPipeline})
    print("rank done", flush=True)


def hooks() -> None:
    import atexit

    import torch.distributed as dist

    from layerstream.distributed.process_group import before_group_teardown, destroy_distributed

    calls: list[str] = []
    # registered before init_distributed registers its teardown, so it runs after it (atexit is LIFO)
    atexit.register(lambda: print(json.dumps({"at_exit": {"calls": calls, "initialized": dist.is_initialized()}})))
    init_distributed("cpu")
    before_group_teardown(lambda: calls.append("first"))
    before_group_teardown(lambda: calls.append("second"))
    destroy_distributed()
    print(json.dumps({"after_destroy": {"calls": list(calls), "initialized": dist.is_initialized()}}))
    destroy_distributed()  # a second call does nothing
    # a group the user creates afterwards is theirs: the exit teardown runs the callbacks but keeps the group
    dist.init_process_group("gloo", init_method="env://", rank=0, world_size=1)
    before_group_teardown(lambda: calls.append("at exit"))


def native_threads() -> list[str]:
    """Names of this process's threads (Linux: /proc), the ones torch starts in C++ included."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass  # ended meanwhile
    return sorted(names)


def threads() -> None:
    """`disable` (no destroy_distributed), printing the native threads before exit and after the exit teardown,
    where the group's gloo workers must be gone: one still running during interpreter finalization aborts the
    process when it releases its last collective's tensors."""
    import atexit

    # registered before init_distributed registers its teardown, so it runs after it (atexit is LIFO)
    atexit.register(lambda: print(json.dumps({"after_teardown": native_threads()}), flush=True))
    forget_destroy(disable=True)
    print(json.dumps({"before_exit": native_threads()}), flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)  # the ranks share the machine's cores
    modes = {
        "disable": forget_destroy,
        "enabled": lambda: forget_destroy(disable=False),
        "docs": docs_example,
        "hooks": hooks,
        "threads": threads,
    }
    modes[sys.argv[1]]()
