"""A component from a file (`models.component_files`) as planning sees it: its meta model, each tensor at the
bytes the loaded component keeps, from the file's header. GGUF weights keep their blocks (34/32 bytes a weight
for Q8_0, 9/16 for Q4_K), fp8_scaled ones 1 byte and a float32 scale; the rest are in the compute dtype."""

from __future__ import annotations

import torch

from layerstream.models.component_headers import StoredTensor
from layerstream.runtime.packing.upcast import FLOAT8_DTYPES


def file_component_skeleton_(name: str, model: torch.nn.Module, tensors: dict[str, StoredTensor], file_name: str) -> torch.nn.Module:
    """`model` (a meta skeleton) with the tensors its file stores quantized or in float8 (`tensors`, from the
    file's header) put in at their stored size, under the model's names (diffusers' single-file converter for
    the model's class, where they differ)."""
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES, _should_convert_state_dict_to_diffusers

    from layerstream.models.fp8_scaled import is_layout_key, read_layout

    if any(t.stored_dtype in FLOAT8_DTYPES for t in tensors.values()):  # fp8_scaled: its layout checked as loading does
        read_layout(name, file_name, {k: {"dtype": t.kind, "shape": list(t.shape)} for k, t in tensors.items()})
    tensors = {k: t for k, t in tensors.items() if not is_layout_key(k)}
    checkpoint = {k: _stored(t) for k, t in tensors.items()}
    mapping = SINGLE_FILE_LOADABLE_CLASSES.get(type(model).__name__, {}).get("checkpoint_mapping_fn")
    wanted = model.state_dict()
    if mapping is not None and _should_convert_state_dict_to_diffusers(wanted, checkpoint):
        checkpoint = mapping(checkpoint=checkpoint, config=dict(model.config))
    for key, tensor in checkpoint.items():
        if key not in wanted or not (tensor.dtype == torch.uint8 or tensor.dtype in FLOAT8_DTYPES):
            continue  # loaded in the compute dtype, as the skeleton has it
        module_path, _, leaf = key.rpartition(".")
        module = model.get_submodule(module_path)
        if not isinstance(tensor, torch.nn.Parameter):  # a GGUF weight is one already (`_stored`)
            tensor = torch.nn.Parameter(tensor, requires_grad=False)
        setattr(module, leaf, tensor)
        if tensor.dtype in FLOAT8_DTYPES:  # every float8 weight has its scale (`read_layout` checked): a float32 buffer
            module.register_buffer("weight_scale", torch.empty((), device="meta"))
    return model


def _stored(t: StoredTensor) -> torch.Tensor:
    """A meta tensor of `t`'s stored bytes; a GGUF-quantized one keeps its type (a `GGUFParameter`, as loading makes
    it, which the converter's splits and joins keep): the plan prices its dequantisation by type."""
    empty = torch.empty(t.stored_shape, dtype=t.stored_dtype, device="meta")
    if t.stored_shape == t.shape:  # not quantized (GGUF's F32, F16, BF16; any safetensors tensor)
        return empty
    import gguf
    from diffusers.quantizers.gguf.utils import GGUFParameter

    return GGUFParameter(empty, quant_type=gguf.GGMLQuantizationType[t.kind])
