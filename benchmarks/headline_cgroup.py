"""The headline scenario at 1/64 scale (`wan22_scenario.FULL`: widths / 8) inside a memory cgroup of the host
memory the issue names (1.15 GB), with no host reserve given: once with `host_budget_gb: "auto"`, once with the
configs the planner recommends for `--host-memory 1.15` (`plan_for_machine`, the code of `layerstream plan`;
`BASELINES_GB`).

Each run is a child process that builds the scaled pipeline (1.1 GB of weights: more than the limit, as a
checkpoint on disk would be), joins a new cgroup v1 memory cgroup (charged from then on: the host store and its
disk tier, the slots, the activations; the built weights stay charged where they were made), enables offload, runs the warm-up (one step of each expert) and a denoising loop, and reports its latents' hash,
the budget chosen and why, and the cgroup's peak. The parent runs the same loop resident outside any limit and
compares the hashes (bit for bit). Needs Linux, root and a writable cgroup v1 memory controller.

    python benchmarks/headline_cgroup.py [--limit-gb 1.15] [--steps 4] [--tokens 32] [--json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
MEMORY_ROOT = Path("/sys/fs/cgroup/memory")
BASELINES_GB = {"planned": 0.0, "planned-baseline-0.45": 0.45}
"""The planner's baseline: what the cgroup holds before offload is enabled, nothing (the child joins it after
building the pipeline; a cgroup v1 charges a page to the cgroup of the process that first touched it); and, a
stricter plan, with a disk tier, a whole process's imports (0.45 GB, as `tests/runtime/test_auto_budget_cgroup.py`
measured them)."""
DEVICE_MEMORY_GB = 4.05
ACTIVATION_RESERVE_GB = 4.0
"""The planner's device: a 4 GB activation reserve given (the planner's flat default when these figures were
measured) and 0.05 GB beside it, so that on the CPU, where the device is host memory, the resident parts stay
small."""

CHILD = r"""
import hashlib, json, os, sys
sys.path.insert(0, sys.argv[2])
mode, steps, tokens, disk_dir = sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
from dataclasses import replace
import torch
from wan22_scenario import FULL, build_pipeline, make_inputs
from layerstream.offload import enable_offload
from layerstream.models.size import GenerationSize
def usage(what):  # progress, with the cgroup's own figures
    folder = os.path.dirname(sys.argv[1])
    read = lambda name: int(open(os.path.join(folder, name)).read()) / 1e9
    print(f"{what}: usage {read('memory.usage_in_bytes'):.3f} GB, peak {read('memory.max_usage_in_bytes'):.3f} GB", file=sys.stderr, flush=True)
s = replace(FULL, steps=steps)
torch.manual_seed(0)  # text_proj draws from the global generator
pipe = build_pipeline(s, torch.device("cpu"))
inputs = make_inputs(s, tokens, pipe.transformer.shape.dim, pipe.text_encoder.config.vocab_size, torch.device("cpu"))
config = json.loads(sys.argv[7])
if "host_budget_gb" in config:
    config["disk_dir"] = disk_dir
with open(sys.argv[1], "w") as f:  # join the cgroup: everything allocated from here on is charged to it
    f.write("0")
# the generation this run makes: the scenario's tokens (its pipeline is not diffusers': no size to read)
generation = GenerationSize(height=720, width=1280, num_frames=81, tokens=tokens, source="the scenario's video at its token count")
usage("joined")
handle = enable_offload(pipe, config, torch.device("cpu"), generation=generation)
usage("enabled")
context, negative = pipe.encode(inputs.prompt_ids, inputs.negative_ids)
pipe.warm_up(inputs.latents, context, negative)
usage("warmed up")
latents = pipe.denoise(inputs.latents, context, negative)
usage("denoised")
stats = handle.stats()
print(json.dumps({
    "sha256": hashlib.sha256(latents.float().numpy().tobytes()).hexdigest(),
    "host_budget": stats.host_budget, "host_bytes": stats.host_bytes, "disk_bytes_read": stats.disk_bytes_read,
}))
sys.stdout.flush()
os._exit(0)  # no disable(): it would read every block back into memory
"""


def make_cgroup(limit_bytes: int) -> Path:
    own = next(line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines() if "memory" in line.split(":")[1].split(","))
    folder = MEMORY_ROOT / own.lstrip("/") / f"layerstream-headline-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    folder.mkdir()
    (folder / "memory.limit_in_bytes").write_text(str(limit_bytes))
    return folder


def run_child(mode: str, config: dict, limit_bytes: int, steps: int, tokens: int, disk_dir: str) -> dict:
    group = make_cgroup(limit_bytes)
    try:
        argv = [sys.executable, "-c", CHILD, str(group / "cgroup.procs"), str(HERE), mode, str(steps), str(tokens), disk_dir, json.dumps(config)]
        done = subprocess.run(argv, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="2"))
        peak = int((group / "memory.max_usage_in_bytes").read_text())
    finally:
        group.rmdir()
    out = {"mode": mode, "config": config, "returncode": done.returncode, "limit_bytes": limit_bytes, "peak_bytes": peak,
           "progress": [line for line in done.stderr.splitlines() if ": usage " in line]}
    if done.returncode != 0:
        return out | {"stderr": done.stderr[-2000:]}
    return out | json.loads(done.stdout.strip().splitlines()[-1])


def resident_sha(steps: int, tokens: int) -> str:
    import torch
    from dataclasses import replace

    sys.path.insert(0, str(HERE))
    from wan22_scenario import FULL, build_pipeline, make_inputs

    s = replace(FULL, steps=steps)
    torch.manual_seed(0)  # as the child
    pipe = build_pipeline(s, torch.device("cpu"))
    inputs = make_inputs(s, tokens, pipe.transformer.shape.dim, pipe.text_encoder.config.vocab_size, torch.device("cpu"))
    context, negative = pipe.encode(inputs.prompt_ids, inputs.negative_ids)
    pipe.warm_up(inputs.latents, context, negative)
    latents = pipe.denoise(inputs.latents, context, negative)
    return hashlib.sha256(latents.float().numpy().tobytes()).hexdigest()


def planned_config(host_memory_gb: float, tokens: int, baseline_gb: float) -> tuple[dict, str]:
    import torch

    sys.path.insert(0, str(HERE))
    from wan22_scenario import FULL, meta_pipeline
    from layerstream.machine.planner import Machine, plan_for_machine
    from layerstream.models.generation_size import pipeline_generation

    del torch
    machine = Machine(device_memory_gb=DEVICE_MEMORY_GB, activation_reserve_gb=ACTIVATION_RESERVE_GB, host_memory_gb=host_memory_gb, baseline_gb=baseline_gb)
    pipe = meta_pipeline(FULL)
    plan = plan_for_machine(pipe, machine, generation=pipeline_generation(pipe, tokens=tokens))
    return dict(plan.config), plan.host_reserve.describe()


def main(argv: list[str] | None = None) -> int:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit-gb", type=float, default=1.15)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    limit = round(args.limit_gb * 1e9)
    configs = {"auto": {"mode": "layer", "components": ["dit"], "host_budget_gb": "auto"}}
    for name, baseline in BASELINES_GB.items():
        configs[name], planned_reserve = planned_config(args.limit_gb, args.tokens, baseline)
    expected = resident_sha(args.steps, args.tokens)
    rows = []
    with tempfile.TemporaryDirectory(prefix="layerstream-headline-cgroup-") as disk_dir:
        for mode, config in configs.items():
            row = run_child(mode, config, limit, args.steps, args.tokens, disk_dir)
            row["bit_identical"] = row.get("sha256") == expected
            rows.append(row)
    result = {"limit_gb": args.limit_gb, "steps": args.steps, "tokens": args.tokens, "planned_reserve": planned_reserve, "rows": rows}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"1/64-scale scenario, cgroup v1 limit {args.limit_gb:g} GB, {args.steps} steps, {args.tokens} tokens")
        print(f"planner (--host-memory {args.limit_gb:g}): reserve {planned_reserve}")
        for row in rows:
            ok = "ran" if row["returncode"] == 0 else f"FAILED (exit {row['returncode']})"
            print(f"- {row['mode']}: {ok}, peak {row['peak_bytes'] / 1e9:.3f} GB of {row['limit_bytes'] / 1e9:.3f} GB, "
                  f"bit-identical {row['bit_identical']}, config {json.dumps(row['config'])}")
            print("\n".join(f"  {line}" for line in row["progress"]))
            print(f"  {row.get('host_budget') or row.get('stderr', '')[-600:]}")
    return 0 if all(r["returncode"] == 0 and r["bit_identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
