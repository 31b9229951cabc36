"""layerstream: layerwise weight offloading for diffusion pipelines.

The core (plans, config, resolver, runtime) needs only torch; `Omni` and the built-in tiny models need the
``diffusers`` extra and are imported on first use.
"""

from layerstream.errors import (
    ConcurrentUseError,
    LayerstreamError,
    OffloadError,
    TransferError,
    UnsupportedTensorError,
    UnsupportedUseError,
)
from layerstream.config.offload_config import (
    LayerOptions,
    OffloadConfig,
    OffloadConfigError,
    parse_offload_config,
)
from layerstream.plan.offload_plan import OffloadPlan, OffloadPlanError, get_offload_plan
from layerstream.plan.resolved import OffloadPlanResolutionError, ResolvedOffloadPlan

__version__ = "0.1.0"

_LAZY = {
    "resolve_offload_plan": ("layerstream.plan.resolver", "resolve_offload_plan"),
    "enable_offload": ("layerstream.offload", "enable_offload"),
    "OffloadHandle": ("layerstream.runtime.modes.handle", "OffloadHandle"),
    "Omni": ("layerstream.omni", "Omni"),
    # errors of the optional parts (each a LayerstreamError), importable without loading those parts' extras
    "GenerationError": ("layerstream.request", "GenerationError"),
    "GenerationRequest": ("layerstream.request", "GenerationRequest"),
    "ModelLoadError": ("layerstream.models.loading", "ModelLoadError"),
    "InputImageError": ("layerstream.models.input_image", "InputImageError"),
    "CacheFolderError": ("layerstream.models.cache", "CacheFolderError"),
    "CorruptFolderError": ("layerstream.models.manifest", "CorruptFolderError"),
    "SafetensorsHeaderError": ("layerstream.models.saved_dtypes", "SafetensorsHeaderError"),
    "CastReadError": ("layerstream.models.cast_on_load", "CastReadError"),
    "SpillFileError": ("layerstream.runtime.stores.disk.sources", "SpillFileError"),
    "CheckpointChangedError": ("layerstream.runtime.stores.disk.sources", "CheckpointChangedError"),
    "BenchConfigError": ("layerstream.bench.config", "BenchConfigError"),
    "StrategyError": ("layerstream.bench.strategies", "StrategyError"),
    "ServeSettingsError": ("layerstream.server.settings", "ServeSettingsError"),
    "RankGroupError": ("layerstream.server.ranks", "RankGroupError"),
    "WaveFailedError": ("layerstream.server.waves", "WaveFailedError"),
    "MachinePlanError": ("layerstream.machine.planner", "MachinePlanError"),
}

__all__ = [
    "ConcurrentUseError",
    "LayerstreamError",
    "OffloadError",
    "TransferError",
    "UnsupportedTensorError",
    "UnsupportedUseError",
    "LayerOptions",
    "OffloadConfig",
    "OffloadConfigError",
    "OffloadPlan",
    "OffloadPlanError",
    "OffloadPlanResolutionError",
    "ResolvedOffloadPlan",
    "get_offload_plan",
    "parse_offload_config",
    *_LAZY,
]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module_name, attr = _LAZY[name]
        return getattr(importlib.import_module(module_name), attr)
    raise AttributeError(f"module 'layerstream' has no attribute {name!r}")
