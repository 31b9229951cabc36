"""The VAE decode's device peak: planned from the VAE's structure (`layerstream.models.decode.vae_decode`, a meta
trace) against the peak a fresh process measures while `vae.decode` runs on this CPU, for real-width VAEs with
random weights (diffusers' Wan 2.x VAE and Flux.1's AutoencoderKL, their published configs), untiled and tiled.

Each row decodes in its own process: build the VAE and the latents, warm the kernels with a one-frame 64x64
decode, return freed heap to the system (``malloc_trim``), reset the kernel's peak resident set
(``/proc/self/clear_refs``), decode, and read ``VmHWM`` against the resident set before the decode. The same
process also counts the CPU allocator's own peak (torch's profiler memory events), which leaves out what the
C library keeps back and what kernels allocate outside torch. Prints the table and writes the raw JSON.

    python benchmarks/vae_decode.py                       # the rows in benchmarks/README.md
    python benchmarks/vae_decode.py --rows smoke --in-process     # the suite's smoke: a few seconds
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

WAN_VAE = {}  # diffusers' AutoencoderKLWan defaults are Wan 2.1's published VAE (Wan 2.2 A14B uses it too)
FLUX_VAE = {
    "in_channels": 3,
    "out_channels": 3,
    "latent_channels": 16,
    "block_out_channels": [128, 256, 512, 512],
    "layers_per_block": 2,
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "norm_num_groups": 32,
    "act_fn": "silu",
    "sample_size": 1024,
    "scaling_factor": 0.3611,
    "shift_factor": 0.1159,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
    "mid_block_add_attention": True,
}
"""FLUX.1-dev's vae/config.json."""
SMOKE_WAN_VAE = {"base_dim": 16, "num_res_blocks": 1}
"""A narrower Wan VAE for the suite's smoke row: the same code, a sixth of the width."""
SMOKE_IMAGE_VAE = {
    **FLUX_VAE, "block_out_channels": [32, 64, 64, 64], "layers_per_block": 1, "norm_num_groups": 8,
}  # fmt: skip
"""A narrower Flux VAE: the same code, an eighth of the width."""

VAES = {
    "wan": ("AutoencoderKLWan", WAN_VAE),
    "flux": ("AutoencoderKL", FLUX_VAE),
    "smoke-wan": ("AutoencoderKLWan", SMOKE_WAN_VAE),
    "smoke-image": ("AutoencoderKL", SMOKE_IMAGE_VAE),
}
MMAP_THRESHOLD = 64 * 1024
"""glibc serves allocations above this from their own mappings, returned when freed. Left to itself, glibc
raises the threshold to the largest block freed so far (up to 32 MB), and the heap then keeps freed tensors
resident: a Wan 128x128, 5-frame decode peaked at 511 MB of resident set against 335 MB the allocator held.
A fixed threshold makes the resident set show what the decode needs, as a device's caching allocator would
reuse freed blocks."""
SMALL_TILES = {"tile_sample_min_size": 256, "tile_latent_min_size": 32}
"""Flux's VAE tiles at its sample size (1024 px), too large for rows this CPU decodes in seconds; its tiled
rows set 256 px tiles on the object, which the plan reads from it as it reads any tiling attribute."""


@dataclass(frozen=True)
class Row:
    vae: str
    height: int
    width: int
    num_frames: int | None
    tiled: bool
    dtype: str = "float32"


ROWS = {
    # three sizes per VAE that tile, each tiled and untiled, and one below a tile (tiling changes nothing there,
    # which the plan must know too); Wan at its own 256-pixel tiles, Flux at SMALL_TILES
    "default": [
        *(
            Row("wan", h, w, f, tiled)
            for h, w, f in ((128, 128, 5), (128, 320, 5), (192, 320, 9), (128, 448, 5))
            for tiled in (False, True)
        ),
        *(
            Row("flux", h, w, None, tiled, "bfloat16")  # Flux's VAE is stored and run in bfloat16
            for h, w in ((256, 256), (384, 384), (512, 512), (256, 640))
            for tiled in (False, True)
        ),
    ],
    "smoke": [Row("smoke-image", 128, 128, None, False)],
}


def build_vae(row: Row, device: str) -> torch.nn.Module:
    import diffusers

    class_name, config = VAES[row.vae]
    torch.manual_seed(0)
    with torch.device(device):
        vae = getattr(diffusers, class_name).from_config(config)
    vae = vae.to(getattr(torch, row.dtype)).eval()
    if row.vae in ("flux", "smoke-image"):
        vars(vae).update(SMALL_TILES)
    elif row.vae == "smoke-wan":
        vars(vae).update(tile_sample_min_height=64, tile_sample_min_width=64)
        vars(vae).update(tile_sample_stride_height=48, tile_sample_stride_width=48)
    return vae


def planned(row: Row) -> dict:
    from layerstream.models.decode.vae_decode import estimate_decode_peak

    vae = build_vae(row, "meta")
    peak = estimate_decode_peak(
        vae, height=row.height, width=row.width, num_frames=row.num_frames, tiled=row.tiled, dtype=vae.dtype,
        device_type="cpu",  # this CPU's convolution kernels, as the decode measured here runs them
    )
    return {"planned_nbytes": peak.nbytes, "weight_nbytes": peak.weight_nbytes, "latent_shape": peak.latent_shape}


def measure(row: Row) -> dict:
    """In this (fresh) process: the resident-set and allocator peaks of one decode, beyond what was there."""
    from layerstream.models.decode.vae_decode import latent_shape
    from layerstream.procfs import PROC, proc_nbytes

    vae = build_vae(row, "cpu")
    vae.use_tiling = row.tiled
    dtype = getattr(torch, row.dtype)
    shape = latent_shape(vae, height=row.height, width=row.width, num_frames=row.num_frames)
    latents = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    with torch.no_grad():
        vae.decode(torch.zeros(*shape[:2], *([1] if len(shape) == 5 else []), 8, 8, dtype=dtype))  # warm kernels
        _trim_heap()
        status = PROC / "self" / "status"
        (PROC / "self" / "clear_refs").write_text("5")  # resets VmHWM to the resident set now
        before = proc_nbytes(status, "VmRSS")
        out = vae.decode(latents, return_dict=False)[0]
        rss_peak = proc_nbytes(status, "VmHWM") - before
        del out
        _trim_heap()
        allocator_nbytes = allocator_peak(lambda: vae.decode(latents, return_dict=False))
    return {"rss_peak_nbytes": rss_peak, "allocator_peak_nbytes": allocator_nbytes}


def _trim_heap() -> None:
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to return
        pass


def allocator_peak(call) -> int:
    """The most bytes torch's CPU allocator held at once during `call`, beyond what it held before."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = call()
        del result
    with tempfile.NamedTemporaryFile(suffix=".json") as trace:
        prof.export_chrome_trace(trace.name)
        events = json.loads(Path(trace.name).read_text())["traceEvents"]
    totals = [(e["args"]["Total Allocated"], e["args"]["Bytes"]) for e in events if e.get("name") == "[memory]"]
    if not totals:
        return 0
    start = totals[0][0] - totals[0][1]
    return max(total for total, _ in totals) - start


def run_row(row: Row, threads: int, *, fresh: bool = True) -> dict:
    """Plans the row here and measures it in a fresh process, or (`fresh` False: the suite's smoke) the
    allocator's peak only, here."""
    if fresh:
        command = [sys.executable, __file__, "--measure", json.dumps(asdict(row)), "--threads", str(threads)]
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
        done = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
        if done.returncode != 0:
            raise RuntimeError(f"measuring {row} failed:\n{done.stderr[-3000:]}")
        measured = json.loads(done.stdout.strip().splitlines()[-1])
    else:
        measured = {"rss_peak_nbytes": None, "allocator_peak_nbytes": measure_allocator(row)}
    result = {**asdict(row), **planned(row), **measured}
    for figure in ("rss", "allocator"):
        value = result[f"{figure}_peak_nbytes"]
        result[f"planned_over_{figure}"] = result["planned_nbytes"] / value if value else None
    return result


def measure_allocator(row: Row) -> int:
    """The allocator's peak of one decode, in this process (after a warm-up decode of the same latents)."""
    from layerstream.models.decode.vae_decode import latent_shape

    vae = build_vae(row, "cpu")
    vae.use_tiling = row.tiled
    shape = latent_shape(vae, height=row.height, width=row.width, num_frames=row.num_frames)
    latents = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(getattr(torch, row.dtype))
    with torch.no_grad():
        vae.decode(latents)  # warm: kernels' first-call allocations are not the decode's
        return allocator_peak(lambda: vae.decode(latents, return_dict=False))


HEADER = (
    f"{'VAE':11} {'size':>9} {'frames':>6} {'tiled':>5} {'planned':>9} {'allocator':>9} {'ratio':>6} "
    f"{'RSS peak':>9} {'ratio':>6}  (MB; the VAE's weights apart)"
)


def row_line(r: dict) -> str:
    def mb(n):
        return f"{n / 1e6:9.1f}" if n is not None else f"{'-':>9}"

    def ratio(x):
        return f"{x:6.3f}" if x is not None else f"{'-':>6}"

    size = f"{r['width']}x{r['height']}"
    return (
        f"{r['vae']:11} {size:>9} {r['num_frames'] or '-':>6} {'yes' if r['tiled'] else 'no':>5} "
        f"{mb(r['planned_nbytes'])} {mb(r['allocator_peak_nbytes'])} {ratio(r['planned_over_allocator'])} "
        f"{mb(r['rss_peak_nbytes'])} {ratio(r['planned_over_rss'])}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", choices=sorted(ROWS), default="default")
    parser.add_argument("--json", type=Path, help="write the raw figures here")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--tolerance", type=float, default=0.2, help="exit 1 if a plan is further off the allocator's peak")
    parser.add_argument("--in-process", action="store_true", help="measure the allocator's peak here, no fresh process (the suite's smoke)")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # one row, in the fresh process
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.measure:
        print(json.dumps(measure(Row(**json.loads(args.measure)))))
        return 0
    print(HEADER, flush=True)
    results = []
    for row in ROWS[args.rows]:
        results.append(run_row(row, args.threads, fresh=not args.in_process))
        print(row_line(results[-1]), flush=True)
        if args.json:  # after every row: a long run leaves what it measured
            args.json.write_text(json.dumps(results, indent=2) + "\n")
    off = [r for r in results if abs(r["planned_over_allocator"] - 1) > args.tolerance]
    return 1 if off else 0


if __name__ == "__main__":
    sys.exit(main())
