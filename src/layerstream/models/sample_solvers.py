"""vllm-omni's ``sample_solver`` (``"unipc"``, ``"euler"``, Wan's ``"dpm++"``) mapped to diffusers schedulers on
Wan's flow-matching sigmas at the same shift (a scheduler already one of them, as Flux's Euler, takes its own
name). The scheduler is built for one call and handed to that call alone, so it never reaches the next."""

from __future__ import annotations

from typing import Any

SAMPLE_SOLVER = "sample_solver"
SOLVER_SCHEDULERS = {
    "unipc": "UniPCMultistepScheduler",
    "euler": "FlowMatchEulerDiscreteScheduler",
    "dpm++": "DPMSolverMultistepScheduler",
}
_FLOW_EULER = SOLVER_SCHEDULERS["euler"]


def solver_name(value: str) -> str:
    """A ``sample_solver`` value as the table spells it: vllm-omni reads it without case or surrounding spaces."""
    return value.strip().lower()


def solvers_for(scheduler: Any) -> dict[str, str]:
    """The ``sample_solver`` values a pipeline with `scheduler` takes, each to the scheduler class it runs."""
    config = getattr(scheduler, "config", None) or {}
    if config.get("use_flow_sigmas") and config.get("prediction_type") == "flow_prediction" and "flow_shift" in config:
        return dict(SOLVER_SCHEDULERS)
    own = type(scheduler).__name__
    return {name: cls for name, cls in SOLVER_SCHEDULERS.items() if cls == own}


def scheduler_for(served: Any, *, solver: str | None, flow_shift: float | None) -> Any:
    """The scheduler one call runs with: `served` itself, or one built from its config where a request names
    another solver (of `solvers_for(served)`) or a `flow_shift`."""
    target = SOLVER_SCHEDULERS[solver_name(solver)] if solver is not None else type(served).__name__
    if target == type(served).__name__ and flow_shift is None:
        return served
    import diffusers

    config = served.config
    shift = flow_shift if flow_shift is not None else config.get("flow_shift")
    scheduler_class = type(served) if target == type(served).__name__ else getattr(diffusers, target)
    if target == _FLOW_EULER and type(served).__name__ != _FLOW_EULER:  # its shift is named shift
        return scheduler_class(num_train_timesteps=config["num_train_timesteps"], shift=shift)
    return scheduler_class.from_config(config, flow_shift=shift)
