"""Which leading DiT blocks stay on the device instead of streaming (`resident_layers`).

An int N keeps the first N blocks of each DiT declared in `resident_dit_paths`. `"auto"` fills a device
budget: everything offload puts on the device (non-block modules, the slot ring, resident blocks) must fit in
`device_budget_gb`, or in the device's free memory minus `activation_reserve_gb`. Auto spreads the resident
blocks evenly through the stack rather than keeping the leading ones: while a resident block computes, the
link is already copying the next streamed block, so every resident block hides one more block's transfer.
With leading blocks resident, all streamed blocks still run back to back and a transfer-bound model exposes
the same gap after every one of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from layerstream.config.offload_config import DEFAULT_ACTIVATION_RESERVE_GB
from layerstream.plan.resolved import ResolvedComponent, ResolvedOffloadPlan
from layerstream.runtime.errors import OffloadError

GB = 1e9


@dataclass(frozen=True)
class ResidencyChoice:
    resident_block_paths: tuple[str, ...]
    num_blocks: int
    reason: str

    def describe(self) -> str:
        return f"{len(self.resident_block_paths)}/{self.num_blocks} blocks resident: {self.reason}"


def main_chain(comp: ResolvedComponent) -> list[str]:
    return [p for s in comp.stacks if not s.own_chain for p in s.block_paths]


def _block_bytes(comp: ResolvedComponent) -> dict[str, int]:
    return {p: n for s in comp.stacks for p, n in zip(s.block_paths, s.block_bytes)}


def spread_indices(num_blocks: int, count: int) -> list[int]:
    """`count` indices spread evenly over range(num_blocks) (count <= num_blocks)."""
    if count <= 0:
        return []
    if count >= num_blocks:
        return list(range(num_blocks))
    return sorted({(2 * i + 1) * num_blocks // (2 * count) for i in range(count)})


def device_budget_bytes(plan: ResolvedOffloadPlan, device: torch.device) -> tuple[int, str]:
    options = plan.config.options_for("dit")
    if options.device_budget_gb is not None:
        return int(options.device_budget_gb * GB), f"device_budget_gb={options.device_budget_gb:g}"
    reserve_gb = options.activation_reserve_gb if options.activation_reserve_gb is not None else DEFAULT_ACTIVATION_RESERVE_GB
    if device.type != "cuda":
        raise OffloadError(
            f'layer_options.dit.resident_layers = "auto" on device {device}: there is no device memory to read; '
            "give layer_options.dit.device_budget_gb"
        )
    free, _ = torch.cuda.mem_get_info(device)
    return int(free - reserve_gb * GB), f"free device memory {free / GB:.3g} GB minus activation_reserve_gb={reserve_gb:g}"


def choose_residency(plan: ResolvedOffloadPlan, device: torch.device) -> dict[str, ResidencyChoice]:
    """Resident blocks per streamed DiT (path -> choice); components that keep nothing resident get 0."""
    choices: dict[str, ResidencyChoice] = {}
    auto = []
    for comp in plan.streamed:
        chain = main_chain(comp)
        if comp.category != "dit" or comp.resident_layers == 0:
            choices[comp.path] = ResidencyChoice((), len(chain), "streams every block")
        elif not comp.resident_allowed:  # the resolver refuses an int here; "auto" quietly keeps nothing
            choices[comp.path] = ResidencyChoice((), len(chain), "auto: not declared in resident_dit_paths")
        elif comp.resident_layers == "auto":
            auto.append(comp)
        else:
            n = int(comp.resident_layers)
            choices[comp.path] = ResidencyChoice(tuple(chain[:n]), len(chain), f"resident_layers={n} (leading blocks)")
    if auto:
        choices.update(_choose_auto(plan, auto, device))
    return choices


def _choose_auto(plan: ResolvedOffloadPlan, auto: list[ResolvedComponent], device: torch.device) -> dict[str, ResidencyChoice]:
    budget, source = device_budget_bytes(plan, device)
    streamed = plan.streamed
    max_block = max((n for c in streamed for s in c.stacks for n in s.block_bytes), default=0)
    depth = max((c.prefetch_depth for c in streamed), default=1)
    slot_bytes = (depth + 1) * max_block
    non_block = sum(c.total_bytes - (c.block_bytes if c.action == "stream" else 0) for c in plan.components if c.action != "on_demand")
    available = budget - slot_bytes - non_block
    chains = {c.path: main_chain(c) for c in auto}
    sizes = {c.path: _block_bytes(c) for c in auto}
    counts = {c.path: 0 for c in auto}
    # hand out blocks one at a time to the DiT with the smallest resident fraction, while they fit
    remaining = available
    while True:
        candidates = [p for p in counts if counts[p] < len(chains[p])]
        if not candidates:
            break
        path = min(candidates, key=lambda p: counts[p] / len(chains[p]))
        chain = chains[path]
        nxt = spread_indices(len(chain), counts[path] + 1)
        extra = sum(sizes[path][chain[i]] for i in nxt) - sum(sizes[path][chain[i]] for i in spread_indices(len(chain), counts[path]))
        if extra > remaining:
            break
        remaining -= extra
        counts[path] += 1
    out = {}
    for comp in auto:
        chain = chains[comp.path]
        picked = tuple(chain[i] for i in spread_indices(len(chain), counts[comp.path]))
        reason = (
            f"auto: budget {budget / GB:.3g} GB ({source}) - slots {slot_bytes / GB:.3g} GB - non-block modules "
            f"{non_block / GB:.3g} GB leaves {max(available, 0) / GB:.3g} GB; resident blocks spread through the stack"
        )
        out[comp.path] = ResidencyChoice(picked, len(chain), reason)
    return out
