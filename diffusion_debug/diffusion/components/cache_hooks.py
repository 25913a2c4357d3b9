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

A call's state (:func:`hook_state`) never holds a container, only its id and contents (a
:class:`_Box`), and holds its tensors up to :data:`KEPT_BYTES` a step, the rest by weak reference:
a cache tensor the call replaces is freed as in the plain run, not kept on the device until the
step's end (PyramidAttentionBroadcast on Flux.1-dev at 1024x1024: ~1.6 GB; the peak is inside the
call, and a call's readings are known clean only as the step is read, so nothing earlier could
let them go). The replay finds None in a freed tensor's place (a dict's entry left out): every
diffusers hook but FasterCache replaced only what it computed again in that call, and a None
cache makes it compute again (exact). FasterCache's blocks keep ``[older, newer]`` attention outputs
and a call that approximates one reads both and drops the older: the replay gets the call's own
output back instead, from the hooks' state now (``[newer, this call's]``: its cache becomes
``[this call's, this call's]``, and ``X + (X - X) * w`` is ``X``), when the state now is the call's
(no later call of the component in the step, seen by the identity of ``newer``); otherwise such a
replay fails, saying so (its anomaly is named at the block). Its denoiser hook's frequency deltas,
replaced at every call and read by a call that skips the unconditional batch, are the first tensors
the budget holds (the hook is on the component itself, met first); beyond it (two deltas of a video's
latents over 64 MiB) such a replay fails too, saying so.

A guider that places hooks on the denoiser's layers for one batch of a step (PAG, SkipLayerGuidance,
SmoothedEnergyGuidance, AutoGuidance: ``prepare_models`` before the call, ``cleanup_models`` after it)
has taken them off again by the step's end, when a replay runs: :func:`hook_placement` keeps which
hooks each registry held as the call began, and :func:`placement_kept` puts them back for the replay
(and takes them off again after it), so the replay runs the call the guider made; ``report.why()``
does so too with the placement of the bundled call, and a bundle names those hooks
(:func:`placed_for_the_call`) so that a replay from it alone says why it runs without them.

A state kept beyond its step (the bundled call's as it began, the caches a raised call left: ``report.why()``
replays from them) is held apart from its module (:func:`held_apart`, :class:`HeldStates`): the hooks, their
``fn_ref`` (the module's bound forward), their callbacks and the module itself by weak reference, so that a
component the user replaces or deletes after the run is collected, its kept state with it, while the
debugger lives; nothing of ours is put on the module or its hooks (``torch.save(model)`` pickles them).

Limits: a hook that changed a cached tensor in place during the replay would keep that change
(no diffusers hook does so today); containers inside other objects than the state objects
(a tuple's list, an attribute of a value) are not followed; a box's container is found again by
its id among those the hooks hold at the replay: one freed since whose id a new one took is refilled
in its place for the replay (seen differently only by a holder not followed). Cost a call under a caching hook: its
hooks' attributes and containers copied one level deep, no tensor copied; the hooks are found once
an attach (:class:`FoundHooks`, checked at each call by their registries' hook counts).

Long because a hook's state is one thing from its saving to its putting back: what a call's state holds
(by value, by weak reference, boxed), how it is put back into the live hooks and containers, and how it is
held beyond its step are each other's halves; a guider's placement (its last hundred lines) is the same
save-and-put-back for the hooks themselves and could become a module of its own.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import weakref
from typing import Any, Callable, Iterator

import torch
from torch import nn


def _registry(module: nn.Module) -> Any:
    return vars(module).get("_diffusers_hook")  # never getattr: nn.Module would look in its buffers


def stateful_hooks(module: nn.Module) -> list[Any]:
    """The stateful diffusers hooks on ``module`` and its submodules, in module order."""
    return FoundHooks(module).hooks


def _state_managers(hook: Any) -> list[Any]:
    return [value for value in vars(hook).values() if hasattr(value, "_state_cache") and hasattr(value, "_context")]


def cache_context(module: nn.Module) -> Any:
    """The cache context set on ``module``'s stateful hooks right now (None outside one)."""
    return _context(stateful_hooks(module))


def _context(hooks: list[Any]) -> Any:
    return next((m._context for h in hooks for m in _state_managers(h) if m._context is not None), None)


def state_objects(hook: Any) -> list[Any]:
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

KEPT_BYTES = 64 << 20
"""The bytes of cache tensors a call's saved state holds (per step, all calls together): beyond them a
tensor is saved by weak reference, so one the call replaces is freed as in the plain run (a replay then
finds None in its place: :func:`hook_state_kept`). PyramidAttentionBroadcast on Flux.1-dev at 1024x1024
would otherwise hold ~1.6 GB (57 attention outputs) on the device until the step's end."""


class FoundHooks:
    """A module's stateful hooks as found by one walk of its modules (:func:`found_hooks`), with what
    tells cheaply whether they still are: every diffusers hook registry met, with its hook count then."""

    __slots__ = ("module", "hooks", "registries", "placed")

    def __init__(self, module: nn.Module):
        self.module, self.hooks, self.registries, self.placed = module, [], [], []
        for sub in module.modules():
            registry = _registry(sub)
            if registry is not None:
                self.registries.append((registry.hooks, len(registry.hooks)))
                for name, hook in registry.hooks.items():
                    if getattr(hook, "_is_stateful", False):
                        self.hooks.append(hook)
                        self.placed.append((registry.hooks, name, hook))

    def still(self, module: nn.Module) -> bool:
        """Whether the hooks are still those on ``module``: a hook added to or removed from a registry
        met, or one put in another's place, is seen (a registry made since on a module that had none
        is seen at the next attach, which finds the hooks again)."""
        if module is not self.module:
            return False
        for hooks, count in self.registries:
            if len(hooks) != count:
                return False
        for hooks, name, hook in self.placed:
            if hooks.get(name) is not hook:
                return False
        return True


def found_hooks(module: nn.Module, found: FoundHooks | None = None) -> FoundHooks:
    """``found`` while it still holds ``module``'s stateful hooks, else a new walk of its modules."""
    return found if found is not None and found.still(module) else FoundHooks(module)


class HeldStates:
    """Saved hook states (:func:`hook_state`, :func:`reset_as_a_call_ends`) by the module whose hooks they
    are, each held while that module lives: a module is held by weak reference and its state
    (:func:`held_apart`: nothing in it reaches the module) is let go with it, so that a debugger that
    keeps a bundled or raised call's state for ``report.why()`` never keeps a component alive the user let go
    of (``pipe.transformer = other``). Nothing of ours goes on the module (``torch.save(model)`` pickles its
    ``__dict__``).

    >>> held, module = HeldStates(), nn.Linear(1, 1)
    >>> held[module] = "its state"
    >>> held.get(module), len(held)
    ('its state', 1)
    >>> del module
    >>> len(held), bool(held)
    (0, False)
    """

    __slots__ = ("_held", "__weakref__")

    def __init__(self) -> None:
        self._held: dict[int, tuple[weakref.ref, Any]] = {}

    def __setitem__(self, module: nn.Module, state: Any) -> None:
        let_go = functools.partial(_let_go, weakref.ref(self), id(module))  # (no cycle: the holder weakly)
        self._held[id(module)] = (weakref.ref(module, let_go), state)

    def get(self, module: Any) -> Any:
        """The state held for ``module`` (None: none, or its module is another now)."""
        found = self._held.get(id(module))
        return found[1] if found is not None and found[0]() is module else None

    def __len__(self) -> int:
        return len(self._held)


def _let_go(holder: weakref.ref, key: int, gone: weakref.ref) -> None:
    """A held module collected: its state goes (while the holder lives and still holds it for that module)."""
    held = holder()
    if held is not None and (found := held._held.get(key)) is not None and found[0] is gone:
        del held._held[key]


def states_left(modules: list[nn.Module]) -> HeldStates:
    """The hooks' state of each of ``modules`` that :func:`reset_as_a_call_ends` resets, as a call ended by our
    policy ``raise`` left them (a modular pipeline's too, whose own end may reset them after), each held while
    its module lives (:class:`HeldStates`): ``why()`` replays that call from it (:func:`hook_state_kept` with
    ``state``), the live hooks keeping their state of now. Taken before the reset and apart from it: a save that
    fails never keeps the reset from running."""
    left = HeldStates()
    for module in modules:
        if hasattr(module, "_reset_stateful_cache") and (hooks := FoundHooks(module).hooks):  # (never made a registry)
            left[module] = held_apart(_saved(hooks, None, detached=True))  # every tensor held: the reset drops them
    return left


def reset_as_a_call_ends(pipe: Any, modules: list[nn.Module]) -> None:
    """Reset the stateful hooks of ``modules`` as a pipeline's call does as it ends (its
    ``maybe_free_model_hooks``: ``_reset_stateful_cache`` on every component that has it): for a call that
    our policy ``raise`` ends before its end, so that its next call starts from fresh caches, as it does
    after the unwatched call (a TaylorSeer's factors or a FirstBlockCache's residuals of the raised call
    would otherwise feed the next call its NaN). A ``ModularPipeline`` has no such end: Modular Diffusers'
    own call resets nothing (its caches go on from call to call, unwatched too), and a subclass that resets
    does so in its ``__call__``'s ``finally`` (Cosmos 3 omni's transformer), which our raise passes through:
    its hooks are left to that end here. A component without ``_reset_stateful_cache`` (a UNet: diffusers'
    CacheMixin is on transformers) keeps its hooks' state from call to call unwatched, and so here too; the
    model offload that end also redoes is left to the next call's own offload hooks, as after any exception.
    What the call left, for ``why()``: :func:`states_left`, taken before."""
    if not hasattr(pipe, "maybe_free_model_hooks"):
        return
    for module in modules:
        if hasattr(module, "_reset_stateful_cache") and FoundHooks(module).hooks:
            for sub in module.modules():  # (diffusers' reset: every registry's, and below)
                if (registry := _registry(sub)) is not None:
                    registry.reset_stateful_hooks(recurse=False)


def hook_state(
    module: nn.Module, found: FoundHooks | None = None, budget: list[int] | None = None
) -> tuple[Any, HookState | None]:
    """``(cache context, state)`` of ``module``'s stateful diffusers hooks right now: taken as a
    watched call begins, so that its replay starts from the state the call started from (a
    PyramidAttentionBroadcast counter, a FirstBlockCache residual, TaylorSeer's factors), not the one
    the call left. ``(None, None)`` for a module without such hooks. ``found``: its hooks as last found
    (:func:`found_hooks`; else one walk of its modules). ``budget``: ``[bytes]`` of tensors still to hold
    (taken from); the rest are held by weak reference (None: all held)."""
    hooks = (found if found is not None else FoundHooks(module)).hooks
    if not hooks:
        return None, None
    context = _context(hooks)
    return context, _saved(hooks, budget, detached=True)


class _Weak:
    """A tensor of a saved state held by weak reference, with its storage's bytes."""

    __slots__ = ("ref", "nbytes")

    def __init__(self, tensor: Any, nbytes: int):
        self.ref, self.nbytes = weakref.ref(tensor), nbytes


class _WeakTuple(tuple):
    """A tuple of a saved state with some of its items held by weak reference (:class:`_Weak`,
    :class:`_WeakObject`)."""


class _WeakObject:
    """What a state kept beyond its step holds by weak reference besides tensors: what may reach the hooked
    module (a hook, its ``fn_ref``, a bound method, a callback, a module), alive through the live hooks while
    the module lives (:func:`held_apart`)."""

    __slots__ = ("ref",)

    def __init__(self, value: Any):
        self.ref = weakref.ref(value)


def _weakly(value: Any, weak: set[int]) -> bool:
    """Whether a state kept beyond its step holds ``value`` by weak reference: one of the hooks' own objects
    (``weak``: their ids), a module, or a callable that is not a class (a bound method holds its module, a
    closure what it names: a pipeline's ``current_timestep``)."""
    return id(value) in weak or isinstance(value, nn.Module) or (callable(value) and not isinstance(value, type))


def _held(value: Any) -> Any:
    """``value`` by weak reference (a :class:`_WeakObject`), or as it is where it takes none."""
    try:
        return _WeakObject(value)
    except TypeError:
        return value


class _Box:
    """A container (dict, list, set, deque) of a saved state: its id then and its contents as saved,
    never the container itself (one the call replaced would keep every tensor in it alive)."""

    __slots__ = ("id", "kind", "make", "contents")

    def __init__(self, container: Any):
        self.id, self.kind, self.contents = id(container), type(container), None
        self.make = self.kind if self.kind in (dict, list, set) else _emptied(container)


def _emptied(container: Any) -> Callable[[], Any]:
    """Makes an empty ``container`` as it was made (a deque's ``maxlen``, a defaultdict's factory); the
    container itself where it cannot be copied and emptied (then kept alive by the saved state)."""
    try:
        empty = copy.copy(container)
        empty.clear()
    except Exception:
        return lambda: container
    return lambda: copy.copy(empty)


_GONE = object()
_DEAD = object()  # a weakly held object collected since: the live value stays in its place


def _detach(value: Any, budget: list[int] | None, boxes: dict[int, _Box]) -> Any:
    """``value`` as a call's saved state holds it: a tensor (or a tuple's) beyond ``budget`` by weak
    reference, a container as a :class:`_Box` (``boxes``: by id, so a shared one is one box)."""
    if isinstance(value, torch.Tensor):
        if budget is None:
            return value
        nbytes = value.untyped_storage().nbytes()
        if nbytes <= budget[0]:
            budget[0] -= nbytes
            return value
        return _Weak(value, nbytes)
    if type(value) is tuple and any(isinstance(v, torch.Tensor) for v in value):
        held = tuple(_detach(v, budget, boxes) for v in value)
        return _WeakTuple(held) if any(type(v) is _Weak for v in held) else value
    if isinstance(value, _CONTAINERS):
        box = boxes.get(id(value))
        if box is None:
            box = boxes[id(value)] = _Box(value)
            if isinstance(value, dict):
                box.contents = [(k, _detach(v, budget, boxes)) for k, v in value.items()]
            else:
                box.contents = list(value) if isinstance(value, set) else [_detach(v, budget, boxes) for v in value]
        return box
    return value


def held_apart(state: HookState) -> HookState:
    """A call's saved state (:func:`hook_state`'s, or :func:`_saved` ``detached``) as one kept beyond its step
    holds it (a bundled or raised call's, for ``why()``: :class:`HeldStates`): every object that may reach the
    hooked module by weak reference: the hooks and their state objects but the per-context states a manager
    may drop (alive through the module's hook registries while it lives), and the callables and modules among
    their attributes (:func:`_weakly`: a hook's ``fn_ref`` holds the module's bound forward). The state then
    never keeps the module alive, and once the module is gone putting it back is a no-op (:func:`_restore`).
    Made once, as the state is kept (a call's own, dropped as its step ends, holds them as they are)."""
    saved, caches, containers = state
    weak = {id(obj) for obj, _ in saved}.difference(id(s) for _, cache in caches for s in cache.values())
    boxes: dict[int, _Box] = {}
    return (
        [
            (_held(obj) if id(obj) in weak else obj, {k: _weakened(v, weak, boxes) for k, v in attributes.items()})
            for obj, attributes in saved
        ],
        [(_held(manager), cache) for manager, cache in caches],
        containers,
    )


def _weakened(value: Any, weak: set[int], boxes: dict[int, _Box]) -> Any:
    """A saved value with what may reach the module in it held by weak reference (:func:`held_apart`); a box
    is copied (``boxes``: by id, so a shared one is one box), the call's own left as it is."""
    kind = type(value)
    if kind is _Box:
        box = boxes.get(id(value))
        if box is None:
            box = boxes[id(value)] = _Box.__new__(_Box)
            box.id, box.kind, box.make = value.id, value.kind, value.make
            if issubclass(value.kind, set):
                box.contents = value.contents
            elif issubclass(value.kind, dict):
                box.contents = [(k, _weakened(v, weak, boxes)) for k, v in value.contents]
            else:
                box.contents = [_weakened(v, weak, boxes) for v in value.contents]
        return box
    if kind is _Weak or isinstance(value, torch.Tensor):
        return value
    if kind is _WeakTuple or (kind is tuple and any(_weakly(v, weak) for v in value)):
        return _WeakTuple(_weakened(v, weak, boxes) for v in value)
    return _held(value) if _weakly(value, weak) else value


def _attach(value: Any, live: dict[int, Any], made: dict[int, Any], released: list[int]) -> Any:
    """A saved value as it was (:func:`_detach`), or :data:`_GONE` for a tensor freed since (its bytes
    added to ``released``), :data:`_DEAD` for another object collected since. A box's container is the live
    one of its id (``live``: every container the hooks hold now), refilled, or a new one where the call
    replaced it (``made``: per box)."""
    kind = type(value)
    if kind is _Weak:
        tensor = value.ref()
        if tensor is None:
            released[0] += value.nbytes
            return _GONE
        return tensor
    if kind is _WeakObject:
        held = value.ref()
        return _DEAD if held is None else held
    if kind is _WeakTuple:
        items = [_attach(v, live, made, released) for v in value]
        if any(v is _DEAD for v in items):
            return _DEAD
        return _GONE if any(v is _GONE for v in items) else tuple(items)
    if kind is not _Box:
        return value
    container = made.get(id(value))
    if container is not None:
        return container
    container = live.get(value.id)
    if container is None or type(container) is not value.kind:
        container = value.make()
    made[id(value)] = container
    container.clear()
    if isinstance(container, dict):
        for key, item in value.contents:
            item = _attach(item, live, made, released)
            if item is not _GONE and item is not _DEAD:  # a freed tensor's entry left out (TaylorSeer: no
                container[key] = item  # factor of that order)
    elif isinstance(container, set):
        container.update(value.contents)
    else:
        items = [_attach(item, live, made, released) for item in value.contents]
        container.extend(None if item is _GONE or item is _DEAD else item for item in items)
    return container


def _saved(hooks: list[Any], budget: list[int] | None = None, detached: bool = False) -> HookState:
    """The hooks' state: each state object's attributes, each state manager's per-context states, and
    (but ``detached``) every container reachable from the attributes with a shallow copy of its
    contents. ``detached`` (a call's state, kept for the step): containers as :class:`_Box`, tensors
    beyond ``budget`` by weak reference, so that nothing the call replaces stays alive through it (kept
    beyond the step: :func:`held_apart`)."""
    objects = [obj for hook in hooks for obj in state_objects(hook)]
    caches = [(m, dict(m._state_cache)) for hook in hooks for m in _state_managers(hook)]
    if detached:
        boxes: dict[int, _Box] = {}
        saved = [(obj, {k: _detach(v, budget, boxes) for k, v in vars(obj).items()}) for obj in objects]
        return saved, caches, None
    saved = [(obj, dict(vars(obj))) for obj in objects]
    containers: dict[int, tuple[Any, Any]] = {}
    for _, attributes in saved:
        for value in attributes.values():
            _containers(value, containers)
    return saved, caches, list(containers.values())


def lost_values(state: HookState | None) -> int:
    """How many objects of a state kept beyond its step (:func:`held_apart`) can no longer be put back: held
    by weak reference (they may reach the module) and collected since, the hooks holding others in their place
    (a stateful hook that replaces its state object or a callable at each call: :func:`_restore` leaves the
    live one). A hook gone with its module counts none (nothing is put back on it). 0 for None."""
    if state is None:
        return 0
    saved, caches, _ = state
    lost = sum(type(manager) is _WeakObject and manager.ref() is None for manager, _ in caches)
    for obj, attributes in saved:
        if type(obj) is _WeakObject and obj.ref() is None:
            continue
        lost += sum(_dead(value) for value in attributes.values())
    return lost


def _dead(value: Any) -> int:
    """The weakly held objects (not tensors) in a held value that were collected since."""
    kind = type(value)
    if kind is _WeakObject:
        return value.ref() is None
    if kind is _WeakTuple:
        return sum(_dead(v) for v in value)
    if kind is _Box and not issubclass(value.kind, set):
        items = (v for _, v in value.contents) if issubclass(value.kind, dict) else value.contents
        return sum(_dead(v) for v in items)
    return 0


def _restore(state: HookState, live: dict[int, Any] | None = None) -> int:
    """Puts ``state`` back; returns the bytes of its weakly held tensors freed since (None in their
    place; a dict's entry left out). ``live``: the containers the hooks hold now, by id (a detached state's)."""
    saved, caches, containers = state
    released, made = [0], {}
    for manager, cache in caches:
        if type(manager) is _WeakObject and (manager := manager.ref()) is None:
            continue  # its module is gone (a detached state's)
        manager._state_cache.clear()
        manager._state_cache.update(cache)
    for obj, attributes in saved:
        if type(obj) is _WeakObject and (obj := obj.ref()) is None:
            continue
        if containers is None:
            now = dict(vars(obj))
            vars(obj).clear()
            for name, value in attributes.items():
                value = _attach(value, live or {}, made, released)
                if value is _DEAD:  # (collected since: the live hooks hold another in its place)
                    if name in now:
                        vars(obj)[name] = now[name]
                else:
                    vars(obj)[name] = None if value is _GONE else value
        else:
            vars(obj).clear()
            vars(obj).update(attributes)
    for container, contents in containers or ():
        _put_back(container, contents)
    return released[0]


@contextlib.contextmanager
def hook_state_kept(module: nn.Module, context: Any = None, state: HookState | None = None) -> Iterator[int]:
    """Within the block, ``module``'s stateful diffusers hooks see ``context`` (the cache context
    of the call being replayed, when it had one) and ``state`` (what :func:`hook_state` saved as that
    call began, when given); afterwards every hook's state, context and per-context caches are
    exactly as before. Nothing happens for a module without such hooks. Yields the bytes of the
    state's tensors that were freed since (held beyond :data:`KEPT_BYTES`, replaced by the call): the
    replay finds None in their place, which makes every diffusers hook but FasterCache compute what
    the call computed (a cache replaced is one the call did not read); a FasterCache block that read
    its freed older output gets the call's own output back (:func:`_faster_cache_rebuilt`) where the
    hooks' state is still the call's; 0 when all were there."""
    hooks = stateful_hooks(module)
    if not hooks:
        yield 0
        return
    now = _saved(hooks)
    try:
        released = 0
        if state is not None:
            latest = _faster_cache_now(hooks)  # before the restore refills the live lists
            released = _restore(state, {id(c): c for c, _ in now[2]})
            if released:
                _faster_cache_rebuilt(latest)
        if context is not None:
            for hook in hooks:
                for manager in _state_managers(hook):
                    manager.set_context(context)
        yield released
    finally:
        _restore(now)


def hook_registries(module: nn.Module) -> list[Any]:
    """Every diffusers hook registry on ``module`` and its submodules (one walk of its modules)."""
    return [registry for sub in module.modules() if (registry := _registry(sub)) is not None]


Placement = tuple
"""Per hook registry, the hooks it held (``(name, hook)`` in order) as a call began (:func:`hook_placement`)."""


def hook_placement(registries: list[Any]) -> Placement:
    """Which hooks each of ``registries`` holds now, in their order (no hook's state: :func:`hook_state`'s)."""
    return tuple((registry, tuple(registry.hooks.items())) for registry in registries)


@contextlib.contextmanager
def placement_kept(placement: Placement) -> Iterator[None]:
    """Within the block, each registry of ``placement`` holds the hooks it held then (a guider's layer
    hooks put back, a hook placed since taken off), through the registry's own ``register_hook`` and
    ``remove_hook``; afterwards it holds those it holds now, in their order. Only the hooks after the
    first difference move: a registry unchanged since is not touched. Putting them back is exception-safe:
    a hook that fails to come off (or on) leaves every other registry's and hook's move undone all the same
    (a guider's hook left on would change every later call), then the first failure is raised."""
    moved = []
    try:
        for registry, then in placement:
            now = tuple(registry.hooks.items())
            same = 0
            while same < min(len(now), len(then)) and now[same] == then[same]:
                same += 1
            if same == len(now) == len(then):
                continue
            moved.append((registry, now[same:], then[same:]))
            _swap_hooks(registry, now[same:], then[same:])
        yield
    finally:
        failed = None
        for registry, now, then in reversed(moved):
            try:
                _swap_hooks(registry, then, now)
            except Exception as error:  # (the first one raised once every registry is back)
                failed = failed or error
        if failed is not None:
            raise failed


def placed_for_the_call(placement: Placement, component: nn.Module) -> dict[str, list[str]]:
    """Per module of ``component`` (its qualified name), the hooks of ``placement`` its registry no
    longer holds: a guider's layer hooks, placed for that call only. These are what a repro bundle
    names (it cannot hold the hooks themselves)."""
    names = {id(module): name for name, module in component.named_modules()}
    placed = {}
    for registry, then in placement:
        gone = [name for name, _ in then if name not in registry.hooks]
        if gone and id(registry._module_ref) in names:
            placed[names[id(registry._module_ref)]] = gone
    return placed


def _swap_hooks(registry: Any, off: tuple, on: tuple) -> None:
    """``off``'s hooks taken off ``registry`` and ``on``'s placed, each tried whatever failed before it (the
    first failure raised after)."""
    failed = None
    for name, _ in reversed(off):  # the last placed wraps the others: taken off first
        try:
            registry.remove_hook(name, recurse=False)
        except Exception as error:
            failed = failed or error
    for name, hook in on:
        try:
            if name not in registry.hooks:
                registry.register_hook(hook, name)
        except Exception as error:
            failed = failed or error
    if failed is not None:
        raise failed


def _faster_cache_now(hooks: list[Any]) -> list[tuple[Any, list]]:
    """Each FasterCache block hook's state with its ``[older, newer]`` cache as the hooks hold it now."""
    try:
        from diffusers.hooks.faster_cache import FasterCacheBlockHook
    except ImportError:  # diffusers before 0.33: no FasterCache
        return []
    states = [vars(hook).get("state") for hook in hooks if isinstance(hook, FasterCacheBlockHook)]
    return [(state, list(state.cache)) for state in states if _pair(vars(state).get("cache"))]


def _faster_cache_rebuilt(now: list[tuple[Any, list]]) -> None:
    """For the replay, each restored FasterCache cache whose older output was freed (None) and whose
    newer one the hooks now hold as their older (the call being replayed moved it there, and no call
    came after it) becomes ``[X, X]``, ``X`` the call's own output (:func:`hook_state_kept`)."""
    for state, (older, latest) in now:
        cache = vars(state).get("cache")
        if _pair(cache) and cache[0] is None and _same(cache[1], older):
            cache[:] = [latest, latest]


def _pair(cache: Any) -> bool:
    return type(cache) is list and len(cache) == 2


def _same(saved: Any, live: Any) -> bool:
    """Whether a restored cache entry is the live one (a restored tuple is a new tuple of the same tensors)."""
    if type(saved) is tuple and type(live) is tuple:
        return len(saved) == len(live) and all(a is b for a, b in zip(saved, live))
    return saved is not None and saved is live


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
