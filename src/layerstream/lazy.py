"""Names a package exports but imports only on first use, so that importing the package stays cheap."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, names_by_module: Mapping[str, tuple[str, ...]]) -> tuple[list[str], Callable[[str], Any]]:
    """The names `package` exports from its modules (module -> names), for its ``__all__``, and the module
    ``__getattr__`` that imports a name's module when the name is first read (any other name is an
    AttributeError, as for any module)."""
    module_of = {name: module for module, names in names_by_module.items() for name in names}

    def __getattr__(name: str) -> Any:
        if name not in module_of:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module_of[name]), name)

    return list(module_of), __getattr__
