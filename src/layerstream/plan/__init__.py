from layerstream.plan.offload_plan import OffloadPlan, OffloadPlanError, get_offload_plan
from layerstream.plan.resolved import (
    BlockStack,
    OffloadPlanResolutionError,
    ResolvedComponent,
    ResolvedOffloadPlan,
)

__all__ = [
    "BlockStack",
    "OffloadPlan",
    "OffloadPlanError",
    "OffloadPlanResolutionError",
    "ResolvedComponent",
    "ResolvedOffloadPlan",
    "get_offload_plan",
]
