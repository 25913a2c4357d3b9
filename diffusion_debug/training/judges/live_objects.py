"""The torch optimizers and ``nn.Module``\\ s alive in the process, found without walking its heap:
what the optimizer-coverage judge names an outside parameter by, and what ``launch`` finds a plain
script's models and optimizers among.

``LiveObjects().install()`` (``launch`` does, before the script runs) notes every optimizer and
module made from then on, by weak reference, in the order they were made: an optimizer when
``Optimizer.__init__`` returns, a module when it registers a parameter, a buffer or a submodule
(torch's global registration hooks, which also note the submodule), and either one that
``copy.deepcopy``, ``pickle`` or ``torch.load`` rebuilds (its class's ``__setstate__``). Its cost
grows with what the script makes, never with what else its heap holds (a dataset of dicts, a
tokenizer's cache), and it calls no ``gc.collect()``: no finalizer of the script's runs at a moment
it did not choose. :func:`live_objects` answers from the one installed last.

>>> import torch
>>> with LiveObjects().install():
...     model = torch.nn.Sequential(torch.nn.Linear(2, 2))
...     optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
...     [type(m).__name__ for m in live_objects(torch.nn.Module)], len(live_objects(torch.optim.Optimizer))
(['Linear', 'Sequential'], 1)

Limits: with none installed (a ``TrainingDebugger`` the script makes itself, after its models and
optimizers), :func:`live_objects` walks the garbage collector's list once per call, with no
collection first. Either way an object the script let go of that only its own reference cycle holds
(an unstepped torch SGD makes one) is listed until the collector frees it. An object made before
:meth:`~LiveObjects.install` is not noted, nor a module that holds no parameter, buffer or
submodule (it names no parameter), nor an optimizer whose ``__init__`` raised (it holds none), nor
a module made inside compiled code (a forward's ``self.blocks[1:]``: a temporary).
"""

from __future__ import annotations

import functools
import gc
import weakref
from typing import Any, Callable

import torch
from torch import nn

from ...probes.tracing import compiling

_INSTALLED: list[LiveObjects] = []
"""The registries installed, the last one answering :func:`live_objects`."""


def noting() -> bool:
    """Whether a :class:`LiveObjects` is installed (``launch``'s: a process whose heap nothing walks)."""
    return bool(_INSTALLED)


def live_objects(kind: type | tuple[type, ...]) -> list[Any]:
    """Every object of ``kind`` alive in the process: the installed :class:`LiveObjects`' (in the
    order they were made), else a walk of the garbage collector's list (no collection first). By
    type: ``isinstance`` asks an object's ``__class__``, which a ``weakref.proxy`` whose referent
    died answers with ReferenceError (torch.compile leaves one behind in the process)."""
    if _INSTALLED:
        return _INSTALLED[-1].of(kind)
    return [obj for obj in gc.get_objects() if issubclass(type(obj), kind)]


class LiveObjects:
    """The optimizers and modules made while installed, held weakly (see the module docstring).
    :meth:`remove` is idempotent and it works as a context manager; a wrapper of ours that someone
    wrapped over since stays inside theirs, and passes through once removed."""

    def __init__(self, on_optimizer: Callable[[Any], None] | None = None) -> None:
        self.on_optimizer = on_optimizer
        """Called with each optimizer noted as its ``__init__`` returns (launch hooks its model's first forward)."""
        self._refs: dict[int, weakref.ref] = {}
        self._handles: list[Any] = []
        self._patched: list[tuple[type, str, Any, Any]] = []
        self._installed = False

    def install(self) -> LiveObjects:
        """Note every optimizer and module made from now on (see the module docstring)."""
        from torch.nn.modules.module import (
            register_module_buffer_registration_hook,
            register_module_module_registration_hook,
            register_module_parameter_registration_hook,
        )

        self._installed = True
        _INSTALLED.append(self)
        try:
            self._handles.append(register_module_parameter_registration_hook(self._registered))
            self._handles.append(register_module_buffer_registration_hook(self._registered))
            self._handles.append(register_module_module_registration_hook(self._child_registered))
            self._wrap(torch.optim.Optimizer, "__init__", made=True)
            self._wrap(torch.optim.Optimizer, "__setstate__")
            self._wrap(nn.Module, "__setstate__")
        except BaseException:
            self.remove()
            raise
        return self

    def remove(self) -> None:
        """Note nothing more (idempotent); :func:`live_objects` answers from the one installed before, else walks."""
        self._installed = False
        if self in _INSTALLED:
            _INSTALLED.remove(self)
        while self._handles:
            self._handles.pop().remove()
        while self._patched:
            owner, name, ours, original = self._patched.pop()
            if vars(owner).get(name) is ours:
                setattr(owner, name, original)

    def __enter__(self) -> LiveObjects:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def of(self, kind: type | tuple[type, ...]) -> list[Any]:
        """The objects of ``kind`` noted and still alive, in the order they were made."""
        alive = (ref() for ref in self._refs.copy().values())  # a callback may drop one meanwhile
        return [obj for obj in alive if obj is not None and issubclass(type(obj), kind)]

    def _note(self, obj: Any) -> None:
        """Note ``obj`` (once; a new object at the address of a freed one is another)."""
        key = id(obj)
        ref = self._refs.get(key)
        if ref is not None and ref() is obj:
            return
        self._refs.pop(key, None)  # a freed object's, whose callback has not run: the new one goes last
        refs = self._refs
        try:
            self._refs[key] = weakref.ref(obj, lambda gone: refs.get(key) is gone and refs.pop(key))
        except TypeError:  # no weak reference to it: not kept alive by us, so not noted
            pass

    def _registered(self, module: nn.Module, name: str, value: Any) -> None:
        if self._installed and not compiling():
            self._note(module)

    def _child_registered(self, module: nn.Module, name: str, child: Any) -> None:
        # inside a compiled forward (``self.resnets[1:]`` makes a ModuleList at every call), dynamo would
        # trace ``id()`` here and fall back to eager for the rest of the forward: a temporary, not noted
        if self._installed and not compiling():
            self._note(module)
            if child is not None:
                self._note(child)

    def _wrap(self, owner: type, name: str, made: bool = False) -> None:
        """``owner.name`` notes its object once it returned (not one whose ``__init__`` raised); ``made``:
        an optimizer's ``__init__``, then told to :attr:`on_optimizer`."""
        original: Callable[..., Any] = vars(owner)[name]
        registry = self

        @functools.wraps(original)
        def noted(obj: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(obj, *args, **kwargs)
            if registry._installed:
                registry._note(obj)
                if made and registry.on_optimizer is not None:
                    registry.on_optimizer(obj)
            return result

        setattr(owner, name, noted)
        self._patched.append((owner, name, noted, original))
