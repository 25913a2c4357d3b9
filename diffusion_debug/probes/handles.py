"""The one handle every attach of the package returns: ``remove()`` takes exactly its hooks off.

>>> import torch
>>> from torch import nn
>>> layer = nn.Linear(2, 2)
>>> with register_all(lambda: [layer.register_forward_hook(lambda *args: None)]) as handle:
...     len(layer._forward_hooks)
1
>>> len(layer._forward_hooks), handle.attached
(0, False)

A torch hook that :func:`register_all` adds stays on the object it was registered on: a deep copy
or a pickle of a watched module (an EMA copy, ``torch.save(module)``) holds none of them
(:mod:`.copies`), so the copy runs as a copy of the unwatched module would, and the debugger's
detach is not needed to clean it.

>>> import copy, pickle
>>> with register_all(lambda: [layer.register_forward_hook(lambda *args: print("seen"))]):
...     twin, thawed = copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))
...     _ = layer(torch.ones(2)), twin(torch.ones(2)), thawed(torch.ones(2))
seen
>>> len(twin._forward_hooks), len(thawed._forward_hooks)
(0, 0)

Limits: a handle removes what it was given; hooks a technique adds later (a profiler range opened
at its first call) are the technique's to hand over through ``on_remove``. A module class whose own
``__getstate__`` skips ``nn.Module``'s copies each hook as an inert :class:`CopiedHook`, which takes
itself off at the copy's first call (a pickle of it names this package).
"""

from __future__ import annotations

import functools
import itertools
import weakref
from collections import OrderedDict, deque
from operator import is_
from typing import Any, Callable, Iterable

from torch.utils.hooks import RemovableHandle

from . import copies
from .copies import HELD, HOOK_DICTS, HOOK_FLAGS


class ProbeHandle:
    """Removes the hooks one ``apply_*`` or ``attach`` added (torch's ``RemovableHandle``, other
    handles, anything with ``remove()``), the last added first, then runs ``on_remove``.
    ``remove()`` is idempotent and removes every one even when one fails (the first failure is
    raised after): the package's one "undo all" loop. The handle is a context manager
    (``with probe.attach(): ...``). ``state`` is the object the hooks write into (a
    :class:`~diffusion_debug.probes.Probe`, a :class:`~diffusion_debug.probes.BackwardOrder`),
    ``None`` when they write nowhere."""

    def __init__(
        self,
        handles: Iterable[Any] = (),
        on_remove: Callable[[], None] | None = None,
        state: Any = None,
        *,
        holds: bool = False,
    ):
        self._handles = list(handles)
        self._on_remove = on_remove
        self.state = state
        self._release = weakref.finalize(self, copies.release) if holds else None
        """Its hold on :mod:`.copies`' patch (:func:`register_all`'s hooks: left out of copies), let go once:
        by :meth:`remove`, or when the handle is collected unremoved (a debugger dropped unclosed)."""

    @property
    def attached(self) -> bool:
        return bool(self._handles) or self._on_remove is not None

    def remove(self) -> None:
        handles, self._handles = self._handles, []
        on_remove, self._on_remove = self._on_remove, None
        failure: BaseException | None = None
        for handle in reversed(handles):
            try:
                handle.remove()
            except BaseException as error:  # undo the rest first, even on an interrupt
                failure = failure or error
        release, self._release = self._release, None
        if release is not None:
            release()  # copies.release(), once: the finalizer is dead after
        if on_remove is not None:
            on_remove()
        if failure is not None:
            raise failure

    def __enter__(self) -> "ProbeHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def register_all(
    register: Callable[[], Iterable[Any]], *, on_remove: Callable[[], None] | None = None, state: Any = None
) -> ProbeHandle:
    """A :class:`ProbeHandle` over the handles ``register()`` yields; if it fails half-way, what
    it had already added is removed before the error goes on."""
    added: list[Any] = []
    kept = False
    try:
        for handle in register():
            added.append(handle)
            if isinstance(handle, RemovableHandle):  # (not ours: ForwardHooks, ProbeHandle)
                kept = _keep_to_owner(handle) or kept
    except BaseException:
        ProbeHandle(added).remove()
        raise
    holds = kept and not HELD[0]  # (as ForwardHooks': another's hold covers these hooks)
    if holds:
        copies.hold()
    return ProbeHandle(added, on_remove=on_remove, state=state, holds=holds)


class ForwardHooks:
    """Forward hooks (and pre-hooks) put straight into their modules' hook dicts, every one taken
    off by one :meth:`remove`: what ``register_forward_hook`` and ``register_forward_pre_hook`` do
    for each hook (a ``RemovableHandle`` with its weak references, built in Python), done in one
    loop for all of them. A 1-step pipeline call attaches and detaches a sentinel's hooks at every
    call, one per block (24 on the tiny SD pipeline in fp16), and each component's call-site hooks (a pre
    and a post hook, the OOM watch riding on the latter: 8 a call). Each hook is an
    :class:`OwnHook` (inert in a copy of its module), keyed by an id of torch's own counter, so it
    sits in the dict as a registered one would, after the hooks already there; ``with_kwargs``
    and ``always_call`` as torch's ``register_*`` take them (the former for both kinds, the latter
    for forward hooks). A module's pre-hook goes in before its hook, as two ``register_*`` calls
    in that order would.

    >>> import torch
    >>> from torch import nn
    >>> layers = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    >>> with ForwardHooks([(m, lambda *a: print("seen")) for m in layers]):
    ...     _ = layers(torch.ones(2))
    seen
    seen
    >>> [len(m._forward_hooks) for m in layers]
    [0, 0]
    """

    def __init__(
        self,
        hooks: Iterable[tuple[Any, Callable]],
        *,
        pre_hooks: Iterable[tuple[Any, Callable]] = (),
        with_kwargs: bool = False,
        always_call: bool = False,
    ):
        self._added: list[tuple[weakref.ref, int, tuple[str, ...]]] = []
        self._holds = False  # whether it holds the copies patch: taken once every hook is in
        pre_tables = ("_forward_pre_hooks",) + ("_forward_pre_hooks_with_kwargs",) * with_kwargs
        tables = ("_forward_hooks",) + ("_forward_hooks_with_kwargs",) * with_kwargs
        tables += ("_forward_hooks_always_called",) * always_call
        # one loop over C iterators: no Python frame a hook
        entries = itertools.chain(zip(pre_hooks, itertools.repeat(pre_tables)), zip(hooks, itertools.repeat(tables)))
        try:
            for (module, hook), names in entries:
                if module is None:  # gone (a caller's weak reference, read as it passes it)
                    continue
                key = RemovableHandle.next_id
                RemovableHandle.next_id += 1
                state = module.__dict__
                state[names[0]][key] = hook if isinstance(hook, OwnHook) else OwnHook(hook)
                for flag in names[1:]:
                    state[flag][key] = True
                self._added.append((weakref.ref(module), key, names))
        except BaseException:  # what was added goes before the error does
            self.remove()
            raise
        # only where nothing else holds the patch in (a debugger's hold covers its hooks: one dropped
        # unclosed, hooks left in, lets go with its finalizer); counted in place, no call at an attach
        if self._added and not HELD[0]:
            self._holds = True
            HELD[0] = 1
            copies.install()

    def remove(self) -> None:
        added, self._added = self._added, []
        if self._holds:  # (not on a failed __init__'s undo: it took no hold)
            self._holds = False
            HELD[0] -= 1
            if not HELD[0]:
                copies.uninstall()
        for ref, key, tables in added:
            module = ref()
            if module is None:
                continue
            state = module.__dict__
            for table in tables:
                hooks = state.get(table)
                if hooks is not None:
                    hooks.pop(key, None)

    def __enter__(self) -> "ForwardHooks":
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


class PausedHooks:
    """Forward hooks taken out of their modules' hook dicts for a while and put back in their place
    (:meth:`pause`, :meth:`resume`): a module left with no hook runs torch's fast path, where a hook
    that returned at once would still cost its dispatch (the ``inner`` closure, ``is_compiling``, the
    hook's call). A hook is taken out only where it is first or last among its module's forward hooks
    (nearly always its one hook; last beside the output-capturing hook transformers puts on each layer
    of a model asked for hidden states), so it goes back in its place and no order among hooks
    changes: put back, it goes before any hook added while it was out (they came after it), and after
    the hooks it was last behind, which stay where they are. Where each is its module's only hook
    (nearly always), pausing and resuming are C loops over the hooks (no Python frame a hook).

    >>> import torch
    >>> from torch import nn
    >>> layer = nn.Linear(2, 2)
    >>> hook = OwnHook(lambda *args: print("seen"))
    >>> with ForwardHooks([(layer, hook)]):
    ...     paused = PausedHooks([(layer, hook)])
    ...     paused.pause()
    ...     _ = layer(torch.ones(2))
    ...     paused.resume()
    ...     _ = layer(torch.ones(2))
    seen
    >>> len(layer._forward_hooks)
    0

    Limits: a hook some code adds with ``prepend=True`` while these are out goes after them when
    they are put back; one between two other hooks stays in. :meth:`remove` forgets the hooks without
    putting any back: the handle that added them removes what is in, and nothing comes back after it
    (the owner removes both together)."""

    def __init__(self, pairs: Iterable[tuple[Any, Callable]]):
        tables: list[OrderedDict] = []
        keys: list[int] = []
        hooks: list[Callable] = []
        for module, hook in pairs:  # each hook's dict and key, found once
            table = getattr(module, "__dict__", {}).get("_forward_hooks")
            if type(table) is not OrderedDict:  # (torch's; gone: None)
                continue
            for key, value in table.items():
                if value is hook:
                    tables.append(table)
                    keys.append(key)
                    hooks.append(hook)
                    break
        self._tables, self._keys, self._hooks = tables, keys, hooks
        self._out: list[int] | None = None
        """The positions of the hooks taken out (None: none is)."""
        self.paused = False
        """Whether :meth:`pause` took them out (an attribute: a caller reads it at every step)."""

    def pause(self) -> None:
        """Take out each hook that is first or last among its module's forward hooks (nearly always its only one)."""
        if self._out is not None:
            return
        self.paused = True
        tables, keys, hooks = self._tables, self._keys, self._hooks
        if set(map(len, tables)) == _ONE and all(map(is_, map(OrderedDict.get, tables, keys), hooks)):
            deque(map(OrderedDict.pop, tables, keys), 0)
            self._out = _ALL
            return
        out = []
        for i, (table, key, hook) in enumerate(zip(tables, keys, hooks)):
            if table.get(key) is not hook:
                continue
            if len(table) == 1 or next(iter(table)) == key:
                before = None  # put back first
            elif next(reversed(table)) == key:
                before = frozenset(table)  # put back after these (transformers' output-capturing hook)
            else:
                continue  # between two others: its place could not be kept
            del table[key]
            out.append((i, before))
        self._out = out

    def resume(self) -> None:
        """Put back what :meth:`pause` took out, each in its place, before the hooks added to its module since."""
        out, self._out, self.paused = self._out, None, False
        if out is None:
            return
        tables, keys, hooks = self._tables, self._keys, self._hooks
        if out is _ALL:
            deque(map(OrderedDict.__setitem__, tables, keys, hooks), 0)
            if set(map(len, tables)) - _ONE:  # hooks added while they were out: after them, as they came
                for table, key in zip(tables, keys):
                    if len(table) > 1:
                        table.move_to_end(key, last=False)
            return
        for i, before in reversed(out):  # the undo of pause's order: two of ours on one module keep theirs
            table, key = tables[i], keys[i]
            table[key] = hooks[i]
            if len(table) == 1:
                continue
            if before is None:
                table.move_to_end(key, last=False)
            else:  # right after the last hook it was last behind; those after that one (added while it
                # was out, as they came) after it; one prepended meanwhile stays before them all
                order = list(table)
                behind = max((j for j, other in enumerate(order) if other in before and other != key), default=-1)
                for added in order[behind + 1 : -1]:
                    table.move_to_end(added)

    def remove(self) -> None:
        self._tables, self._keys, self._hooks, self._out, self.paused = [], [], [], None, False


_ONE = {1}
_ALL: list[int] = []
""":attr:`PausedHooks._out` when every hook was taken out (compared by identity)."""


class OwnHook(functools.partial):
    """A hook as :func:`register_all` leaves it in a torch hook dict: called as the function it
    holds (``partial``: no Python frame added); copied or pickled with its module, an inert
    :class:`CopiedHook`."""

    __slots__ = ()

    def __getattr__(self, name: str) -> Any:  # __name__, __qualname__, __wrapped__: the hook's own
        return getattr(self.func, name)

    def __deepcopy__(self, memo: dict) -> "CopiedHook":
        return CopiedHook()

    def __reduce__(self) -> tuple:
        return CopiedHook, ()


copies.OWN_HOOKS.append(OwnHook)


class CopiedHook:
    """What a copy of a watched module holds in place of a hook: it returns None (the call goes on
    as without it) and takes itself off the module (or tensor) it is called on."""

    def __call__(self, owner: Any = None, *args: Any, **kwargs: Any) -> None:
        state = getattr(owner, "__dict__", None)
        if not isinstance(state, dict):  # a tensor hook called with its gradient: nothing to find
            return None
        for name in HOOK_DICTS:
            hooks = state.get(name)
            if not isinstance(hooks, dict):
                continue
            for key in [key for key, value in hooks.items() if value is self]:
                del hooks[key]
                for extra in HOOK_FLAGS:  # ids are unique across every hook dict
                    flags = state.get(extra)
                    if isinstance(flags, dict):
                        flags.pop(key, None)
        return None


def _keep_to_owner(handle: Any) -> bool:
    """Put the hook ``handle`` added in an :class:`OwnHook` (same place in its dict); whether it is one."""
    if not isinstance(handle, RemovableHandle):
        return False
    hooks = handle.hooks_dict_ref()
    if isinstance(hooks, dict):
        hook = hooks.get(handle.id)
        if hook is not None and not isinstance(hook, OwnHook):
            hooks[handle.id] = OwnHook(hook)
        return hook is not None
    return False
