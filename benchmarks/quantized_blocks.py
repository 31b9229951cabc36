"""Host bytes of one real-width Wan 2.2 A14B block (dim 5120, ffn 13824) in each single-file format against
bfloat16, and whether dequantising a streamed block costs more than the copy it saves.

The bytes are exact (the GGUF block sizes; fp8_scaled's 1 byte a weight with a float32 scale a tensor; biases
and norms in bfloat16 in every format). The dequantise time is measured on one 5120x5120 weight with diffusers'
own GGUF dequantisation (and the fp8_scaled upcast, `weight.to(bf16) * scale`) on `--device`, and scaled to the
block's 351 M weights (on a CPU in the process's CPU time, one thread); the copy saved is the bytes not moved, at `--link-gbps` (default: measured, a pinned
host-to-device copy on a GPU; 25 GB/s, a PCIe 4.0 x16 link, on a CPU).

    python benchmarks/quantized_blocks.py                  # CPU, one thread
    python benchmarks/quantized_blocks.py --device cuda    # what gpu.sh runs
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

DIM, FFN = 5120, 13824
LINEARS = [(DIM, DIM)] * 8 + [(FFN, DIM), (DIM, FFN)]
"""(out, in) of a Wan block's Linear weights: self- and cross-attention q, k, v, o, then the feed-forward."""
OTHER_ELEMENTS = 8 * DIM + FFN + DIM + 6 * DIM + 4 * DIM + 2 * DIM  # biases, norms, modulation: bfloat16 everywhere
BYTES_PER_WEIGHT = {"bfloat16": 2.0, "Q8_0": 34 / 32, "Q6_K": 210 / 256, "Q4_K": 144 / 256, "Q4_0": 18 / 32, "fp8_scaled": 1.0}


def block_bytes(fmt: str) -> int:
    weights = sum(o * i for o, i in LINEARS)
    scales = 4 * len(LINEARS) if fmt == "fp8_scaled" else 0
    return int(weights * BYTES_PER_WEIGHT[fmt]) + scales + 2 * OTHER_ELEMENTS


def _blocks(fmt: str, rows: int, cols: int) -> np.ndarray:
    """Valid quantized blocks of a (rows, cols) weight: the gguf package's quantizer where it has one, random
    super-blocks with small scales for the K-quants (any quant bytes are valid)."""
    import gguf

    kind = gguf.GGMLQuantizationType[fmt]
    if fmt in ("Q8_0", "Q4_0"):
        return gguf.quants.quantize(np.random.default_rng(0).standard_normal((rows, cols), dtype=np.float32) * 0.02, kind)
    size, d_at = {"Q4_K": (144, 0), "Q6_K": (210, 208)}[fmt]
    blocks = np.random.default_rng(0).integers(0, 256, size=(rows, cols // 256, size), dtype=np.uint8)
    blocks[:, :, d_at : d_at + 2] = np.array([0.002], dtype=np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def dequantise_seconds(fmt: str, device: torch.device, repeats: int) -> float:
    """The fastest of `repeats` dequantisations of one DIM x DIM weight into bfloat16 on `device`."""
    if fmt == "fp8_scaled":
        weight = (torch.randn(DIM, DIM) * 0.02).to(torch.float8_e4m3fn).to(device)
        scale = torch.tensor(0.01, device=device)
        run = lambda: weight.to(torch.bfloat16) * scale.to(torch.bfloat16)  # noqa: E731
    else:
        import gguf
        from diffusers.quantizers.gguf.utils import GGUFParameter, dequantize_gguf_tensor

        data = torch.from_numpy(_blocks(fmt, DIM, DIM)).to(device)
        weight = GGUFParameter(data, quant_type=gguf.GGMLQuantizationType[fmt])
        run = lambda: dequantize_gguf_tensor(weight).to(torch.bfloat16)  # noqa: E731
    run()
    # on a CPU the process's own CPU time (one thread): a shared machine's other work does not count
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # time the kernels, not their launch
        start = clock()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(clock() - start)
    return min(times)


def link_gbps(device: torch.device) -> float:
    """A pinned host-to-device copy of 1 GiB, measured (GB/s)."""
    source = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
    target = torch.empty_like(source, device=device)
    target.copy_(source, non_blocking=True)
    torch.cuda.synchronize(device)  # warm, then time one copy
    start = time.perf_counter()
    target.copy_(source, non_blocking=True)
    torch.cuda.synchronize(device)
    return source.numel() / (time.perf_counter() - start) / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--link-gbps", type=float, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    gbps = args.link_gbps or (link_gbps(device) if device.type == "cuda" else 25.0)
    weights = sum(o * i for o, i in LINEARS)
    base = block_bytes("bfloat16")
    print(f"one Wan 2.2 A14B block, {weights / 1e6:.0f} M weights; device {device}; link {gbps:.1f} GB/s")
    print("| format | host bytes / block | vs bfloat16 | dequantise / block | copy saved / block |")
    print("|---|---:|---:|---:|---:|")
    print(f"| bfloat16 | {base / 1e6:.0f} MB | 1.00 | - | - |")
    for fmt in ("Q8_0", "Q6_K", "Q4_K", "Q4_0", "fp8_scaled"):
        nbytes = block_bytes(fmt)
        dequant = dequantise_seconds(fmt, device, args.repeats) * weights / (DIM * DIM)
        saved = (base - nbytes) / (gbps * 1e9)
        print(f"| {fmt} | {nbytes / 1e6:.0f} MB | {nbytes / base:.2f} | {dequant * 1e3:.1f} ms | {saved * 1e3:.1f} ms |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
