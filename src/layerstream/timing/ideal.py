"""What a perfect streamer would achieve, to judge a measured forward against.

With every block streamed and compute and copies overlapped perfectly, each block costs the longer of its
compute and the transfer that runs beside it, and the work outside the blocks costs its own time:

    ideal = other + sum_i max(compute_i, transfer_i)

With some blocks resident the same rule applies per streamed block, with the compute that can hide its
transfer: a streamed block's copy is issued when the previous streamed block starts (the runtime prefetches
along the chain of streamed blocks, the last one fetching the first), so it overlaps that block's compute and
the compute of every resident block in between. For streamed blocks s_0 < s_1 < ... (cyclically):

    ideal = other + sum_j max(compute[s_(j-1) .. s_j - 1], transfer[s_j])

which is the formula above when every block streams (each transfer paired with the compute it overlaps), and
the resident time when none does. Pairing only a block's own compute with its transfer would ignore the
resident blocks' compute and put the ideal above what the runtime achieves.

The transfer floor is the time the link needs for the bytes of one forward, whatever the compute:

    floor = sum_i transfer_i

A measured forward above `ideal` shows overlap lost (exposed copies, hook and scheduling overhead); when
transfers dominate, measured / floor says how close the link runs to saturation.
"""

from __future__ import annotations

from collections.abc import Sequence

from layerstream.wording import GB


def transfer_seconds(nbytes: int, link_gbps: float) -> float:
    """Seconds `nbytes` take on a link of `link_gbps` GB/s (1 GB = 1e9 bytes, as the simulated link counts)."""
    if not link_gbps > 0:
        raise ValueError(f"link_gbps = {link_gbps!r} is not valid; expected a number > 0")
    return nbytes / (link_gbps * GB)


def link_gbps_for_ratio(block_bytes: int, block_compute_s: float, ratio: float) -> float:
    """The link bandwidth at which one block's transfer lasts `ratio` times its compute.

    `ratio` 0.5 means "the transfer takes half the compute"; 2 means "twice the compute".
    """
    if not ratio > 0:
        raise ValueError(f"link ratio = {ratio!r} is not valid; expected a number > 0")
    if not block_compute_s > 0:
        raise ValueError(f"block compute time = {block_compute_s!r} s; expected a measured time > 0")
    return block_bytes / (ratio * block_compute_s) / GB


def ideal_forward_seconds(compute_s: Sequence[float], transfer_s: Sequence[float], other_s: float = 0.0) -> float:
    """The ideal forward (see the module docstring); `transfer_s[i]` is 0 for a block that stays on the device."""
    if len(compute_s) != len(transfer_s):
        raise ValueError(f"{len(compute_s)} compute times but {len(transfer_s)} transfer times; expected one per block")
    streamed = [i for i, t in enumerate(transfer_s) if t > 0]
    if not streamed:
        return max(other_s, 0.0) + sum(compute_s)
    return max(other_s, 0.0) + sum(_streamed_terms(compute_s, transfer_s, streamed))


def transfer_floor_seconds(transfer_s: Sequence[float]) -> float:
    """The link's busy time for one forward: every streamed block's transfer, back to back."""
    return float(sum(transfer_s))


def block_transfer_seconds(block_bytes: Sequence[int], streamed: Sequence[bool], link_gbps: float) -> list[float]:
    """Per block: its transfer time if it streams, else 0."""
    if len(block_bytes) != len(streamed):
        raise ValueError(f"{len(block_bytes)} block sizes but {len(streamed)} streamed flags")
    return [transfer_seconds(n, link_gbps) if s else 0.0 for n, s in zip(block_bytes, streamed)]


# --- the disk tier (`--host-budget-gb`) ----------------------------------------------------------------------
#
# With blocks on disk a third stage runs ahead of the link: the disk reads disk block d_k ahead along the chain
# of disk blocks, beside everything that runs after the previous disk block d_(k-1) started. So the streamed
# blocks fall into segments, each ending at a disk block (cyclically), and each segment costs the longer of
# its blocks' compute-and-link terms (the formula above) and its disk block's read:
#
#     ideal = other + sum_k max(sum_(j in segment k) max(compute hiding s_j, transfer[s_j]), disk[d_k])
#
# With every block on disk each segment is one block: the maximum of its compute, link and disk. With few disk
# blocks their reads hide behind the host blocks between them. When the disk dominates, the ideal is the disk
# floor, the disk's busy time for one forward:
#
#     disk floor = sum_k disk[d_k] = disk bytes per forward / disk bandwidth


def ideal_forward_seconds_with_disk(
    compute_s: Sequence[float], transfer_s: Sequence[float], disk_s: Sequence[float], other_s: float = 0.0
) -> float:
    """The ideal forward with a disk stage (see above); `disk_s[i]` is 0 for a block not read from disk.
    A block read from disk must stream (`transfer_s[i] > 0`)."""
    if not len(compute_s) == len(transfer_s) == len(disk_s):
        raise ValueError(
            f"{len(compute_s)} compute, {len(transfer_s)} transfer and {len(disk_s)} disk times; expected one per block"
        )
    if any(d > 0 and t <= 0 for d, t in zip(disk_s, transfer_s)):
        raise ValueError("a block read from disk must stream (transfer time > 0)")
    streamed = [i for i, t in enumerate(transfer_s) if t > 0]
    if not any(d > 0 for d in disk_s):
        return ideal_forward_seconds(compute_s, transfer_s, other_s)
    terms = _streamed_terms(compute_s, transfer_s, streamed)
    # rotate the streamed blocks so that the last one is a disk block: then every segment ends at one
    last_disk = max(j for j, block in enumerate(streamed) if disk_s[block] > 0)
    order = [*range(last_disk + 1, len(streamed)), *range(0, last_disk + 1)]
    total = segment = 0.0
    for j in order:
        segment += terms[j]
        if disk_s[streamed[j]] > 0:
            total += max(segment, disk_s[streamed[j]])
            segment = 0.0
    return max(other_s, 0.0) + total


def disk_floor_seconds(disk_s: Sequence[float]) -> float:
    """The disk's busy time for one forward: every disk block's read, back to back."""
    return float(sum(disk_s))


def block_disk_seconds(block_bytes: Sequence[int], on_disk: Sequence[bool], disk_gbps: float) -> list[float]:
    """Per block: its read time if it lives on disk, else 0 (1 GB = 1e9 bytes, as the simulated disk counts)."""
    if len(block_bytes) != len(on_disk):
        raise ValueError(f"{len(block_bytes)} block sizes but {len(on_disk)} on-disk flags")
    return [transfer_seconds(n, disk_gbps) if d else 0.0 for n, d in zip(block_bytes, on_disk)]


def _streamed_terms(compute_s: Sequence[float], transfer_s: Sequence[float], streamed: list[int]) -> list[float]:
    """Per streamed block: the longer of its transfer and the compute that hides it (`ideal_forward_seconds`)."""
    num_blocks = len(compute_s)
    terms = []
    for j, block in enumerate(streamed):
        previous = streamed[j - 1]  # cyclic: the first streamed block is prefetched by the last one
        if previous < block:
            hiding = range(previous, block)
        else:  # wraps around the end of the stack (or a single streamed block: the whole stack hides it)
            hiding = [*range(previous, num_blocks), *range(0, block)]
        terms.append(max(sum(compute_s[i] for i in hiding), transfer_s[block]))
    return terms
