"""The disk tier under a real memory limit: generation inside a memory cgroup smaller than the streamed bytes.

A child process joins a new cgroup v1 memory cgroup after its imports and a warm-up on a tiny model, so the cgroup is charged only for what
comes after: loading the checkpoint (lazy views of a safetensors file), enabling offload with a small
`host_budget_gb` and running the model (the resident output it is compared with is computed first, from the
same lazily loaded model, in the same process and threads). The cgroup's limit is below the bytes the model streams, so the run
passes only if the blocks beyond the budget really stay on disk (read from the checkpoint at every use); its
output must equal the resident model's bit for bit. Runs where Linux, root and a writable cgroup v1 memory
controller allow it; skipped elsewhere with the reason. The cgroup is removed afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from memory_cgroups import make_memory_cgroup, memory_cgroup  # noqa: F401 (fixtures)
from runtime_toys import ToyDiT

# children under memory limits, each beside a large checkpoint: on one xdist worker, one at a time
pytestmark = pytest.mark.xdist_group("memory_cgroups")

DIM, NUM_BLOCKS = 512, 12  # 4 MiB blocks, 48 MiB streamed
LIMIT_FRACTION = 0.6
"""The cgroup's limit, as a fraction of the streamed bytes (on top of what the child held before joining)."""

CHILD = r"""
import json, sys
import torch
from safetensors.torch import load_file
from layerstream import enable_offload
from runtime_toys import ToyDiT

folder, procs, dim, num_blocks, budget_gb = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
inputs = torch.load(f"{folder}/io.pt")
torch.set_num_threads(1)
# warm up on a tiny model first: the imports and one-time set-ups (meta device, kernels, threads) are the
# process's baseline, paid before joining, not memory the run below needs
warm = ToyDiT(dim=8, num_blocks=3)
with torch.device("meta"):
    ToyDiT(dim=8, num_blocks=3)
config = {"mode": "layer", "components": ["dit"], "host_budget_gb": 1e-9, "disk_dir": f"{folder}/spill"}
warm_handle = enable_offload(warm, config, device="cpu")
with torch.inference_mode():
    for _ in range(2):
        warm(torch.randn(2, 16, 8))
warm_handle.disable()
weights = load_file(f"{folder}/model.safetensors")  # lazy views of a private mapping of the file
with torch.device("meta"):
    model = ToyDiT(dim=dim, num_blocks=num_blocks)
model.load_state_dict(weights, assign=True)
del weights
model.eval()
with torch.inference_mode():
    expected = model(inputs["x"])  # the resident model, as loaded (its pages belong to the file's cache)
with open(procs, "w") as f:  # join the cgroup: from here on every page this process touches is charged to it
    f.write("0")
handle = enable_offload(model, {"mode": "layer", "components": ["dit"], "host_budget_gb": budget_gb}, device="cpu")
with torch.inference_mode():
    outputs = [model(inputs["x"]) for _ in range(2)]
stats = handle.stats()
print(json.dumps({
    "equal": all(torch.equal(out, expected) for out in outputs),
    "host_bytes": stats.host_bytes,
    "disk_bytes_read": stats.disk_bytes_read,
    "num_disk_blocks": len(handle.placement.host_tier.disk_block_paths),
}))
# no disable() here: it would read every block back into memory, which this cgroup cannot hold
"""


def test_generation_inside_a_memory_cgroup_smaller_than_the_streamed_bytes(tmp_path, memory_cgroup):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = ToyDiT(dim=DIM, num_blocks=NUM_BLOCKS).eval()
    x = torch.randn(2, 16, DIM)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "model.safetensors"))
    torch.save({"x": x}, tmp_path / "io.pt")
    block_bytes = sum(t.numel() * t.element_size() for t in model.blocks[0].state_dict().values())
    streamed = NUM_BLOCKS * block_bytes
    del model

    limit = int(LIMIT_FRACTION * streamed)
    (memory_cgroup / "memory.limit_in_bytes").write_text(str(limit))
    budget_gb = 1.5 * block_bytes / 1e9  # one block in host memory, the others read from the checkpoint file
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), *sys.path]))
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path), str(memory_cgroup / "cgroup.procs"), str(DIM), str(NUM_BLOCKS), str(budget_gb)],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    peak = int((memory_cgroup / "memory.max_usage_in_bytes").read_text())
    assert done.returncode == 0, f"exit {done.returncode} (killed by the cgroup's OOM killer if -9): {done.stderr[-2000:]}"
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["equal"] is True  # bit-identical to the resident model
    assert report["num_disk_blocks"] == NUM_BLOCKS - 1
    assert report["host_bytes"] <= 1.5 * block_bytes  # the runtime's own accounting: one block held
    assert report["disk_bytes_read"] >= 2 * (NUM_BLOCKS - 1) * block_bytes * 0.9  # every disk block, every forward
    assert peak <= limit < streamed  # the kernel's own figure: never above a limit below the streamed bytes
