"""The headline, measured by simulation: Wan 2.2 A14B at 720p x 81 frames on a 24 GB device, 32 GB of host memory
and an NVMe disk, through the real runtime (`enable_offload`: the disk tier, the experts' host pool, float8
storage), scaled down to run on a CPU.

The scenario (`wan22_scenario.py` beside this script: the pipeline, its loop, the compute source and the calibration)
builds Wan 2.2's parts at 1/8 of every width. A width / 8 has 1/64 of the bytes, so every byte figure is scaled
by S = 64 (the real block's bytes over the built one's) and so is compute: each block's CPU forward is calibrated (by its token count) to last the published compute of a real block / S. The link
and the disk keep their real bandwidths (`simulated_link_gbps`, `simulated_disk_gbps`), so a block's transfer
and read are scaled by S too, and every time measured here times S is the time on the target machine. Each row
runs the configuration the planner recommends for that machine (`plan_for_machine`, what `layerstream plan
--device-memory 24 --host-memory 32 [--allow-lossy]` prints) and shows its prediction beside the measurement;
every output is compared bit for bit with its reference (resident; for float8, float8 in host memory).

Compute source: 0.488 s per block forward on one H100, from a published 8 x H100 run of Wan 2.2 at 720p x 81
frames (cited, with its assumptions, in `wan22_scenario.py`).

    python benchmarks/headline.py                   # the full scenario, about 10 minutes on a 2-core CPU
    python benchmarks/headline.py --smoke --json    # seconds, a tiny scale: the shape of the output only
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from layerstream import enable_offload
from layerstream.config.offload_config import DEFAULT_ACTIVATION_RESERVE_GB
from layerstream.host.reserve import DECODED_BYTES_PER_VALUE, ENCODING_BYTES_PER_VALUE, FLOOR_NBYTES
from layerstream.models.generation_estimates import TEXT_TOKENS
from layerstream.models.generation_size import pipeline_generation
from layerstream.machine.planner import CUDA_CONTEXT_GB, DEVICE_DECODE_GBPS, PROCESS_BASELINE_GB, Machine, MachinePlan, plan_for_machine
from layerstream.timing.block_timer import synchronize
from layerstream.timing.ideal import ideal_forward_seconds_with_disk, transfer_seconds

# the scenario is the module beside this script, found also when a test loads the script from its file
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from strategy_bench.measure import measure_block_compute, measure_link_gbps  # noqa: E402
from wan22_scenario import (
    DTYPE, FULL, GB, PUBLISHED_BLOCK_SECONDS, SMOKE, Inputs, Scale, Scenario, WanPipeline, block_bytes, build_pipeline,
    calibrate_tokens, make_inputs, real_streamed_bytes, streamed_blocks,
)  # fmt: skip

STORAGES = ("bfloat16", "lossless", "float8")
PREDICTION_SOURCE = (
    "the planner (layerstream.machine.planner.plan_for_machine, as `layerstream plan --device-memory 24 --host-memory 32 "
    "[--allow-lossy]`), with compute per block measured on the resident pipeline at the start, times how much slower the "
    "resident twin ran beside the row (drift); on the CPU with this CPU's compute time lost per GB copied, read, cast and "
    "decoded by the copy and read threads, the decode's own rate on the copy thread (host_copy_costs, measured first) "
    "and the copy thread and the reads on the one core beside compute; the host pool's reads at each change of expert "
    "over the scenario's steps; its configuration is the one each row runs"
)



@dataclass(frozen=True)
class Video:
    """One timed video: its output and times, and the runtime's counters around the denoising loop."""

    latents: torch.Tensor
    encode_s: float
    loop_s: float
    before: Any = None
    after: Any = None
    loop_cpu_s: float = 0.0
    """CPU time of the whole process during the loop (every thread): on the CPU what the copy and read
    threads add to compute shows here."""


def timed_video(pipe: WanPipeline, inputs: Inputs, snapshot=lambda: None) -> Video:
    device = inputs.latents.device
    synchronize(device)  # timing boundaries: on a GPU every queued kernel and copy counts in its interval
    start = time.perf_counter()
    context, negative = pipe.encode(inputs.prompt_ids, inputs.negative_ids)
    synchronize(device)
    encoded = time.perf_counter()
    before, cpu = snapshot(), time.process_time()
    latents = pipe.denoise(inputs.latents, context, negative)
    synchronize(device)
    end = time.perf_counter()
    return Video(latents.cpu(), encoded - start, end - encoded, before, snapshot(), time.process_time() - cpu)


def warm_up(pipe: WanPipeline, inputs: Inputs) -> None:
    context, negative = pipe.encode(inputs.prompt_ids, inputs.negative_ids)
    pipe.warm_up(inputs.latents, context, negative)


@dataclass(frozen=True)
class ExpertCompute:
    """Per block of one expert: its forward's compute on the resident model (seconds), and the rest of a forward."""

    block_s: list[float]
    other_s: float


def measure_experts(pipe: WanPipeline, inputs: Inputs) -> dict[str, ExpertCompute]:
    context, _ = pipe.encode(inputs.prompt_ids, inputs.negative_ids)
    x = inputs.latents.to(DTYPE)
    out = {}
    for path in ("transformer", "transformer_2"):
        expert = getattr(pipe, path)
        t = torch.full((1, expert.shape.dim), 0.5, dtype=DTYPE, device=x.device)
        with torch.no_grad():
            # a GPU's block times vary little, and one of its forwards at 720p lasts seconds: one forward there
            forwards = 3 if x.device.type == "cpu" else 1
            timings = measure_block_compute(lambda: expert(x, context, t), list(expert.blocks), x.device, num_forwards=forwards)
        out[path] = ExpertCompute(timings.block_medians(), timings.other_median())
    return out


REAL_VIDEO = (720, 1280, 81)
"""The real generation's height, width and frames (what its decode holds on the host)."""


def real_host_reserve_gb() -> float:
    """The planner's host reserve for the real generation (`host.reserve`: its 720p x 81 frames decoded
    and encoded, UMT5-XXL's outputs for the prompt and the negative one); this pipeline has no VAE to read it from."""
    height, width, frames = REAL_VIDEO
    values = height * width * frames * 3
    text = 2 * TEXT_TOKENS * 4096 * DTYPE.itemsize
    return max((DECODED_BYTES_PER_VALUE + ENCODING_BYTES_PER_VALUE) * values + text, FLOOR_NBYTES) / GB


def machine_plan(
    pipe: WanPipeline, ctx: dict[str, Any], disk_gbps: float, lossy: bool, lossless: bool | None = None, *, drift: float = 1.0, host_copy: bool = True,
) -> MachinePlan:  # fmt: skip
    """The planner's recommendation for the target machine (`layerstream plan --device-memory 24 --host-memory 32`),
    asked at the run's scale: memory figures divided by the memory scale (an activation reserve of 4 GB given and
    kept whole, as the rows were measured: the planner's own estimate, the largest phase's transient, is that of
    the scaled blocks and tokens, not the real ones), the link and the disk as they are, the run's tokens and steps, compute per block as measured on the
    resident pipeline times `drift` (how much slower the resident twin ran beside a row: the shared machine's
    drift), and on the CPU the compute time this CPU loses per GB the copy and read threads move and per float8
    GB they cast or decode, the decode's own rate, and whether the copy thread and the reads share the one core
    beside compute (`measure_host_copy_costs`; `host_copy` False leaves them out). Its seconds per step, times
    S, are its prediction for the real machine. `lossless` (without `lossy`): the DiT stored lossless (True) or as it
    is (False), instead of the planner's choice between them."""
    s, m = ctx["scenario"], ctx["scale"].memory
    costs = (ctx["host_copy_costs"] or {}) if host_copy else {}
    machine = Machine(
        device_memory_gb=DEFAULT_ACTIVATION_RESERVE_GB + (s.device_gb - DEFAULT_ACTIVATION_RESERVE_GB) / m,
        host_memory_gb=s.host_gb / m, baseline_gb=(PROCESS_BASELINE_GB + CUDA_CONTEXT_GB) / m,
        host_reserve_gb=real_host_reserve_gb() / m, activation_reserve_gb=DEFAULT_ACTIVATION_RESERVE_GB, link_gbps=ctx["link_gbps"], disk_gbps=disk_gbps, allow_lossy=lossy,
        host_copy_s_per_gb=costs.get("copy_s_per_gb", 0.0), host_cast_s_per_gb=costs.get("cast_s_per_gb", 0.0),
        host_decode_s_per_gb=costs.get("decode_s_per_gb", 0.0), decode_gbps=costs.get("decode_gbps", DEVICE_DECODE_GBPS),
        copy_and_read_share_a_core=bool(costs) and torch.get_num_threads() + 1 >= (os.cpu_count() or 1),
    )  # fmt: skip
    seconds = {f"{path}.blocks.{i}": t * drift for path, c in ctx["compute"].items() for i, t in enumerate(c.block_s)}
    return plan_for_machine(pipe, machine, block_seconds=seconds, lossless=lossless,
        generation=pipeline_generation(pipe, tokens=ctx["scale"].num_tokens, num_inference_steps=s.steps),
    )  # fmt: skip


def measure_host_copy_costs(pipe: WanPipeline, inputs: Inputs, rounds: int = 3, forwards: int = 40) -> dict[str, float]:
    """On a CPU device: the compute time a block's forward loses per GB a thread beside it copies (a block's
    bytes, memcpy, once per forward, as the copy thread does while the stream runs ahead), per GB of float8
    bytes it casts to bfloat16 (the table lookups of the float8 form's unpacking) and per GB it decodes from the
    lossless form (the block's own coded bytes decoded in a slot), against the same forwards alone; medians of
    `rounds` alternating turns. Also the decode's own rate on that thread beside the forwards (decoded GB/s: a
    lossless block's copy job is its copy and then its decode). Machine figures for the planner
    (`Machine.host_copy_s_per_gb`, `host_cast_s_per_gb`, `host_decode_s_per_gb`, `decode_gbps`)."""
    from layerstream.runtime.packing.layout import BlockLayout
    from layerstream.runtime.forms.slot import SlotUnpack
    from layerstream.runtime.packing.upcast import upcast_
    from layerstream.runtime.forms.lossless import LosslessForm

    block, dim = pipe.transformer.blocks[0], pipe.transformer.shape.dim
    context, _ = pipe.encode(inputs.prompt_ids, inputs.negative_ids)
    x, cond = inputs.latents.to(DTYPE), torch.zeros(1, dim, dtype=DTYPE)
    nbytes = block_bytes(block)
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    stored = torch.ones(nbytes // 2, dtype=torch.uint8).view(torch.float8_e4m3fn)
    cast_to = torch.empty(nbytes // 2, dtype=DTYPE)
    form = LosslessForm(BlockLayout("block", block, torch.device("cpu")))  # the block's own values, coded
    slot = torch.zeros(form.slot_nbytes, dtype=torch.uint8)
    form.fill_(slot[form.stored_offset : form.stored_offset + form.stored_nbytes])
    unpack = SlotUnpack(form)
    unpack.run_(slot)  # warm: views, scratch
    jobs = {
        "alone": (None, 0), "copy": (lambda: dst.copy_(src), nbytes), "cast": (lambda: upcast_(cast_to, stored), nbytes // 2),
        "decode": (lambda: unpack.run_(slot), form.layout.nbytes),
    }  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in jobs}
    decode_busy: list[float] = []
    with torch.no_grad():
        block(x, context, cond)  # warm
        for _ in range(rounds):
            for name, (job, _) in jobs.items():
                busy: list[float] = []
                times[name].append(_forwards_beside(lambda: block(x, context, cond), forwards, job, busy))
                if name == "decode":
                    decode_busy.append(sum(busy) / len(busy))
    alone = statistics.median(times["alone"])
    lost = {name: max(statistics.median(times[name]) - alone, 0.0) for name in ("copy", "cast", "decode")}
    return {
        "copy_s_per_gb": lost["copy"] / (forwards * jobs["copy"][1] / GB),
        "cast_s_per_gb": lost["cast"] / (forwards * jobs["cast"][1] / GB),
        "decode_s_per_gb": lost["decode"] / (forwards * jobs["decode"][1] / GB),
        "decode_gbps": jobs["decode"][1] / statistics.median(decode_busy) / GB,
        "forward_alone_s": alone / forwards,
    }


def _forwards_beside(forward, n: int, job, busy: list[float] | None = None) -> float:
    """Seconds of `n` forwards, each handing `job` (None: nothing) to a thread beside them, its queue drained;
    each job's own seconds appended to `busy`."""
    import queue
    import threading

    todo: queue.Queue = queue.Queue()

    def work() -> None:
        while (item := todo.get()) is not None:
            begin = time.perf_counter()
            item()
            if busy is not None:
                busy.append(time.perf_counter() - begin)

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    start = time.perf_counter()
    for _ in range(n):
        if job is not None:
            todo.put(job)
        forward()
    todo.put(None)
    thread.join()
    return time.perf_counter() - start


def row_config(plan: MachinePlan, disk_dir: str, *, budget: bool = True) -> dict[str, Any]:
    """The planner's config to paste, with the run's spill folder; `budget` False drops the host budget (the
    float8 reference: every block in host memory)."""
    config = json.loads(json.dumps(plan.config))  # a plain copy
    if "host_budget_gb" in config:
        if budget:
            config["disk_dir"] = disk_dir
        else:
            del config["host_budget_gb"]
    return config


@dataclass(frozen=True)
class Offloaded:
    videos: list[Video]
    """The timed videos of the row, in turn with..."""
    ideals: list[Video]
    """... the resident videos they are compared with (the ideal of the same moment, on the CPU)."""
    placement: Any
    config: dict[str, Any]
    copy_s: float | None
    """Median time of a DiT block's copy job on the CPU copy thread (the simulated link, plus any cast); None on
    a GPU (its copies are timed on the device only with a trace)."""


def run_offloaded(pipe: WanPipeline, inputs: Inputs, config: dict[str, Any], ctx: dict[str, Any], disk_gbps: float | None) -> Offloaded:
    """Enable, warm up, then `repeats` turns of a resident video (the twin, on the CPU) and an offloaded one, so
    that the shared machine's load drifts over both alike (the turns alternate which runs first: a drift that
    lasts the whole run favours neither); on a GPU, whose memory is limited after the resident run, every turn is
    compared with that one run."""
    device, twin = inputs.latents.device, ctx["twin"]
    simulated = {"simulated_link_gbps": ctx["scenario"].link_gbps, "simulated_disk_gbps": disk_gbps} if device.type == "cpu" else {}
    started = time.perf_counter()
    handle = enable_offload(pipe, config, device, **simulated)
    print(f"enabled in {time.perf_counter() - started:.1f} s: {json.dumps(config)}", file=sys.stderr)  # progress
    try:
        warm_up(pipe, inputs)
        videos, ideals = [], []
        for turn in range(ctx["repeats"]):
            if turn % 2:  # offloaded first
                videos.append(timed_video(pipe, inputs, handle.stats))
            ideals.append(timed_video(twin, inputs) if twin is not None else ctx["resident"])
            if not turn % 2:
                videos.append(timed_video(pipe, inputs, handle.stats))
            print(f"  resident {ideals[-1].loop_s:.2f} s, offloaded {videos[-1].loop_s:.2f} s a video", file=sys.stderr)
        if device.type != "cpu":
            return Offloaded(videos, ideals, handle.placement, config, None)
        copies = [i.end - i.start for i in handle.trace().lane("copy") if i.component in ("transformer", "transformer_2")]
        return Offloaded(videos, ideals, handle.placement, config, statistics.median(copies) if copies else None)
    finally:
        handle.disable()  # the pipeline is whole on the host again (and the spill files are gone) for the next row


def predicted_loop_s(ctx: dict[str, Any], placement, transfer_s: float, disk_s: float, resident_loop_s: float) -> float:
    """The bench ideal of the denoising loop: the resident loop plus, per forward, what the ideal of its blocks
    (the longest of compute, link and disk per block, `ideal_forward_seconds_with_disk`) adds to their compute.
    `transfer_s` and `disk_s` are one DiT block's copy and read. A disk block is read at every use, a pooled
    block once per change of expert (the video before this one ended on the low-noise expert)."""
    pipe, tier = ctx["pipe"], placement.host_tier
    previous, extra = "transformer_2", 0.0
    for timestep in pipe.scheduler().timesteps:
        path = "transformer" if pipe.expert_for(float(timestep))[0] is pipe.transformer else "transformer_2"
        c = ctx["compute"][path]
        paths = [f"{path}.blocks.{i}" for i in range(len(c.block_s))]
        resident = set(placement.resident_block_paths(path))
        transfer = [0.0 if p in resident else transfer_s for p in paths]
        for _ in range(2):  # classifier-free guidance: two forwards a step
            reread = path != previous
            disk = [disk_s if tier is not None and (tier.on_disk(p) or (reread and tier.pooled(p))) else 0.0 for p in paths]
            ideal = ideal_forward_seconds_with_disk(c.block_s, transfer, disk, c.other_s)
            extra += ideal - (c.other_s + sum(c.block_s))
            previous = path
    return resident_loop_s + extra


def _delta(v: Video, name: str) -> float:
    return getattr(v.after, name) - getattr(v.before, name)


def _dit_paths(paths) -> list[str]:
    return [p for p in paths if p.split(".")[0] in ("transformer", "transformer_2")]


def tier_counts(placement, blocks_per_expert: int) -> dict[str, float]:
    """Per expert: blocks in the host pool, held for the whole run, and read from disk at every use."""
    tier = placement.host_tier
    resident = {"resident_blocks_per_expert": sum(len(placement.resident_block_paths(p)) for p in ("transformer", "transformer_2")) / 2}
    if tier is None:
        streamed = blocks_per_expert - resident["resident_blocks_per_expert"]
        return {**resident, "pooled_blocks_per_expert": 0, "host_blocks_per_expert": streamed, "disk_blocks_per_expert": 0, "text_encoder_disk_blocks": 0}
    pooled = tier.pool.block_paths if tier.pool is not None else ()
    return {
        **resident,
        "pooled_blocks_per_expert": len(_dit_paths(pooled)) / 2,
        "host_blocks_per_expert": len(_dit_paths(tier.host_block_paths)) / 2,
        "disk_blocks_per_expert": len(_dit_paths(tier.disk_block_paths)) / 2,
        "text_encoder_disk_blocks": len([p for p in tier.disk_block_paths if p.startswith("text_encoder.")]),
    }


def row_figures(name: str, run: Offloaded, plan: MachinePlan, disk_gbps: float | None, reference: tuple[str, Video], ctx: dict[str, Any]) -> dict[str, Any]:
    """A measured row: seconds per step scaled back against the resident loop (the ideal of a GPU that holds
    everything) and the prediction, and the stage that bounds a block: the longest of its compute, its copy
    (the link's time on the target machine; the copy job measured on the CPU) and its disk read."""
    s, scale, v = ctx["scenario"], ctx["scale"], run.videos[-1]
    S, steps, on_disk = scale.time_and_bytes, s.steps, run.placement.host_tier is not None
    ideal_loop_s = statistics.median(i.loop_s for i in run.ideals)
    link_bytes = round(_delta(v, "bytes_transferred") / max(_delta(v, "num_transfers"), 1))
    transfer_s = transfer_seconds(link_bytes, ctx["link_gbps"])
    disk_s = transfer_seconds(link_bytes, disk_gbps) if disk_gbps and on_disk else 0.0
    drift = ideal_loop_s / ctx["resident"].loop_s  # the resident twin beside this row over the first resident video
    stored = run.config.get("layer_options", {}).get("dit", {}).get("storage_dtype")
    lossy = stored not in (None, "lossless")
    lossless = None if lossy else stored == "lossless"  # the row's own form, not the planner's choice
    disk_for_plan = disk_gbps if disk_gbps is not None else s.disks_gbps[0]
    plan = machine_plan(ctx["pipe"], ctx, disk_for_plan, lossy, lossless, drift=drift)  # the same config: compute moves no block
    predicted = plan.seconds_per_step * S
    parts = {
        "predicted_before_s": machine_plan(ctx["pipe"], ctx, disk_for_plan, lossy, lossless, host_copy=False).seconds_per_step * S,
        "predicted_without_drift_s": machine_plan(ctx["pipe"], ctx, disk_for_plan, lossy, lossless).seconds_per_step * S,
        "predicted_without_host_copy_s": machine_plan(ctx["pipe"], ctx, disk_for_plan, lossy, lossless, drift=drift, host_copy=False).seconds_per_step * S,
        "drift": drift,
    }
    bench_ideal = predicted_loop_s(ctx, run.placement, transfer_s, disk_s, ideal_loop_s) / steps * S
    compute_s = statistics.mean(t for c in ctx["compute"].values() for t in c.block_s)
    stages = {"compute": compute_s, "link": transfer_s if run.copy_s is None else max(transfer_s, run.copy_s), "disk": disk_s}
    measured = statistics.median(video.loop_s for video in run.videos) / steps * S
    ideal = ideal_loop_s / steps * S
    row = {
        "name": name, "status": "measured", "disk_gbps": disk_gbps,
        "measured_s": measured, "predicted_s": predicted, "ideal_s": ideal, "x_ideal": statistics.median(v.loop_s / i.loop_s for v, i in zip(run.videos, run.ideals)),
        "measured_over_predicted": measured / predicted, "planner_bound": plan.bound, **parts,
        "measured_over_predicted_before": measured / parts["predicted_before_s"],
        "planner_disk_gb_per_step": plan.disk_nbytes_per_step * S / GB, "config": run.config,
        "bench_ideal_s": bench_ideal,
        "disk_gb_per_step": _delta(v, "disk_bytes_read") / steps * S / GB,
        "link_gb_per_step": _delta(v, "bytes_transferred") / steps * S / GB,
        "stall_s_per_step": _delta(v, "stall_seconds") / steps * S,
        "extra_cpu_s_per_step": statistics.median(v.loop_cpu_s - i.loop_cpu_s for v, i in zip(run.videos, run.ideals)) / steps * S,
        "disk_stall_s_per_step": _delta(v, "disk_stall_seconds") / steps * S,
        "encode_s": v.encode_s * S,
        "host_gb": (v.after.host_bytes + v.after.disk_staging_bytes) * scale.memory / GB,
        "device_gb": v.after.device_bytes * S / GB,
        **tier_counts(run.placement, s.blocks_per_expert),
        "block_s": {k: t * S for k, t in stages.items()}, "bound": max(stages, key=stages.get),
        "bit_identical": all(torch.equal(video.latents, reference[1].latents) for video in run.videos), "reference": reference[0],
        "repeats": len(run.videos), "x_ideal_each": [v.loop_s / i.loop_s for v, i in zip(run.videos, run.ideals)],
        "max_abs_diff_from_bfloat16": float((v.latents - ctx["resident"].latents).abs().max()),
    }  # fmt: skip
    if run.copy_s is not None:  # the same ideal with the copy job this CPU measured: what the simulation can reach
        row["predicted_with_cpu_copy_s"] = predicted_loop_s(ctx, run.placement, max(transfer_s, run.copy_s), disk_s, ideal_loop_s) / steps * S
    return row


def measure_rows(pipe: WanPipeline, inputs: Inputs, ctx: dict[str, Any], disk_dir: str) -> list[dict[str, Any]]:
    """Per disk, the planner's configuration for the target machine: bfloat16 as it is, then stored lossless (the
    same bits: its output must equal the resident one bit for bit), then float8 (`--allow-lossy`) beside a float8
    reference with the same config and every block in host memory (what its output must equal bit for bit)."""
    s, storages = ctx["scenario"], ctx["storages"]
    rows = []

    def measure(name: str, plan: MachinePlan, config: dict[str, Any], disk_gbps: float | None, reference) -> Offloaded:
        run = run_offloaded(pipe, inputs, config, ctx, disk_gbps)
        rows.append(row_figures(name, run, plan, disk_gbps, reference or ("itself: the float8 reference", run.videos[0]), ctx))
        return run

    for storage in ("bfloat16", "lossless"):
        if storage not in storages:
            continue
        for disk_gbps in s.disks_gbps:
            plan = machine_plan(pipe, ctx, disk_gbps, lossy=False, lossless=storage == "lossless")
            measure(f"{storage}@{disk_gbps:g}", plan, row_config(plan, disk_dir), disk_gbps, ("resident", ctx["resident"]))
    if "float8" in storages:
        plans = {d: machine_plan(pipe, ctx, d, lossy=True) for d in s.disks_gbps}
        budgeted = {d: plan for d, plan in plans.items() if "host_budget_gb" in plan.config}
        first = plans[s.disks_gbps[0]]
        # where the planner keeps every float8 block in host memory, the reference is the row itself (no disk tier)
        name = "float8-host (reference, no budget)" if budgeted else "float8 (the planner: every block in host memory)"
        host = measure(name, first, row_config(first, disk_dir, budget=False), None, None)
        for disk_gbps, plan in budgeted.items():
            measure(f"float8@{disk_gbps:g}", plan, row_config(plan, disk_dir), disk_gbps, ("float8 in host memory", host.videos[0]))
    return rows


def prepare(s: Scenario, device: torch.device) -> tuple[WanPipeline, Inputs, Scale]:
    """Build the scaled pipeline, take the scale from its bytes, and on a CPU calibrate the token count."""
    pipe = build_pipeline(s, device)
    real_block, real_streamed = real_streamed_bytes()
    built_streamed = sum(block_bytes(b) for b in streamed_blocks(pipe))
    S = real_block / block_bytes(pipe.transformer.blocks[0])
    vocab, dim = pipe.text_encoder.config.vocab_size, pipe.transformer.shape.dim
    if device.type != "cpu":  # real widths, real tokens: the device's own compute, nothing calibrated
        return pipe, make_inputs(s, s.video_tokens, dim, vocab, device), Scale(S, real_streamed / built_streamed, s.video_tokens, 0.0)
    probe = make_inputs(s, 1, dim, vocab, device)
    context, _ = pipe.encode(probe.prompt_ids, probe.negative_ids)
    tokens, measured = calibrate_tokens(pipe, s.block_compute_s / S, context)
    return pipe, make_inputs(s, tokens, dim, vocab, device), Scale(S, real_streamed / built_streamed, tokens, measured)


def run_resident(pipe: WanPipeline, inputs: Inputs, device_memory_gb: float) -> tuple[Video, dict[str, ExpertCompute]]:
    """The ideal: every weight on the device (on a GPU before its memory is limited to the target's)."""
    device = inputs.latents.device
    pipe.to(device)
    warm_up(pipe, inputs)
    video, compute = timed_video(pipe, inputs), measure_experts(pipe, inputs)
    print(f"resident: encode {video.encode_s:.2f} s, denoise {video.loop_s:.2f} s", file=sys.stderr)
    pipe.to("cpu")
    if device.type == "cuda":
        torch.cuda.empty_cache()  # give the resident weights back before the limit applies
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, device_memory_gb * GB / total), device)
    return video, compute


def run(s: Scenario, disk_dir: str, device: torch.device, repeats: int = 1, storages: tuple[str, ...] = STORAGES) -> dict[str, Any]:
    pipe, inputs, scale = prepare(s, device)
    resident, compute = run_resident(pipe, inputs, s.device_gb)
    link_gbps = s.link_gbps if device.type == "cpu" else measure_link_gbps(device, block_bytes(pipe.transformer.blocks[0]))
    costs = measure_host_copy_costs(pipe, inputs) if device.type == "cpu" else None
    if costs is not None:
        print(f"host copy costs: {json.dumps(costs)}", file=sys.stderr)  # progress
    ctx = {"scenario": s, "scale": scale, "pipe": pipe, "resident": resident, "compute": compute, "link_gbps": link_gbps,
           "repeats": repeats, "storages": storages, "host_copy_costs": costs,
           "twin": copy.deepcopy(pipe) if device.type == "cpu" else None}  # fmt: skip
    rows = measure_rows(pipe, inputs, ctx, disk_dir)
    S, steps = scale.time_and_bytes, s.steps
    high = sum(1 for t in pipe.scheduler().timesteps if pipe.expert_for(float(t))[0] is pipe.transformer)
    return {
        "schema": "layerstream-headline/1",
        "device": str(device), "simulated": device.type == "cpu",
        "scenario": {**asdict(s), "high_noise_steps": high, "link_gbps_used": link_gbps},
        "scale": asdict(scale),
        "ideal": {"source": "the resident loop (every weight on the device); on the CPU a resident twin is timed in turn "
                  "with each row's videos, and x_ideal is the median of those pairs' ratios", "s_per_step": resident.loop_s / steps * S,
                  "published_s_per_step": s.block_compute_s * 2 * s.blocks_per_expert, "encode_s": resident.encode_s * S},
        "prediction_source": PREDICTION_SOURCE, "host_copy_costs": costs,
        "rows": rows,
    }  # fmt: skip


def format_report(result: dict[str, Any]) -> str:
    s, scale, ideal = result["scenario"], result["scale"], result["ideal"]
    S = scale["time_and_bytes"]
    where = (
        f"CPU simulation, scaled by S = {S:.1f} (bytes and times): a block's compute {s['block_compute_s'] * 1e3:.0f} ms "
        f"(published, one H100) / S = {s['block_compute_s'] / S * 1e3:.2f} ms, measured {scale['block_compute_s'] * 1e3:.2f} "
        f"ms at {scale['num_tokens']} tokens"
        if result["simulated"]
        else f"device {result['device']} limited to {s['device_gb']:g} GB, real widths, {scale['num_tokens']} tokens, the real "
        f"link ({s['link_gbps_used']:.1f} GB/s measured) and the disk under the spill folder (predicted at {s['disks_gbps'][0]:g} GB/s)"
    )
    lines = [
        f"Wan 2.2 A14B, 720p x 81 frames: {s['steps']} steps ({s['high_noise_steps']} on the high-noise expert), two "
        f"forwards a step, 2 x {s['blocks_per_expert']} blocks + UMT5 ({s['text_layers']} layers); {s['device_gb']:g} GB "
        f"device, {s['host_gb']:g} GB host, link {s['link_gbps']:g} GB/s, NVMe {' and '.join(f'{d:g}' for d in s['disks_gbps'])} GB/s",
        where,
        f"ideal (a GPU that holds everything, measured resident, first run): {ideal['s_per_step']:.2f} s / step (published: "
        f"{ideal['published_s_per_step']:.2f}); the encoder once: {ideal['encode_s']:.2f} s",
        f"prediction and configuration: {result['prediction_source']}",
        "",
        "| row | s / step | x ideal | predicted s / step (bench ideal; with this CPU's copy) | measured / predicted | disk GB / step (predicted) "
        "| per expert: resident, pooled, held, on disk | host GB | bound (s per block: compute, link, disk) | stall, extra CPU s / step | = reference |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        b, cpu = r["block_s"], r.get("predicted_with_cpu_copy_s")
        lines.append(
            f"| {r['name']} | {r['measured_s']:.2f} | **{r['x_ideal']:.3f}** | {r['predicted_s']:.2f} ({r['bench_ideal_s']:.2f}"
            f"{f'; {cpu:.2f}' if cpu is not None else ''}) | {r['measured_over_predicted']:.3f} | {r['disk_gb_per_step']:.2f} "
            f"({r['planner_disk_gb_per_step']:.2f}) | {r['resident_blocks_per_expert']:g}, {r['pooled_blocks_per_expert']:g}, "
            f"{r['host_blocks_per_expert']:g}, {r['disk_blocks_per_expert']:g} | {r['host_gb']:.1f} | {r['bound']} "
            f"({b['compute']:.3f}, {b['link']:.3f}, {b['disk']:.3f}) | {r['stall_s_per_step']:.2f}, {r['extra_cpu_s_per_step']:.2f} | "
            f"{'yes' if r['bit_identical'] else 'NO'} ({r['reference']}) |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny scale that runs in seconds (checks the output's shape only)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON on stdout, nothing else")
    parser.add_argument("--device", default="cpu", help="cpu (the simulation) or cuda (real widths and tokens, the real link and disk)")
    parser.add_argument("--steps", type=int, default=None, help="denoising steps (default: 40, Wan 2.2's; --smoke: 4)")
    parser.add_argument("--repeats", type=int, default=1, help="timed videos per row, each after a resident one (CPU)")
    parser.add_argument("--storage", choices=(*STORAGES, "all"), default="all", help="which rows to run (default all)")
    parser.add_argument("--disk-gbps", type=float, default=None, help="GPU only: the drive's rating, for the prediction (default 7)")
    parser.add_argument("--disk-dir", default=None, help="spill files go here (default: a temporary folder; on a GPU put it on the NVMe)")
    parser.add_argument("--out", default=None, help="also write the table and the JSON to OUT/results.md and OUT/results.json")
    parser.add_argument("--threads", type=int, default=None, help="CPU compute threads (default: all cores but one)")
    parser.add_argument("--block-compute-s", type=float, default=None, help=f"CPU only: a real block forward's compute (default {PUBLISHED_BLOCK_SECONDS:.3f}: one H100)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    scenario = check_args(parser, args, device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads or max(1, torch.get_num_threads() - 1))  # a core for the copy and read threads
    with tempfile.TemporaryDirectory(prefix="layerstream-headline-", dir=args.disk_dir) as tmp:
        result = run(scenario, tmp, device, args.repeats, STORAGES if args.storage == "all" else (args.storage,))
    result["smoke"] = args.smoke
    print(json.dumps(result, indent=2) if args.json else format_report(result))
    if args.out is not None:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
        (out / "results.md").write_text(format_report(result) + "\n")
    measured = [r for r in result["rows"] if r["status"] == "measured"]
    return 0 if all(r["bit_identical"] for r in measured) else 1


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace, device: torch.device) -> Scenario:
    """The scenario the flags select, or a parser error naming the flag, before anything is built."""
    for flag, value in (("--steps", args.steps), ("--threads", args.threads), ("--repeats", args.repeats)):
        if value is not None and value < 1:
            parser.error(f"{flag} = {value!r} is not valid; expected an integer >= 1")
    for flag, value in (("--disk-gbps", args.disk_gbps), ("--block-compute-s", args.block_compute_s)):
        if value is not None and not value > 0:
            parser.error(f"{flag} = {value!r} is not valid; expected a number > 0")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device = {args.device!r} is not valid; expected cpu or cuda")
    if device.type == "cuda" and (args.smoke or args.block_compute_s is not None):
        parser.error("--smoke and --block-compute-s are for the CPU simulation; on a GPU the device computes")
    if device.type == "cpu" and args.disk_gbps is not None:
        parser.error("--disk-gbps is for a GPU run's prediction; the CPU simulation runs every disk of the scenario")
    scenario = SMOKE if args.smoke else FULL
    if device.type == "cuda":
        scenario = replace(scenario, width_divisor=1, disks_gbps=(args.disk_gbps or 7.0,))
    if args.steps is not None:
        scenario = replace(scenario, steps=args.steps)
    if args.block_compute_s is not None:
        scenario = replace(scenario, block_compute_s=args.block_compute_s)
    return scenario


if __name__ == "__main__":
    sys.exit(main())
