"""The HTTP contract as literals: request schemas, response, health and error keys.

Kept apart from the code on purpose: a test compares the code against these, so a change to the API has to
be made twice, here and in `layerstream.server.schemas`, which is what makes it deliberate.
"""

from __future__ import annotations

_OPTIONAL_STRING = {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None}
_COMMON_CONTRACT = {
    "required": ["prompt"],
    "additionalProperties": False,
    "properties": {
        "prompt": {"maxLength": 10000, "minLength": 1, "type": "string"},
        "negative_prompt": {"anyOf": [{"maxLength": 10000, "type": "string"}, {"type": "null"}], "default": None},
        "model": _OPTIONAL_STRING,
        "n": {"default": 1, "maximum": 4, "minimum": 1, "type": "integer"},
        "size": {
            "anyOf": [{"pattern": "^[1-9][0-9]{0,5}x[1-9][0-9]{0,5}$", "type": "string"}, {"type": "null"}],
            "default": None,
        },
        "seed": {"anyOf": [{"maximum": 9007199254740991, "minimum": 0, "type": "integer"}, {"type": "null"}], "default": None},
        "num_inference_steps": {"anyOf": [{"maximum": 1000, "minimum": 1, "type": "integer"}, {"type": "null"}], "default": None},
        "guidance_scale": {"anyOf": [{"maximum": 100.0, "minimum": 0.0, "type": "number"}, {"type": "null"}], "default": None},
        # vllm-omni's fields (each refused with a 422 by a pipeline that cannot take it)
        "guidance_scale_2": {"anyOf": [{"maximum": 100.0, "minimum": 0.0, "type": "number"}, {"type": "null"}], "default": None},
        "true_cfg_scale": {"anyOf": [{"maximum": 100.0, "minimum": 0.0, "type": "number"}, {"type": "null"}], "default": None},
        "boundary_ratio": {"anyOf": [{"maximum": 1.0, "minimum": 0.0, "type": "number"}, {"type": "null"}], "default": None},
        "flow_shift": {"anyOf": [{"exclusiveMinimum": 0.0, "maximum": 100.0, "type": "number"}, {"type": "null"}], "default": None},
        # vllm-omni's extra call arguments (a 400 for a key the model cannot take, or one that is not an object)
        "extra_params": {"anyOf": [{"additionalProperties": True, "type": "object"}, {"type": "null"}], "default": None},
        "timeout": {"anyOf": [{"exclusiveMinimum": 0.0, "maximum": 86400.0, "type": "number"}, {"type": "null"}], "default": None},
    },
}
_IMAGE_SIZE = {"anyOf": [{"pattern": "^(auto|[1-9][0-9]{0,5}x[1-9][0-9]{0,5})$", "type": "string"}, {"type": "null"}], "default": None}
IMAGE_REQUEST_CONTRACT = {
    **_COMMON_CONTRACT,
    "properties": {
        **_COMMON_CONTRACT["properties"],
        "size": _IMAGE_SIZE,
        "response_format": {"default": "b64_json", "enum": ["b64_json", "url"], "type": "string"},
        "output_format": {"default": "png", "enum": ["png", "jpeg", "webp"], "type": "string"},
        "output_compression": {"anyOf": [{"maximum": 100, "minimum": 0, "type": "integer"}, {"type": "null"}], "default": None},
        "quality": {
            "anyOf": [{"enum": ["auto", "low", "medium", "high", "xhigh", "max", "standard", "hd"], "type": "string"}, {"type": "null"}],
            "default": None,
        },
        "user": {"anyOf": [{"maxLength": 256, "type": "string"}, {"type": "null"}], "default": None},
    },
}
VIDEO_REQUEST_CONTRACT = {
    **_COMMON_CONTRACT,
    "properties": {
        **_COMMON_CONTRACT["properties"],
        "response_format": {"const": "b64_json", "default": "b64_json", "type": "string"},
        "num_frames": {"anyOf": [{"minimum": 1, "type": "integer"}, {"type": "null"}], "default": None},
        "fps": {"anyOf": [{"maximum": 120, "minimum": 1, "type": "integer"}, {"type": "null"}], "default": None},
        "image": {"anyOf": [{"minLength": 1, "type": "string"}, {"type": "null"}], "default": None},
    },
}
RESPONSE_KEYS = ["created", "data", "layerstream"]
IMAGE_RESPONSE_KEYS = ["created", "data", "output_format", "size", "layerstream"]
IMAGE_DATA_KEYS = ["b64_json", "url", "revised_prompt"]
VIDEO_DATA_KEYS = ["b64_json", "mime_type"]
USAGE_KEYS = [
    "model", "seeds", "width", "height", "num_frames", "num_inference_steps", "queue_seconds", "seconds",
    "seconds_per_step", "bytes_streamed", "num_transfers", "num_sync_loads", "stall_seconds", "device_bytes",
    "host_bytes", "peak_device_bytes", "size_note", "batch_size", "vae_decode",
]  # fmt: skip
HEALTH_KEYS = [
    "status", "status_reason", "model", "model_source", "kind", "device", "dtype", "component_dtypes", "offload_config", "queue_depth", "max_queue",
    "running", "size_multiple", "frame_multiple", "max_frames", "max_side_pixels", "max_work", "image_input",
    "max_image_bytes", "max_image_pixels", "max_batch_size", "batch_wait_ms", "world_size", "backend", "ranks",
    "default_size", "default_num_frames", "default_steps", "fps", "takes_image", "jobs_path", "jobs_storage", "jobs_unreadable", "jobs_bookkeeping",
]  # fmt: skip
ERROR_KEYS = ["message", "type", "param", "code", "details"]
