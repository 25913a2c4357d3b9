"""The one handle every attach of the package returns: ``remove()`` takes exactly its hooks off.

>>> from torch import nn
>>> layer = nn.Linear(2, 2)
>>> with register_all(lambda: [layer.register_forward_hook(lambda *args: None)]) as handle:
...     len(layer._forward_hooks)
1
>>> len(layer._forward_hooks), handle.attached
(0, False)

Limits: a handle removes what it was given; hooks a technique adds later (a profiler range opened
at its first call) are the technique's to hand over through ``on_remove``.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable


class ProbeHandle:
    """Removes the hooks one ``apply_*`` or ``attach`` added (torch's ``RemovableHandle``, other
    handles, anything with ``remove()``), the last added first, then runs ``on_remove``.
    ``remove()`` is idempotent and removes every one even when one fails (the first failure is
    raised after): the package's one "undo all" loop. The handle is a context manager
    (``with probe.attach(): ...``). ``state`` is the object the hooks write into (a
    :class:`~diffusion_debug.probes.Probe`, a :class:`~diffusion_debug.probes.BackwardOrder`),
    ``None`` when they write nowhere."""

    def __init__(self, handles: Iterable[Any] = (), on_remove: Callable[[], None] | None = None, state: Any = None):
        self._handles = list(handles)
        self._on_remove = on_remove
        self.state = state

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
    try:
        for handle in register():
            added.append(handle)
    except BaseException:
        ProbeHandle(added).remove()
        raise
    return ProbeHandle(added, on_remove=on_remove, state=state)
