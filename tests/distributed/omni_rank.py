"""One rank of `test_omni_under_torchrun.py`: run by torchrun, it writes what it made to OUT/rank<R>.json.

First `Omni` with allgather and nothing initialized (it joins torchrun's group itself), then, after
`destroy_distributed()`, the same with an explicit `init_distributed` first (the group it made is kept).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch.distributed as dist

from layerstream import Omni
from layerstream.distributed import destroy_distributed, init_distributed

CONFIG = {"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"weight_transfer": "allgather"}}}
REQUEST = dict(prompt="a fox", height=32, width=32, num_frames=5, num_inference_steps=2, seed=0)


def generate(explicit: bool) -> dict:
    initialized_before = dist.is_initialized()
    omni = Omni(model="tiny-wan", diffusion_offload_config=CONFIG)
    try:
        raw = np.asarray(omni.generate(**REQUEST).raw)
        stats = omni.stats()
        return {
            "explicit": explicit, "initialized_before": initialized_before, "world_size": dist.get_world_size(),
            "device": str(omni.device), "host_bytes": stats.host_bytes, "raw": raw.tolist(), "dtype": str(raw.dtype),
        }  # fmt: skip
    finally:
        omni.close()  # a collective: every rank closes before the group goes


def main(out: Path, mode: str) -> None:
    """`mode` "joined": Omni joins torchrun's group by itself; "explicit": `init_distributed` first. One launch
    each: a group made again in the same process can read the first group's rendezvous keys (a refused connect)."""
    rank = int(__import__("os").environ["RANK"])
    if mode == "explicit":
        init_distributed("cpu")
    run = generate(explicit=mode == "explicit")
    (out / f"rank{rank}-{mode}.json").write_text(json.dumps(run))
    destroy_distributed()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
