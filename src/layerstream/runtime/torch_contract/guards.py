"""Refusals installed on offloaded modules and their pipeline: copying one (deepcopy, pickling, `torch.save`)
would copy placeholders, converting or moving it would reach only the resident parts. Each is refused with one
clear error before anything changes (the pipeline's before it moves its first component).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

from torch import nn

from layerstream.errors import UnsupportedUseError


def guard_module_(module: nn.Module) -> Callable[[], None]:
    """Refuse copying, pickling and converting `module` while offload is enabled; returns the undo."""
    name = type(module).__name__
    refuse_copy = _refusing(
        f"{name} has layerstream offload enabled: its streamed blocks hold placeholders between calls, so it "
        "cannot be copied or pickled (copy.deepcopy, pickle, torch.save of the module). Call handle.disable() "
        "first, or save its state_dict(), which holds the real weights"
    )
    refuse_apply = _refusing(
        f"{name} has layerstream offload enabled: converting it (.to, .half, .float, .cuda, .cpu) would convert "
        "only the resident parts, not the host store. Nothing was changed; call handle.disable(), convert, "
        "then enable offload again"
    )
    return _shadow_methods_(module, {"__deepcopy__": refuse_copy, "__reduce_ex__": refuse_copy, "_apply": refuse_apply})


_PIPELINE_MOVES = ("to", "cuda", "cpu", "half", "float", "enable_model_cpu_offload", "enable_sequential_cpu_offload", "enable_group_offload")


def guard_pipeline_(pipeline, streamed_names: list[str]) -> Callable[[], None]:
    """Refuse moving, converting, copying and pickling `pipeline` while offload is enabled; returns the undo."""
    if isinstance(pipeline, nn.Module):
        return guard_module_(pipeline)
    name = type(pipeline).__name__
    which = ", ".join(streamed_names) or "its components"
    refuse_move = _refusing(
        f"{name} has layerstream offload enabled on {which}: moving or converting the pipeline (pipe.to, "
        "enable_model_cpu_offload, ...) would move only the resident parts, not the host store. Nothing was "
        "changed; call handle.disable() first (then move it and enable offload again)"
    )
    refuse_copy = _refusing(
        f"{name} has layerstream offload enabled on {which}: its streamed blocks hold placeholders between "
        "calls, so it cannot be copied or pickled. Call handle.disable() first, or use save_pretrained(), "
        "which writes the real weights"
    )
    replaced = {key: refuse_move for key in _PIPELINE_MOVES if callable(getattr(pipeline, key, None))}
    replaced.update({"__deepcopy__": refuse_copy, "__reduce_ex__": refuse_copy})
    return _shadow_methods_(pipeline, replaced)


def _refusing(message: str) -> Callable[..., NoReturn]:
    def refuse(*args, **kwargs) -> NoReturn:
        raise UnsupportedUseError(message)

    return refuse


def _shadow_methods_(obj, replaced: dict[str, Callable]) -> Callable[[], None]:
    """Shadow the class's methods in `obj.__dict__`; the undo leaves an entry someone replaced since alone."""
    previous = {key: obj.__dict__[key] for key in replaced if key in obj.__dict__}
    obj.__dict__.update(replaced)

    def unguard() -> None:
        for key, fn in replaced.items():
            if obj.__dict__.get(key) is fn:
                del obj.__dict__[key]
                if key in previous:
                    obj.__dict__[key] = previous[key]

    return unguard
