"""What a perfect streamer would achieve, to judge a measured forward against: a streamed block's copy hides
behind the compute since the previous streamed block started (cyclically), so for streamed blocks s_0 < s_1 < ...

    ideal = other + sum_j max(compute[s_(j-1) .. s_j - 1], transfer[s_j])

The transfer floor, sum_i transfer_i, is the link's busy time: measured / floor says how close it runs to
saturation.
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
    """The link bandwidth at which one block's transfer lasts `ratio` times its compute (0.5: half of it)."""
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
    """The link's (or, of reads, the disk's) busy time for one forward: every transfer, back to back."""
    return float(sum(transfer_s))


def block_transfer_seconds(block_bytes: Sequence[int], moved: Sequence[bool], link_gbps: float) -> list[float]:
    """Per block: its transfer (or, of a disk, read) time where it moves, else 0 (1 GB = 1e9 bytes, as the simulated
    link and disk count)."""
    if len(block_bytes) != len(moved):
        raise ValueError(f"{len(block_bytes)} block sizes but {len(moved)} flags")
    return [transfer_seconds(n, link_gbps) if s else 0.0 for n, s in zip(block_bytes, moved)]


# --- the disk tier: a third stage reads disk block d_k beside everything after d_(k-1) started, so the streamed
# blocks fall into segments ending at a disk block (cyclically), each costing the longer of its compute-and-link
# terms and its read; where the disk dominates this is the disk floor, sum_k disk[d_k]:
#
#     ideal = other + sum_k max(sum_(j in segment k) max(compute hiding s_j, transfer[s_j]), disk[d_k])


def ideal_forward_seconds_with_disk(
    compute_s: Sequence[float], transfer_s: Sequence[float], disk_s: Sequence[float], other_s: float = 0.0
) -> float:
    """The ideal forward with a disk stage (see above); a block read from disk (`disk_s[i] > 0`) must stream."""
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
