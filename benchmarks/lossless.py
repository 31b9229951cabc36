"""The lossless form (`storage_dtype: "lossless"`) on one real-width Wan block: the stored ratio, the encode time
at enable and the decode rate on one core (or on a device), in one run.

The block is the cold-start benchmark's (`bench.checkpoint_folders.WAN_1_3B_WIDTH`: Wan 2.2 at Wan 1.3B's width,
bfloat16), measured twice: with its initial weights (diffusers' initialisation, what the cold-start folder
holds), and with every linear weight redrawn normal with a spread of its own per layer, as trained weights
are distributed (`--spreads`: the standard deviations drawn from, log-uniformly per layer; an assumption, not a
figure from a paper: the ratio on real trained checkpoints is to be confirmed on one). It also prints the
exponent entropy of the weights, to set beside the ~2.6 bits the DFloat11 paper (arXiv 2504.11651) reports for
trained bfloat16 models. Every decode is checked bit for bit.

    PYTHONPATH=src python benchmarks/lossless.py
    PYTHONPATH=src python benchmarks/lossless.py --device cuda --repeats 20
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

from layerstream.runtime.packing.layout import BlockLayout
from layerstream.runtime.forms.lossless import LosslessForm
from layerstream.runtime.forms.slot import SlotUnpack

# the cold start's checkpoint shapes, in the module beside this script
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoint_folders import WAN_1_3B_WIDTH, wan_transformer  # noqa: E402


def exponent_entropy_bits(block: torch.nn.Module) -> float:
    """Shannon entropy of the bfloat16 exponent byte over the block's bfloat16 parameters."""
    counts = torch.zeros(256, dtype=torch.float64)
    for p in block.parameters():
        if p.dtype == torch.bfloat16:
            counts += torch.bincount(((p.detach().reshape(-1).view(torch.int16).to(torch.int32) >> 7) & 0xFF), minlength=256).double()
    probs = counts[counts > 0] / counts.sum()
    return float(-(probs * probs.log2()).sum())


def redraw_trained_like_(block: torch.nn.Module, spreads: tuple[float, float], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    low, high = math.log(spreads[0]), math.log(spreads[1])
    with torch.no_grad():
        for m in block.modules():
            if isinstance(m, torch.nn.Linear):
                std = math.exp(low + (high - low) * torch.rand((), generator=g).item())
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * std)


def measure(block: torch.nn.Module, device: torch.device, repeats: int) -> dict[str, float]:
    start = time.perf_counter()
    form = LosslessForm(BlockLayout("block", block, device))  # plan every span's code (reads the values once)
    stored = torch.zeros(form.stored_nbytes, dtype=torch.uint8)
    form.fill_(stored)  # what staging does at enable
    encode_s = time.perf_counter() - start
    expected = torch.empty(form.layout.nbytes, dtype=torch.uint8)
    form.layout.copy_sources_into(expected)
    slot = torch.zeros(form.slot_nbytes, dtype=torch.uint8, device=device)
    slot[form.stored_offset : form.stored_offset + form.stored_nbytes].copy_(stored)
    unpack = SlotUnpack(form)
    unpack.run_(slot)  # warm: views, scratch
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        unpack.run_(slot)
        sync()  # the decode is queued on the device: time it to its end
        times.append(time.perf_counter() - begin)
    assert torch.equal(slot[: form.layout.nbytes].cpu(), expected), "decode is not bit-exact"
    return {
        "ratio": form.stored_nbytes / form.layout.nbytes,
        "coded_fraction": form.kept_nbytes / form.layout.nbytes,
        "encode_gbps": form.layout.nbytes / encode_s / 1e9,
        "decode_gbps": form.layout.nbytes / min(times) / 1e9,
        "entropy": exponent_entropy_bits(block),
        "block_mb": form.layout.nbytes / 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--spreads", type=float, nargs=2, default=(0.01, 0.05), metavar=("LOW", "HIGH"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model = wan_transformer(WAN_1_3B_WIDTH.__class__(**{**vars(WAN_1_3B_WIDTH), "num_blocks": 1}), seed=0)
    block = model.blocks[0]
    rows = [("initial weights (cold-start checkpoint)", measure(block, device, args.repeats))]
    redraw_trained_like_(block, tuple(args.spreads), seed=1)
    rows.append((f"normal, per-layer std {args.spreads[0]:g}-{args.spreads[1]:g}", measure(block, device, args.repeats)))
    print(f"one Wan block at Wan 1.3B's width, bfloat16; decode on {device} ({args.threads} thread(s))")
    print("| weights | block MB | coded part | exponent entropy (bits) | stored / bf16 | encode GB/s | decode GB/s (output) |")
    print("|---|---|---|---|---|---|---|")
    for name, r in rows:
        print(
            f"| {name} | {r['block_mb']:.1f} | {r['coded_fraction']:.3f} | {r['entropy']:.2f} | {r['ratio']:.3f} | "
            f"{r['encode_gbps']:.3f} | {r['decode_gbps']:.3f} |"
        )


if __name__ == "__main__":
    main()
