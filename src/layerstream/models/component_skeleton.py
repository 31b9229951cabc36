"""A component from a file (`models.component_files`) as planning sees it: its model on the meta device, each
tensor at the bytes the loaded component keeps on the host, read from the file's header alone (a GGUF file's
tensor infos, a safetensors header). GGUF-quantized weights keep their blocks (1 + 1/16 bytes a weight for
Q8_0, 9/16 for Q4_K), fp8_scaled weights 1 byte with a float32 scale; every other tensor is loaded in the
compute dtype, as the skeleton already has it."""

from __future__ import annotations

from pathlib import Path

import torch

from layerstream.models.folder_check import ModelLoadError
from layerstream.wording import first_line


def stored_meta_tensors(name: str, path: Path) -> dict[str, torch.Tensor]:
    """The file's GGUF-quantized or float8 tensors as stored, as meta tensors by the file's names; read from its
    header (an fp8_scaled layout checked as loading checks it)."""
    from layerstream.models.fp8_scaled import FLOAT8_DTYPES, is_float8_file, read_layout
    from layerstream.models.saved_dtypes import read_safetensors_header

    try:
        if path.suffix == ".gguf":
            import gguf

            plain = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16}
            tensors = gguf.GGUFReader(str(path)).tensors
            return {t.name: torch.empty(t.data.shape, dtype=torch.uint8, device="meta") for t in tensors if t.tensor_type not in plain}
        if not is_float8_file(path):
            return {}
        header = read_safetensors_header(path)
    except Exception as e:  # not a GGUF / safetensors file after all
        raise ModelLoadError(f"component {name}: cannot read {path}: {first_line(e, with_type=True)}") from e
    layout = read_layout(name, path, header)
    return {k: torch.empty(header[k]["shape"], dtype=FLOAT8_DTYPES[header[k]["dtype"]], device="meta") for k in layout.scales}


def file_component_skeleton_(name: str, model: torch.nn.Module, path: Path) -> torch.nn.Module:
    """`model` (a meta skeleton) with the tensors `path` stores quantized or in float8 put in at their stored
    size, under the model's names (diffusers' single-file converter for the model's class, where they differ)."""
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES, _should_convert_state_dict_to_diffusers

    from layerstream.models.component_files import file_tensor_shapes
    from layerstream.models.fp8_scaled import is_layout_key

    stored = stored_meta_tensors(name, path)
    mapping = SINGLE_FILE_LOADABLE_CLASSES.get(type(model).__name__, {}).get("checkpoint_mapping_fn")
    wanted = model.state_dict()
    shapes = {k: v for k, v in file_tensor_shapes(name, path).items() if not is_layout_key(k)}
    if mapping is not None and _should_convert_state_dict_to_diffusers(wanted, shapes):
        # every tensor the converter reads: the stored ones as stored, the rest at their logical shape
        every = {k: stored.get(k, torch.empty(shape, device="meta")) for k, shape in shapes.items()}
        converted = mapping(checkpoint=every, config=dict(model.config))
        stored = {k: v for k, v in converted.items() if k in wanted and (v.dtype == torch.uint8 or v.dtype in FLOAT8)}
    for key, tensor in stored.items():
        module_path, _, leaf = key.rpartition(".")
        module = model.get_submodule(module_path)
        setattr(module, leaf, torch.nn.Parameter(tensor, requires_grad=False))
        if tensor.dtype in FLOAT8:  # every float8 weight has its scale (`read_layout` checked): a float32 buffer
            module.register_buffer("weight_scale", torch.empty((), device="meta"))
    return model


FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)
