"""What attach needs of a component's module tree, worked out once and reused while the tree is the same.

Each attach lists the modules to probe and to watch for OOM, whether a component is compiled or
runs diffusers' caching hooks, and the dtype of its parameters; each of those walks every module,
and a 1-step pipeline pays them on every call. :class:`TreeMemo` walks each component once per
attach, cheaply (no generators, no names), into a key: every module with its children's names,
its parameters, its in-place compiled call and its diffusers hook registry. What was computed
from a component is reused while its key is the same; any change (a LoRA loaded, a module
replaced or deleted, ``module.compile()``, ``vae.decode = torch.compile(vae.decode)``, a cache hook
enabled, a parameter replaced) gives another key and everything of that component is computed
again. A dtype change in place
(``pipe.to(torch.float16)`` keeps the parameter objects) changes the parameters' dtypes, read
at every attach.

>>> import torch
>>> memo = TreeMemo()
>>> net = torch.nn.Sequential(torch.nn.Linear(2, 2))
>>> memo.refresh([net])
>>> calls = []
>>> count = lambda: calls.append(1) or len(calls)
>>> memo.get(net, "n", count), memo.get(net, "n", count)
(1, 1)
>>> net.append(torch.nn.Linear(2, 2))
Sequential(...)
>>> memo.refresh([net]); memo.get(net, "n", count)
2

A pipeline's memo is shared by every debugger of it (:func:`shared_memo`): a debugger made for
each call (``with DiffusionModelDebugger(pipe, config): pipe(...)``) finds what an earlier one
worked out, checked by the same walk, rather than listing every module again.

Limits: a module's own attributes other than these (a flag a forward reads) are not in the key:
nothing memoised depends on them. The shared memo holds what it was computed from (the modules
of each component it saw): a component replaced on the pipeline (``pipe.unet = other``) is let
go at the next close or attach of a debugger of that pipeline, or with the pipeline; a module
that holds its pipeline (a user's hook that closes over ``pipe``) keeps the pipeline alive
through the memo between two debuggers (none of ours does: the memo is held by the attached
debuggers alone while one is attached).
"""

from __future__ import annotations

import functools
import weakref
from operator import is_, itemgetter
from typing import Any, Callable, Iterable

import torch
from torch import nn

_size = itemgetter(1)


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
    id made per object cost a fifth more)."""
    order: list[Any] = [root]
    names: list[Any] = []
    parameters: list[torch.Tensor | None] = []
    hooked: list[Any] = []  # compiled in place, or with a diffusers hook registry: the objects themselves
    add_names, end_module, add_children, add_parameters = names.extend, names.append, order.extend, parameters.extend
    for module in order:
        if module is None:  # a child registered as None (compared as such)
            continue
        state = module.__dict__
        children, own = state["_modules"], state["_parameters"]
        if children:  # most modules are leaves
            add_names(children)
            add_children(children.values())
        if own:
            add_names(own)
            add_parameters(own.values())
        end_module(None)
        if "_diffusers_hook" in state or state.get("_compiled_call_impl") is not None:
            compiled, registry = state.get("_compiled_call_impl"), state.get("_diffusers_hook")
            hooks = tuple(registry.hooks.values()) if registry is not None else ()
            hooked += (module, compiled, registry, *hooks, _END)
    owners = (root,) if "_orig_mod" not in root._modules else (root, root._modules["_orig_mod"])
    for owner in owners:  # a torch.compile wrapper's original's too
        state = owner.__dict__
        for name in ROOT_METHODS:  # one the user compiled in place of the class's (vae.decode = torch.compile(...))
            if name in state:
                hooked += (owner, name, state[name], _END)
    return TreeKey((order, names, parameters, hooked)), order, parameters


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
        self._by_size: dict[int, tuple[list[tuple[torch.Tensor, int]], int]] = {}
        """Per root: its parameters with their sizes, largest first, and their total size."""
        self.current: dict[int, dict[Any, Any]] = {}
        """Per root of the last :meth:`refresh` (by id; each held by the memo while it is here): the
        dict of values :meth:`get` fills. Read as ``memo.current.get(id(root), {})`` where a Python
        call per value counts (a reused debugger's attach, at every call of a 1-step pipeline): a
        root not seen gets a dict of its own, so its values are computed each time, as by ``get``."""

    def refresh(self, roots: list[nn.Module]) -> None:
        """Walk each root once (at attach): what was computed from a changed tree is forgotten, and
        so is every root not in ``roots`` (a component the pipeline no longer holds)."""
        trees, values = self._trees, self._values
        current: dict[int, dict[Any, Any]] = {}
        for root in roots:
            key, kept, parameters = tree_key(root)
            before = trees.get(id(root))
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
                trees[id(root)] = (key, kept)
                values[id(root)] = {}
                sized = sorted(((p, p.numel()) for p in parameters if p is not None), key=_size, reverse=True)
                self._by_size[id(root)] = (sized, sum(n for _, n in sized))
            current[id(root)] = values[id(root)]
        self.current = current
        if len(trees) != len(current):  # a root not in ``roots`` (a reused debugger's attach: none)
            self.keep_only(roots)

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
        parameter (an in-place conversion keeps the tree's key, so this is read at every attach).
        ``None`` for a root :meth:`refresh` has not seen, or without floating parameters."""
        return self.dtypes((root,))[0]

    def dtypes(self, roots: Iterable[nn.Module]) -> list[torch.dtype | None]:
        """:meth:`dtype` of each of ``roots``, in one Python call (at every attach)."""
        found_all: list[torch.dtype | None] = []
        for root in roots:
            found = self._by_size.get(id(root))
            if found is None:
                found_all.append(None)
                continue
            sized, total = found
            counts: dict[torch.dtype, int] = {}
            most = None
            for parameter, size in sized:
                if parameter.is_floating_point():
                    dtype = parameter.dtype
                    counts[dtype] = counts.get(dtype, 0) + size
                    if 2 * counts[dtype] > total:
                        most = dtype
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
            self.current.pop(key, None)

    def clear(self) -> None:
        self.__init__()


class _Shared:
    """One pipeline's memo: held here only while none of its debuggers is attached. An attached
    debugger's hooks reach it (and its pipeline) from the modules the memo holds, so a memo held
    here then would keep a debugger dropped while attached, and its pipeline, alive."""

    __slots__ = ("pipe", "memo", "weak", "attached")

    def __init__(self, pipe: "weakref.ref[Any]", memo: TreeMemo):
        self.pipe, self.memo, self.weak, self.attached = pipe, memo, weakref.ref(memo), 0


_SHARED: dict[int, _Shared] = {}
"""Per pipeline (by id, while it lives): the memo its debuggers share."""


def shared_memo(pipe: Any) -> TreeMemo:
    """The :class:`TreeMemo` every debugger of ``pipe`` shares, for as long as ``pipe`` lives (a
    memo of its own where ``pipe`` cannot be weakly referenced). The memo holds the components'
    modules, never the pipeline; :func:`attached_memo` says when a debugger holds it.

    >>> pipe = torch.nn.Sequential(torch.nn.Linear(2, 2))  # any object, a pipeline here
    >>> shared_memo(pipe) is shared_memo(pipe), shared_memo(pipe) is shared_memo(torch.nn.ReLU())
    (True, False)
    """
    entry = _SHARED.get(id(pipe))
    if entry is not None and entry.pipe() is pipe:
        memo = entry.memo or entry.weak()
        if memo is not None:
            return memo
    try:
        ref = weakref.ref(pipe, functools.partial(_forget, id(pipe)))
    except TypeError:  # no weak reference to it: a memo of this debugger's own
        return TreeMemo()
    memo = TreeMemo()  # the first, or the last one went with the debuggers that held it
    _SHARED[id(pipe)] = _Shared(ref, memo)
    return memo


def attached_memo(pipe: Any, memo: TreeMemo, attached: bool) -> None:
    """A debugger of ``pipe`` that holds ``memo`` attaches (``attached``) or detaches: the memo is
    held here while none is attached."""
    entry = _SHARED.get(id(pipe))
    if entry is None or entry.pipe() is not pipe or entry.weak() is not memo:
        return
    entry.attached = entry.attached + 1 if attached else max(entry.attached - 1, 0)
    entry.memo = None if entry.attached else memo


def _forget(key: int, ref: "weakref.ref[Any]", shared: dict[int, _Shared] = _SHARED) -> None:
    entry = shared.get(key)  # no global looked up: this may run as the interpreter shuts down
    if entry is not None and entry.pipe is ref:
        del shared[key]
