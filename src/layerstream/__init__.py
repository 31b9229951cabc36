"""layerstream: layerwise weight offloading for diffusion pipelines. What a user calls (`enable_offload`, `Omni`,
the config and the plans) and the errors a user catches; `Omni` needs the ``diffusers`` extra, imported on first
use. The command line's, the server's and the benchmarks' errors stay in their packages."""

from layerstream.errors import (
    ConcurrentUseError,
    LayerstreamError,
    MissingExtraError,
    OffloadError,
    TransferError,
    UnsupportedTensorError,
    UnsupportedUseError,
)
from layerstream.errors import extra_needed as _extra_needed
from layerstream.config.offload_config import (
    LayerOptions,
    OffloadConfig,
    OffloadConfigError,
    parse_offload_config,
)
from layerstream.plan.offload_plan import OffloadPlan, OffloadPlanError, get_offload_plan
from layerstream.plan.resolved import OffloadPlanResolutionError, ResolvedOffloadPlan
from layerstream.lazy import lazy_exports

__version__ = "0.1.0"

_LAZY, _import_on_first_use = lazy_exports(
    __name__,
    {
        "layerstream.plan.resolver": ("resolve_offload_plan",),
        "layerstream.offload": ("enable_offload",),
        "layerstream.runtime.modes.handle": ("OffloadHandle",),
        "layerstream.omni": ("Omni",),
        # GenerationError, ModelLoadError, InputImageError: what Omni raises of its own (each a LayerstreamError),
        # importable without loading diffusers
        "layerstream.request": ("GenerationRequest", "GenerationError"),
        "layerstream.models.folder_check": ("ModelLoadError",),
        "layerstream.models.input_image": ("InputImageError",),
    },
)


def __getattr__(name: str):
    with _extra_needed(name):  # `Omni` on a core install: one error naming the extra, not the import's traceback
        return _import_on_first_use(name)


__all__ = [
    "ConcurrentUseError",
    "LayerstreamError",
    "MissingExtraError",
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
