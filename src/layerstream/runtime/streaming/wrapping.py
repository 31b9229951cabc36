"""Wrapping a module's method as an instance attribute, so that work runs around every call: torch skips even
`always_call` forward hooks on `KeyboardInterrupt`, and pipelines reach some components through other methods
than `forward` (`vae.decode(...)`). The wrapper is opaque to `torch.compile`; the wrapped method compiles alone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class MethodWrapper:
    """`module.<name>` wrapped in `enter()` and (always) `leave()`; `remove()` puts the original back."""

    def __init__(self, module: nn.Module, name: str, enter: Callable[[], None], leave: Callable[[], None]):
        self.module = module
        self.name = name
        self.had_own = name in module.__dict__
        self.original = module.__dict__.get(name)
        inner = getattr(module, name)
        # the bookkeeping never runs under dynamo; the wrapped method does, as a frame of its own
        enter = torch.compiler.disable(enter, reason="layerstream bookkeeping around a call")
        leave = torch.compiler.disable(leave, reason="layerstream bookkeeping around a call")

        def around(method, *args, **kwargs):
            enter()
            try:
                return method(*args, **kwargs)
            finally:
                leave()

        reason = "layerstream enters and leaves its streamer outside any graph"
        disabled = torch.compiler.disable(around, recursive=False, reason=reason)
        wrapper = _Unbindable(disabled, inner)
        self.wrapper = wrapper
        module.__dict__[name] = wrapper

    def remove(self) -> None:
        if self.module.__dict__.get(self.name) is not self.wrapper:
            return  # already removed, or replaced by someone else after us: leave theirs alone
        if self.had_own:
            self.module.__dict__[self.name] = self.original
        else:
            del self.module.__dict__[self.name]

    def __repr__(self) -> str:
        return f"MethodWrapper({type(self.module).__name__}.{self.name})"


class _Unbindable:
    """The wrapper as installed, whose `__get__` returns itself: `saved.__get__(module)` (cache-dit) binds it once."""

    def __init__(self, around: Callable, inner: Callable):
        self._around = around
        self.__wrapped__ = inner
        self.__doc__ = getattr(inner, "__doc__", None)
        self.__name__ = getattr(inner, "__name__", "wrapper")

    def __call__(self, *args, **kwargs):
        return self._around(self.__wrapped__, *args, **kwargs)

    def __get__(self, obj, objtype=None):
        return self


def wrappers_for_view(module: nn.Module, view: nn.Module) -> dict[str, Callable]:
    """The wrappers installed on `module`, each running the same work around its method bound to `view` (an object
    sharing `module`'s state, with settings of its own for one call): by name, for `view`'s ``__dict__``."""
    return {
        name: _Unbindable(wrapper._around, wrapper.__wrapped__.__func__.__get__(view))
        for name, wrapper in vars(module).items()
        if isinstance(wrapper, _Unbindable) and getattr(wrapper.__wrapped__, "__self__", None) is module
    }
