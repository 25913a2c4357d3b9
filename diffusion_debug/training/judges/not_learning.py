"""A run that does not learn: the optimizer steps move no weight although the gradients are
normal (:class:`StallWatch`), and which of the usual causes it looks like (:func:`diagnose`).

The update each optimizer step applied comes from the weights themselves (``updates``: the
sketch's ``||dw|| / ||w||`` per module, known at the next monitored step). When
:data:`STALL_UPDATES` updates in a row moved no module by more than :data:`STILL_RATIO` of its
norm while the gradients they should have applied were finite and above the vanishing threshold,
the run is stalled at the step that showed the last of them; the cause is read from the
optimizer, once: it holds none of the watched parameters, or its learning rate is 0 for them, or
the weights are fp16/bf16 and every update rounds away (the optimizer keeps state for them, or
it keeps none, as SGD without momentum, and a plain step ``lr x |g| / |w|`` is below half the
dtype's epsilon), else what ``optimizer.step()`` itself received (:class:`StepGradients`, a step
pre-hook on each optimizer the debugger is given, from its first step judged, reading only while a run of
still updates lasts; a compiled step reads nothing; of several optimizers, the one that stepped last is
diagnosed and named, ``stepped_optimizer``): no
gradient at all (``gradients_cleared``: ``zero_grad()`` between ``backward()`` and ``step()``), zeroed
ones (``gradients_zeroed``: a mask or hook between the monitor and the step zeroed the rows that should
learn, as a textual-inversion mask that misses the placeholder token), or the gradients the monitor read
(``undone_after_step``: the step applied them and something after it put the weights back). Where no
step was seen (an optimizer without step hooks) an optimizer without state for the watched parameters is
read as cleared gradients, as AdamW's is; SGD without momentum keeps none whatever happens, so there only
the step's hook tells. DeepSpeed's engine steps copies of the watched tensors (ZeRO-1/2's flat partitions,
whose step hook fires but reads nothing of theirs): past an lr of 0 the cause is ``unknown`` there.

>>> watch = StallWatch()
>>> [watch.update(step, {"a": 0.0, "b": 0.0}, grad_norm=0.5, skipped=False) for step in range(5)]
[False, False, False, False, True]
>>> watch.first_step, watch.updates, watch.largest
(0, 5, 0.0)

Under several processes a stall is the whole model's, not one rank's: each rank says whether the
update it read moved its weights (:attr:`StallWatch.moved`, a flag of the step's one reduce), and
where any rank's did, every rank's run of still updates ends and a ``not_learning`` found at that
step is withdrawn before the ranks exchange their anomalies (``LocalJudge.judge_across_ranks``). Under
FSDP2 or ZeRO a rank's shard may never move while the run learns: textual inversion trains an
embedding table's new rows, all in the last rank's shard, and puts every other row back.

>>> watch.moved, watch.flagged
(False, True)
>>> watch.some_rank_moved()  # another rank's shard moved in the update read at this step
>>> watch.updates, watch.flagged
(0, False)

Before a stall is reported the whole weights are checked too (their float64 norms, read when the run of
still updates began and again at its end: two host reads per :data:`STALL_UPDATES` steps while
the sampled blocks stay still), since the ratios come from one sampled block per parameter.

Limits: a step skipped by the GradScaler (or by policy ``skip``) restarts the count, and a
warmup that starts at lr 0 moves nothing for one step (five are needed). Across ranks an update
counts where every rank reads it: every rank reads the steps the schedule details on every rank
(``step.detail``: the first ten, then one in five), so each run of five still updates holds one of
them; a shard that moves only in updates another rank alone read is not seen moving. A rank that
reads every step after a finding of its own may count five still updates before the next such step,
and its stall is withdrawn there (the reduce's ``stalled`` flag apart from ``anomalies``: a withdrawn stall
costs no details exchange). Weight decay
alone still moves the weights (AdamW with ``zero_grad(set_to_none=False)`` before ``step()``): such
a run is not reported. The diagnosis is an elimination from what the optimizer shows, not a proof.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from ...record import Anomaly, make_anomaly
from ...stats import read_now
from ..measure import gradients
from ..measure.deepspeed_fp16_scale import ISSUE, LossScaling
from ..measure.gradients import TrainableParameters
from ..measure.optimizer_state import param_groups, raw_optimizer

STALL_UPDATES = 5
"""Updates in a row that moved nothing before the run is reported."""
STILL_RATIO = 1e-9
"""An update below this share of every module's norm moved nothing (one float32 rounding step of
one sampled element is already about 1e-8 of a 128-element block)."""
_LOW_PRECISION = (torch.float16, torch.bfloat16)
ZEROED_RATIO = 1e-6
"""Gradients that reach ``optimizer.step()`` below this share of the norm the monitor read were zeroed
between the two (a mask, a hook), not applied."""
UNSCALED_LOSS = "deepspeed_fp16_unscaled_loss"
"""``not_learning``'s reason where DeepSpeed's fp16 engine without ZeRO backpropagated the loss unscaled
(``measure.deepspeed_fp16_scale``): found at the first monitored step (:func:`judge_unscaled_loss`)."""


@dataclass
class StallWatch:
    """The current run of updates that moved nothing, and the gradient norm of the step whose
    update the next reading shows."""

    first_step: Any = None
    last_step: Any = None
    updates: int = 0
    largest: float = 0.0
    """The largest module ratio over the run of still updates."""
    grad_norm: float = math.nan
    """The smallest gradient norm over that run (each one normal)."""
    pending_grad_norm: float = math.nan
    """The global gradient norm of the last monitored step: the gradients its update should apply."""
    flagged: bool = False
    policy_skipped: bool = False
    """Policy ``skip`` zeroed the last step's gradients: its update is not judged."""
    fingerprint: list[float] | None = None
    """The whole weights' float64 norms when this run of still updates began (see :meth:`update`)."""
    moved: bool = False
    """The last update taken moved this rank's weights (its sampled blocks, or the whole weights checked
    before a report): under several processes every rank learns whether any rank's did
    (:meth:`some_rank_moved`)."""
    seen: StepGradients = field(default_factory=lambda: StepGradients())
    """What the optimizer's step received, watched while a run of still updates lasts (:meth:`follow_step`)."""

    def follow_step(self, optimizer: Any, params: TrainableParameters) -> None:
        """Watch what ``optimizer.step()`` receives while a run of still updates is counted and not yet
        reported (the diagnosis reads it); otherwise pause the watch. The hook goes on ``optimizer`` at the
        first call with it (its first step judged, before the user's step is ever compiled) and stays to
        close, beside each other optimizer's: put on and taken off, it recompiled a ``torch.compile``'d step
        each time."""
        if optimizer is None:
            return
        still = bool(self.updates) and not self.flagged
        if self.seen.active and not still:
            self.seen.pause()
        self.seen.watch(optimizer, params, active=still)

    def update(
        self,
        update_step: Any,
        ratios: dict[str, float],
        *,
        grad_norm: float,
        skipped: bool,
        weights: Callable[[], list[float]] | None = None,
    ) -> bool:
        """Take the update of ``update_step`` (its per-module ratios) and the norm of the gradients
        it should have applied; True when this update makes the stall clear. ``weights``: the whole
        weights' float64 norms, read when a run of still updates begins and again before it is reported:
        the ratios come from a sampled block of each parameter, and a run that moves only rows
        outside it (textual inversion trains one row of the token embedding) is not stalled."""
        skipped, self.policy_skipped = skipped or self.policy_skipped, False
        values = np.fromiter(ratios.values(), dtype=np.float64, count=len(ratios))
        finite = values[np.isfinite(values)]  # one numpy pass where a per-module loop ran every step
        largest = float(finite.max()) if len(finite) else math.nan
        still = bool(len(finite)) and largest <= STILL_RATIO
        self.moved = largest > STILL_RATIO  # NaN (no finite ratio): not known to have moved
        if skipped or not still or not (math.isfinite(grad_norm) and grad_norm > 0):
            self.updates, self.flagged = 0, self.flagged and still
            return False
        if self.updates == 0:
            self.first_step, self.largest, self.grad_norm = update_step, 0.0, grad_norm
            self.fingerprint = weights() if weights is not None else None
        self.updates += 1
        self.last_step = update_step
        self.largest = max(self.largest, largest)
        self.grad_norm = min(self.grad_norm, grad_norm)
        if self.updates >= STALL_UPDATES and not self.flagged:
            if weights is not None and weights() != self.fingerprint:  # moved outside the sampled blocks
                self.updates, self.moved = 0, True
                return False
            self.flagged = True
            return True
        return False

    def some_rank_moved(self) -> None:
        """Some rank's weights moved in the update this step read (this rank's or another's: a rank's
        shard of a parameter, FSDP2's or ZeRO's, may never move while another rank's does): the run
        learns, so its run of still updates ends, and a stall reported before may be reported again
        once one is clear."""
        self.updates, self.flagged = 0, False


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
    >>> seen.stepped() is optimizer, seen.name()  # one optimizer: no name needed
    (True, None)
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
            if groups is None or params.deepspeed is not None or not hasattr(inner, "register_step_pre_hook"):
                return
            self.params = params
            self.hooks[id(inner)] = (weakref.ref(inner), inner.register_step_pre_hook(self._stepping))
            if self.active:
                self.holds[id(inner)] = self._held_by(inner)
        if active and not self.active:
            for key, (ref, _) in self.hooks.items():
                self.holds[key] = self._held_by(ref())
            self.active = any(self.holds.values())  # (FSDP1's flat parameters: the watched ones are not its own)

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

    def read(self) -> dict[str, Any] | None:
        """What the last step received (None: no step seen): ``held_at_step``, ``cleared_at_step`` (of
        them, how many had no gradient) and ``grad_norm_at_step`` (the others' norm). One host read."""
        if self.cleared < 0 or self.norms is None:
            return None
        norms = read_now(self.norms.double())
        norm = math.sqrt(sum(norms[i] ** 2 for i in self.held))
        return {"held_at_step": len(self.held), "cleared_at_step": self.cleared, "grad_norm_at_step": norm}

    def name(self) -> str | None:
        """Which optimizer stepped last, where several hooked ones hold watched parameters (else None): its
        class and the first watched parameter it holds (``"SGD holding discriminator.0.weight and 3 more"``;
        one that holds none of them is never the one read)."""
        stepped = self.stepped()
        live = sum(ref() is not None and bool(self.holds.get(key)) for key, (ref, _) in self.hooks.items())
        if live < 2 or stepped is None or self.params is None:
            return None
        more = f" and {len(self.held) - 1} more" if len(self.held) > 1 else ""
        return f"{type(stepped).__name__} holding {self.params.names[self.held[0]]}{more}"

    def pause(self) -> None:
        """Read no step from now, and forget what was seen (the hooks stay on)."""
        self.active, self.norms, self.cleared, self.held, self.holds = False, None, -1, [], {}
        self.stepped = lambda: None

    def stop(self) -> None:
        """Take the hooks off and forget what they saw."""
        hooks, self.hooks = self.hooks, {}
        for _, handle in hooks.values():
            handle.remove()
        self.followed = {id(None): None}
        self.params = None
        self.pause()


def diagnose(
    optimizer: Any, params: TrainableParameters, grad_norm: float = math.nan, seen: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Which cause a stalled run looks like (``reason``), with what the optimizer shows
    (``grad_norm``: the gradients' norm over the stalled updates; ``seen``: what its last step
    received, :meth:`StepGradients.read`)."""
    scaling = getattr(getattr(params, "deepspeed", None), "scaling", None)
    unscaled = scaling.unscaled() if scaling is not None else None
    if unscaled is not None:  # DeepSpeed fp16 without ZeRO: every update loss_scale x too small
        return {"reason": UNSCALED_LOSS, **unscaled, "issue": ISSUE}
    groups = param_groups(optimizer)
    if groups is None:
        return {"reason": "unknown"}
    watched = {id(p) for p in params.params}
    holding = [g for g in groups if any(id(p) in watched for p in g["params"])]
    held = [p for g in holding for p in g["params"] if id(p) in watched]
    evidence: dict[str, Any] = {
        "watched_parameters": len(params),
        "held_by_optimizer": len(held),
        "other_parameters": sum(1 for g in groups for p in g["params"] if id(p) not in watched),
    }
    # DeepSpeed's engine trains copies of the watched tensors (ZeRO's flat partitions, fp16/bf16's float32
    # masters): none held, yet its step's gradients and its state are theirs, not to be read for the watched
    copies = not holding and getattr(params, "deepspeed", None) is not None
    if not holding and not copies:
        return {"reason": "optimizer_params", **evidence}
    # a group's lr None is an optimizer that makes its own (transformers' Adafactor, relative_step)
    known = [float(g["lr"]) for g in holding or groups if g.get("lr") is not None]
    evidence["lr"] = max(known) if known else None
    if evidence["lr"] == 0 and len(known) == len(holding or groups):
        return {"reason": "lr_zero", **evidence}
    if copies:  # no cause told rather than a wrong one
        return {"reason": "unknown", **evidence}
    state = getattr(raw_optimizer(optimizer), "state", {})
    evidence["state_empty"] = all(not state.get(p) for p in held)
    low = sorted({str(p.dtype).removeprefix("torch.") for p in held if p.dtype in _LOW_PRECISION})
    if low and not evidence["state_empty"]:
        return {"reason": "below_precision", "dtype": "/".join(low), **evidence}
    if low and evidence["lr"] is not None:  # no state: cleared gradients, or an optimizer that keeps none (SGD)
        resolution = max(float(torch.finfo(p.dtype).eps) for p in held if p.dtype in _LOW_PRECISION) / 2
        weight_norm = math.sqrt(sum(float(p.detach().double().square().sum()) for p in held))
        evidence["step_ratio"] = evidence["lr"] * grad_norm / weight_norm if weight_norm > 0 else math.inf
        if evidence["step_ratio"] < resolution:  # lr x |g| / |w|: a plain gradient step rounds away
            return {"reason": "below_precision", "dtype": "/".join(low), **evidence}
    if seen is None:  # no step seen: an optimizer without state for them saw no gradient (SGD keeps none anyway)
        return {"reason": "gradients_cleared", **evidence}
    evidence.update(seen)
    if seen["cleared_at_step"] == seen["held_at_step"]:
        return {"reason": "gradients_cleared", **evidence}
    monitored = grad_norm if math.isfinite(grad_norm) else 0.0  # none known: zeroed means exactly 0
    if seen["grad_norm_at_step"] <= ZEROED_RATIO * monitored:
        return {"reason": "gradients_zeroed", **evidence}
    return {"reason": "undone_after_step", **evidence}


def judge_stall(rank: int, watch: StallWatch, step: Any, optimizer: Any, params: TrainableParameters) -> list[Anomaly]:
    """``not_learning`` at ``step``, the monitored step whose reading made the stall clear."""
    stepped = watch.seen.stepped()  # the optimizer whose step the last still update was (a GAN's two: either)
    details = {
        **diagnose(optimizer if stepped is None else stepped, params, watch.grad_norm, watch.seen.read()),
        "first_step": watch.first_step,
        "last_step": watch.last_step,
        "updates": watch.updates,
        "max_update_ratio": watch.largest,
        "grad_norm": watch.grad_norm,
    }
    if name := watch.seen.name():
        details["stepped_optimizer"] = name
    return [
        make_anomaly(
            kind="not_learning", severity="warning", component="optimizer", step=step, rank=rank, details=details
        )
    ]


def judge_unscaled_loss(rank: int, step: Any, scaling: LossScaling) -> list[Anomaly]:
    """``not_learning`` at the first monitored step where DeepSpeed's fp16 engine without ZeRO left the loss
    unscaled in ``engine.backward`` while its optimizer's step divides the gradients by the loss scale
    (deepspeedai/DeepSpeed#8393: every update ``loss_scale`` x too small), else nothing."""
    found = scaling.unscaled()
    if found is None:
        return []
    details = {"reason": UNSCALED_LOSS, **found, "issue": ISSUE}
    return [
        make_anomaly(
            kind="not_learning", severity="warning", component="optimizer", step=step, rank=rank, details=details
        )
    ]
