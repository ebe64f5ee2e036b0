"""Name -> implementation registries for every plug-in kind (estimators, losses, rewards, engines...).

One registry per kind, one signature per kind, one lookup::

    ADV_ESTIMATORS = Registry("advantage estimator", config_key="algorithm.adv_estimator")

    @ADV_ESTIMATORS.register("grpo")
    def grpo(...): ...

    ADV_ESTIMATORS["grpo"]      # unknown names raise KeyError listing the valid ones
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class RegistryError(KeyError):
    """Unknown or duplicate registry name; ``str()`` is the readable message."""

    def __str__(self) -> str:
        return str(self.args[0])


class Registry(Generic[T]):
    def __init__(self, kind: str, config_key: str | None = None):
        self.kind = kind
        self.config_key = config_key
        self._items: dict[str, T] = {}

    def register(self, name: str, *aliases: str) -> Callable[[T], T]:
        """Decorator registering ``obj`` under ``name`` (and aliases). A name taken twice raises."""

        def wrap(obj: T) -> T:
            for key in (name, *aliases):
                if key in self._items:
                    raise RegistryError(f"{self.kind} {key!r} is already registered; pick another name")
                self._items[key] = obj
            return obj

        return wrap

    def add(self, name: str, obj: T) -> T:
        return self.register(name)(obj)

    def __getitem__(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            valid = ", ".join(sorted(self._items))
            close = difflib.get_close_matches(str(name), list(self._items), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            where = f"{self.config_key}: " if self.config_key else ""
            raise RegistryError(f"{where}unknown {self.kind} {name!r}{hint}; valid names: {valid}") from None

    def get(self, name: str) -> T:
        return self[name]

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def names(self) -> list[str]:
        return sorted(self._items)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"
