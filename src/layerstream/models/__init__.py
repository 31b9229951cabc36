"""Models layerstream can load: the embedded tiny models, local diffusers-format folders and Hub ids (the
``diffusers`` extra); names are imported on first use, so that importing `layerstream.models` stays cheap."""

from layerstream.lazy import lazy_exports

__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "layerstream.models.tiny": (
            "TINY_MODELS",
            "TinyModelSpec",
            "build_tiny_pipeline",
            "build_tiny_pipeline_components",
            "ensure_tiny_model",
            "get_tiny_model_spec",
            "is_tiny_model_name",
            "tiny_model_dir",
        ),
        "layerstream.models.loading": ("ModelLoadError", "load_model", "load_pipeline", "resolve_model", "resolve_model_folder"),
        "layerstream.models.cache": ("cache_root",),
        "layerstream.models.geometry": ("pipeline_kind",),
        "layerstream.models.hub": ("ModelSource", "looks_like_hub_id"),
    },
)
