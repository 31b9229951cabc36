from layerstream.config.offload_config import (
    LayerOptions,
    OffloadConfig,
    OffloadConfigError,
    parse_offload_config,
)

__all__ = ["LayerOptions", "OffloadConfig", "OffloadConfigError", "parse_offload_config"]
