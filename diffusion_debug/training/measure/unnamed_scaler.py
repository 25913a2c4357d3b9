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
Several: a warning names the fix (``scaler=``) and the gradients are read as they are.

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
import sys
import types
import weakref
from typing import Any

import torch

from ...record import Anomaly, make_anomaly
from .optimizer_state import scale_tensor, scaler_already_unscaled
from .step_row import LocalReadings, Measurement, StepRow

FRAMES_LOOKED = 16
"""Calling frames whose locals and globals are looked through."""
_NOT_OBJECTS = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.MethodType)


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
        for namespace in (frame.f_locals, frame.f_globals):
            if id(namespace) in seen:
                continue
            seen.add(id(namespace))
            for value in list(namespace.values()):
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
        frame = frame.f_back
    return list(found.values())


def _take(value: Any, kinds: tuple[type, ...], found: dict[int, Any]) -> None:
    if _in_use(value, kinds):
        found.setdefault(id(value), value)


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
        """Per optimizer (by ``id``), a weak reference to the scaler found at one of its steps."""

    def read_unscaled(
        self, sink: Any, step: Any, row: StepRow, local: LocalReadings, measured: Measurement, call: Any, ctx: Any
    ) -> tuple[StepRow, LocalReadings]:
        """At a step whose gradients look scaled (the monitor's test on ``row``): where no scaler is known
        (``step.last``, the ``training.step.state.MonitoredStep``), once a run, :meth:`seek` from the
        monitor's caller, its finding emitted through ``sink`` (``core.AnomalySink``) and the scaler
        found made the step's (``step.last``). Never raises (before the step's collectives): an error
        of ours is recorded and the row left as it is."""
        if id(call.optimizer) in self.sought or step.last is None or step.last[1] is not None or row.scaled:
            return row, local
        try:
            frame = sys._getframe(1)
            row, local, found = self.seek(
                row, local, measured, call.optimizer, step=step.index, rank=ctx.rank, frame=frame
            )
        except Exception as error:
            sink.debugger_error("looking for the GradScaler in use", error, step=step.index, rank=ctx.rank)
            return row, local
        finally:
            frame = None  # no reference cycle through the frames
        if found is not None:
            sink.emit(found, log=ctx.is_main)
        scaler = self.found.get(id(call.optimizer), NO_SCALER)()
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
        try:
            self.found[id(optimizer)] = weakref.ref(scaler)
        except TypeError:  # no weak reference: not kept (looked for once all the same)
            pass
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
        return row, local, make_anomaly("grad_scaler_not_given", severity="info", **where, details=details)
