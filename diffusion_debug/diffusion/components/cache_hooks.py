"""diffusers' stateful hooks (FirstBlockCache, PyramidAttentionBroadcast, FasterCache, MagCache,
TaylorSeer...): the debugger's own extra call of a component (a localising replay) runs without
touching their state.

A localising replay calls a component once more. Under a caching hook that call would advance the
hook's counters and overwrite its cache, so the watched image and every later call would change,
and a FirstBlockCache raises outside the pipeline's ``cache_context``. :func:`hook_state` keeps the
cache context and the hooks' state as the watched call begins; :func:`hook_state_kept` puts both
back for the replay (a block the call computed is computed again, one it took from the cache is
taken again) and restores every stateful hook's state as it was before the replay afterwards.

The state is restored by reference, one container deep at every level: each state object's
attributes are put back as they were, and the dicts, lists, sets and deques they hold (nested in
one another) get their contents back in place, since hooks grow them during a call (TaylorSeer's
``taylor_factors[i] = ...``, SeaCache's ``history.append``, MagCache's ratios, a text KV cache).

Limits: a hook that changed a cached tensor in place during the replay would keep that change
(no diffusers hook does so today); containers inside other objects than the state objects
(a tuple's list, an attribute of a value) are not followed. Cost under a caching hook: the state
taken at each call of the component (its hooks' attributes and containers copied one level deep,
no tensor copied); the cache tensors a call replaces stay referenced by it until the component's
next call or the step's end (one step's cache state, on the device).
"""

from __future__ import annotations

import collections
import contextlib
import copy
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


HookState = tuple
"""What :func:`hook_state` saved of a module's stateful hooks (opaque: given back to :func:`hook_state_kept`)."""


def hook_state(module: nn.Module) -> tuple[Any, HookState | None]:
    """``(cache context, state)`` of ``module``'s stateful diffusers hooks right now, one walk of its
    modules: taken as a watched call begins, so that its replay starts from the state the call
    started from (a PyramidAttentionBroadcast counter, a FirstBlockCache residual, TaylorSeer's
    factors), not the one the call left. ``(None, None)`` for a module without such hooks."""
    hooks = stateful_hooks(module)
    if not hooks:
        return None, None
    context = next((m._context for h in hooks for m in _state_managers(h) if m._context is not None), None)
    return context, _saved(hooks)


def _saved(hooks: list[Any]) -> HookState:
    saved = [(obj, dict(vars(obj))) for hook in hooks for obj in _objects(hook)]
    caches = [(m, dict(m._state_cache)) for hook in hooks for m in _state_managers(hook)]
    containers: dict[int, tuple[Any, Any]] = {}
    for _, attributes in saved:
        for value in attributes.values():
            _containers(value, containers)
    return saved, caches, list(containers.values())


def _restore(state: HookState) -> None:
    saved, caches, containers = state
    for manager, cache in caches:
        manager._state_cache.clear()
        manager._state_cache.update(cache)
    for obj, attributes in saved:
        vars(obj).clear()
        vars(obj).update(attributes)
    for container, contents in containers:
        _put_back(container, contents)


@contextlib.contextmanager
def hook_state_kept(module: nn.Module, context: Any = None, state: HookState | None = None) -> Iterator[None]:
    """Within the block, ``module``'s stateful diffusers hooks see ``context`` (the cache context
    of the call being replayed, when it had one) and ``state`` (what :func:`hook_state` saved as that
    call began, when given); afterwards every hook's state, context and per-context caches are
    exactly as before. Nothing happens for a module without such hooks."""
    hooks = stateful_hooks(module)
    if not hooks:
        yield
        return
    now = _saved(hooks)
    try:
        if state is not None:
            _restore(state)
        if context is not None:
            for hook in hooks:
                for manager in _state_managers(hook):
                    manager.set_context(context)
        yield
    finally:
        _restore(now)


_CONTAINERS = (dict, list, set, collections.deque)


def _containers(value: Any, found: dict[int, tuple[Any, Any]]) -> None:
    """Every dict, list, set and deque reachable from ``value`` through such containers, each with a
    shallow copy of its contents (``found``: by id, so a shared one is copied once)."""
    if not isinstance(value, _CONTAINERS) or id(value) in found:
        return
    found[id(value)] = (value, copy.copy(value))
    for item in value.values() if isinstance(value, dict) else value:
        _containers(item, found)


def _put_back(container: Any, contents: Any) -> None:
    if isinstance(container, list):
        container[:] = contents
    elif isinstance(container, collections.deque):
        container.clear()
        container.extend(contents)
    else:  # dict, set
        container.clear()
        container.update(contents)
