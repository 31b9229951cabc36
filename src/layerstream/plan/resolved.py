"""`ResolvedOffloadPlan`: what the resolver decided, as plain data every backend consumes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from layerstream.config.offload_config import OffloadConfig, WeightTransfer
from layerstream.errors import LayerstreamError

Category = Literal["dit", "text_encoder", "encoder", "image_encoder", "vae", "other"]
Source = Literal["plan", "builtin", "class_attribute", "auto", "none"]
Action = Literal["stream", "swap", "resident", "on_demand"]
"""What enabling does with a component: stream its blocks, swap it whole (module mode), keep it on the device,
or leave it to the pipeline (on-demand components)."""


class OffloadPlanResolutionError(LayerstreamError, ValueError):
    """A pipeline and config that cannot be resolved into an offload plan; names the class and the path."""


@dataclass(frozen=True)
class BlockStack:
    """One block list that streams: an ``nn.ModuleList``/``nn.Sequential`` inside a component."""

    owner_path: str
    """Module path (from the pipeline) of the module holding the list, e.g. ``"transformer"``."""
    attr_path: str
    """Attribute path of the list inside its owner, e.g. ``"blocks"`` or ``"encoder.block"``."""
    block_paths: tuple[str, ...]
    """Full module path of every block, in declared order."""
    block_bytes: tuple[int, ...]
    """Bytes of parameters and buffers of every block."""
    own_chain: bool = False
    """True for ``offload_submodules`` stacks, which prefetch along a chain of their own."""

    @property
    def qualified_name(self) -> str:
        return join_path(self.owner_path, self.attr_path)

    @property
    def num_blocks(self) -> int:
        return len(self.block_paths)

    @property
    def total_bytes(self) -> int:
        return sum(self.block_bytes)


@dataclass(frozen=True)
class ResolvedComponent:
    """One component of the pipeline and what offload does with it."""

    path: str
    """Attribute path from the pipeline; ``""`` when the pipeline is itself the model."""
    category: Category
    module_class: str
    source: Source
    """Where the block lists came from (``"none"`` when it has none)."""
    stacks: tuple[BlockStack, ...]
    """Streamable block lists (empty for components that cannot stream)."""
    action: Action
    """What enabling does with this component under the config."""
    total_bytes: int
    """Bytes of all parameters and buffers of the component."""
    weight_transfer: WeightTransfer = "rank-local"
    prefetch_depth: int = 1
    storage_dtype: str | None = None
    """Host storage dtype of the castable block weights (`layer_options.<component>.storage_dtype`); None: as is."""
    resident_layers: int | str = 0
    """Requested leading blocks kept on the device ("auto" is decided at enable time from the device budget)."""
    resident_allowed: bool = False
    """Declared in ``resident_dit_paths`` (or discovered automatically)."""
    replicated: bool = False
    """Block tensors identical on every rank (DiTs, and encoders in ``encoder_dlo_weight_replication``)."""
    alternates: bool = False
    """A DiT that runs in other denoising steps than the other alternating DiTs, never in the same one (Wan 2.2's
    experts, `PipelineFamily.alternating_dits`): under ``host_budget_gb`` they share one host pool."""
    reason: str = ""
    """Why `action` was chosen, as a phrase (``"image encoders stay resident in layer mode: ..."``)."""
    on_demand: bool = False
    """The pipeline manages this component's residency (``on_demand_component_paths``, selected in layer mode):
    enabling calls its ``offload_to_cpu()`` once (before streaming its blocks, if it has any) and disabling calls
    its ``load_to_device()`` once."""
    own_to: str | None = None
    """``"<Class>.to"`` for a resident component whose class defines its own ``to()`` (it stages itself there):
    enabling moves it through that ``to()``, once, and ``disable()`` moves it back through it to where enabling
    found it; None where the component is moved tensor by tensor (every other one)."""

    @property
    def block_bytes(self) -> int:
        return sum(stack.total_bytes for stack in self.stacks)

    @property
    def num_blocks(self) -> int:
        return sum(stack.num_blocks for stack in self.stacks)

    @property
    def display_path(self) -> str:
        return self.path or "<model>"


@dataclass(frozen=True)
class AbsentComponent:
    """A path a declaration names that this pipeline instance does not hold (diffusers sets optional components
    to None; a dotted path may miss a middle part): skipped, not an error."""

    path: str
    declared_in: str
    """Where it was declared (``"_offload_plan.block_attrs"``, ``"_dit_modules"`` ...)."""
    why: str
    """What was found instead (``"it is None"``, ``"Pipe has no attribute 'transformer_2'"``)."""


@dataclass(frozen=True)
class UntouchedComponent:
    """A child of a pipeline that declares its roles (all of ``_dit_modules``, ``_encoder_modules`` and
    ``_vae_modules``) and names it in none of its declarations: enabling leaves it where it is, untouched (not
    moved, not marked), as vllm-omni does; a module the pipeline keeps elsewhere on purpose stays there."""

    path: str
    module_class: str
    total_bytes: int


@dataclass(frozen=True)
class ResolvedOffloadPlan:
    """The resolver's answer for one pipeline and one config. Pure data: no module references."""

    pipeline_class: str
    config: OffloadConfig
    components: tuple[ResolvedComponent, ...]
    absent: tuple[AbsentComponent, ...] = ()
    """Declared paths this instance does not hold (skipped; `layerstream plan` lists them)."""
    untouched: tuple[UntouchedComponent, ...] = ()
    """Undeclared children of a pipeline that declares its roles: left where they are (`layerstream plan` lists
    them as "undeclared, untouched")."""

    def component(self, path: str) -> ResolvedComponent:
        for comp in self.components:
            if comp.path == path:
                return comp
        raise KeyError(path)

    @property
    def streamed(self) -> tuple[ResolvedComponent, ...]:
        return tuple(c for c in self.components if c.action == "stream")

    def to_dict(self) -> dict[str, Any]:
        return {
            "pipeline_class": self.pipeline_class,
            "config": self.config.to_dict(),
            "components": [
                {
                    "path": c.display_path,
                    "class": c.module_class,
                    **{key: getattr(c, key) for key in _COMPONENT_KEYS},
                    "stacks": [
                        {
                            "name": s.qualified_name,
                            "num_blocks": s.num_blocks,
                            "block_bytes": list(s.block_bytes),
                            "own_chain": s.own_chain,
                        }
                        for s in c.stacks
                    ],
                }
                for c in self.components
            ],
            "absent": [{"path": a.path, "declared_in": a.declared_in, "why": a.why} for a in self.absent],
            "untouched": [
                {"path": u.path, "class": u.module_class, "total_bytes": u.total_bytes} for u in self.untouched
            ],
        }


_COMPONENT_KEYS = (
    "category", "source", "action", "reason", "total_bytes", "block_bytes", "resident_layers", "resident_allowed",
    "weight_transfer", "alternates", "storage_dtype", "on_demand", "own_to",
)  # fmt: skip
"""The fields of a `ResolvedComponent` its dict gives as they are."""


def join_path(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


def lookup(root: Any, path: str) -> Any:
    """The object at a dotted attribute path from `root` (``""`` is `root` itself); raises AttributeError."""
    obj = root
    for part in path.split(".") if path else ():
        obj = getattr(obj, part)
    return obj
