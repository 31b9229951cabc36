"""`generate --compare-resident`: the streamed output against the resident model's, bit for bit. Under a lossy
storage (float8, rounded at enable) the reference is the model loaded afresh, and the difference is by design."""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class ResidentComparison:
    identical: bool
    max_abs_diff: float
    """The largest absolute difference of the raw outputs (0.0 where identical; inf where the shapes differ)."""
    lossy_storage: str | None
    """The lossy storage dtype a component streams in (differs by design), or None."""

    def to_dict(self) -> dict:
        return {"identical": self.identical, "max_abs_diff": self.max_abs_diff, "lossy_storage": self.lossy_storage}

    @staticmethod
    def summary(compared: dict | None) -> str:
        """The table's line of `to_dict`'s `compared`."""
        if compared is None:
            return "not checked"
        if compared["identical"]:
            return "yes"
        if compared["lossy_storage"] is not None:
            return f"{compared['lossy_storage']}: differs by design (max abs {compared['max_abs_diff']:.3g})"
        return f"NO (max abs {compared['max_abs_diff']:.3g})"


def compare_with_resident(args: argparse.Namespace, omni, request, result) -> ResidentComparison:
    """Run `request` on the resident model and compare its raw output with `result`'s (kept with keep_raw)."""
    import numpy as np

    from layerstream.omni import Omni

    from layerstream.cli.common import component_files

    # the float8 storage dtype a component streams in, if any (lossless storage keeps every bit)
    dtypes = [options.storage_dtype for options in omni.config.layer_options.values() if options.storage_dtype]
    lossy = next((dtype for dtype in dtypes if dtype.startswith("float8")), None)
    omni.close()  # disable gives back a fully resident pipeline: the same weights, now all on the device
    if lossy is None:
        reference = omni.run(request, keep_raw=True)
    else:  # its weights were rounded at enable: the model afresh (its --component files too), as its files give
        fresh = Omni(model=args.model, diffusion_offload_config=omni.config, device=omni.device, dtype=args.dtype,
                     offload=False, revision=args.revision, variant=args.variant,
                     components=component_files(args) or None)  # fmt: skip
        reference = fresh.run(request, keep_raw=True)
    if reference.raw.shape != result.raw.shape:
        return ResidentComparison(False, float("inf"), lossy)
    difference = np.abs(np.asarray(reference.raw, np.float64) - np.asarray(result.raw, np.float64))
    max_abs = float(difference.max()) if difference.size else 0.0
    return ResidentComparison(bool((reference.raw == result.raw).all()), max_abs, lossy)
