"""Models layerstream can load: the embedded tiny models, local diffusers-format folders and Hub ids.

Everything here needs the ``diffusers`` extra; names are imported on first use so that importing
`layerstream.models` stays cheap.
"""

_LAZY = {
    "TINY_MODELS": "layerstream.models.tiny",
    "TinyModelSpec": "layerstream.models.tiny",
    "build_tiny_pipeline": "layerstream.models.tiny",
    "build_tiny_pipeline_components": "layerstream.models.tiny",
    "ensure_tiny_model": "layerstream.models.tiny",
    "get_tiny_model_spec": "layerstream.models.tiny",
    "tiny_model_dir": "layerstream.models.tiny",
    "cache_root": "layerstream.models.cache",
    "ModelLoadError": "layerstream.models.loading",
    "is_tiny_model_name": "layerstream.models.tiny",
    "load_model": "layerstream.models.loading",
    "load_pipeline": "layerstream.models.loading",
    "pipeline_kind": "layerstream.models.geometry",
    "resolve_model_folder": "layerstream.models.loading",
    "resolve_model": "layerstream.models.loading",
    "ModelSource": "layerstream.models.hub",
    "looks_like_hub_id": "layerstream.models.hub",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'layerstream.models' has no attribute {name!r}")
