"""The registry of per-request scheduling plugins: name -> plugin class.

The built-ins register here (:mod:`ext_proc.scheduling.builtin`); a third-party module registers its
own the same way, with one line, and is imported by naming it in ``picker.plugin_modules``::

    from ext_proc.scheduling import register

    @register
    class LoraAffinity:
        name = "lora-affinity"
        ...

A plugin is a class with a ``name`` (lower case, digits and ``-``), a ``Params`` model (a subclass of
:class:`~ext_proc.scheduling.api.PluginParams`), a constructor taking its params, and the methods
and attributes of one kind (:class:`~ext_proc.scheduling.api.Filter`,
:class:`~ext_proc.scheduling.api.Scorer` or :class:`~ext_proc.scheduling.api.Picker`).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Sequence
from typing import Any, Literal, TypeVar

from ext_proc.scheduling.api import PluginParams

__all__ = ["REGISTRY", "Kind", "Registry", "import_plugins", "kind_of", "register"]

Kind = Literal["filter", "scorer", "picker"]
_NAME = re.compile(r"^[a-z][a-z0-9-]{0,62}$")
T = TypeVar("T", bound=type)


def kind_of(plugin: type) -> Kind:
    """What ``plugin`` is: a picker (``pick``), a scorer (``score`` and ``default_weight``) or a filter
    (``keep`` and ``soft``).

    Raises:
        TypeError: it is none of them.
    """
    if callable(getattr(plugin, "pick", None)):
        return "picker"
    if callable(getattr(plugin, "score", None)) and isinstance(getattr(plugin, "default_weight", None),
                                                               int | float):
        return "scorer"
    if callable(getattr(plugin, "keep", None)) and isinstance(getattr(plugin, "soft", None), bool):
        return "filter"
    raise TypeError(f"{plugin!r} is no scheduling plugin: a picker has pick(request, profile), a scorer "
                    "score(request, endpoints) and default_weight, a filter keep(request, endpoint) and soft")


class Registry:
    """Plugin classes by name (names unique across kinds)."""

    def __init__(self) -> None:
        self._plugins: dict[str, type] = {}

    def register(self, plugin: T) -> T:
        """Add ``plugin`` (a class; usable as a decorator) and return it. Registering the same class
        again changes nothing.

        Raises:
            ValueError: its name is not lower case, digits and ``-`` (1-63 characters), another
                class has it, or a filter's ``outcome`` is not ``spilled`` or ``memory``.
            TypeError: it is no plugin (:func:`kind_of`), or its ``Params`` is no
                :class:`~ext_proc.scheduling.api.PluginParams`.
        """
        name = getattr(plugin, "name", None)
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"{plugin!r}: a plugin's name is lower case letters, digits and '-' "
                             f"(at most 63), got {name!r}")
        kind = kind_of(plugin)
        params = getattr(plugin, "Params", None)
        if not (isinstance(params, type) and issubclass(params, PluginParams)):
            raise TypeError(f"plugin {name!r}: Params must be a subclass of ext_proc.scheduling.PluginParams")
        if kind == "filter":
            if getattr(plugin, "outcome", None) not in ("spilled", "memory"):
                raise ValueError(f"filter {name!r}: outcome must be 'spilled' or 'memory'")
            if not isinstance(getattr(plugin, "repins", None), bool):
                raise TypeError(f"filter {name!r}: repins must be true or false")
        known = self._plugins.get(name)
        if known is not None and known is not plugin:
            raise ValueError(f"plugin {name!r} is already registered ({known.__module__}.{known.__qualname__})")
        self._plugins[name] = plugin
        return plugin

    def get(self, name: str) -> type:
        """The plugin class called ``name``.

        Raises:
            KeyError: no plugin has that name (the message lists the known ones).
        """
        try:
            return self._plugins[name]
        except KeyError:
            raise KeyError(f"unknown plugin {name!r}; known: {', '.join(self.names())}") from None

    def names(self, kind: Kind | None = None) -> list[str]:
        """The registered names (of one kind), sorted."""
        return sorted(n for n, p in self._plugins.items() if kind is None or kind_of(p) == kind)

    def __contains__(self, name: Any) -> bool:
        return name in self._plugins


REGISTRY = Registry()
"""The process's registry: the built-ins and every module named in ``picker.plugin_modules``."""

register = REGISTRY.register


def import_plugins(modules: Sequence[str]) -> None:
    """Import each of ``modules`` (dotted paths, ``picker.plugin_modules``): each registers its plugins
    when imported (:func:`register`). A module imported before is not imported again.

    Raises:
        ValueError: a module cannot be imported, or registering its plugins failed (the message
            names the module and the cause).
    """
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as err:  # any error of a third-party module's import: refused with its name
            raise ValueError(f"cannot import plugin module {module!r}: {type(err).__name__}: {err}") from err
