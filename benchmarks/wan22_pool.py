"""Wan 2.2's two experts under a host budget: the shared host pool against a static split, and resident.

A pipeline named `WanPipeline` (so that layerstream's built-in Wan plan applies and pairs its experts) holds
two synthetic DiTs of one bench shape and runs a denoising loop as diffusers' Wan 2.2 does: `--steps` steps,
the first half on `transformer` (high noise), the rest on `transformer_2`, each step two forwards
(classifier-free guidance). Rows, each timed over whole loops after a warm-up loop:

- resident: every weight on the device;
- pool: layerwise with `host_budget_gb`; the experts share a host pool (the one not running holds none);
- static: the same, with the experts declared by the pipeline's own plan, which the pairing does not cover:
  each expert keeps its share of the budget for the whole run.

Every row's output is compared bit for bit with resident. On the CPU the link and the disk are simulated
(`--link-gbps`, `--disk-gbps`); on a GPU the disk is the one under `--disk-dir` (reads drop their pages from
the page cache, so they reach it). Figures are ratios measured in one run.

    python benchmarks/wan22_pool.py                      # CPU simulation, small shape
    python benchmarks/wan22_pool.py --device cuda --shape wan14b --blocks 8 --tokens 8192 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import torch
from torch import nn

from layerstream import OffloadPlan, enable_offload
from strategy_bench.synthetic import MODEL_SHAPES, build_synthetic_dit

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class WanPipeline(nn.Module):
    """Two experts, one per step, split at the middle step (diffusers' Wan 2.2 splits at a boundary timestep)."""

    def __init__(self, transformer: nn.Module, transformer_2: nn.Module):
        super().__init__()
        self.transformer = transformer
        self.transformer_2 = transformer_2

    @torch.no_grad()
    def denoise(self, x: torch.Tensor, context: torch.Tensor, negative: torch.Tensor, steps: int, guidance: float = 4.0):
        for i in range(steps):
            expert = self.transformer if i < steps // 2 else self.transformer_2
            t = torch.full((x.shape[0], x.shape[-1]), 1.0 - i / steps, dtype=x.dtype, device=x.device)
            cond = expert(x, context, t)
            uncond = expert(x, negative, t)
            x = x - (uncond + guidance * (cond - uncond)) / steps
        return x


class StaticSplitPipeline(nn.Module):
    """The same experts, declared by the pipeline's own plan: no pairing, so no pool."""

    _offload_plan = OffloadPlan(block_attrs={"transformer": ("blocks",), "transformer_2": ("blocks",)})
    denoise = WanPipeline.denoise

    def __init__(self, transformer: nn.Module, transformer_2: nn.Module):
        super().__init__()
        self.transformer = transformer
        self.transformer_2 = transformer_2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", default="small", choices=sorted(MODEL_SHAPES))
    parser.add_argument("--blocks", type=int, default=6, help="blocks per expert")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--context-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--budget-fraction", type=float, default=0.34, help="host budget, as a fraction of the streamed bytes")
    parser.add_argument("--link-gbps", type=float, default=None, help="CPU only: simulated link")
    parser.add_argument("--disk-gbps", type=float, default=None, help="CPU only: simulated disk")
    parser.add_argument("--disk-dir", default=None, help="spill files go here (default: a temporary folder)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="CPU compute threads (default: all cores but one)")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads or max(1, torch.get_num_threads() - 1))  # a core for copies and reads
    elif args.link_gbps is not None or args.disk_gbps is not None:
        parser.error(f"--link-gbps and --disk-gbps simulate a link and a disk on the CPU; device {device} has real ones")
    if not 0 < args.budget_fraction < 1:
        parser.error(f"--budget-fraction = {args.budget_fraction!r} is not valid; expected a number in (0, 1)")
    shape, dtype = MODEL_SHAPES[args.shape], DTYPES[args.dtype]
    experts = [build_synthetic_dit(shape, args.blocks, dtype=dtype, seed=s, init_device=device) for s in (0, 1)]
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, args.tokens, shape.dim, generator=generator).to(device, dtype)
    context = torch.randn(1, args.context_tokens, shape.dim, generator=generator).to(device, dtype)
    negative = torch.zeros_like(context)
    streamed = sum(p.numel() * p.element_size() for e in experts for p in e.blocks.parameters())
    budget_gb = args.budget_fraction * streamed / 1e9
    disk_dir = args.disk_dir or tempfile.mkdtemp(prefix="layerstream-wan22-pool-")

    def timed(pipe) -> tuple[float, torch.Tensor]:
        pipe.denoise(x, context, negative, args.steps)  # warm-up: the first loop also moves the pool to its steady use
        times = []
        for _ in range(args.repeats):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            out = pipe.denoise(x, context, negative, args.steps)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        return statistics.median(times), out

    rows = {}
    resident = WanPipeline(*[e.to(device) for e in experts])
    seconds, expected = timed(resident)
    rows["resident"] = {"seconds_per_loop": seconds}
    for e in experts:
        e.to("cpu")
    for name, cls in (("pool", WanPipeline), ("static", StaticSplitPipeline)):
        pipe = cls(*experts)
        config = {"mode": "layer", "components": ["dit"], "host_budget_gb": budget_gb, "disk_dir": disk_dir}
        handle = enable_offload(pipe, config, device, simulated_link_gbps=args.link_gbps, simulated_disk_gbps=args.disk_gbps)
        tier = handle.placement.host_tier
        before = handle.stats().disk_bytes_read
        seconds, out = timed(pipe)
        stats = handle.stats()
        loops = args.repeats + 1
        rows[name] = {
            "seconds_per_loop": seconds,
            "over_resident": seconds / rows["resident"]["seconds_per_loop"],
            "bit_identical": bool(torch.equal(out.cpu(), expected.cpu())),
            "disk_mb_per_loop": (stats.disk_bytes_read - before) / loops / 1e6,
            "disk_stall_s_per_loop": stats.disk_stall_seconds / loops,
            "host_mb": stats.host_bytes / 1e6,
            "host_pool_mb": stats.host_pool_bytes / 1e6,
            "staging_mb": stats.disk_staging_bytes / 1e6,
            "budget_mb": budget_gb * 1e3,
            "blocks_in_host_memory_per_expert": (len(tier.pool.entries) if tier.pool else len(tier.host_block_paths) / 2),
            "disk_blocks_per_expert": len(tier.disk_block_paths) / 2,
        }
        handle.disable()

    print(
        f"Wan 2.2-like: 2 experts x {args.blocks} {args.shape} blocks ({streamed / 1e6:.0f} MB streamed), {args.steps} steps x 2 "
        f"forwards, {args.tokens} tokens, {args.dtype}, device {device}, host budget {budget_gb * 1e3:.0f} MB "
        f"({args.budget_fraction:g} of the streamed bytes), link {args.link_gbps or 'real'} GB/s, disk "
        f"{args.disk_gbps or 'real'} GB/s"
    )
    print("| row | s / loop | x resident | bit-identical | blocks in host memory per expert | disk blocks per expert | disk MB / loop | host MB (pool) | staging MB |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| resident | {rows['resident']['seconds_per_loop']:.3f} | 1.000 | yes | all | 0 | 0 | - | - |")
    for name in ("pool", "static"):
        r = rows[name]
        print(
            f"| {name} | {r['seconds_per_loop']:.3f} | {r['over_resident']:.3f} | {'yes' if r['bit_identical'] else 'NO'} | "
            f"{r['blocks_in_host_memory_per_expert']:g} | {r['disk_blocks_per_expert']:g} | {r['disk_mb_per_loop']:.0f} | "
            f"{r['host_mb']:.0f} ({r['host_pool_mb']:.0f}) | {r['staging_mb']:.0f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)
    return 0 if all(rows[n]["bit_identical"] for n in ("pool", "static")) else 1


if __name__ == "__main__":
    sys.exit(main())
