"""What attach needs of a component's module tree, worked out once and reused while the tree is the same.

Each attach lists the modules to probe and to watch for OOM, whether a component is compiled or
runs diffusers' caching hooks, and the dtype of its parameters; each of those walks every module,
and a 1-step pipeline pays them on every call. :class:`TreeMemo` walks each component once per
attach, cheaply (no generators, no names), into a key: every module with its children's names,
its parameters, its in-place compiled call and its diffusers hook registry. What was computed
from a component is reused while its key is the same; any change (a LoRA loaded, a module
replaced or deleted, ``module.compile()``, ``vae.decode = torch.compile(vae.decode)``, a cache hook
enabled, a parameter replaced) gives another key and everything of that component is computed
again. Between two walks the attach reads only the version tags of the tree's dicts
(:mod:`.tree_tags`, one C loop a component): a tree none of whose dicts was written since its last
walk is not walked again. A dtype change in place
(``pipe.to(torch.float16)`` keeps the parameter objects) changes the parameters' dtypes, read
at every attach.

>>> import torch
>>> memo = TreeMemo()
>>> net = torch.nn.Sequential(torch.nn.Linear(2, 2))
>>> memo.refresh([net])  # a tree it had not seen
True
>>> calls = []
>>> count = lambda: calls.append(1) or len(calls)
>>> memo.get(net, "n", count), memo.get(net, "n", count)
(1, 1)
>>> net.append(torch.nn.Linear(2, 2))
Sequential(...)
>>> memo.refresh([net]), memo.get(net, "n", count)
(True, 2)

A pipeline's memo is shared by every debugger of it (:func:`shared_memo`): a debugger made for
each call (``with DiffusionModelDebugger(pipe, config): pipe(...)``) finds what an earlier one
worked out, checked by the same walk, rather than listing every module again.

Limits: a module's own attributes other than these (a flag a forward reads) are not in the key:
nothing memoised depends on them. A live memo holds what it was computed from (the modules of
each component it saw), and is held by its debuggers alone: a component replaced on the pipeline
(``pipe.unet = other``) while a debugger lives is let go at that debugger's next attach (or its
next call, attached) or with the debugger. Once no debugger holds it, the memo is parked with every
module, parameter and hook in it held weakly: what the user drops then goes at once. Parking
walks every module and parameter once (about 1.4 ms at SD1.5's topology, and as much to revive
it), paid by a debugger made per call, never by a reused one. A value of a type parking does not
know (neither plain, nor a list, tuple, set or dataclass of such, nor weakly referable) is left
out and worked out again.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from itertools import repeat
from operator import attrgetter, is_, itemgetter
from typing import Any, Callable, Iterable

import torch
from torch import nn

from ...stats.quantized import PLAIN_TYPES, computed_views
from . import tree_tags as tags_of
from .tree_tags import TreeTags, tags_after_walk, unchanged

_size = itemgetter(1)
_FIRST = itemgetter(0)
_DTYPE = attrgetter("dtype")


class TreeKey(tuple):
    """What :func:`tree_key` found of a tree, ``(modules, names, parameters, hooked)``, compared with
    ``==`` (:func:`same_tree`): the modules and parameter tensors by identity, in order (one C loop
    each: no id made per object), the child and parameter names per module, and the compiled calls
    and hook registries by identity. Holding it holds every object it names, so no compared object's
    memory is reused while it is kept. (A tuple: made with no Python call.)"""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TreeKey):
            return NotImplemented
        return same_tree(self, other)

    def __ne__(self, other: object) -> bool:
        if not isinstance(other, TreeKey):
            return NotImplemented
        return not same_tree(self, other)

    __hash__ = None  # type: ignore[assignment]


def same_tree(a: TreeKey, b: TreeKey) -> bool:
    """Whether two keys name the same tree."""
    return (
        len(a[0]) == len(b[0])
        and len(a[2]) == len(b[2])
        and len(a[3]) == len(b[3])
        and a[1] == b[1]
        and all(map(is_, a[0], b[0]))
        and all(map(is_, a[2], b[2]))
        and all(map(is_, a[3], b[3]))
    )


def tree_key(root: nn.Module) -> tuple[TreeKey, list[Any], list[torch.Tensor | None]]:
    """``(key, kept, parameters)``: ``key`` (a :class:`TreeKey`, compared with ``==``) says what the
    tree is made of, and holds every object in it; ``kept``: the modules, the root first;
    ``parameters`` are the tree's parameter tensors. This runs at every attach, over every module of
    every component, so it does the least per module: the modules are listed breadth first (the list
    being walked is the list extended), each one's child and parameter names go into one list with
    a separator after each module. The modules in order and the names per module give back the
    tree, so any change gives another key; the modules and parameters are compared by identity (an
    id made per object cost a fifth more). A module compiled in place or with a diffusers hook
    registry is told by its ``__dict__`` holding the name (``_compiled_call_impl`` is a class
    attribute until ``module.compile()`` sets it): two look-ups, no call, a module; a child
    registered as None (rare) sends the whole walk the long way (:func:`_walk_with_none`). A registry's
    ``__dict__``, made at its first read with a new tag, is made by the walk that finds it (its ``hooks`` read
    there), not by the tags' read after a later walk, which would take that tag for a write."""
    order: list[Any] = [root]
    names: list[Any] = []
    parameters: list[torch.Tensor | None] = []
    hooked: list[Any] = []  # compiled in place, or with a diffusers hook registry: the objects themselves
    add_names, end_module, add_children, add_parameters = names.extend, names.append, order.extend, parameters.extend
    try:
        for module in order:  # (no None test a module: None has no __dict__, the long way below)
            state = module.__dict__
            children, own = state["_modules"], state["_parameters"]
            if children:  # most modules are leaves
                add_names(children)
                add_children(children.values())
            if own:
                add_names(own)
                add_parameters(own.values())
            end_module(None)
            if "_diffusers_hook" in state or "_compiled_call_impl" in state:  # (inline: a cache hook's every block)
                compiled, registry = state.get("_compiled_call_impl"), state.get("_diffusers_hook")
                hooks = tuple(registry.__dict__["hooks"].values()) if registry is not None else ()
                hooked += (module, compiled, registry, *hooks, _END)
    except AttributeError:
        if not any(map(is_, order, repeat(None))):  # (not a child registered as None: an object that is no module)
            raise
        order, names, parameters, hooked = _walk_with_none(root)
    owners = (root,) if "_orig_mod" not in root._modules else (root, root._modules["_orig_mod"])
    for owner in owners:  # a torch.compile wrapper's original's too
        state = owner.__dict__
        for name in ROOT_METHODS:  # one the user compiled in place of the class's (vae.decode = torch.compile(...))
            if name in state:
                hooked += (owner, name, state[name], _END)
    return TreeKey((order, names, parameters, hooked)), order, parameters


def _walk_with_none(root: nn.Module) -> tuple[list[Any], list[Any], list[torch.Tensor | None], list[Any]]:
    """:func:`tree_key`'s walk of a tree with a child registered as None (compared as such):
    ``(order, names, parameters, hooked)``."""
    order: list[Any] = [root]
    names: list[Any] = []
    parameters: list[torch.Tensor | None] = []
    hooked: list[Any] = []
    for module in order:
        if module is None:
            continue
        state = module.__dict__
        children, own = state["_modules"], state["_parameters"]
        if children:
            names.extend(children)
            order.extend(children.values())
        if own:
            names.extend(own)
            parameters.extend(own.values())
        names.append(None)
        if "_diffusers_hook" in state or "_compiled_call_impl" in state:
            compiled, registry = state.get("_compiled_call_impl"), state.get("_diffusers_hook")
            hooks = tuple(registry.__dict__["hooks"].values()) if registry is not None else ()
            hooked += (module, compiled, registry, *hooks, _END)
    return order, names, parameters, hooked


ROOT_METHODS = ("decode", "encode", "forward")
"""The methods of a component a user may replace on the instance by their ``torch.compile``'d
selves (:func:`~.compiled.compiled_methods`): in the key, so that compiling one gives another."""


_END = object()
"""Closes one module's entry in a :class:`TreeKey`'s ``hooked`` (its last item)."""


class TreeMemo:
    """Values computed from components' module trees, per component, kept while its tree is unchanged."""

    def __init__(self) -> None:
        self._trees: dict[int, tuple[TreeKey, list[Any]]] = {}
        self._values: dict[int, dict[str, Any]] = {}
        self._tags: dict[int, TreeTags | None] = {}
        """Per root: the version tags of its tree's dicts read after its last walk (:mod:`.tree_tags`):
        while none was written, the attach does not walk it again."""
        self._backoff: dict[int, list[int]] = {}
        """Per root tagged before: when to build its tags again (:func:`.tree_tags.tags_after_walk`)."""
        self._refreshes = 0
        self._by_size: dict[int, tuple[list[tuple[torch.Tensor, int]], int, list[torch.Tensor]]] = {}
        """Per root: its parameters with their sizes, largest first, their total size, and the largest ones
        that held more than half of it in one dtype when :meth:`dtypes` last counted (empty until then)."""
        self.current: dict[int, dict[Any, Any]] = {}
        """Per root of the last :meth:`refresh` (by id; each held by the memo while it is here): the
        dict of values :meth:`get` fills. Read as ``memo.current.get(id(root), {})`` where a Python
        call per value counts (a reused debugger's attach, at every call of a 1-step pipeline): a
        root not seen gets a dict of its own, so its values are computed each time, as by ``get``."""
        self._parked_in: _Shared | None = None
        """Where this memo, a pipeline's (:func:`shared_memo`), is parked when no debugger holds it."""
        self.held_weakly: Callable[[], None] | None = None
        """Set while a detached debugger holds this memo's modules weakly (:mod:`.detached`): puts them
        back, run before the memo is read by another debugger or parked."""

    def refresh(self, roots: list[nn.Module]) -> bool:
        """Walk each root whose dicts were written since its last walk (at attach; every root the
        first time, and every time where no tags can be read): what was computed from a changed tree
        is forgotten, and so is every root not in ``roots`` (a component the pipeline no longer
        holds). Returns whether a root's tree changed (or is new)."""
        if self.held_weakly is not None:  # another debugger of the pipeline, detached, held them weakly
            self.held_weakly()
        trees, values = self._trees, self._values
        current: dict[int, dict[Any, Any]] = {}
        changed = False
        self._refreshes = refresh = self._refreshes + 1
        for root in roots:
            before = trees.get(id(root))
            tags = self._tags.get(id(root))
            if tags is not None and before[1][0] is root and unchanged(root, tags):  # no dict of it written
                current[id(root)] = values[id(root)]
                continue
            tagging = before is not None and id(root) in self._tags and tags_of.READ is not None
            start = tags_of.start_of_walk(self._backoff.get(id(root)), before[1], tags, refresh) if tagging else None
            key, kept, parameters = tree_key(root)
            old = before[0] if before is not None and before[1][0] is root else None
            same = (  # same_tree(old, key), inline (at every attach)
                old is not None
                and len(old[0]) == len(key[0])
                and len(old[2]) == len(key[2])
                and len(old[3]) == len(key[3])
                and old[1] == key[1]
                and all(map(is_, old[0], key[0]))
                and all(map(is_, old[2], key[2]))
                and all(map(is_, old[3], key[3]))
            )
            if not same:
                changed = True
                trees[id(root)] = (key, kept)
                values[id(root)] = {}
                self._by_size[id(root)] = _by_size(parameters, kept)
            # tagged after a walk that found what this memo's last walk had (read now: the next attach's test);
            # not after a first walk (a debugger made per call, whose memo is revived at each: never read) nor a
            # change (a tree changed at every call, by an offload's new parameters: its walk alone, as before);
            # backed off where they keep failing at their first read, the tree the same (set_adapters at each call)
            backoff = self._backoff.setdefault(id(root), [0, 0, 0]) if tagging else None
            self._tags[id(root)] = tags_after_walk(backoff, kept, same, tags, start, refresh) if backoff else None
            current[id(root)] = values[id(root)]
        self.current = current
        if len(trees) != len(current):  # a root not in ``roots`` (a reused debugger's attach: none)
            self.keep_only(roots)
        return changed

    def get(self, root: nn.Module, name: Any, compute: Callable[[], Any]) -> Any:
        """``compute()``'s value for ``root``, computed once while its tree is unchanged
        (always computed for a root :meth:`refresh` has not seen)."""
        values = self._values.get(id(root))
        if values is None or self._trees[id(root)][1][0] is not root:
            return compute()
        if name not in values:
            values[name] = compute()
        return values[name]

    def dtype(self, root: nn.Module) -> torch.dtype | None:
        """The dtype most of ``root``'s floating parameters (by size) have now, as
        :func:`~.inventory.module_dtype` counts it, read from the largest parameters first and
        stopped once one dtype holds more than half of all of them: a few reads rather than one per
        parameter (an in-place conversion keeps the tree's key, so this is read at every attach). The
        parameters that held more than half last time are read first, in one C loop: where they
        share one floating dtype it holds more than half now too. ``None`` for a root
        :meth:`refresh` has not seen, or without floating parameters."""
        return self.dtypes((root,))[0]

    def dtypes(self, roots: Iterable[nn.Module]) -> list[torch.dtype | None]:
        """:meth:`dtype` of each of ``roots``, in one Python call (at every attach)."""
        found_all: list[torch.dtype | None] = []
        for root in roots:
            found = self._by_size.get(id(root))
            if found is None:
                found_all.append(None)
                continue
            sized, total, enough = found
            if enough:  # the largest parameters, more than half of all: one floating dtype among them is the answer
                seen = set(map(_DTYPE, enough))  # (one C loop: a reused debugger's every attach reads the same ones)
                if len(seen) == 1:
                    most = seen.pop()
                    if most.is_floating_point:
                        found_all.append(most)
                        continue
            counts: dict[torch.dtype, int] = {}
            most = None
            for index, (parameter, size) in enumerate(sized):
                if parameter.is_floating_point():
                    dtype = parameter.dtype
                    counts[dtype] = counts.get(dtype, 0) + size
                    if 2 * counts[dtype] > total:
                        most = dtype
                        enough[:] = map(_FIRST, sized[: index + 1])
                        break
            else:
                most = max(counts, key=counts.__getitem__) if counts else None
            found_all.append(most)
        return found_all

    def keep_only(self, roots: Iterable[nn.Module]) -> None:
        """Forget every root but ``roots``, and what was computed from them."""
        kept = {id(root) for root in roots}
        for key in [key for key in self._trees if key not in kept]:
            del self._trees[key], self._values[key], self._by_size[key]
            self._tags.pop(key, None), self._backoff.pop(key, None), self.current.pop(key, None)

    def forget(self, keys: Iterable[int]) -> None:
        """Forget the roots at ``keys`` (their ids) and what was computed from them, the others kept."""
        for key in keys:
            self._trees.pop(key, None), self._values.pop(key, None), self._by_size.pop(key, None)
            self._tags.pop(key, None), self._backoff.pop(key, None), self.current.pop(key, None)

    def __del__(self) -> None:
        # (not weakref.finalize: its registry, a global, would hold the modules, through their hooks an
        # attached debugger dropped, and its pipeline)
        entry = self._parked_in
        if entry is not None:
            try:
                if self.held_weakly is not None:
                    self.held_weakly()
                _park(entry, self._trees, self._values)
            except Exception:  # (at interpreter shutdown: nothing to keep)
                pass

    def clear(self) -> None:
        self._trees.clear(), self._values.clear(), self._by_size.clear(), self._tags.clear(), self._backoff.clear()
        self.current = {}


def _by_size(
    parameters: list[torch.Tensor | None], modules: list[Any] = ()
) -> tuple[list[tuple[torch.Tensor, int]], int, list[torch.Tensor]]:
    if not all(map(PLAIN_TYPES.__contains__, map(type, parameters))):  # (two C loops: a tree that changed)
        parameters = computed_views(parameters, modules)
    sized = sorted(((p, p.numel()) for p in parameters if p is not None), key=_size, reverse=True)
    return sized, sum(n for _, n in sized), []


class _Shared:
    """One pipeline's memo: the live one (weakly: the debuggers of the pipeline hold it), or, once no
    debugger holds it, what it had worked out, held weakly (:func:`_park`) for the next debugger."""

    __slots__ = ("pipe", "weak", "parked")

    def __init__(self, pipe: "weakref.ref[Any]"):
        self.pipe, self.weak, self.parked = pipe, None, None


_SHARED: dict[int, _Shared] = {}
"""Per pipeline (by id, while it lives): the memo its debuggers share, or what it had worked out."""


def shared_memo(pipe: Any) -> TreeMemo:
    """The :class:`TreeMemo` every debugger of ``pipe`` shares, for as long as ``pipe`` lives (a
    memo of its own where ``pipe`` cannot be weakly referenced). It is held by the debuggers of
    ``pipe`` alone; once none holds it, what it had worked out is kept with every module, parameter
    and hook in it held weakly (:func:`_park`): a component the user replaces or deletes then is
    let go at once, and the next debugger finds the rest, as far as all it was made of still lives.

    >>> pipe = torch.nn.Sequential(torch.nn.Linear(2, 2))  # any object, a pipeline here
    >>> shared_memo(pipe) is shared_memo(pipe), shared_memo(pipe) is shared_memo(torch.nn.ReLU())
    (True, False)
    """
    entry = _SHARED.get(id(pipe))
    if entry is None or entry.pipe() is not pipe:
        try:
            ref = weakref.ref(pipe, functools.partial(_forget, id(pipe)))
        except TypeError:  # no weak reference to it: a memo of this debugger's own
            return TreeMemo()
        entry = _SHARED[id(pipe)] = _Shared(ref)
    memo = entry.weak() if entry.weak is not None else None
    if memo is None:  # the first, or the last one went with the debuggers that held it
        memo = TreeMemo()
        parked, entry.parked = entry.parked, None
        if parked:
            _revive(memo, parked)
        entry.weak, memo._parked_in = weakref.ref(memo), entry
    return memo


_PLAIN = (str, int, float, bool, type(None), torch.dtype, torch.device)
"""What a parked memo holds as it is: it holds nothing of the user's."""


class _Gone(Exception):
    """A parked value that cannot be revived: an object in it was collected (or it was not parked)."""


def _weak(value: Any) -> Any:
    """``value`` with every object in it held weakly (a container or dataclass of them walked, a
    plain value kept): what :func:`_strong` gives back while they all live."""
    kind = type(value)
    if kind in _PLAIN or value is _END:
        return value
    if kind in (list, tuple, set, frozenset):
        return (_Container, kind, [_weak(item) for item in value])
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (_Container, kind, {f.name: _weak(getattr(value, f.name)) for f in dataclasses.fields(value)})
    try:
        return weakref.ref(value)
    except TypeError:  # (a dict, an unknown object that cannot be weakly held: not parked)
        raise _Gone from None


def _strong(held: Any) -> Any:
    """What :func:`_weak` made ``held`` of; :class:`_Gone` where an object in it was collected."""
    kind = type(held)
    if kind is weakref.ref:
        value = held()
        if value is None:
            raise _Gone
        return value
    if kind is not tuple or not held or (held[0] is not _Container and held[0] is not _Refs):
        return held
    if held[0] is _Refs:
        objects = list(map(weakref.ref.__call__, held[1]))
        if any(map(is_, objects, repeat(None))):
            raise _Gone
        return objects
    _, made, items = held
    if made in (list, tuple, set, frozenset):
        return made(_strong(item) for item in items)
    return made(**{name: _strong(item) for name, item in items.items()})


class _Container:
    """Marks a container in :func:`_weak`'s output."""


class _Refs:
    """Marks a list of weak references in :func:`_refs`'s output."""


def _refs(objects: list[Any]) -> Any:
    """:func:`_weak` of a list of modules or tensors (a tree's), in one C loop where none is None."""
    try:
        return (_Refs, list(map(weakref.ref, objects)))
    except TypeError:  # (a child or parameter registered as None)
        return _weak(objects)


def _park(entry: _Shared, trees: dict, values: dict) -> None:
    """A memo no debugger holds any more: what it worked out is kept for the next, weakly held
    (the memo was the only holder of a component replaced since: it goes now, not at the next
    attach); a value that cannot be held so is left out (the next debugger works it out again)."""
    if entry.pipe() is None:
        return
    parked = {}
    for key, (tree, _) in trees.items():
        order, names, parameters, hooked = tree
        try:
            weak_tree = (_refs(order), names, _refs(parameters), _weak(hooked))
        except _Gone:
            continue
        kept = {}
        for name, value in values.get(key, {}).items():
            try:
                kept[name] = _weak(value)
            except _Gone:
                pass
        parked[key] = (weak_tree, kept)
    entry.parked = parked


def _revive(memo: TreeMemo, parked: dict) -> None:
    """Put back in ``memo`` every parked tree whose objects all live, with its values that do."""
    for key, (weak_tree, kept) in parked.items():
        try:
            order, parameters, hooked = _strong(weak_tree[0]), _strong(weak_tree[2]), _strong(weak_tree[3])
        except _Gone:
            continue
        names = weak_tree[1]
        if id(order[0]) != key:  # (its id reused: cannot be, it lives, but cheap to say)
            continue
        values = {}
        for name, value in kept.items():
            try:
                values[name] = _strong(value)
            except _Gone:
                pass
        memo._trees[key] = (TreeKey((order, names, parameters, hooked)), order)
        memo._values[key] = values
        memo._by_size[key] = _by_size(parameters, order)


def _forget(key: int, ref: "weakref.ref[Any]", shared: dict[int, _Shared] = _SHARED) -> None:
    entry = shared.get(key)  # no global looked up: this may run as the interpreter shuts down
    if entry is not None and entry.pipe is ref:
        del shared[key]
