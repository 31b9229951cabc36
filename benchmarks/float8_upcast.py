"""The float8 -> bfloat16 cast on this CPU: torch's `copy_` against layerstream's table lookups
(`layerstream.runtime.packing.upcast`), on one core, for a block's worth of elements (default: a 1/64-scale
Wan 2.2 block, the headline simulation's, 5.5 M elements). Prints the fastest of the repeats, in ms, and
checks that both give the same bits.

    python benchmarks/float8_upcast.py
    python benchmarks/float8_upcast.py --elements 1000000 --repeats 5 --threads 2
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from layerstream.runtime.packing.upcast import Upcast

WAN_BLOCK_ELEMENTS = 5_508_928
"""Cast elements of one Wan 2.2 block at 1/8 of every width (`benchmarks/wan22_scenario.py`)."""


def fastest_ms(run, repeats: int) -> float:
    run()  # warm: tables, index buffer, pages
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=WAN_BLOCK_ELEMENTS)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="torch's intra-op threads (default 1: the copy thread's core)")
    args = parser.parse_args(argv)
    for name in ("elements", "repeats", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} = {getattr(args, name)} is not valid; expected an integer >= 1")
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    stored = (torch.randn(args.elements, generator=generator) * 0.1).to(torch.float8_e4m3fn)
    by_torch = torch.empty(args.elements, dtype=torch.bfloat16)
    by_lookup = torch.empty(args.elements, dtype=torch.bfloat16)
    upcast = Upcast(by_lookup, stored)
    torch_ms = fastest_ms(lambda: by_torch.copy_(stored), args.repeats)
    lookup_ms = fastest_ms(upcast.run_, args.repeats)
    same = torch.equal(by_torch.view(torch.int16), by_lookup.view(torch.int16))
    print(f"{args.elements} float8_e4m3fn -> bfloat16 elements, {args.threads} thread(s), fastest of {args.repeats}:")
    print(f"  torch copy_      {torch_ms:8.2f} ms ({torch_ms * 1e6 / args.elements:.2f} ns an element)")
    print(f"  table lookups    {lookup_ms:8.2f} ms ({lookup_ms * 1e6 / args.elements:.2f} ns an element), {torch_ms / lookup_ms:.1f}x")
    print(f"  same bits: {'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
