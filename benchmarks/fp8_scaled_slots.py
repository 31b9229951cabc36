"""The device slot ring an fp8_scaled transformer needs, against the same weights upcast: why a scaled Linear
keeps its float8 weight and scale in the slot (the upcast runs in the Linear, at each call) instead of the float8
form casting it into the slot (docs/storage.md, "Quantized weights").

Both experts of the tiny Wan 2.2, in bfloat16, are written as fp8_scaled files (each 2-D block weight float8 with
a per-tensor scale ``<layer>.weight_scale``) and as the reference those files stand for (each weight upcast with
its scale); the slot ring is the handle's own figure (`OffloadStats.slot_bytes`).

    python benchmarks/fp8_scaled_slots.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from layerstream import Omni
from layerstream.models import ensure_tiny_model

EXPERTS = ("transformer", "transformer_2")


def write_files(folder: Path) -> tuple[dict[str, str], dict[str, str]]:
    """(fp8_scaled files, their upcast references) of the tiny Wan 2.2's experts, by component name."""
    from diffusers import WanTransformer3DModel

    scaled, upcast = {}, {}
    for name in EXPERTS:
        state = WanTransformer3DModel.from_pretrained(ensure_tiny_model("tiny-wan"), subfolder=name).state_dict()
        stored, reference = {}, {}
        for key, value in state.items():
            if "blocks." in key and key.endswith(".weight") and value.ndim == 2:
                scale = value.abs().amax().float() / 448.0
                weight = (value.float() / scale).to(torch.float8_e4m3fn)
                stored[key], stored[key.removesuffix("weight") + "weight_scale"] = weight, scale.reshape(())
                reference[key] = weight.float() * scale
            else:
                stored[key] = reference[key] = value.contiguous()
        scaled[name], upcast[name] = str(folder / f"{name}-fp8_scaled.safetensors"), str(folder / f"{name}.safetensors")
        save_file(stored, scaled[name])
        save_file(reference, upcast[name])
    return scaled, upcast


def slot_bytes(components: dict[str, str], storage_dtype: str | None) -> int:
    config = {"mode": "layer", "components": ["dit"]}
    if storage_dtype is not None:
        config["layer_options"] = {"dit": {"storage_dtype": storage_dtype}}
    omni = Omni("tiny-wan", config, device="cpu", dtype="bfloat16", components=components)
    try:
        return omni.stats().slot_bytes
    finally:
        omni.close()


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        scaled, upcast = write_files(Path(folder))
        rows = [
            ("the fp8_scaled files", scaled, None),
            ("the fp8_scaled files, float8 storage", scaled, "float8_e4m3fn"),
            ("the weights upcast, float8 storage", upcast, "float8_e4m3fn"),
            ("the weights upcast, no storage form", upcast, None),
        ]
        print("tiny Wan 2.2 in bfloat16, both experts streamed on the CPU")
        print("| what streams | slot ring |\n|---|---:|")
        for label, components, storage in rows:
            print(f"| {label} | {slot_bytes(components, storage):,} B |")


if __name__ == "__main__":
    main()
