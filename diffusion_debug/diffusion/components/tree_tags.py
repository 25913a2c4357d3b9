"""Whether a component's module tree was written since it was last walked, told without walking it:
from the version tags of the dicts it is made of (PEP 509).

:func:`~.structure.tree_key` walks every module of every component at each attach (490 modules on
tiny SD: ~0.15 ms of CPU warm, ~0.76 ms less a reused fp16 1-step call without it, cost32). All it reads
of a tree lives in dicts: each module's ``__dict__`` (its ``_modules`` and ``_parameters`` dicts, a
compiled call, a diffusers hook registry, a method compiled in place, accelerate's ``forward``),
its ``_modules`` (the children, by name, in order), its ``_parameters``, and a registry's
``__dict__`` and ``hooks``. CPython gives a dict's version tag a new value, greater than every tag
before it, at each write that changes it (a set, delete, pop, clear, update): so while the largest
tag among a tree's dicts is the one read after its last walk, no dict of it was written since and a
walk would give the same key. A dict empty when tagged (a leaf's ``_modules``, a container's
``_parameters``: 562 of tiny SD's 1,467) is tested for emptiness instead (one ``any`` loop, cost37): one
filled and emptied again between two checks goes unseen, and gives the walk nothing new to read. Reading the
tags is one C loop (``max(map(dict_version, dicts))``,
~70 ns a dict, no Python per module); any write (a LoRA layer set in, ``del unet.mid_block``, a
``_modules[...] =`` or ``_parameters[...] =`` write, ``compile()``, a cache hook enabled or removed,
offloading's hooks, even ``set_adapters``' flags, which the key does not need) sends the next
attach through the walk, which decides. Building the tags after a walk costs about as much as the
walk: where they keep failing at their first read with the tree the same (a flag written before
every call: ``set_adapters`` alternated), they are built ever less often (:func:`tags_after_walk`).

The tags are read by torch's own reader, what dynamo's guards use
(``torch._C._dynamo.guards.dict_version``), checked once at import against the writes it must
see (:func:`_reader`); where it is missing or sees less, every attach walks, as before. On Python
3.12+ torch keeps the tags with a dict watcher, which is not told of an empty dict filled by
``update`` (a "clone"): where the check finds that, the dicts' total length is compared too (a
clone only adds); that reader also puts its watcher on each dict it reads, as dynamo's guards do, and
gives a dict its first tag at its first read (:data:`FIRST_READ_TAGS`): a dict never read before has
no tag to tell a write by, so the last walk's tree is read once before the walk that builds tags
(:func:`start_of_walk`); without that, its first tags, all newer than the walk, were dropped as a write
(below) and each tree took one walk more after each change before its tags held.
Tags are dropped where one is newer than ``READ({})`` read before the walk: a write between the walk
and the tags' read (another thread's), which the walk may have missed and the tags would hide; where lengths
are compared, also where the dicts' total length read before the walk is not the tags' (a clone, which no tag
tells, between the walk and the tags' read).
On 3.13.0 the watcher misses a module's attribute set (CPython gh-125608, fixed in 3.13.1): the check finds
that, and every attach walks there.
Only plain dicts are tagged: a tree with a dict of a subclass (an ``OrderedDict`` ``_modules``, as
``del module_list[i]`` leaves; its ``move_to_end`` reorders with no write) is walked at each attach.

What holds the root is read through the root at each check, not kept: the root's ``__dict__`` and
its registry's dicts hold what holds the root back (a compiled call, the registry, a bound
``forward``), and a detached debugger holds the root weakly (:mod:`.detached`).

>>> import torch
>>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
>>> tags = tree_tags(list(net.modules()))  # None where this torch cannot read the tags
>>> tags is None or unchanged(net, tags)
True
>>> net[1].inplace = True  # any write to a dict of the tree: here a child's ``__dict__``
>>> tags is not None and unchanged(net, tags)
False

Limits: a module's ``__dict__`` replaced whole (``object.__setattr__(module, "__dict__", d)``)
writes no dict of the tree: not seen below the root (checking each module's ``__dict__`` by
identity would cost as much again as the tags). A module's class changed in place is not in the key
either. A tag read costs a C call per dict that held something when tagged (~1.9 a module); an empty one, a truth
test in one C loop (``any``).
"""

from __future__ import annotations

import sys
from itertools import compress, repeat
from operator import attrgetter, contains, itemgetter
from typing import Any, Callable

_MODULES, _PARAMETERS, _STATE = itemgetter("_modules"), itemgetter("_parameters"), attrgetter("__dict__")


def _reader() -> tuple[Callable[[dict], int] | None, bool, bool]:
    """torch's tag reader, as :func:`_checked` finds it (``(None, False, False)`` where this torch has none)."""
    try:
        from torch._C._dynamo.guards import dict_version
    except Exception:  # (no dynamo in this torch build)
        return None, False, False
    return _checked(dict_version)


def _checked(read: Callable[[dict], int]) -> tuple[Callable[[dict], int] | None, bool, bool]:
    """``(read, lengths_too, first_read)``: ``read`` if it sees every write a tree can take (a set, a
    delete, a pop, a clear, an update, a module's attribute set and deleted, a child added), else ``None``;
    ``lengths_too``: it misses an empty dict filled by ``update``; ``first_read``: it gives a dict its
    first tag when it first reads it, not when the dict is made (both torch's watcher, on 3.12+)."""
    from torch import nn

    def written(target: dict, write: Callable[[dict], Any]) -> bool:
        before = read(target)
        write(target)
        return read(target) > before

    try:
        module = nn.Module()
        state = vars(module)
        seen = (
            written({"a": 1}, lambda d: d.__setitem__("a", 2)),
            written({"a": 1}, lambda d: d.__setitem__("b", 2)),
            written({"a": 1}, lambda d: d.__delitem__("a")),
            written({"a": 1}, lambda d: d.pop("a")),
            written({"a": 1}, dict.clear),
            written({"a": 1}, lambda d: d.update(b=2)),
            written(state, lambda _: setattr(module, "tag", 1)),
            written(state, lambda _: delattr(module, "tag")),
            written(module._modules, lambda _: module.add_module("child", nn.Module())),
            read({}) > read(state),  # a new value is greater than every value before it
        )
        clone = written({}, lambda d: d.update({"a": 1}))
        made_first, made_next = {}, {}
        first_read = read(made_next) < read(made_first)  # tagged as read, not as made
    except Exception:  # (a torch whose reader is not for this Python)
        return None, False, False
    return (read, not clone, first_read) if all(seen) else (None, False, False)


READ, LENGTHS_TOO, FIRST_READ_TAGS = _reader() if sys.implementation.name == "cpython" else (None, False, False)
"""torch's dict version reader (None where it is missing or misses a write), whether lengths are compared too,
and whether it tags a dict at its first read (then :func:`start_of_walk` reads the tree before a walk)."""


class TreeTags(tuple):
    """``(dicts, newest, length, empty)``: the tree's dicts but the root's own that held something when read
    (just after a walk), the largest tag among them and the root's, the total length of all (read where
    :data:`LENGTHS_TOO`), and the dicts that were empty: those are told unchanged by staying empty (a C truth
    test each, not a tag read: ~38% of a tree's dicts, a leaf's ``_modules`` and a container's ``_parameters``),
    since an empty dict that is empty again gives the walk the same nothing to read."""

    __slots__ = ()


def tree_tags(kept: list[Any], since: int | None = None, length: int | None = None) -> TreeTags | None:
    """The tags of the tree whose modules (its root first) are ``kept``, read now (just after a walk
    of it); ``None`` where they cannot tell a write (no reader, a dict of a subclass) or where a dict
    of it was written after ``since`` (``READ({})``, read before the walk: a tag newer than it is a
    write the walk may have missed, which these tags would hide at every later attach), or, lengths
    compared, where their total is not ``length`` (read before the walk: a clone since, no tag newer)."""
    if READ is None or not kept:
        return None
    dicts = _dicts(kept)
    root = _root_dicts(kept[0]) if dicts is not None else None
    if root is None:
        return None
    held = list(map(bool, dicts))  # before the tags: a write after this is one they tell (since, or the next test)
    read, at_root = list(map(READ, dicts)), max(map(READ, root))
    newest = max(at_root, max(read, default=0))
    if since is not None and newest > since:  # (every dict's tag: an empty one written since the walk too)
        return None
    found = sum(map(len, dicts)) + sum(map(len, root)) if LENGTHS_TOO else 0
    if length is not None and found != length:
        return None
    empty = [one for one, full in zip(dicts, held) if not full]
    if empty:  # the tags of the dicts that hold something, and the root's
        dicts = list(compress(dicts, held))
        newest = max(at_root, max(compress(read, held), default=0))  # (as read before since's test)
    return TreeTags((dicts, newest, found, empty))


def _dicts(kept: list[Any]) -> list[dict] | None:
    """The dicts of the tree whose modules (its root first) are ``kept``, but the root's own; ``None`` where
    one is not a plain dict or a module lacks its dicts."""
    try:
        states = list(map(_STATE, kept))
    except AttributeError:  # (a child registered as None: none)
        states = [module.__dict__ for module in kept if module is not None]
    try:
        dicts = [*states[1:], *map(_MODULES, states), *map(_PARAMETERS, states)]
    except KeyError:  # (a module without its dicts: walked every time)
        return None
    below = states[1:]
    for state in compress(below, map(contains, below, repeat("_diffusers_hook"))):  # registries below the root
        registry = state["_diffusers_hook"]
        if registry is not None:  # (``_diffusers_hook = None``: no registry, as tree_key reads it)
            dicts += (vars(registry), registry.hooks)
    return None if set(map(type, dicts)) - {dict} else dicts


def start_of_walk(
    backoff: list[int] | None, last: list[Any], failed: TreeTags | None, refresh: int
) -> tuple[int, int | None]:
    """``(since, length)`` before the ``refresh``-th walk of a tree tagged before (:func:`tree_tags`'s):
    ``READ({})``, newer than every tag now, and where tags are to be built after this walk if it finds the
    tree the same (:func:`tags_after_walk`, from ``backoff`` and ``failed``) and lengths are compared
    (:data:`LENGTHS_TOO`), the total length of the dicts of ``last`` (the modules the last walk kept), else
    ``None``: a clone after it (no tag tells one) changes it, and the tags built after the walk are dropped;
    without it a clone after the walk, before the tags' read, was read into their length, hidden for good.
    Where the reader tags a dict at its first read (:data:`FIRST_READ_TAGS`), those dicts are read first: their
    tags, then older than the walk, are the ones read after it, which tell a write since; a dict not read now
    (new in the tree) still gets a newer tag and drops the tags."""
    length = None
    if (FIRST_READ_TAGS or LENGTHS_TOO) and _builds_if_same(backoff or [0, 0, 0], failed, refresh) and last:
        dicts, root = _dicts(last), _root_dicts(last[0])
        if dicts is not None and root is not None:
            if FIRST_READ_TAGS:
                max(map(READ, dicts), default=0), max(map(READ, root))
            if LENGTHS_TOO:
                length = sum(map(len, dicts)) + sum(map(len, root))
    return READ({}), length


def _builds_if_same(backoff: list[int], failed: TreeTags | None, refresh: int) -> bool:
    """Whether :func:`tags_after_walk` will build tags after this walk if it finds the tree the same."""
    strikes, wait, built = backoff
    if failed is not None and built == refresh - 1:  # a strike: the wait starts anew
        wait = (1 << (min(strikes + 1, MAX_STRIKES) - 1)) - 1
    return wait == 0


MAX_STRIKES = 7
"""Tags failing at their first read this many times in a row, the tree the same, are built once in 64
walks (:func:`tags_after_walk`): a write at every call then costs its walk and 1/64 of a build; a tree
left unchanged after it is tagged again within 64 walks."""


def tags_after_walk(
    backoff: list[int], kept: list[Any], same: bool, failed: TreeTags | None, start: tuple, refresh: int
) -> TreeTags | None:
    """The tags to keep after the ``refresh``-th walk of a tree whose modules are ``kept`` (``same``: it
    found the tree the walk before had; ``failed``: the tags that sent it through the walk, if any), or
    ``None``. ``backoff`` (``[strikes, walks left untagged, refresh that built the last tags]``, updated):
    a strike is tags that failed at their first read, the tree the same (a write before every call that
    leaves the tree: ``set_adapters`` alternated, ``enable_lora``/``disable_lora``); after ``k`` in a row
    tags are built once in ``2 ** (k - 1)`` walks (a build costs ~0.2 ms, about a walk), not after each;
    tags read unchanged once before they failed set the strikes back to 0. A changed tree: no tags
    (built after the next walk that finds it the same). ``start``: :func:`start_of_walk`'s, before the walk."""
    strikes, wait, built = backoff
    if failed is not None and built != refresh - 1:  # read unchanged at least once: a hit
        strikes = 0
    found = None
    if same:
        if failed is not None and built == refresh - 1:  # failed at their first read, the tree the same
            strikes = min(strikes + 1, MAX_STRIKES)
            wait = (1 << (strikes - 1)) - 1
        if wait:
            wait -= 1
        else:
            found, built = tree_tags(kept, *start), refresh
    backoff[:] = strikes, wait, built
    return found


def _root_dicts(root: Any) -> tuple[dict, ...] | None:
    """The root's ``__dict__``, and its registry's ``__dict__`` and ``hooks`` where it has one."""
    state = root.__dict__
    registry = state.get("_diffusers_hook")
    if registry is None:
        return (state,)
    found = (state, vars(registry), registry.hooks)
    return found if type(found[2]) is dict else None


def unchanged(root: Any, tags: TreeTags) -> bool:
    """Whether no dict of the tree of ``root`` tagged by ``tags`` was written since."""
    state = root.__dict__
    registry = state["_diffusers_hook"] if "_diffusers_hook" in state else None  # (no C call: every attach)
    if registry is not None:
        root_dicts: tuple = (state, registry.__dict__, registry.hooks)
        if type(root_dicts[2]) is not dict:
            return False
    else:
        root_dicts = (state,)
    dicts, newest, length, empty = tags
    if max(max(map(READ, root_dicts)), max(map(READ, dicts), default=0)) != newest or any(empty):
        return False
    return not LENGTHS_TOO or sum(map(len, dicts)) + sum(map(len, root_dicts)) == length
