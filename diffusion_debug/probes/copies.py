"""A copy of a watched module is a plain module: ``copy.deepcopy`` (an EMA copy, a distillation's
target network) and a pickle (``torch.save(model)``) leave out every hook of ours, keep the
script's own as torch copies them, and the original stays watched.

While anything of ours is held (:func:`hold`), ``nn.Module.__getstate__`` (what a deepcopy and a
pickle of a module read) is torch's with our hooks taken out of the copy's hook dicts: each
:class:`~diffusion_debug.probes.handles.OwnHook` (what :func:`~.handles.register_all` and
:class:`~.handles.ForwardHooks` leave), and each hook registered with torch's ``register_*`` whose
handle was :func:`mark`\\ ed (launch's watches, whose hooks dynamo must see as plain functions). The
copy holds no reference to a debugger (a deep-copied bound method would copy its ``__self__``, the
whole debugger), and its pickle names nothing of this package, so it loads where none is installed.

>>> import copy, pickle, torch
>>> from torch import nn
>>> from .handles import register_all
>>> layer = nn.Linear(2, 2)
>>> own = layer.register_forward_hook(lambda *args: None)  # the script's own (copied as torch copies it)
>>> with register_all(lambda: [layer.register_forward_hook(lambda *args: print("seen"))]):
...     twin = copy.deepcopy(layer)
...     own.remove()  # (a lambda: no pickle)
...     data = pickle.dumps(layer)
...     _ = layer(torch.ones(2)), twin(torch.ones(2))
seen
>>> len(twin._forward_hooks), len(pickle.loads(data)._forward_hooks), b"diffusion_debug" in data
(1, 0, False)

Limits: a module class whose own ``__getstate__`` does not call ``nn.Module``'s copies our
:class:`~.handles.OwnHook` s as inert hooks that take themselves off at the copy's first call
(:class:`~.handles.CopiedHook`, which names this package in a pickle); a marked hook of such a class
is copied as it is. The hooks layer holds the patch only where nothing else does (a debugger's hold
covers the hooks it puts in, so one dropped unclosed takes the patch out with its finalizer): a hook
of ours that outlives the holder it went in under is copied as a ``CopiedHook``.
"""

from __future__ import annotations

import warnings
from typing import Any

from torch import nn

from ..errors import UnbalancedRelease

HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_backward_pre_hooks",
    "_backward_hooks",
    "_post_accumulate_grad_hooks",  # (a tensor's)
)
"""torch's hook dicts on a module or tensor, by attribute name."""
HOOK_FLAGS = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")
"""The dicts that flag a module's forward hooks by their ids (``with_kwargs``, ``always_call``)."""

HELD = [0]
"""How many holders want our hooks left out of copies (the patch is in while above 0). A list: the
hooks layer counts in place, with no call a hook attach."""
MARKED: set[int] = set()
"""The ids (torch's hook-dict keys, unique across every dict) of hooks of ours that are not
:class:`~.handles.OwnHook` s."""
OWN_HOOKS: list[type] = []
"""The types of hook :mod:`.handles` leaves in torch's dicts (its ``OwnHook``; set there: it imports this)."""
_PATCH: list[Any] = []
"""``[torch's __getstate__, ours]`` while the patch is in."""


def hold() -> None:
    """One more holder: the patch goes in with the first."""
    HELD[0] += 1
    if HELD[0] == 1:
        install()


def release() -> None:
    """One holder fewer: the patch comes out with the last. A release with no hold left is a holder
    that released twice (or never held): it is warned as :class:`~diffusion_debug.errors.UnbalancedRelease`
    and changes nothing (clamped at 0, it went unseen and let a later holder's hooks into copies while
    that holder still counted on the patch). The test suite makes the warning an error; a user's run
    goes on."""
    if HELD[0] <= 0:
        warnings.warn(UnbalancedRelease("probes.copies.release() with no hold left: a holder released twice"))
        return
    HELD[0] -= 1
    if HELD[0] == 0:
        uninstall()


def mark(handle: Any) -> Any:
    """``handle`` (torch's ``RemovableHandle``) is ours: its hook is left out of copies. Returns it."""
    MARKED.add(handle.id)
    return handle


def unmark(handle: Any) -> None:
    MARKED.discard(handle.id)


def install() -> None:
    if _PATCH:
        return
    original = nn.Module.__getstate__

    def __getstate__(module: nn.Module) -> Any:
        return _without_ours(original(module))

    _PATCH.extend((original, __getstate__))
    nn.Module.__getstate__ = __getstate__  # type: ignore[method-assign]


def uninstall() -> None:
    if not _PATCH:
        return
    original, ours = _PATCH
    _PATCH.clear()
    if nn.Module.__dict__.get("__getstate__") is ours:  # another's patch over ours stays (it calls ours)
        nn.Module.__getstate__ = original  # type: ignore[method-assign]


def _without_ours(state: Any) -> Any:
    """``state`` (a module's ``__dict__`` copy) with new hook dicts that hold none of ours; the
    module's own dicts are never changed."""
    if not isinstance(state, dict):
        return state
    own = tuple(OWN_HOOKS)
    ours: set[Any] = set()
    for name in HOOK_DICTS:
        hooks = state.get(name)
        if not hooks:
            continue
        found = [key for key, hook in hooks.items() if key in MARKED or isinstance(hook, own)]
        if found:
            ours.update(found)
            state[name] = type(hooks)((key, hook) for key, hook in hooks.items() if key not in ours)
    if ours:
        for name in HOOK_FLAGS:
            flags = state.get(name)
            if flags and not ours.isdisjoint(flags):
                state[name] = type(flags)((key, value) for key, value in flags.items() if key not in ours)
    return state
