"""Checks `enable_offload` runs before it touches anything."""

from __future__ import annotations

from torch import nn

from layerstream.errors import OffloadError, UnsupportedTensorError
from layerstream.runtime.packing.layout import tensor_byte_extent
from layerstream.runtime.packing.subclass_tensors import plain_tensors, unpackable_reason

COMPOSABLE_DIFFUSERS_HOOKS = frozenset({"layerwise_casting", "peft_autocast_disable"})
"""diffusers hooks that only change dtypes around a leaf module's forward, after layerstream bound the block
(casting allocates fresh tensors: the slot is never written). Every other diffusers hook is refused."""


def check_no_foreign_offload(pipeline_class: str, components: dict[str, nn.Module]) -> None:
    """Refuse modules already managed by diffusers or accelerate offload hooks (layerwise casting composes)."""
    for path, root in components.items():
        for name, module in root.named_modules(prefix=path):
            if getattr(module, "_hf_hook", None) is not None:
                raise OffloadError(
                    f"{pipeline_class}: {name or '<model>'} carries an accelerate hook (e.g. from "
                    "enable_model_cpu_offload or device_map); remove it before enabling layerstream offload"
                )
            registry = getattr(module, "_diffusers_hook", None)
            foreign = [h for h in getattr(registry, "hooks", None) or () if h not in COMPOSABLE_DIFFUSERS_HOOKS]
            if foreign:
                raise OffloadError(
                    f"{pipeline_class}: {name or '<model>'} carries diffusers hooks ({', '.join(foreign)}); "
                    "remove group offloading or other hooks before enabling layerstream offload (diffusers' "
                    "layerwise casting is the one kind that composes)"
                )


def check_no_shared_block_tensors(
    pipeline_class: str, components: dict[str, nn.Module], stream_modules: dict[str, nn.Module]
) -> None:
    """Refuse a weight a streamed block shares with a resident module or another block (read as a placeholder)."""
    intervals: dict[tuple[str, int], list[tuple[int, int, str | None, str]]] = {}
    for comp_path, root in components.items():
        for path, module in _walk(root, comp_path):
            owner = _owner(path, stream_modules)
            for kind in (module._parameters, module._buffers):
                for name, t in kind.items():
                    if t is None or t.device.type == "meta" or t.numel() == 0:
                        continue
                    for inner in plain_tensors(t):  # a wrapper subclass's bytes are its inner tensors
                        key = (str(inner.device), inner.untyped_storage().data_ptr())
                        start, end = tensor_byte_extent(inner)
                        intervals.setdefault(key, []).append((start, end, owner, f"{path}.{name}" if path else name))
    for spans in intervals.values():
        if len(spans) < 2 or all(owner is None for _, _, owner, _ in spans):
            continue
        spans.sort(key=lambda span: span[:2])  # by extent only: owners may be None (resident) and do not order
        active: list[tuple[int, str | None, str]] = []
        for start, end, owner, name in spans:
            active = [a for a in active if a[0] > start]
            for _, other_owner, other_name in active:
                if other_owner != owner:
                    raise OffloadError(
                        f"{pipeline_class}: {name} shares memory with {other_name} ({_owner_label(owner)} and "
                        f"{_owner_label(other_owner)}); a weight shared between a streamed block and another module "
                        "cannot be streamed safely. Untie it, keep that DiT resident, or declare block lists that "
                        "keep shared weights outside streamed blocks"
                    )
            active.append((end, owner, name))


def _owner_label(owner: str | None) -> str:
    return "a resident module" if owner is None else f"streamed block {owner}"


def _walk(root: nn.Module, root_path: str):
    stack = [(root_path, root)]
    while stack:
        path, module = stack.pop()
        yield path, module
        for name, child in module._modules.items():
            if child is not None:
                stack.append((f"{path}.{name}" if path else name, child))


def _owner(path: str, stream_modules) -> str | None:
    """The streamed block this occurrence sits in, by path (a module also reachable outside counts outside there)."""
    probe = path
    while True:
        if probe in stream_modules:
            return probe
        if "." not in probe:
            return None
        probe = probe.rsplit(".", 1)[0]


def check_packable_block_tensors(pipeline_class: str, block_path: str, block: nn.Module) -> None:
    """Refuse, naming it, a tensor of a streamed block that cannot be packed as bytes: only one with storage of its
    own, or a wrapper subclass whose inner tensors all have storage of their own, can."""
    for name, module in block.named_modules(prefix=block_path):
        for kind in (module._parameters, module._buffers):
            for tensor_name, t in kind.items():
                if t is None:
                    continue
                reason = unpackable_reason(t)
                if reason is not None:
                    cls = type(t)
                    raise UnsupportedTensorError(
                        f"{pipeline_class}: {name}.{tensor_name} is a {cls.__module__}.{cls.__qualname__} ({reason}); "
                        "layerstream cannot stream it (plain tensors, diffusers' GGUF weights and torchao's wrapper "
                        "subclasses stream). Keep this model resident, or load it another way"
                    )
