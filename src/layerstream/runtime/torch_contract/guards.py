"""Refusals installed on offloaded modules and their pipeline: operations that would silently go wrong on a
streamed model.

While offload is enabled, a streamed block's tensors are empty placeholders between its calls, so copying the
module (`copy.deepcopy`, pickling, `torch.save(model)`) would copy placeholders, and converting it
(`.half()`, `.to(dtype)`, `.cuda()`) would convert only the resident parts. Each is refused with one clear
error before anything changes; `handle.disable()` first makes all of them work again. The pipeline gets the same
refusals, checked before it converts or moves its first component (diffusers' `pipe.to(...)` would otherwise
convert the text encoders before reaching the transformer), and so do its other ways of moving components
(`enable_model_cpu_offload`, `enable_sequential_cpu_offload`, `enable_group_offload`).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from layerstream.errors import UnsupportedUseError

_GUARDED = ("__deepcopy__", "__reduce_ex__", "_apply")


def guard_module_(module: nn.Module) -> Callable[[], None]:
    """Refuse copying, pickling and converting `module` while offload is enabled; returns the undo."""
    name = type(module).__name__

    def refuse_copy(*args, **kwargs):
        raise UnsupportedUseError(
            f"{name} has layerstream offload enabled: its streamed blocks hold placeholders between calls, so it "
            "cannot be copied or pickled (copy.deepcopy, pickle, torch.save of the module). Call handle.disable() "
            "first, or save its state_dict(), which holds the real weights"
        )

    def refuse_apply(*args, **kwargs):
        raise UnsupportedUseError(
            f"{name} has layerstream offload enabled: converting it (.to, .half, .float, .cuda, .cpu) would convert "
            "only the resident parts, not the host store. Nothing was changed; call handle.disable(), convert, "
            "then enable offload again"
        )

    replaced = {"__deepcopy__": refuse_copy, "__reduce_ex__": refuse_copy, "_apply": refuse_apply}
    previous = {key: module.__dict__[key] for key in _GUARDED if key in module.__dict__}
    module.__dict__.update(replaced)

    def unguard() -> None:
        for key, fn in replaced.items():
            if module.__dict__.get(key) is fn:
                del module.__dict__[key]
                if key in previous:
                    module.__dict__[key] = previous[key]

    return unguard


_PIPELINE_MOVES = ("to", "cuda", "cpu", "half", "float", "enable_model_cpu_offload", "enable_sequential_cpu_offload", "enable_group_offload")


def guard_pipeline_(pipeline, streamed_names: list[str]) -> Callable[[], None]:
    """Refuse moving, converting, copying and pickling `pipeline` (a diffusers pipeline or any object holding
    the streamed components) while offload is enabled; returns the undo. An `nn.Module` pipeline gets
    `guard_module_`."""
    if isinstance(pipeline, nn.Module):
        return guard_module_(pipeline)
    name = type(pipeline).__name__
    which = ", ".join(streamed_names) or "its components"

    def refuse_move(*args, **kwargs):
        raise UnsupportedUseError(
            f"{name} has layerstream offload enabled on {which}: moving or converting the pipeline (pipe.to, "
            "enable_model_cpu_offload, ...) would move only the resident parts, not the host store. Nothing was "
            "changed; call handle.disable() first (then move it and enable offload again)"
        )

    def refuse_copy(*args, **kwargs):
        raise UnsupportedUseError(
            f"{name} has layerstream offload enabled on {which}: its streamed blocks hold placeholders between "
            "calls, so it cannot be copied or pickled. Call handle.disable() first, or use save_pretrained(), "
            "which writes the real weights"
        )

    replaced = {key: refuse_move for key in _PIPELINE_MOVES if callable(getattr(pipeline, key, None))}
    replaced.update({"__deepcopy__": refuse_copy, "__reduce_ex__": refuse_copy})
    previous = {key: pipeline.__dict__[key] for key in replaced if key in pipeline.__dict__}
    pipeline.__dict__.update(replaced)

    def unguard() -> None:
        for key, fn in replaced.items():
            if pipeline.__dict__.get(key) is fn:
                del pipeline.__dict__[key]
                if key in previous:
                    pipeline.__dict__[key] = previous[key]

    return unguard
