"""A GradScaler that a plain loop uses without passing it as ``scaler=`` (:class:`UnnamedScaler`): its
gradients hold the loss scale (65,536 at the start), read as an exploding norm at every step, and each
overflow it skips as a NaN gradient error.

It is looked for once an optimizer, at its first measured step with no scaler known whose gradients
look so: a norm above ``grad_explosion_threshold``, or a non-finite one (a clean step pays one comparison, no call).
The place looked is the code that called the monitor: each calling frame's locals and globals, and one
attribute deep in each of their objects (a trainer's ``self.scaler``), for an enabled
``torch.amp.GradScaler`` that has scaled a loss. One found: that step's row and norms are read again
unscaled on the host (divided by its scale, unless ``unscale_`` ran already), the scaler is used for
that optimizer's steps from then on as if passed, and an info ``grad_scaler_not_given`` says so.
Several: a warning names the fix (``scaler=``) and the gradients are read as they are. A ``scaler=``
given (a disabled one too) is never searched past.

One found is the optimizer's only once it steps it: ``unscale_(optimizer)`` ran before the monitor, or
at the next step the scaler's per-step state of the step found (``update()`` replaced it) holds the
optimizer (``scaler.step(optimizer)`` ran). Otherwise (a second, fp16 model's scaler beside a plain fp32
one) it is dropped at that next step, read as it is from then on, and a warning ``grad_scaler_not_given``
tells the norm the step found read (a real explosion there was read divided by its scale).

The calling frames' locals are read through ``frame.f_locals``: before Python 3.13 that stores a copy of
a function's locals on its frame, which kept the step's batch alive until the loop returned; the copy
is emptied once read (the frame's own variables are untouched: the next ``locals()`` fills it again).

>>> import torch
>>> scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
>>> _ = scaler.scale(torch.ones(()))  # a loss scaled: its scale is made
>>> [found is scaler for found in scalers_in_callers(sys._getframe())]
[True]

Limits: a scaler held only deeper in the caller's objects (two attributes down, in a list) is not
found, nor one the calling code does not hold (the process's other objects are not walked: a scaler
left alive by an earlier run would be taken for this one's); a loop whose scaled gradients stay under
the threshold and never overflow is never looked at (its norms, update ratios and module figures are
the scale times too large): pass ``scaler=``.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import types
import weakref
from typing import Any

import torch

from ...record import Anomaly, make_anomaly
from .optimizer_state import raw_optimizer, scale_tensor, scaler_already_unscaled
from .step_row import LocalReadings, Measurement, StepRow

FRAMES_LOOKED = 16
"""Calling frames whose locals and globals are looked through."""
_NOT_OBJECTS = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.MethodType)
_SNAPSHOT_LOCALS = sys.version_info < (3, 13)
"""``frame.f_locals`` of a function is a copy stored on the frame (PEP 667 made it a view in 3.13)."""


class _Gone:
    pass


NO_SCALER = weakref.ref(_Gone())
"""A dead reference (it answers None): no scaler found."""


def _grad_scaler_types() -> tuple[type, ...]:
    """``torch.amp.GradScaler`` (torch 2.3 on; ``torch.cuda.amp``'s and FSDP's sharded one are subclasses),
    and ``torch.cuda.amp.GradScaler`` where it is not one (an older torch)."""
    kinds = [k for k in (getattr(torch.amp, "GradScaler", None),) if isinstance(k, type)]
    cuda = getattr(getattr(torch.cuda, "amp", None), "GradScaler", None)
    if isinstance(cuda, type) and not any(issubclass(cuda, k) for k in kinds):
        kinds.append(cuda)
    return tuple(kinds)


def _in_use(obj: Any, kinds: tuple[type, ...]) -> bool:
    """An enabled GradScaler that has scaled a loss (its scale made)."""
    # by type: ``isinstance`` asks ``__class__``, which a dead ``weakref.proxy`` answers with ReferenceError
    if not issubclass(type(obj), kinds) or scale_tensor(obj) is None:
        return False
    enabled = getattr(obj, "is_enabled", None)
    return bool(enabled()) if callable(enabled) else False


def scalers_in_callers(frame: Any) -> list[Any]:
    """The GradScalers in use held by ``frame`` and its callers (up to :data:`FRAMES_LOOKED`): their
    locals' and globals' values, and those values' own attributes (one level), each once."""
    kinds, found, seen = _grad_scaler_types(), {}, set()
    for _ in range(FRAMES_LOOKED):
        if frame is None:
            break
        snapshot = _SNAPSHOT_LOCALS and bool(frame.f_code.co_flags & inspect.CO_OPTIMIZED)  # a function's
        for namespace in (frame.f_locals, frame.f_globals):
            if id(namespace) in seen:
                continue
            seen.add(id(namespace))
            values = list(namespace.values())
            if snapshot and namespace is not frame.f_globals:
                namespace.clear()  # the copy stored on the frame: it would hold the step's locals alive
            snapshot = False
            _take_all(values, kinds, found)
        frame = frame.f_back
    return list(found.values())


def _take_all(values: list[Any], kinds: tuple[type, ...], found: dict[int, Any]) -> None:
    for value in values:
        _take(value, kinds, found)
        if issubclass(type(value), _NOT_OBJECTS):
            continue
        try:
            attributes = object.__getattribute__(value, "__dict__")
        except Exception:  # no __dict__ (slots, a C object): nothing one level down
            continue
        if isinstance(attributes, dict):
            for inner in list(attributes.values()):
                _take(inner, kinds, found)


def _take(value: Any, kinds: tuple[type, ...], found: dict[int, Any]) -> None:
    if _in_use(value, kinds):
        found.setdefault(id(value), value)


class _OnTrial:
    """The scaler found at an optimizer's step whose ``unscale_`` had not run: in :attr:`UnnamedScaler.found`
    until the next step calls it (as a weak reference is called), which keeps it (``scaler.step`` of that
    optimizer ran: its key is in the per-step state of the step found) or drops it, with the warning."""

    __slots__ = ("owner", "key", "keys", "scaler", "states", "sink", "warning", "log")

    def __init__(self, owner: UnnamedScaler, optimizer: Any, scaler: Any, sink: Any, warning: Anomaly, log: bool):
        self.owner, self.key, self.sink, self.warning, self.log = owner, id(optimizer), sink, warning, log
        self.keys = {id(optimizer), id(raw_optimizer(optimizer))}
        self.scaler = weakref.ref(scaler)
        self.states = getattr(scaler, "_per_optimizer_states", None)  # the step found's: update() replaces it

    def __call__(self) -> Any:
        scaler = self.scaler()
        if scaler is not None and getattr(scaler, "_per_optimizer_states", None) is self.states:
            return scaler  # no update() since the step found: nothing to tell yet
        if scaler is not None and isinstance(self.states, dict) and not self.keys.isdisjoint(self.states):
            self.owner.found[self.key] = self.scaler
            return scaler
        self.owner.found[self.key] = NO_SCALER
        if scaler is not None:
            try:
                self.sink.emit(self.warning, ("grad_scaler_not_given", "dropped", self.key), log=self.log)
            except Exception as error:  # never breaks the step that calls it
                self.sink.debugger_error("dropping the GradScaler found", error, step=self.warning.step)
        return None


class UnnamedScaler:
    """The GradScaler found in use though not passed (see the module docstring): looked for once an
    optimizer (:attr:`sought`), then taken as the scaler of that optimizer's steps (:attr:`found`; a GAN's
    other optimizer, whose loss it may not scale, is looked for at a step of its own)::

        scaler = scalers.found.get(id(optimizer), NO_SCALER)()  # None: none found (no Python call)
    """

    __slots__ = ("sought", "found")

    def __init__(self) -> None:
        self.sought: set[int] = set()
        """The optimizers (by ``id``) whose steps were looked at."""
        self.found: dict[int, weakref.ref] = {}
        """Per optimizer (by ``id``), a weak reference to the scaler found at one of its steps (or, until its
        next step, the scaler on trial: :class:`_OnTrial`; called alike)."""

    def read_unscaled(
        self, sink: Any, step: Any, row: StepRow, local: LocalReadings, measured: Measurement, call: Any, ctx: Any
    ) -> tuple[StepRow, LocalReadings]:
        """At a step whose gradients look scaled (the monitor's test on ``row``): where no scaler is known
        (``step.last``, the ``training.step.state.MonitoredStep``), once a run, :meth:`seek` from the
        monitor's caller, its finding emitted through ``sink`` (``core.AnomalySink``) and the scaler
        found made the step's (``step.last``). Never raises (before the step's collectives): an error
        of ours is recorded and the row left as it is."""
        if (
            id(call.optimizer) in self.sought
            or call.scaler is not None  # given, if disabled: the user's answer
            or step.last is None
            or step.last[1] is not None
            or row.scaled
        ):
            return row, local
        try:
            frame = sys._getframe(1)
            row, local, found = self.seek(
                row, local, measured, call.optimizer, step=step.index, rank=ctx.rank, frame=frame
            )
            scaler = self.taken(call.optimizer, found, sink, ctx.is_main)
        except Exception as error:
            sink.debugger_error("looking for the GradScaler in use", error, step=step.index, rank=ctx.rank)
            return row, local
        finally:
            frame = None  # no reference cycle through the frames
        if found is not None:
            sink.emit(found, log=ctx.is_main)
        if scaler is not None:  # the skip of this step, told at the next one (or at close), is the scaler's
            step.last = (step.last[0], scaler, getattr(scaler, "_per_optimizer_states", None))
        return row, local

    def seek(
        self,
        row: StepRow,
        local: LocalReadings,
        measured: Measurement,
        optimizer: Any,
        *,
        step: Any,
        rank: int,
        frame: Any,
    ) -> tuple[StepRow, LocalReadings, Anomaly | None]:
        """Once an ``optimizer``: the GradScaler the code of ``frame`` (the monitor's caller) and its callers
        hold. Found alone: ``row`` and ``local`` read unscaled (``measured.norms`` too) and the info that says
        so; several: the warning; none: nothing. The row and readings as they are but where one was found."""
        self.sought.add(id(optimizer))
        held = scalers_in_callers(frame)
        if not held:
            return row, local, None
        if len(held) > 1:
            details = {"scalers": len(held), "grad_norm": row.grad_norm}
            where = {"component": "model", "step": step, "rank": rank}
            return row, local, make_anomaly("grad_scaler_not_given", severity="warning", **where, details=details)
        scaler = held[0]
        scale = float(scaler.get_scale())
        unscaled = scaler_already_unscaled(scaler, optimizer)
        divisor = 1.0 if unscaled or not scale > 0 else scale
        details = {"scale": scale, "grad_norm_read": row.grad_norm, "already_unscaled": unscaled}
        row = dataclasses.replace(row, grad_norm=row.grad_norm / divisor, grad_scale=scale)
        if divisor != 1.0:
            changes = {
                name: [v / divisor for v in values]
                for name in ("param_norms", "module_norms")
                if (values := getattr(local, name)) is not None
            }
            local = dataclasses.replace(local, **changes)
            if measured.norms is not None:
                measured.norms = measured.norms / divisor
        details["grad_norm"] = row.grad_norm
        where = {"component": "model", "step": step, "rank": rank}
        found = make_anomaly("grad_scaler_not_given", severity="info", **where, details=details)
        found.details["_scaler"] = scaler  # for :meth:`taken`, which removes it
        return row, local, found

    def taken(self, optimizer: Any, found: Anomaly | None, sink: Any, log: bool) -> Any:
        """The scaler ``found`` (the info of :meth:`seek`) made ``optimizer``'s: kept if ``unscale_(optimizer)``
        ran, else on trial until its next step (:class:`_OnTrial`). The scaler, or None (none found)."""
        scaler = found.details.pop("_scaler", None) if found is not None else None
        if scaler is None:
            return None
        d = found.details
        if d["already_unscaled"]:
            self.found[id(optimizer)] = weakref.ref(scaler)
            return scaler
        details = {"dropped": True, "scale": d["scale"], "grad_norm": d["grad_norm_read"]}
        details["grad_norm_unscaled"] = d["grad_norm"]
        where = {"component": "model", "step": found.step, "rank": found.rank}
        warning = make_anomaly("grad_scaler_not_given", severity="warning", **where, details=details)
        self.found[id(optimizer)] = _OnTrial(self, optimizer, scaler, sink, warning, log)
        return scaler
