"""diffusers' stateful hooks (FirstBlockCache, PyramidAttentionBroadcast, FasterCache, MagCache,
TaylorSeer...): the debugger's own extra call of a component (a localising replay) runs without
touching their state.

A localising replay calls a component once more. Under a caching hook that call would advance the
hook's counters and overwrite its cache, so the watched image and every later call would change,
and a FirstBlockCache raises outside the pipeline's ``cache_context``. :func:`hook_state_kept`
puts the cache context of the watched call back for the replay and restores every stateful hook's
state afterwards.

Limits: the state is restored by reference (each state object's attributes are put back as they
were); a hook that changed a cached tensor in place during the replay would keep that change. No
diffusers hook does so today.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from torch import nn


def _registry(module: nn.Module) -> Any:
    return vars(module).get("_diffusers_hook")  # never getattr: nn.Module would look in its buffers


def stateful_hooks(module: nn.Module) -> list[Any]:
    """The stateful diffusers hooks on ``module`` and its submodules, in module order."""
    found = []
    for sub in module.modules():
        registry = _registry(sub)
        if registry is not None:
            found += [hook for hook in registry.hooks.values() if getattr(hook, "_is_stateful", False)]
    return found


def _state_managers(hook: Any) -> list[Any]:
    return [value for value in vars(hook).values() if hasattr(value, "_state_cache") and hasattr(value, "_context")]


def cache_context(module: nn.Module) -> Any:
    """The cache context set on ``module``'s stateful hooks right now (None outside one)."""
    for hook in stateful_hooks(module):
        for manager in _state_managers(hook):
            if manager._context is not None:
                return manager._context
    return None


def _objects(hook: Any) -> list[Any]:
    """The objects whose attributes make up a hook's state: the hook, its state objects and state
    managers, and the states a manager keeps per context."""
    objects = [hook]
    for value in vars(hook).values():
        if isinstance(value, nn.Module) or not hasattr(value, "__dict__") or callable(value):
            continue
        objects.append(value)
        cache = vars(value).get("_state_cache")
        if isinstance(cache, dict):
            objects += list(cache.values())
    return objects


@contextlib.contextmanager
def hook_state_kept(module: nn.Module, context: Any = None) -> Iterator[None]:
    """Within the block, ``module``'s stateful diffusers hooks see ``context`` (the cache context
    of the call being replayed, when it had one); afterwards every hook's state, context and
    per-context caches are exactly as before. Nothing happens for a module without such hooks."""
    hooks = stateful_hooks(module)
    if not hooks:
        yield
        return
    saved = [(obj, dict(vars(obj))) for hook in hooks for obj in _objects(hook)]
    caches = [(m, dict(m._state_cache)) for hook in hooks for m in _state_managers(hook)]
    try:
        if context is not None:
            for hook in hooks:
                for manager in _state_managers(hook):
                    manager.set_context(context)
        yield
    finally:
        for manager, cache in caches:
            manager._state_cache.clear()
            manager._state_cache.update(cache)
        for obj, attributes in saved:
            vars(obj).clear()
            vars(obj).update(attributes)
