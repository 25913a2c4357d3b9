"""What attach needs of a component's module tree, worked out once and reused while the tree is the same.

Each attach lists the modules to probe and to watch for OOM, whether a component is compiled or
runs diffusers' caching hooks, and the dtype of its parameters; each of those walks every module,
and a 1-step pipeline pays them on every call. :class:`TreeMemo` walks each component once per
attach, cheaply (no generators, no names), into a key: every module with its children's names,
its parameters, its in-place compiled call and its diffusers hook registry. What was computed
from a component is reused while its key is the same; any change (a LoRA loaded, a module
replaced or deleted, ``module.compile()``, a cache hook enabled, a parameter replaced) gives
another key and everything of that component is computed again. A dtype change in place
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

Limits: a module's own attributes other than these (a flag a forward reads) are not in the key:
nothing memoised depends on them.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn


def tree_key(root: nn.Module) -> tuple[list[Any], list[Any]]:
    """``(key, kept)``: ``key`` (ids, compared with ``==``) says what the tree is made of; ``kept``
    holds every object whose id is in it, so that no id is reused while the key is kept."""
    key: list[Any] = []
    kept: list[Any] = []
    stack = [root]
    while stack:
        module = stack.pop()
        if module is None:  # a child registered as None
            key.append(None)
            continue
        state = module.__dict__
        children, parameters = state["_modules"], state["_parameters"]
        compiled, registry = state.get("_compiled_call_impl"), state.get("_diffusers_hook")
        hooks = tuple(registry.hooks.values()) if registry is not None else ()
        values = tuple(parameters.values())
        key.append((id(module), tuple(children), tuple(map(id, values)), id(compiled), id(registry), *map(id, hooks)))
        kept += (module, compiled, registry, *hooks, *values)
        stack.extend(children.values())
    return key, kept


class TreeMemo:
    """Values computed from components' module trees, per component, kept while its tree is unchanged."""

    def __init__(self) -> None:
        self._trees: dict[int, tuple[list[Any], list[Any]]] = {}
        self._values: dict[int, dict[str, Any]] = {}
        self._parameters: dict[int, list[torch.Tensor]] = {}

    def refresh(self, roots: list[nn.Module]) -> None:
        """Walk each root once (at attach): what was computed from a changed tree is forgotten."""
        for root in roots:
            key, kept = tree_key(root)
            before = self._trees.get(id(root))
            if before is None or before[0] != key or before[1][0] is not root:
                self._trees[id(root)] = (key, kept)
                self._values[id(root)] = {}
                self._parameters[id(root)] = [p for p in kept if isinstance(p, torch.Tensor)]

    def get(self, root: nn.Module, name: Any, compute: Callable[[], Any]) -> Any:
        """``compute()``'s value for ``root``, computed once while its tree is unchanged
        (always computed for a root :meth:`refresh` has not seen)."""
        values = self._values.get(id(root))
        if values is None or self._trees[id(root)][1][0] is not root:
            return compute()
        if name not in values:
            values[name] = compute()
        return values[name]

    def dtypes_key(self, root: nn.Module) -> tuple[torch.dtype, ...] | None:
        """The dtype of every parameter of ``root`` now (in place conversions keep the key)."""
        parameters = self._parameters.get(id(root))
        return None if parameters is None else tuple(p.dtype for p in parameters)

    def clear(self) -> None:
        self.__init__()
