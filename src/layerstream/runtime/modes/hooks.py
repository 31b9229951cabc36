"""What enable installed, by name: every block call, method wrapper, state-dict hook, guard and pipeline wrapper,
with the module it sits on and what it does. `handle.hooks()` lists them; `disable()` removes them all, in the
reverse order of their installation, and leaves the list empty."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

PIPELINE = "<pipeline>"  # the module path shown for hooks on the pipeline object itself


@dataclass(frozen=True)
class HookInfo:
    """One installed hook: where (the module's path in the pipeline), its name and what it does."""

    module_path: str
    name: str
    what: str

    def __str__(self) -> str:
        return f"{self.module_path}: {self.name} ({self.what})"


@dataclass
class _Installed:
    info: HookInfo
    remove: Callable[[], None] = field(repr=False)


class HookSet:
    """The hooks of one enable, in installation order."""

    def __init__(self):
        self._installed: list[_Installed] = []

    def add(self, module_path: str, name: str, what: str, remove: Callable[[], None]) -> None:
        self._installed.append(_Installed(HookInfo(module_path, name, what), remove))

    def listing(self) -> tuple[HookInfo, ...]:
        return tuple(i.info for i in self._installed)

    def remove_all_(self) -> None:
        """Remove every hook, the last installed first; the first error is raised once all were tried."""
        first: BaseException | None = None
        while self._installed:
            installed = self._installed.pop()
            try:
                installed.remove()
            except BaseException as e:  # noqa: BLE001 - every hook is removed; the first error is kept
                first = first or e
        if first is not None:
            raise first

    def __len__(self) -> int:
        return len(self._installed)

    def __repr__(self) -> str:
        return "HookSet(\n" + "".join(f"  {i.info}\n" for i in self._installed) + ")" if self._installed else "HookSet()"
