"""Whether a VAE decode is tiled, and a batch decoded one sample at a time: vllm-omni's settings
``vae_use_tiling`` and ``vae_use_slicing``, each true, false or "auto"; the choice (pure: the decode's peaks and
the device memory left in, a decision and its reason out) and the VAE one call decodes with (`vae_for`).

Tiling blends the edges of overlapping tiles, so a tiled decode is not bit-identical to an untiled one: it is
chosen only where the untiled decode would not fit, and every choice carries a reason to show. Slicing splits a
batch only (the same computation per sample), so "auto" slices only a batch that would not fit whole.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass
from typing import Literal

from torch import nn

from layerstream.runtime.streaming.wrapping import wrappers_for_view
from layerstream.wording import format_bytes

VaeSetting = bool | Literal["auto"]
"""``vae_use_tiling`` / ``vae_use_slicing``: always, never, or only where the decode would not fit otherwise."""
AUTO = "auto"
LOSSY_NOTE = "tile edges are blended: not bit-identical to an untiled decode"


@dataclass(frozen=True)
class VaeDecodeChoice:
    """How one decode runs, and why."""

    tiled: bool
    sliced: bool
    fits: bool
    """False: the decode chosen needs more than the memory left (a run refuses it before its first step)."""
    peak_nbytes: int | None
    """The chosen decode's device peak beyond the VAE's weights (None: not estimated)."""
    free_nbytes: int | None
    """Device memory left for the decode (None: none to read)."""
    reason: str

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        """One line for a run's summary: what was done, and why."""
        how = ("tiled" if self.tiled else "untiled") + (", one sample at a time" if self.sliced else "")
        return f"{how} ({self.reason})"


def choose_vae_tiling(
    setting: VaeSetting, untiled_peak: int | None, tiled_peak: int | None, free_nbytes: int | None
) -> VaeDecodeChoice:
    """Tiled or not, for one sample (the planner's question): `setting` is ``vae_use_tiling``; the peaks are
    `estimate_decode_peak`'s untiled and tiled (None: not estimated); `free_nbytes` the device memory left."""
    peaks = {(False, False): untiled_peak, (True, False): tiled_peak}
    return choose_vae_decode(setting, False, peaks, peaks.get, free_nbytes)


def choose_vae_decode(
    tiling: VaeSetting,
    slicing: VaeSetting,
    ways: Collection[tuple[bool, bool]],
    peak_of: Callable[[tuple[bool, bool]], int | None],
    free_nbytes: int | None,
) -> VaeDecodeChoice:
    """The first decode the settings allow that fits `free_nbytes`, in the order (untiled, whole batch),
    (untiled, sliced), (tiled, whole), (tiled, sliced): bit-identical ways first. Only the `ways` (tiled, sliced)
    the VAE has are considered; `peak_of(way)` is that decode's peak (None: not estimated), asked for only where
    needed. Where none fits, the most frugal allowed, marked as not fitting."""
    options = [o for o in ((False, False), (False, True), (True, False), (True, True)) if o in ways]
    options = [(t, s) for t, s in options if _allows(tiling, t) and _allows(slicing, s)]
    named = _named(tiling, slicing)
    if not options:  # a VAE without slicing, asked to slice
        names = ", ".join(f"{'tiled' if t else 'untiled'}{' sliced' if s else ''}" for t, s in ways)
        return VaeDecodeChoice(False, False, False, None, free_nbytes, f"{named}: this VAE decodes only {names}")
    whole = peak_of((False, False)) if free_nbytes is not None and (False, False) in ways else None
    if free_nbytes is None or whole is None:
        tiled, sliced = options[0]
        why = "no device memory to read" if free_nbytes is None else "the decode's peak was not estimated"
        peak = peak_of(options[0]) if free_nbytes is not None else None  # nothing to compare it with: not traced
        return VaeDecodeChoice(tiled, sliced, True, peak, free_nbytes, _reason(named, why, tiled))
    for tiled, sliced in options:
        peak = peak_of((tiled, sliced))
        if peak is not None and peak <= free_nbytes:
            if (tiled, sliced) == (False, False) or (tiling is True or not tiled) and (slicing is True or not sliced):
                why = f"needs {_gb(peak)} of the {_gb(free_nbytes)} left"  # as the settings ask
            else:
                why = f"the whole decode needs {_gb(whole)}, more than the {_gb(free_nbytes)} left; this way it needs {_gb(peak)}"
            return VaeDecodeChoice(tiled, sliced, True, peak, free_nbytes, _reason(named, why, tiled))
    tiled, sliced = options[-1]
    peak = peak_of(options[-1])
    why = f"the decode needs {_gb(peak)}, more than the {_gb(free_nbytes)} of device memory left; ask for a smaller size or fewer frames"
    if not tiled:
        why += ', or set vae_use_tiling to "auto" or true'
    return VaeDecodeChoice(tiled, sliced, False, peak, free_nbytes, _reason(named, why, tiled))


def _allows(setting: VaeSetting, value: bool) -> bool:
    return setting == AUTO or setting is value


def _named(tiling: VaeSetting, slicing: VaeSetting) -> str:
    settings = [value if value == AUTO else str(value).lower() for value in (tiling, slicing)]
    return f"vae_use_tiling {settings[0]}, vae_use_slicing {settings[1]}"


def _reason(named: str, why: str, tiled: bool) -> str:
    return f"{named}: {why}" + (f"; {LOSSY_NOTE}" if tiled else "")


def _gb(nbytes: int | None) -> str:
    return "an unknown amount" if nbytes is None else format_bytes(nbytes)


def vae_for(vae: nn.Module, *, tiled: bool, sliced: bool) -> nn.Module:
    """`vae` as one call decodes with it, tiled or not and sliced or not: a view sharing its modules, tensors and
    tile sizes (and offload's swapping around its methods, `wrappers_for_view`) with its own ``use_tiling`` and
    ``use_slicing``, as its ``enable_tiling()`` would set them. The shared VAE is never written, so nothing leaks
    into the next request, whatever the call does."""
    if (bool(getattr(vae, "use_tiling", False)), bool(getattr(vae, "use_slicing", False))) == (tiled, sliced):
        return vae
    view = object.__new__(type(vae))
    view.__dict__.update(vars(vae), use_tiling=tiled, use_slicing=sliced)
    view.__dict__.update(wrappers_for_view(vae, view))
    return view
