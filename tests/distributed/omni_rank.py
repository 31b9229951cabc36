"""One rank of `test_omni_under_torchrun.py`: run by torchrun, it writes what it made to OUT/rank<R>.json.

`Omni` with allgather and nothing initialized: it joins torchrun's group by itself (the group's exit teardown
is the one `init_distributed` registers).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import torch.distributed as dist

from layerstream import Omni
from layerstream.distributed import destroy_distributed

CONFIG = {"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"weight_transfer": "allgather"}}}
REQUEST = dict(prompt="a fox", height=32, width=32, num_frames=5, num_inference_steps=2, seed=0)


def main(out: Path) -> None:
    initialized_before = dist.is_initialized()
    omni = Omni(model="tiny-wan", diffusion_offload_config=CONFIG)
    try:
        raw = np.asarray(omni.generate(**REQUEST, keep_raw=True).raw)
        run = {
            "initialized_before": initialized_before, "initialized_after": dist.is_initialized(),
            "world_size": dist.get_world_size(), "device": str(omni.device), "host_bytes": omni.stats().host_bytes,
            "raw": raw.tolist(), "dtype": str(raw.dtype),
        }  # fmt: skip
    finally:
        omni.close()  # a collective: every rank closes before the group goes
    (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(run))
    destroy_distributed()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
