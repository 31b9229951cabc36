"""Fitting a generation's phases on a machine's device: the config `"auto"` settings reach there, and, where no
config fits, the refusal that names the phase that bounds, its parts and what would make it fit.

Residency "auto" leaves the largest phase's transient free beside the weights kept on the device and the slot
ring (`models.generation_estimates.activation_reserve_nbytes`), so every phase fits once the weights and the ring
do. The candidates are tried from the one that changes least: the VAE decode untiled before tiled (a tiled decode
is not bit-identical: tiled only where it must be), and within each the text encoder resident before streamed (it
runs once a generation: its blocks cost a prompt encoding's transfers, not a step's).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from layerstream.config.offload_config import parse_offload_config
from layerstream.machine.figures import DeviceTooSmallError, Machine
from layerstream.machine.phases import PhasePeaks, device_phase_peaks
from layerstream.models.generation_estimates import Transient, activation_reserve_nbytes, decode_transient, decodes, phase_transients
from layerstream.models.decode.vae_tiling import LOSSY_NOTE, VaeDecodeChoice, choose_vae_tiling
from layerstream.plan.phase_blocks import phase_blocks
from layerstream.plan.placement import Placement
from layerstream.plan.resolved import ResolvedOffloadPlan
from layerstream.wording import GB, format_bytes

if TYPE_CHECKING:
    from layerstream.models.size import GenerationSize


@dataclass(frozen=True)
class DeviceFit:
    """One candidate config on the device: its plan (no host budget yet), placement and each phase's peak."""

    text_encoder_streams: bool
    decode_tiled: bool | None
    """Whether the VAE decode was planned tiled (None: no VAE)."""
    reserve_nbytes: int
    """What residency "auto" leaves free: the largest transient and the allowance, or the machine's given reserve."""
    plan: ResolvedOffloadPlan
    placement: Placement
    block_host_nbytes: Mapping[str, int]
    phases: PhasePeaks
    device_type: str = "cuda"
    decode_choice: VaeDecodeChoice | None = None
    """The decode's choice as a run makes it (`models.decode.vae_tiling.choose_vae_tiling`: its peaks untiled and tiled,
    and the device memory the fit leaves it), with its reason; None without a VAE."""


def recommended_config(
    machine: Machine, *, text_encoder: bool, host_budget_gb: float | None, activation_reserve_gb: float, lossless: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """The config `"auto"` settings would reach on `machine`, with its figures written out: the device budget of
    residency "auto" is the device memory less `activation_reserve_gb` (none left: 0, no block resident)."""
    device_budget = max(machine.device_memory_gb - activation_reserve_gb, 0.0)
    dit: dict[str, Any] = {"resident_layers": "auto", "device_budget_gb": round(device_budget, 4)}
    if machine.allow_lossy:
        dit["storage_dtype"] = "float8_e4m3fn"
    elif lossless:
        dit["storage_dtype"] = "lossless"  # the same bits: no --allow-lossy needed
    config: dict[str, Any] = {"mode": "layer", "components": ["dit", "text_encoder"] if text_encoder else ["dit"]}
    config["layer_options"] = {"dit": dit}
    if host_budget_gb is not None:
        config["host_budget_gb"] = host_budget_gb
    return config


def generation_transients(
    pipeline: Any, generation: GenerationSize, *, tiled: bool | None = False, device_type: str = "cuda",
) -> tuple[Transient, ...]:  # fmt: skip
    """Each phase's transient for `pipeline` at `generation` (`models.generation_estimates`: `phase_transients`
    on the blocks `plan.phase_blocks` finds, and the VAE decode on a device of `device_type`, tiled or not;
    `tiled` None leaves it out)."""
    transients = phase_transients(pipeline, generation, phase_blocks(pipeline))
    decode = decode_transient(pipeline, generation, tiled=tiled, device_type=device_type) if tiled is not None else None
    return transients + ((decode,) if decode is not None else ())


def fit_device(
    pipeline: Any, machine: Machine, generation: GenerationSize, *, lossless: bool, text_encoder_streams: bool = False,
) -> tuple[DeviceFit, tuple[str, ...]]:  # fmt: skip
    """The first candidate whose phases all fit the device at `generation`, and the notes that say what was chosen
    and why: the VAE decode untiled before tiled (`Machine.vae_use_tiling` "auto": tiled only where it must be; a
    tiled decode blends its tiles' edges), within each the text encoder resident before streamed
    (`text_encoder_streams`: streamed only, where it can stream). Raises `DeviceTooSmallError` naming the phase
    that bounds where none fits (`refusal`)."""
    tilings = {"auto": (False, True), True: (True,), False: (False,)}[machine.vae_use_tiling] if decodes(pipeline) else (None,)
    tried: list[DeviceFit] = []
    for tiled in tilings:
        transients = generation_transients(pipeline, generation, tiled=tiled, device_type=machine.device_type)
        for text_encoder in (True,) if text_encoder_streams else (False, True):
            fit = _candidate(pipeline, machine, transients, text_encoder=text_encoder, lossless=lossless, tiled=tiled)
            if fit.phases.fits:
                fit = _with_decode_choice(pipeline, machine, generation, fit)
                return fit, _notes(machine, fit, tried)
            tried.append(fit)
            if not any(c.category == "text_encoder" and c.stacks for c in fit.plan.components):
                break  # no text encoder to stream
    raise refusal(pipeline, machine, tried[-1], generation)


def _candidate(pipeline, machine: Machine, transients, *, text_encoder: bool, lossless: bool, tiled: bool | None) -> DeviceFit:
    from layerstream.offload import priced_placement  # the composition root prices the stores
    from layerstream.plan.resolver import resolve_offload_plan

    allowance = round(machine.device_allowance_gb * GB)
    if machine.activation_reserve_gb is not None:
        reserve = round(machine.activation_reserve_gb * GB)
    else:
        reserve = activation_reserve_nbytes(transients, allowance)
    config = recommended_config(machine, text_encoder=text_encoder, host_budget_gb=None, activation_reserve_gb=reserve / GB, lossless=lossless)
    plan = resolve_offload_plan(pipeline, parse_offload_config(config))
    placement, host_nbytes = priced_placement(pipeline, plan, torch.device("cpu"))  # bytes do not depend on the device
    memory = round(machine.device_memory_gb * GB)
    notes = {"VAE decode": LOSSY_NOTE} if tiled else {}
    phases = device_phase_peaks(plan, placement, transients, memory_nbytes=memory, allowance_nbytes=allowance, notes=notes)
    return DeviceFit(text_encoder, tiled, reserve, plan, placement, host_nbytes, phases, machine.device_type)


def _with_decode_choice(pipeline: Any, machine: Machine, generation: GenerationSize, fit: DeviceFit) -> DeviceFit:
    """`fit` with the decode's choice, made as a run makes it: the device memory left beside what stays on the
    device (weights, ring, allowance), the decode's peaks untiled and tiled. It is the fit's own choice: an
    untiled decode that fitted fits what it leaves, and a tiled one was planned because the untiled did not fit
    even with no block resident."""
    decode = fit.phases.phase("VAE decode")
    if decode is None:
        return fit
    free = fit.phases.memory_nbytes - (decode.nbytes - decode.parts[_transient_name(decode)])
    untiled, tiled = (decode_transient(pipeline, generation, tiled=t, device_type=machine.device_type) for t in (False, True))
    return replace(fit, decode_choice=choose_vae_tiling(machine.vae_use_tiling, untiled.nbytes, tiled.nbytes, free))


def _notes(machine: Machine, fit: DeviceFit, tried: list[DeviceFit]) -> tuple[str, ...]:
    """What the chosen candidate changed from the first one, and why."""
    notes = []
    same_tiling = [f for f in tried if f.decode_tiled == fit.decode_tiled]
    if fit.text_encoder_streams and same_tiling:
        peak = same_tiling[0].phases.peak
        notes.append(
            f"the text encoder streams: kept resident, {peak.phase} would need {format_bytes(peak.nbytes)}, more than "
            f"the device's {format_bytes(fit.phases.memory_nbytes)}"
        )
    if fit.decode_tiled and fit.decode_choice is not None:
        notes.append(f"the VAE decode is tiled: {fit.decode_choice.reason}")
    return tuple(notes)


def refusal(pipeline: Any, machine: Machine, fit: DeviceFit, generation: GenerationSize) -> DeviceTooSmallError:
    """Why `fit` (the last candidate) does not fit the device: the phase that bounds, its parts, and what would
    make it fit (a tiled decode where it was refused, a smaller generation, the device it needs)."""
    peak = fit.phases.peak
    streamed = ", with the text encoder streamed" if fit.text_encoder_streams else ""
    resident = sum(len(r.resident_block_paths) for r in fit.placement.residency.values())
    blocks = "" if resident else " and no block resident"
    ways = _what_would_fit(pipeline, fit, generation)
    message = (
        f"device_memory_gb = {machine.device_memory_gb:g}: {peak.describe()} is more than the device's "
        f"{format_bytes(fit.phases.memory_nbytes)}{streamed}{blocks}; "
    )
    kept = peak.nbytes - peak.parts[_transient_name(peak)]
    if kept >= fit.phases.memory_nbytes:
        message += f"the weights kept on the device, the slot ring and the allowance alone need {format_bytes(kept)}: {ways[-1]} would run it"
    else:
        message += "it would fit with " + ", or ".join(ways)
    return DeviceTooSmallError(message, peak=peak, memory_nbytes=fit.phases.memory_nbytes, would_fit=ways)


def _what_would_fit(pipeline: Any, fit: DeviceFit, generation: GenerationSize) -> tuple[str, ...]:
    """A tiled decode (where `vae_use_tiling` false refused it), the largest smaller generation whose phases fit
    beside the same weights and ring, and the device memory it needs (always, last)."""
    peak, memory = fit.phases.peak, fit.phases.memory_nbytes
    kept = peak.nbytes - peak.parts[_transient_name(peak)]
    device = f"a device of {format_bytes(peak.nbytes)}"
    if kept >= memory:
        return (device,)
    ways = []
    if peak.phase == "VAE decode" and fit.decode_tiled is False:
        tiled = kept + max(t.nbytes for t in generation_transients(pipeline, generation, tiled=True, device_type=fit.device_type))
        if tiled <= memory:
            ways.append(f'a tiled decode (vae_use_tiling true or "auto": {format_bytes(tiled)} at its peak; {LOSSY_NOTE})')
    for smaller in _smaller_generations(pipeline, generation):
        largest = kept + max(t.nbytes for t in generation_transients(pipeline, smaller, tiled=fit.decode_tiled, device_type=fit.device_type))
        if largest <= memory:
            ways.append(f"{size_phrase(smaller)} ({format_bytes(largest)} at its peak)")
            break
    return (*ways, device)


def _transient_name(peak) -> str:
    return list(peak.parts)[-1]  # the phase's own transient is its last part (`device_phase_peaks`)


def size_phrase(generation: GenerationSize) -> str:
    frames = f" x {generation.num_frames} frames" if generation.num_frames > 1 else ""
    return f"{generation.height}x{generation.width}{frames}"


def _smaller_generations(pipeline: Any, generation: GenerationSize) -> list[GenerationSize]:
    """Smaller generations of the same shape, largest first: each side at 3/4, 2/3 and 1/2 (whole size multiples),
    and a video's frames halved (whole frame rule); none where the planned one gives its tokens, not a size."""
    from layerstream.models.geometry import pipeline_frame_multiple, pipeline_size_multiple

    if generation.tokens is not None:
        return []
    multiple, temporal = pipeline_size_multiple(pipeline), pipeline_frame_multiple(pipeline) or 1
    frames = [generation.num_frames]
    if generation.num_frames > 1:
        frames.append(max(1, (generation.num_frames - 1) // 2 // temporal * temporal + 1))
    out = []
    for scale in (1.0, 0.75, 2 / 3, 0.5):
        height = max(multiple, int(generation.height * scale) // multiple * multiple)
        width = max(multiple, int(generation.width * scale) // multiple * multiple)
        for f in frames:
            if (height, width, f) != (generation.height, generation.width, generation.num_frames):
                out.append(replace(generation, height=height, width=width, num_frames=f, tokens=None))
    return sorted(out, key=lambda g: -g.height * g.width * g.num_frames)
