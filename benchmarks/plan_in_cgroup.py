"""The plan checked in a memory cgroup: the config `layerstream plan --host-memory X` recommends runs in a cgroup v1
memory cgroup of X GB plus the plan's device bytes (on a CPU the device is host memory), the whole process inside it
from its first import, the model loaded, enabled and generating there; its measured peak against the plan's.

The model is the real-width Wan folder (`checkpoint_folders.WAN_1_3B_WIDTH`: Wan 2.2's two experts at Wan 1.3B's
width, 6 blocks each, 93 MB a block in bfloat16; tiny text encoder and VAE), at two host memories: one that holds
every streamed block, one that puts some on disk, each at two generations (`--sizes`). Planned for the CPU device:
`device_type` "cpu" (the decode's convolution scratch as the CPU's kernels allocate it), `device_allowance_gb` 0
(no CUDA context), the baseline measured first (a child that imports what `Omni` imports, in a cgroup of its own),
the host reserve, the activations and the VAE decode estimated as for any request. A run the cgroup's OOM killer
ends is run again without a limit, to measure what it needed.

Measured by the parent while the child runs, every 20 ms, from the cgroup's own files: the working set (usage less
the page cache the kernel reclaims before it kills anything: the file cache less its mapped and dirty pages, as
`layerstream.host.memory` reads it) and the kernel's `memory.max_usage_in_bytes` (page cache included), each
phase's peak by the child's marks (imports, loading and enabling, generating). Planned: the host's peak phase plus
the device's (`MachinePlan.host_phases`, `device_phases`). Needs Linux, root and a writable cgroup v1 memory
controller.

    python benchmarks/plan_in_cgroup.py [--json] [--sizes 128x128x5,256x256x9] [--steps 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

MEMORY_ROOT = Path("/sys/fs/cgroup/memory")
DEVICE_MEMORY_GB = 1.0
"""The planned device: room beside the two slots, the resident parts and the activations for a few resident
blocks (on the CPU, host memory)."""
SAMPLE_S = 0.02

CHILD = r"""
import json, os, sys, time
marks = {"start": time.time()}
with open(sys.argv[1], "w") as f:  # the whole process runs in the cgroup, its imports included
    f.write("0")
folder, config, size, mode = sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4]), sys.argv[5]
import torch, diffusers, transformers  # what Omni imports
from layerstream import Omni
marks["imported"] = time.time()
if mode == "baseline":
    print(json.dumps({"marks": marks})); sys.stdout.flush(); os._exit(0)
omni = Omni(model=folder, diffusion_offload_config=config)
marks["enabled"] = time.time()
result = omni.generate(prompt="a fox", seed=0, **size)
marks["generated"] = time.time()
stats = omni.stats()
print(json.dumps({"marks": marks, "host_bytes": stats.host_bytes, "disk_bytes_read": stats.disk_bytes_read}))
sys.stdout.flush()
os._exit(0)  # no close(): disable() would read every block back into memory
"""


def _stat(folder: Path) -> dict[str, int]:
    out = {}
    for line in (folder / "memory.stat").read_text().splitlines():
        name, value = line.split()
        out[name] = int(value)
    return out


def _working_set(folder: Path) -> tuple[int, int, int, int]:
    """(usage, working set: usage less the clean, unmapped file cache, as `layerstream.host.memory` reads it,
    anonymous memory, mapped file pages)."""
    usage = int((folder / "memory.usage_in_bytes").read_text())
    stat = _stat(folder)
    reclaimable = stat["total_inactive_file"] + stat["total_active_file"] - stat["total_mapped_file"] - stat["total_dirty"]
    return usage, usage - max(reclaimable, 0), stat["total_rss"], stat["total_mapped_file"]


def run_in_cgroup(limit_nbytes: int | None, argv_tail: list[str]) -> dict[str, Any]:
    """The child in a fresh cgroup under `limit_nbytes`, sampled every `SAMPLE_S`: its report, the samples' peaks."""
    folder = MEMORY_ROOT / f"layerstream-plan-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    folder.mkdir()
    try:
        if limit_nbytes is not None:
            (folder / "memory.limit_in_bytes").write_text(str(limit_nbytes))
        samples: list[tuple[float, int, int, int, int]] = []
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                samples.append((time.time(), *_working_set(folder)))
                time.sleep(SAMPLE_S)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        child = subprocess.run([sys.executable, "-c", CHILD, str(folder / "cgroup.procs"), *argv_tail], capture_output=True, text=True, timeout=1800)
        done.set()
        sampler.join()
        max_usage = int((folder / "memory.max_usage_in_bytes").read_text())
        failcnt = int((folder / "memory.failcnt").read_text())
    finally:
        folder.rmdir()
    if child.returncode != 0:
        return {"returncode": child.returncode, "stderr": child.stderr[-3000:], "max_usage_bytes": max_usage}
    report = json.loads(child.stdout.strip().splitlines()[-1])
    return {"returncode": 0, **report, "max_usage_bytes": max_usage, "failcnt": failcnt, "phases": _phase_peaks(samples, report["marks"])}


def _phase_peaks(samples: list[tuple[float, int, int, int, int]], marks: dict[str, float]) -> dict[str, dict[str, int]]:
    """The working set's and the usage's peaks in each span between the child's marks, with the anonymous and
    the mapped file bytes at the working set's peak."""
    names = list(marks)
    spans = {f"{a} -> {b}": (marks[a], marks[b]) for a, b in zip(names, names[1:])}
    spans["whole run"] = (marks["start"], marks[names[-1]] + 1.0)
    out = {}
    for name, (start, end) in spans.items():
        inside = [s for s in samples if start <= s[0] <= end]
        peak = max(inside, key=lambda s: s[2], default=(0, 0, 0, 0, 0))
        out[name] = {
            "working_set_bytes": peak[2], "usage_bytes": max((s[1] for s in inside), default=0),
            "anonymous_bytes_at_peak": peak[3], "mapped_file_bytes_at_peak": peak[4],
        }  # fmt: skip
    return out


def plan_for(folder: Path, host_memory_gb: float, baseline_gb: float, size: dict[str, int]):
    from layerstream.machine.planner import Machine, plan_for_machine
    from layerstream.models.generation_size import planned_generation
    from layerstream.models.loading import load_skeleton
    from layerstream.models.model_rules import read_model_rules

    pipe, _ = load_skeleton(str(folder))
    generation = planned_generation(read_model_rules(pipe, str(folder)), **size)
    machine = Machine(
        device_memory_gb=DEVICE_MEMORY_GB, host_memory_gb=host_memory_gb, baseline_gb=baseline_gb, device_allowance_gb=0.0, device_type="cpu",
    )  # fmt: skip
    return plan_for_machine(pipe, machine, generation=generation)


def check(folder: Path, host_memory_gb: float, baseline_gb: float, size: dict[str, int]) -> dict[str, Any]:
    """One host memory: the plan, its run in a cgroup of X GB + the plan's device bytes, planned against measured
    (a run the limit killed, measured again without it: `unlimited`)."""
    plan = plan_for(folder, host_memory_gb, baseline_gb, size)
    limit = round(host_memory_gb * 1e9) + plan.device_nbytes
    argv = [str(folder), json.dumps(dict(plan.config)), json.dumps(size), "run"]
    run = run_in_cgroup(limit, argv)
    unlimited = run_in_cgroup(None, argv) if run["returncode"] != 0 else None
    host_peak = plan.host_phases.peak
    planned = host_peak.nbytes + plan.device_nbytes
    row: dict[str, Any] = {
        "host_memory_gb": host_memory_gb, "limit_bytes": limit, "config": dict(plan.config),
        "planned": {
            "peak_bytes": planned, "host_phase": host_peak.phase, "host_bytes": host_peak.nbytes,
            "device_phase": plan.device_phases.peak.phase, "device_bytes": plan.device_nbytes,
            "host_phases": plan.host_phases.to_dict(), "device_phases": plan.device_phases.to_dict(),
        },
        "run": run, "unlimited": unlimited,
    }  # fmt: skip
    measured_run = run if run["returncode"] == 0 else unlimited
    if measured_run is not None and measured_run["returncode"] == 0:
        measured = measured_run["phases"]["whole run"]["working_set_bytes"]
        row["measured_over_planned"] = measured / planned
        row["within_15_percent"] = abs(measured / planned - 1) <= 0.15
    return row


def _row_line(row: dict[str, Any]) -> str:
    planned, run = row["planned"], row["run"]
    size = "{height}x{width}x{num_frames}".format(**row["size"])
    head = (
        f"{size}, {row['host']}: X = {row['host_memory_gb']} GB, limit {row['limit_bytes'] / 1e9:.3f} GB: planned "
        f"{planned['peak_bytes'] / 1e9:.3f} GB ({planned['host_phase']} {planned['host_bytes'] / 1e9:.3f} + device "
        f"{planned['device_phase']} {planned['device_bytes'] / 1e9:.3f})"
    )
    measured_run = run if run["returncode"] == 0 else row["unlimited"]
    killed = "" if run["returncode"] == 0 else f", killed at the limit (exit {run['returncode']}); without it"
    if measured_run is None or measured_run["returncode"] != 0:
        return head + killed + ": failed"
    spans = "; ".join(f"{name} {peak['working_set_bytes'] / 1e9:.3f}" for name, peak in measured_run["phases"].items())
    return (
        f"{head}{killed}: measured {measured_run['phases']['whole run']['working_set_bytes'] / 1e9:.3f} GB working set, "
        f"{row['measured_over_planned']:.3f}x ({spans})"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="128x128x5,256x256x9", help="generations, HEIGHTxWIDTHxFRAMES, comma-separated")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if os.geteuid() != 0 or not (MEMORY_ROOT / "memory.limit_in_bytes").exists():
        parser.error("needs root and a cgroup v1 memory controller at /sys/fs/cgroup/memory")
    from checkpoint_folders import WAN_1_3B_WIDTH, cached_checkpoint_folder

    folder, _ = cached_checkpoint_folder(WAN_1_3B_WIDTH)
    base = run_in_cgroup(None, [str(folder), "{}", "{}", "baseline"])
    baseline_gb = base["phases"]["whole run"]["working_set_bytes"] / 1e9
    rows = []
    for text in args.sizes.split(","):
        height, width, frames = (int(x) for x in text.split("x"))
        size = {"height": height, "width": width, "num_frames": frames, "num_inference_steps": args.steps}
        roomy = plan_for(folder, 8.0, baseline_gb, size)  # every block in host memory: the store's own bytes
        streamed = roomy.host_budget.streamed_nbytes / 1e9
        staging = roomy.host_budget.needs["disk staging ring"] / 1e9  # needed only with a disk tier
        beside = sum(roomy.host_budget.needs.values()) / 1e9 - staging
        hosts = {"every block in host memory": round(baseline_gb + beside + streamed + 0.1, 2),
                 "a disk tier": round(baseline_gb + beside + staging + 0.3 * streamed, 2)}  # fmt: skip
        rows += [{"size": size, "host": name, **check(folder, x, baseline_gb, size)} for name, x in hosts.items()]
    document = {"baseline_bytes": base["phases"]["whole run"]["working_set_bytes"], "device_memory_gb": DEVICE_MEMORY_GB, "rows": rows}
    if args.json:
        print(json.dumps(document, indent=1))
        return 0
    print(f"baseline (imports) {baseline_gb:.3f} GB")
    for row in rows:
        print(_row_line(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
