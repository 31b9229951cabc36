"""`diffusion_offload_config`: parsing and the immutable config it produces. The parser is the only reader of
user-supplied offload settings; every rejection names the key path, the value seen and what is allowed, and
happens before anything in a pipeline is touched.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType
from typing import Any, Literal, get_args

from layerstream.errors import LayerstreamError
from layerstream.json_object import read_json_text

Mode = Literal["layer", "module"]
WeightTransfer = Literal["rank-local", "allgather"]
MODES: tuple[Mode, ...] = get_args(Mode)
LAYER_COMPONENTS = ("dit", "text_encoder")
MODULE_COMPONENTS = ("dit", "text_encoder", "vae")
WEIGHT_TRANSFERS: tuple[WeightTransfer, ...] = get_args(WeightTransfer)
STORAGE_DTYPES = ("float8_e4m3fn", "float8_e5m2", "lossless")  # float8 rounds once, at enable; lossless is exact
DEFAULT_ACTIVATION_RESERVE_GB = 4.0
AUTO = "auto"  # `host_budget_gb: "auto"` (and `resident_layers: "auto"`): a figure read from the machine when enabling

_TOP_LEVEL_KEYS = (
    "mode", "components", "layer_options", "pin_memory", "host_budget_gb", "host_reserve_gb", "disk_dir",
    "lora_exact_unfuse", "vae_use_tiling", "vae_use_slicing", "device_memory_gb",
)  # fmt: skip
_VAE_KEYS = ("vae_use_tiling", "vae_use_slicing")  # vllm-omni's names: true, false or "auto"
_COMMON_OPTION_KEYS = ("weight_transfer", "prefetch_depth", "storage_dtype")
_DIT_ONLY_OPTION_KEYS = ("resident_layers", "device_budget_gb", "activation_reserve_gb")


class OffloadConfigError(LayerstreamError, ValueError):
    """A `diffusion_offload_config` that cannot be used; the message names the key path."""

    def __init__(self, key_path: str, value: Any, allowed: str):
        self.key_path = key_path
        self.value = value
        self.allowed = allowed
        super().__init__(f"diffusion_offload_config: {key_path} = {_show(value)} is not valid; {allowed}")


def _show(value: Any) -> str:
    try:
        text = repr(value)
    except (ValueError, RecursionError):  # an int past Python's digit limit, or nesting too deep to print
        return f"<{type(value).__name__} too large to show>"
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass(frozen=True, kw_only=True)
class LayerOptions:
    """How one streamed component moves its blocks."""

    weight_transfer: WeightTransfer = "rank-local"
    """"rank-local": each process streams from its own full host copy; "allgather": each rank keeps 1/N."""
    resident_layers: int | str = 0
    """DiT only: leading blocks kept on the device (never streamed), or "auto" to fill a device budget."""
    prefetch_depth: int = 1
    """Blocks kept in flight ahead of compute; the slot ring holds prefetch_depth + 1 blocks."""
    device_budget_gb: float | None = None
    """DiT only, for "auto": device bytes (GB) that streamed slots and resident blocks may use."""
    activation_reserve_gb: float | None = None
    """DiT only, for "auto" without a budget: free device memory kept back for activations (GB)."""
    storage_dtype: str | None = None
    """float8: what layerwise casting would cast is stored in it (lossy); "lossless": 16-bit parameters coded,
    about 0.68x the bytes of trained bfloat16 weights (0.87x of float16), decoded bit-exact on the device."""
    resident_layers_given: bool = False
    """Whether the config names `resident_layers` (else a DiT's own declared count applies)."""

    def __post_init__(self) -> None:
        if self.resident_layers != 0:
            object.__setattr__(self, "resident_layers_given", True)


@dataclass(frozen=True, kw_only=True)
class OffloadConfig:
    """A validated `diffusion_offload_config`. Build it with `parse_offload_config`."""

    mode: Mode
    """"layer" streams blocks; "module" swaps whole components on and off the device."""
    components: tuple[str, ...]
    """Selected components, in the order given."""
    layer_options: Mapping[str, LayerOptions] = field(default_factory=lambda: MappingProxyType({}))
    """Per-component layer options, as given (defaults are filled by `options_for`)."""
    pin_memory: bool = True
    """Pin host buffers when the device supports it."""
    host_budget_gb: float | Literal["auto"] | None = None
    """Layer mode: host memory (GB) this process's store may hold for streamed blocks, the rest on disk. "auto":
    what the machine allows when enabling, less the rings, the resident parts and `host_reserve_gb`."""
    host_reserve_gb: float | None = None
    """With "auto": host memory (GB) kept free for a generation (None: estimated, `layerstream.host.reserve`)."""
    disk_dir: str | None = None
    """With `host_budget_gb`: where blocks not backed by checkpoint files are spilled (default: the cache)."""
    vae_use_tiling: bool | Literal["auto"] = AUTO
    """Decode in tiles (not bit-identical to untiled): always, never, or "auto": only where untiled would not fit."""
    vae_use_slicing: bool | Literal["auto"] = AUTO
    """A batch decodes one sample at a time: always, never, or "auto": only a batch that would not fit whole."""
    device_memory_gb: float | None = None
    """The device's memory (GB) for the decode's "auto" where it cannot be read, or to plan a smaller card."""
    lora_exact_unfuse: bool = False
    """`unfuse_lora` restores the pre-fuse bytes exactly (a host copy per fused block), not subtracting the delta."""

    def __post_init__(self) -> None:
        # Freeze containers handed to the constructor, so no caller keeps a mutable alias into the config.
        if isinstance(self.components, list):
            object.__setattr__(self, "components", tuple(self.components))
        object.__setattr__(self, "layer_options", MappingProxyType(dict(self.layer_options)))

    def __hash__(self) -> int:
        return hash(tuple(frozenset(v.items()) if isinstance(v, Mapping) else v for v in self._fields().values()))

    def __reduce__(self):
        # mappingproxy cannot be pickled or deep-copied; rebuild from plain data instead.
        return (_rebuild, (type(self), {**self._fields(), "layer_options": dict(self.layer_options)}))

    def _fields(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def options_for(self, component: str) -> LayerOptions:
        return self.layer_options.get(component, LayerOptions())

    def to_dict(self) -> dict[str, Any]:
        """The config as plain JSON data that parses back (defaults filled in, `resident_layers` only where given)."""
        out: dict[str, Any] = {"mode": self.mode, "components": list(self.components), "pin_memory": self.pin_memory}
        if self.layer_options:
            out["layer_options"] = {name: _options_dict(name, opts) for name, opts in self.layer_options.items()}
        optional = ("host_budget_gb", "host_reserve_gb", "lora_exact_unfuse", "disk_dir", "vae_use_tiling",
                    "vae_use_slicing", "device_memory_gb")  # fmt: skip
        # left out where unset (None; lora_exact_unfuse False), so that the data reads as the user wrote it
        out |= {k: v for k in optional if (v := getattr(self, k)) is not None and v is not False or "vae" in k}
        return out


def _options_dict(component: str, opts: LayerOptions) -> dict[str, Any]:
    # Only keys the parser accepts for this component, so that to_dict() always parses back.
    allowed = _COMMON_OPTION_KEYS + (_DIT_ONLY_OPTION_KEYS if component == "dit" else ())
    # resident_layers only where given: left out, a DiT's own declared count applies (parsed back the same)
    given = {k: v for k, v in vars(opts).items() if k in allowed and v is not None}
    if not opts.resident_layers_given:
        given.pop("resident_layers", None)
    return given


def _rebuild(cls: type, kwargs: dict[str, Any]) -> Any:
    return cls(**kwargs)


def parse_offload_config(obj: Any) -> OffloadConfig:
    """Parse a dict (or its JSON text) into an `OffloadConfig`, or raise `OffloadConfigError`."""
    if isinstance(obj, OffloadConfig):
        return obj
    if isinstance(obj, (str, bytes, bytearray)):
        try:
            obj = read_json_text(obj)
        except json.JSONDecodeError as e:
            raise OffloadConfigError(
                "<json>", obj, f"the text must be JSON: {e.msg} at line {e.lineno} column {e.colno} (char {e.pos})"
            ) from e
        except UnicodeDecodeError as e:
            raise OffloadConfigError("<json>", obj, f"the text must be UTF-8 JSON: {e}") from e
        except ValueError as e:  # an integer past Python's digit limit, or past a limit of `read_json_text`
            raise OffloadConfigError("<json>", obj, f"the text must be a JSON object of the documented keys: {e}") from e
    if not isinstance(obj, Mapping):
        raise OffloadConfigError("<root>", obj, "expected a JSON object with keys mode and components")
    _reject_unknown(obj, _TOP_LEVEL_KEYS, "")

    if "mode" not in obj:
        raise OffloadConfigError("mode", None, f"the key is required; allowed: {_one_of(MODES)}")
    mode = obj["mode"]
    if not isinstance(mode, str) or mode not in MODES:
        raise OffloadConfigError("mode", mode, f"allowed: {_one_of(MODES)}")

    allowed_components = LAYER_COMPONENTS if mode == "layer" else MODULE_COMPONENTS
    if "components" not in obj:
        raise OffloadConfigError("components", None, f"the key is required: a non-empty list of {_one_of(allowed_components)}")
    components = obj["components"]
    if not isinstance(components, list) or not components:
        raise OffloadConfigError("components", components, f"expected a non-empty list of {_one_of(allowed_components)}")
    seen: list[str] = []
    for i, name in enumerate(components):
        if not isinstance(name, str):
            raise OffloadConfigError(f"components[{i}]", name, f"expected a string, one of {_one_of(allowed_components)}")
        if name not in allowed_components:
            raise OffloadConfigError(f"components[{i}]", name, f"with mode {mode!r}, allowed: {_one_of(allowed_components)}")
        if name in seen:
            raise OffloadConfigError(
                f"components[{i}]", name, f"each component may be listed once (already at components[{seen.index(name)}])"
            )
        seen.append(name)

    pin_memory = obj.get("pin_memory", True)
    if not isinstance(pin_memory, bool):
        raise OffloadConfigError("pin_memory", pin_memory, "expected true or false")

    lora_exact_unfuse = obj.get("lora_exact_unfuse", False)
    if not isinstance(lora_exact_unfuse, bool):
        raise OffloadConfigError("lora_exact_unfuse", lora_exact_unfuse, "expected true or false")
    if lora_exact_unfuse and mode != "layer":
        raise OffloadConfigError("lora_exact_unfuse", lora_exact_unfuse, 'applies only to mode "layer"; remove the key')

    layer_options: dict[str, LayerOptions] = {}
    if "layer_options" in obj:
        raw = obj["layer_options"]
        if mode != "layer":
            raise OffloadConfigError("layer_options", raw, 'layer_options apply only to mode "layer"; remove the key')
        if not isinstance(raw, Mapping):
            raise OffloadConfigError("layer_options", raw, "expected an object keyed by selected component")
        for name, opts in raw.items():
            if name not in seen:
                allowed = f"selected components: {_one_of(seen)}"
                raise OffloadConfigError(_key_path("layer_options", name), opts, f"options are only for {allowed}")
            layer_options[name] = _parse_layer_options(name, opts)

    host_budget_gb, disk_dir = _parse_host_tier(obj, mode)
    host_reserve_gb = _parse_host_reserve(obj, host_budget_gb)
    return OffloadConfig(
        mode=mode,
        components=tuple(seen),
        layer_options=MappingProxyType(layer_options),
        pin_memory=pin_memory,
        host_budget_gb=host_budget_gb,
        host_reserve_gb=host_reserve_gb,
        disk_dir=disk_dir,
        lora_exact_unfuse=lora_exact_unfuse,
        **{key: _parse_vae_setting(obj, key) for key in _VAE_KEYS},
        device_memory_gb=_optional_gb(obj, "device_memory_gb", ""),
    )


def with_vae_settings(config: OffloadConfig, **given: bool | str | None) -> OffloadConfig:
    """`config` with the VAE settings given as arguments (None: the config's); a set one must agree."""
    changes = {}
    for key, value in given.items():
        if value is None:
            continue
        parsed = _parse_vae_setting({key: value}, key)
        own = getattr(config, key)
        if own != AUTO and own is not parsed:
            raise OffloadConfigError(key, own, f"given otherwise ({_show(parsed)}) beside the config; give it once")
        changes[key] = parsed
    return replace(config, **changes) if changes else config


def _parse_vae_setting(obj: Mapping, key: str) -> bool | str:
    """`vae_use_tiling` / `vae_use_slicing`: true, false or "auto" (the default)."""
    value = obj.get(key, AUTO)
    if not (isinstance(value, bool) or value == AUTO):
        raise OffloadConfigError(key, value, 'expected true, false or "auto"')
    return value


def _parse_host_tier(obj: Mapping, mode: str) -> tuple[float | str | None, str | None]:
    """`host_budget_gb` (a number > 0 or "auto", layer mode) and `disk_dir` (a path, only with a budget)."""
    budget = None
    if "host_budget_gb" in obj:
        value = obj["host_budget_gb"]
        allowed = f"expected a finite number of GB > 0 or {AUTO!r} (the budget this machine allows)"
        if isinstance(value, str) and value == AUTO:
            budget = AUTO
        else:
            budget = _number_gb(value, "host_budget_gb", allowed, positive=True)
        if mode != "layer":
            raise OffloadConfigError("host_budget_gb", value, 'a host budget applies only to mode "layer"; remove the key')
    disk_dir = None
    if "disk_dir" in obj:
        disk_dir = obj["disk_dir"]
        if not isinstance(disk_dir, str) or not disk_dir or "\x00" in disk_dir:
            raise OffloadConfigError("disk_dir", disk_dir, "expected a non-empty path string (a folder for spill files)")
        if budget is None:
            raise OffloadConfigError("disk_dir", disk_dir, "only used with host_budget_gb; set it or remove the key")
    return budget, disk_dir


def _parse_host_reserve(obj: Mapping, budget: float | str | None) -> float | None:
    """`host_reserve_gb`: a finite number >= 0, only with `host_budget_gb: "auto"`."""
    if "host_reserve_gb" not in obj:
        return None
    value = obj["host_reserve_gb"]
    if budget != AUTO:
        raise OffloadConfigError(
            "host_reserve_gb", value, f'only used with host_budget_gb "auto" (host_budget_gb is {_show(budget)}); set it or remove the key'
        )
    return _optional_gb(obj, "host_reserve_gb", "")


def _parse_layer_options(component: str, raw: Any) -> LayerOptions:
    base = f"layer_options.{component}"
    if not isinstance(raw, Mapping):
        raise OffloadConfigError(base, raw, "expected an object")
    allowed_keys = _COMMON_OPTION_KEYS + (_DIT_ONLY_OPTION_KEYS if component == "dit" else ())
    for key in raw:
        if key in _DIT_ONLY_OPTION_KEYS and component != "dit":
            raise OffloadConfigError(f"{base}.{key}", raw[key], f"{key} applies only to dit; allowed here: {_one_of(allowed_keys)}")
    _reject_unknown(raw, allowed_keys, base)

    weight_transfer = raw.get("weight_transfer", "rank-local")
    if not isinstance(weight_transfer, str) or weight_transfer not in WEIGHT_TRANSFERS:
        raise OffloadConfigError(f"{base}.weight_transfer", weight_transfer, f"allowed: {_one_of(WEIGHT_TRANSFERS)}")

    prefetch_depth = raw.get("prefetch_depth", 1)
    if not _is_int(prefetch_depth) or not 1 <= prefetch_depth <= 8:
        raise OffloadConfigError(f"{base}.prefetch_depth", prefetch_depth, "expected an integer from 1 to 8")

    resident_layers = raw.get("resident_layers", 0)
    if resident_layers != "auto" and (not _is_int(resident_layers) or resident_layers < 0):
        raise OffloadConfigError(f"{base}.resident_layers", resident_layers, 'expected an integer >= 0 or "auto"')

    storage_dtype = raw.get("storage_dtype")
    if "storage_dtype" in raw and (not isinstance(storage_dtype, str) or storage_dtype not in STORAGE_DTYPES):
        raise OffloadConfigError(
            f"{base}.storage_dtype", storage_dtype, f"allowed: {_one_of(STORAGE_DTYPES)} (omit the key to keep the model's dtype)"
        )

    budget = _optional_gb(raw, "device_budget_gb", base)
    reserve = _optional_gb(raw, "activation_reserve_gb", base)
    if (budget is not None or reserve is not None) and resident_layers != "auto":
        key = "device_budget_gb" if budget is not None else "activation_reserve_gb"
        raise OffloadConfigError(f"{base}.{key}", raw[key], 'only used with resident_layers "auto"; set it or remove the key')
    if budget is not None and reserve is not None:
        raise OffloadConfigError(
            f"{base}.activation_reserve_gb", reserve, "give either device_budget_gb or activation_reserve_gb, not both"
        )
    return LayerOptions(
        weight_transfer=weight_transfer,
        resident_layers=resident_layers,
        resident_layers_given="resident_layers" in raw,
        prefetch_depth=prefetch_depth,
        device_budget_gb=budget,
        activation_reserve_gb=reserve,
        storage_dtype=storage_dtype,
    )


def _optional_gb(raw: Mapping, key: str, base: str) -> float | None:
    if key not in raw:
        return None
    return _number_gb(raw[key], _key_path(base, key), "expected a finite number of GB >= 0")


def _number_gb(value: Any, path: str, allowed: str, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise OffloadConfigError(path, value, allowed)
    try:
        gb = float(value)
    except OverflowError as e:  # an int too large for a float
        raise OffloadConfigError(path, value, allowed) from e
    if not math.isfinite(gb) or gb < 0 or (positive and gb == 0):
        raise OffloadConfigError(path, value, allowed)
    return gb


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _reject_unknown(obj: Mapping, allowed: tuple[str, ...], base: str) -> None:
    for key in obj:
        if key not in allowed:
            raise OffloadConfigError(_key_path(base, key), obj[key], f"unknown key; allowed keys: {_one_of(allowed)}")


def _key_path(base: str, key: Any) -> str:
    # A key that would not read as a path segment ("", "a.b", 3) is quoted, so the path stays unambiguous.
    if isinstance(key, str) and key.isidentifier():
        return f"{base}.{key}" if base else key
    quoted = json.dumps(key) if isinstance(key, str) else _show(key)
    return f"{base}[{quoted}]"


def _one_of(values) -> str:
    return ", ".join(json.dumps(v) for v in values)
