"""The pre-hooks that make launch's debugger as a plain script's model begins its first forward under
grad (``launched.LaunchWatch._first_forward_call``), kept out of every trace dynamo makes.

A hook on a module whose call dynamo traces is guarded there (``len(model._forward_pre_hooks) == 1``):
its removal, or a hook the debugger adds beside it, recompiles that code (a script's compiled training
step that calls its model). So these hooks are lifted while dynamo compiles a frame and put back after
(torch's compile callbacks; registered once dynamo is imported): a traced call runs none of them, as
with no launch, and the model's first step makes the debugger, as before them. A copy of the model
(``copy.deepcopy``: an EMA copy; ``torch.save(model)``) holds none of them: each is marked ours
(:mod:`~diffusion_debug.probes.copies`; the hook holds launch's watch, which cannot be copied). Under
``model.compile()`` they run eagerly (:func:`~diffusion_debug.probes.tracing.eager_frame`), before
dynamo compiles the model's ``forward``. Limits: on a torch without those callbacks (private API) a
traced hook stays in its trace (a recompile at the first step); a call on another thread while dynamo
compiles runs without them."""

from __future__ import annotations

import sys
import weakref
from typing import Any, Callable

from torch import nn

from ..probes import copies
from .launch_deepspeed import _AfterImport

DYNAMO = "torch._dynamo"


def _unhook(handle: Any) -> None:
    handle.remove()
    copies.unmark(handle)


class FirstForwardHooks:
    """One prepended forward pre-hook a model (:meth:`add`), each removed by :meth:`pop` or all by
    :meth:`remove` (idempotent), lifted while dynamo compiles."""

    def __init__(self) -> None:
        self._hooks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        """By model: ``[hook, handle]``, the handle None while dynamo compiles."""
        self._undo: list[Callable[[], None]] = []

    def __contains__(self, model: nn.Module) -> bool:
        return model in self._hooks

    def add(self, model: nn.Module, hook: Callable[..., Any]) -> None:
        """``hook`` on ``model``, before every hook of its own (FSDP2's unshard, ZeRO-3's fetch); once a model."""
        if model in self._hooks:
            return
        self._hooks[model] = [hook, copies.mark(model.register_forward_pre_hook(hook, prepend=True))]
        if not self._undo:
            self._follow_compiles()
            copies.hold()  # left out of every copy of the model
            self._undo.append(copies.release)

    def pop(self, model: nn.Module) -> None:
        entry = self._hooks.pop(model, None)
        if entry is not None and entry[1] is not None:
            _unhook(entry[1])

    def remove(self) -> None:
        while self._hooks:
            handle = self._hooks.popitem()[1][1]
            if handle is not None:
                _unhook(handle)
        while self._undo:
            self._undo.pop()()

    def _lift(self, *args: Any) -> None:
        try:
            for entry in list(self._hooks.values()):
                if entry[1] is not None:
                    _unhook(entry[1])
                    entry[1] = None
        except Exception:  # never dynamo's compile: a hook left is traced, as where no callback is
            pass

    def _put_back(self, *args: Any) -> None:
        try:
            for model, entry in list(self._hooks.items()):
                if entry[1] is None:
                    entry[1] = copies.mark(model.register_forward_pre_hook(entry[0], prepend=True))
        except Exception:  # never dynamo's compile: that model's first step makes the debugger
            pass

    def _follow_compiles(self) -> None:
        """Lift the hooks while dynamo compiles: now if it is imported, else once it is (no import of ours)."""
        if DYNAMO in sys.modules:
            self._register(sys.modules[DYNAMO])
            return
        finder = _AfterImport(DYNAMO, self._register)
        sys.meta_path.insert(0, finder)
        self._undo.append(lambda: sys.meta_path.remove(finder) if finder in sys.meta_path else None)

    def _register(self, dynamo: Any) -> None:
        handler = getattr(dynamo, "callback_handler", None)
        if handler is None or not hasattr(handler, "remove_end_callback"):
            return  # a torch without compile callbacks: see the module's limits
        handler.register_start_callback(self._lift)
        handler.register_end_callback(self._put_back)

        def unregister() -> None:
            for remove, callback in (
                (handler.remove_start_callback, self._lift),
                (handler.remove_end_callback, self._put_back),
            ):
                try:
                    remove(callback)
                except ValueError:  # removed already (dynamo's callbacks cleared)
                    pass

        self._undo.append(unregister)
