"""The lossless form (`storage_dtype: "lossless"`) on real-width and on trained weights: the stored ratio beside
the entropy bound, the encode time at enable and the decode rate on one core (or on a device), in one run.

The block is the cold-start benchmark's (`bench.checkpoint_folders.WAN_1_3B_WIDTH`: Wan 2.2 at Wan 1.3B's width,
bfloat16), measured twice: with its initial weights (diffusers' initialisation, what the cold-start folder
holds), and with every linear weight redrawn normal with a spread of its own per layer (`--spreads`: the standard
deviations drawn from, log-uniformly per layer). `--weights FOLDER` adds trained weights: each folder of
safetensors files under FOLDER (FOLDER itself, or its subfolders) is one model, whose floating-point tensors of
4,096 elements or more are cast to `--dtype` (as a checkpoint saved in it holds them) and measured as one block.
The entropy bound is a raw byte plus the coded byte's Shannon entropy (bfloat16: the exponent; float16: the
high byte), per tensor, per element: what an entropy coder of the coded bytes would reach. Every decode is
checked bit for bit.

    PYTHONPATH=src python benchmarks/lossless.py
    PYTHONPATH=src python benchmarks/lossless.py --weights FOLDER --skip-wan
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

MIN_ELEMENTS = 2048
"""Tensors of fewer 16-bit elements (under 4 KiB) stay raw in the lossless form."""
TRAINED_MIN_ELEMENTS = 4096
"""The trained tensors measured: 4,096 elements or more (smaller ones are biases and norms, a few KB a model)."""


def coded_byte_counts(tensor: torch.Tensor) -> torch.Tensor:
    """How often each coded byte value occurs in a 16-bit tensor (bfloat16: the exponent; float16: the high
    byte), float64, 256."""
    shift = 7 if tensor.dtype == torch.bfloat16 else 8
    return torch.bincount((tensor.detach().reshape(-1).view(torch.int16).to(torch.int32) >> shift) & 0xFF, minlength=256).double()


def entropy_bits(counts: torch.Tensor) -> float:
    probs = counts[counts > 0] / counts.sum()
    return float(-(probs * probs.log2()).sum())


def entropy_figures(block: torch.nn.Module, nbytes: int) -> tuple[float, float]:
    """(the coded byte's entropy over all of the block's coded parameters, in bits; the entropy bound per byte of
    the block's `nbytes`: a raw byte plus each tensor's own entropy per coded element, the other bytes as they
    are)."""
    pooled = torch.zeros(256, dtype=torch.float64)
    bound_bytes, raw_bytes = 0.0, nbytes
    for p in block.parameters():
        if p.dtype in (torch.bfloat16, torch.float16) and p.numel() >= MIN_ELEMENTS:
            counts = coded_byte_counts(p)
            pooled += counts
            bound_bytes += p.numel() * (8 + entropy_bits(counts)) / 8
            raw_bytes -= 2 * p.numel()
    return entropy_bits(pooled), (bound_bytes + raw_bytes) / nbytes


def trained_blocks(folder: Path, dtype: torch.dtype) -> list[tuple[str, torch.nn.Module]]:
    """(name, a module holding its tensors) of each model under `folder`: a folder with safetensors files."""
    from safetensors.torch import load_file

    models = sorted({f.parent for f in folder.rglob("*.safetensors")})
    out = []
    for model in models:
        block = torch.nn.Module()
        for file in sorted(model.glob("*.safetensors")):
            for tensor in load_file(file).values():
                if tensor.is_floating_point() and tensor.numel() >= TRAINED_MIN_ELEMENTS:
                    name = f"t{len(block._parameters)}"
                    block.register_parameter(name, torch.nn.Parameter(tensor.to(dtype), requires_grad=False))
        if len(block._parameters):
            out.append((model.relative_to(folder).as_posix() if model != folder else model.name, block))
    return out


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
    expected = torch.zeros(form.layout.nbytes, dtype=torch.uint8)
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
    entropy, bound = entropy_figures(block, form.layout.nbytes)
    return {
        "nbytes": form.layout.nbytes,
        "stored_nbytes": form.stored_nbytes,
        "coded_nbytes": form.kept_nbytes,
        "encode_s": encode_s,
        "decode_s": min(times),
        "entropy": entropy,
        "bound": bound,
    }


def row(name: str, r: dict[str, float]) -> str:
    return (
        f"| {name} | {r['nbytes'] / 1e6:.1f} | {r['coded_nbytes'] / r['nbytes']:.3f} | {r['entropy']:.2f} | "
        f"{r['bound']:.3f} | {r['stored_nbytes'] / r['nbytes']:.3f} | {r['nbytes'] / r['encode_s'] / 1e9:.3f} | "
        f"{r['nbytes'] / r['decode_s'] / 1e9:.3f} |"
    )


def total(rows: list[dict[str, float]]) -> dict[str, float]:
    """The figures of several models together (the entropy: the bytes-weighted mean of theirs)."""
    nbytes = sum(r["nbytes"] for r in rows)
    out = {key: sum(r[key] for r in rows) for key in ("nbytes", "stored_nbytes", "coded_nbytes", "encode_s", "decode_s")}
    out.update({key: sum(r[key] * r["nbytes"] for r in rows) / nbytes for key in ("entropy", "bound")})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--spreads", type=float, nargs=2, default=(0.01, 0.05), metavar=("LOW", "HIGH"))
    parser.add_argument("--weights", type=Path, help="a folder of trained models' safetensors files (one model a folder)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16", help="what --weights are cast to")
    parser.add_argument("--skip-wan", action="store_true", help="only the --weights rows")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"decode on {device} ({args.threads} thread(s)); stored / 16-bit and the bound are per byte of {args.dtype if args.skip_wan else 'bfloat16'}")
    print("| weights | MB | coded part | coded byte entropy (bits) | entropy bound | stored / 16-bit | encode GB/s | decode GB/s (output) |")
    print("|---|---|---|---|---|---|---|---|")
    if not args.skip_wan:
        model = wan_transformer(WAN_1_3B_WIDTH.__class__(**{**vars(WAN_1_3B_WIDTH), "num_blocks": 1}), seed=0)
        block = model.blocks[0]
        print(row("Wan block, initial weights (cold-start checkpoint)", measure(block, device, args.repeats)), flush=True)
        redraw_trained_like_(block, tuple(args.spreads), seed=1)
        print(row(f"Wan block, normal, per-layer std {args.spreads[0]:g}-{args.spreads[1]:g}", measure(block, device, args.repeats)), flush=True)
    if args.weights is not None:
        trained = []
        for name, block in trained_blocks(args.weights, getattr(torch, args.dtype)):
            trained.append(measure(block, device, args.repeats))
            print(row(f"trained: {name} ({args.dtype})", trained[-1]), flush=True)
        if len(trained) > 1:
            print(row(f"trained: all {len(trained)} models ({args.dtype})", total(trained)))


if __name__ == "__main__":
    main()
