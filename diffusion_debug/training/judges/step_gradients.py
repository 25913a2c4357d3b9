"""What ``optimizer.step()`` received for the watched parameters (:class:`StepGradients`): a step pre-hook on
each optimizer the training debugger is given, read while ``not_learning``'s run of still updates lasts, whose
reading tells cleared, zeroed and undone updates apart (``judges.stall_causes.diagnose``); and how a report
names one optimizer of several (:func:`named`)."""

from __future__ import annotations

import math
import weakref
from typing import Any, Callable

import torch

from ...stats import read_now
from ..measure import gradients
from ..measure.gradients import TrainableParameters
from ..measure.optimizer_state import param_groups, raw_optimizer


class StepGradients:
    """What the last ``optimizer.step()`` received for the watched parameters its optimizer holds: how many
    had no gradient (``None``) and the norm of the others, kept on the device (read once, by a report). A
    step pre-hook on each optimizer the debugger is given (a GAN's two: the stall's update is the step of
    the one that stepped last), put on once (its first step judged) and reading only while
    :class:`StallWatch` counts still updates (:attr:`active`); it never raises into the user's step (a
    failure leaves nothing seen). A hook added or removed between steps recompiles a ``torch.compile``'d
    ``optimizer.step()`` (its guards hold the step's hooks), so it stays on, and compiled it reads nothing:
    the diagnosis is then the one without a step's reading. A step given a closure (``torch.optim.LBFGS``'s
    ``step(closure)``) applies the gradients its closure makes: they are read after its first call.

    >>> layer = torch.nn.Linear(2, 2)
    >>> optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    >>> seen = StepGradients()
    >>> seen.watch(optimizer, TrainableParameters.of(layer))
    >>> layer(torch.ones(2)).sum().backward()
    >>> layer.weight.grad = None  # cleared; the bias's gradient is ones
    >>> optimizer.step()
    >>> found = seen.read()
    >>> found["held_at_step"], found["cleared_at_step"], round(found["grad_norm_at_step"], 4)
    (2, 1, 1.4142)
    >>> seen.stepped() is optimizer
    True
    >>> seen.stop(); seen.hooks
    {}
    """

    def __init__(self) -> None:
        self.hooks: dict[int, tuple[weakref.ref, Any]] = {}
        """Each hooked torch optimizer's (by id; weakly: a user's optimizer replaced mid-run is not kept) and
        its hook's handle, in the order they were put on."""
        self.followed: dict[int, Any] = {id(None): None}
        """The optimizers :meth:`watch` was given (by id, weakly; None's: a step without one asks nothing):
        a monitored step asks for the hook only with one not in it (no call on a clean run's step)."""
        self.params: TrainableParameters | None = None
        self.active = False
        """The hooks read the step (a run of still updates is counted)."""
        self.holds: dict[int, list[int]] = {}
        """While active, the indices (in ``params``) of the watched parameters each hooked optimizer holds."""
        self.held: list[int] = []
        """Those of the optimizer whose step was read last."""
        self.stepped: Callable[[], Any] = lambda: None
        """The torch optimizer whose step was read last (while active; weakly)."""
        self.cleared = -1
        """How many of them had no gradient at the last step (-1: no step seen)."""
        self.norms: torch.Tensor | None = None
        self.readings: dict[int, tuple[list[int], int, torch.Tensor | None]] = {}
        """While active, each hooked optimizer's last step read (by ``id``): its :attr:`held`, :attr:`cleared`
        and norms, for the diagnosis of one optimizer's own stall of several (:meth:`read`)."""

    def watch(self, optimizer: Any, params: TrainableParameters, active: bool = True) -> None:
        """Put the hook on ``optimizer`` (the torch one inside a wrapper) once, where it stays beside any
        other optimizer's, and read the steps of every hooked optimizer from now (``active``), the parameters
        each holds listed then (a group added mid-run counts)."""
        if id(optimizer) not in self.followed:
            try:  # its id leaves with it (another optimizer may get it)
                key, followed = id(optimizer), self.followed
                followed[key] = weakref.ref(optimizer, lambda _, key=key: followed.pop(key, None))
            except TypeError:  # no weak reference: its id stays
                self.followed[id(optimizer)] = None
        inner = raw_optimizer(optimizer)
        hooked = self.hooks.get(id(inner))
        if hooked is None or hooked[0]() is not inner:
            for key in [key for key, (ref, _) in self.hooks.items() if ref() is None]:  # gone optimizers'
                self.hooks.pop(key)[1].remove()  # (a loop making an optimizer an epoch piles up none)
                self.holds.pop(key, None)
            groups = param_groups(inner)
            # ZeRO's flat partitions (``params.partitions``): its step hook fires, their .grad is in ZeRO's buckets
            if groups is None or params.partitions is not None or not hasattr(inner, "register_step_pre_hook"):
                return
            if params.deepspeed is not None and not _holds_any(groups, params):  # stage 0's float32 copies
                return
            self.params = params
            self.hooks[id(inner)] = (weakref.ref(inner), inner.register_step_pre_hook(self._stepping))
            if self.active:
                self.holds[id(inner)] = self._held_by(inner)
        if active and not self.active:
            for key, (ref, _) in self.hooks.items():
                self.holds[key] = self._held_by(ref())
            self.active = any(self.holds.values())  # (FSDP1's flat parameters: the watched ones are not its own)

    def rehold(self) -> None:
        """The watched parameters changed (joined mid-run): each hooked optimizer's listed again while active."""
        if self.active:
            for key, (ref, _) in self.hooks.items():
                self.holds[key] = self._held_by(ref())

    def _held_by(self, inner: Any) -> list[int]:
        """The indices (in ``params``) of the watched parameters ``inner`` holds (none where it is gone)."""
        groups = (param_groups(inner) if inner is not None else None) or ()
        held = {id(p) for g in groups for p in g["params"]}
        assert self.params is not None
        return [i for i, p in enumerate(self.params.params) if id(p) in held]

    def _stepping(self, optimizer: Any, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        if torch.compiler.is_dynamo_compiling() or not self.active:  # first: no guard on ``active`` when compiled
            return None
        held = self.holds.get(id(optimizer), [])
        if not held:  # one that holds none of them (a GAN's unwatched model's): the last reading stays
            return None
        self.stepped, self.cleared, self.norms, self.held = weakref.ref(optimizer), -1, None, held
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)  # (args[0]: the optimizer)
        if not callable(closure):  # no closure (or another argument in its place, passed on as given)
            self._read()
            return None
        # step(closure) (LBFGS): the closure makes the gradients the step applies; before it, they may be gone
        # (a zero_grad() that changes nothing there): read after its first call
        calls = [closure]

        def read_after(*a: Any, **k: Any) -> Any:
            loss = calls[0](*a, **k)
            if len(calls) == 1:
                calls.append(None)
                self._read()
            return loss

        if "closure" in kwargs:
            return args, {**kwargs, "closure": read_after}
        return (args[0], read_after, *args[2:]), kwargs

    def _read(self) -> None:
        """The watched gradients as the step receives them (never raises: a failure leaves nothing seen)."""
        try:
            assert self.params is not None
            grads = self.params.local_gradients()
            held = [grads[i] for i in self.held]
            self.cleared = sum(g is None for g in held)
            chosen = set(self.held)
            only = [g if i in chosen else None for i, g in enumerate(grads)]
            self.norms = gradients.grad_norms(self.params, self.params.params[0].device, only)
        except Exception:  # the user's step goes on: nothing seen
            self.cleared, self.norms = -1, None
        self.readings[id(self.stepped())] = (self.held, self.cleared, self.norms)

    def read(self, optimizer: Any = None) -> dict[str, Any] | None:
        """What the last step received (None: no step seen), or ``optimizer``'s last step (the torch one):
        ``held_at_step``, ``cleared_at_step`` (of them, how many had no gradient) and ``grad_norm_at_step``
        (the others' norm). One host read."""
        held, cleared, norms = self.held, self.cleared, self.norms
        if optimizer is not None:
            held, cleared, norms = self.readings.get(id(optimizer), ([], -1, None))
        if cleared < 0 or norms is None:
            return None
        values = read_now(norms.double())
        norm = math.sqrt(sum(values[i] ** 2 for i in held))
        return {"held_at_step": len(held), "cleared_at_step": cleared, "grad_norm_at_step": norm}

    def pause(self) -> None:
        """Read no step from now, and forget what was seen (the hooks stay on)."""
        self.active, self.norms, self.cleared, self.held, self.holds = False, None, -1, [], {}
        self.stepped, self.readings = lambda: None, {}

    def stop(self) -> None:
        """Take the hooks off and forget what they saw."""
        hooks, self.hooks = self.hooks, {}
        for _, handle in hooks.values():
            handle.remove()
        self.followed = {id(None): None}
        self.params = None
        self.pause()


def _holds_any(groups: list[dict], params: TrainableParameters) -> bool:
    watched = {id(p) for p in params.params}
    return any(id(p) in watched for g in groups for p in g["params"])


def named(optimizer: Any, held: list[int], params: TrainableParameters) -> str:
    """An optimizer of several, as a report names it: its class (the torch one) and the first watched parameter
    it holds (``held``: their indices), ``"SGD holding discriminator.0.weight and 3 more"``."""
    more = f" and {len(held) - 1} more" if len(held) > 1 else ""
    return f"{type(raw_optimizer(optimizer)).__name__} holding {params.names[held[0]]}{more}"
