"""The plugin manager: built-ins and third-party plugins, all through :mod:`jem_plugin.hookspecs`.

External plugins come from the ``jem`` entry-point group. Set ``JEM_DISABLE_PLUGINS=1`` to load
none of them, or to a comma-separated list of entry-point names to skip just those.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Literal

import pluggy

from . import hookspecs
from .errors import JEMError, UnknownNameError

PROJECT = "jem"
ENTRY_POINT_GROUP = "jem"
DISABLE_ENV = "JEM_DISABLE_PLUGINS"

hookimpl = pluggy.HookimplMarker(PROJECT)

# Built-in plugin modules, registered exactly like third-party ones (by module, through hooks).
BUILTIN_PLUGINS: tuple[str, ...] = (
    "jem_adapters.generic",
    "jem_adapters.timm_adapter",
    "jem_adapters.torchvision_adapter",
    "jem_adapters.huggingface",
    "jem_plugin.builtins.init_distributions",
    "jem_plugin.builtins.ood_scores",
    "jem_plugin.builtins.posthoc",
    "jem_plugin.builtins.energy_bounded",
    "jem_plugin.builtins.pgd_negatives",
    "jem_plugin.builtins.smoothed_negatives",
)

_pm: pluggy.PluginManager | None = None


def _disabled_entry_points() -> set[str] | Literal[True]:
    value = os.environ.get(DISABLE_ENV, "").strip()
    if not value or value.lower() in {"0", "false", "no"}:
        return set()
    if value.lower() in {"1", "true", "yes", "all", "*"}:
        return True
    return {v.strip() for v in value.split(",") if v.strip()}


def _load_entry_points(pm: pluggy.PluginManager) -> None:
    disabled = _disabled_entry_points()
    if disabled is True:
        return
    for name in disabled:
        pm.set_blocked(name)  # pluggy skips blocked names when loading entry points
    pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)


def get_plugin_manager() -> pluggy.PluginManager:
    """Return the process-wide plugin manager, creating it on first use."""
    global _pm
    if _pm is None:
        pm = pluggy.PluginManager(PROJECT)
        pm.add_hookspecs(hookspecs)
        for modname in BUILTIN_PLUGINS:
            # A built-in that fails to import is a broken installation: let the error surface.
            pm.register(importlib.import_module(modname), name=modname)
        _load_entry_points(pm)
        _pm = pm
    return _pm


def register(plugin: Any, name: str | None = None) -> str:
    """Register a plugin object or module at run time; returns its name.

    Plugins registered later are called first, so a plugin registered here can override a
    built-in choice (for example the adapter for a model).
    """
    pm = get_plugin_manager()
    result = pm.register(plugin, name=name)
    if result is None:
        raise JEMError(f"plugin {name or plugin!r} is already registered or blocked")
    return result


def unregister(plugin: Any = None, name: str | None = None) -> None:
    """Remove a plugin registered with :func:`register`."""
    get_plugin_manager().unregister(plugin=plugin, name=name)


def list_plugins() -> list[dict[str, Any]]:
    """Every loaded plugin: ``{"name", "hooks", "builtin", "version"}``, sorted by name."""
    pm = get_plugin_manager()
    dists = {id(p): d for p, d in pm.list_plugin_distinfo()}
    rows = []
    for name, plugin in pm.list_name_plugin():
        if plugin is None:
            continue
        hooks = sorted(h.name for h in (pm.get_hookcallers(plugin) or []))
        dist = dists.get(id(plugin))
        rows.append(
            {
                "name": name,
                "hooks": hooks,
                "builtin": name in BUILTIN_PLUGINS,
                "version": getattr(dist, "version", None) if dist else None,
            }
        )
    return sorted(rows, key=lambda r: (not r["builtin"], r["name"]))


def collect(hook_name: str) -> dict[str, dict[str, Any]]:
    """Call a ``jem_register_*`` hook through pluggy and return ``{name: {"item": ..., **info}}``.

    Later registrations of the same name win, so plugins may replace a built-in (and, as
    everywhere in pluggy, ``tryfirst`` beats ``trylast``). Called on demand (cheap) rather than
    cached, so run-time registrations are always seen. Going through pluggy means a hook
    implementation may take fewer arguments than the spec (even none).
    """
    found: dict[str, dict[str, Any]] = {}

    def _register(name: str, item: Any, **info: Any) -> None:
        # pluggy asks the most recently registered plugin first: the first answer for a name wins.
        found.setdefault(name, {"item": item, **info})

    getattr(get_plugin_manager().hook, hook_name)(register=_register)
    return found


def lookup(hook_name: str, name: str, kind: str) -> dict[str, Any]:
    """Return the entry ``name`` of a registry, or raise :class:`UnknownNameError` listing the choices."""
    entries = collect(hook_name)
    if name not in entries:
        raise UnknownNameError(
            f"unknown {kind} {name!r}{UnknownNameError.did_you_mean(name, entries)}; "
            f"available: {', '.join(sorted(entries)) or '(none)'}"
        )
    return entries[name]


def has_implementations(hook_name: str) -> bool:
    """True when at least one plugin implements ``hook_name`` (used to skip hot-loop hooks)."""
    return bool(getattr(get_plugin_manager().hook, hook_name).get_hookimpls())
