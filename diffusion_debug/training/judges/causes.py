"""Cause before consequence, within a step and across steps. Pure: anomalies in, anomalies out.

Within a step (:func:`trace_causes`): a NaN loss or gradient that follows a NaN input, loss
weight or loss of the same step says so (``details["follows"]``); such NaN gradients are named by
their first registered parameter (``step_checks.named_by_registration``: every gradient holds the
NaN, so where backward met it says nothing), the same on every engine and rank.

Across steps (:class:`CauseTracker`): a consequence (a NaN loss, NaN gradients, a loss spike, an
exploding gradient norm) with no cause in its own step points at the earlier anomaly that
explains it (``details["cause"]``, :func:`~diffusion_debug.record.cause_reference`), and its
message says so by the cause's ``where()``; ``record.by_cause`` then puts the cause first, so
report.html's headline, the terminal summary and summary.json's ``headline`` name it.

* Weights that went non-finite (found by the monitor on a step whose own loss or gradients are
  NaN, :meth:`CauseTracker.weights_found`): the NaN loss says the weights went non-finite in the
  previous step's optimizer step, and names what explains that update: that step's NaN gradients
  (or, when they follow a NaN loss, input or loss weight of that step, this rank's or another's
  that DDP averaged into every rank, that origin: the earliest cause), else a learning-rate jump,
  else a new ``nonfinite_update`` anomaly at that step.
* Sharded weights (FSDP2, FSDP1) finite on this rank: a NaN loss or NaN gradients follow the
  previous monitored step's NaN gradients of any rank (applied to that rank's shard, which every
  rank's forward all-gathers), or what those follow; not an earlier step's (a finite step between:
  that update was left out, as by a loop that skips a NaN step).
* With finite weights and no jump, a NaN loss points at the ``unwatched_parameters`` warning when
  the optimizer trains parameters the debugger does not watch (the suspects it cannot see).
* With finite weights: the latest ``lr_spike`` (a learning-rate jump, or an update that moved
  modules by more than their own norm) of an earlier step, at most :data:`CAUSE_WINDOW`
  monitored steps back.

>>> from diffusion_debug.record import make_anomaly
>>> tracker = CauseTracker()
>>> jump = make_anomaly("lr_spike", component="optimizer", step=5,
...                     details={"reason": "lr_jump", "lr_before": 1e-4, "lr": 100.0, "factor": 1e6})
>>> tracker.remember([jump], joined=6)
>>> nan = make_anomaly("nonfinite_loss", component="model", step=6, details={"loss": float("nan")})
>>> (linked,) = tracker.link([nan], rank=0, joined=7)
>>> print(linked.message)
The loss is nan at step 6 on rank 0; it follows the lr_spike at optimizer, step 5: fix that first.

Limits: a link is an inference from the order of events, not a proof: a NaN loss within
:data:`CAUSE_WINDOW` steps of a learning-rate jump is blamed on it. Weights are known non-finite
only where they were checked (steps whose own loss or gradients are NaN), so "went non-finite in
the optimizer step of step k" assumes they were finite at step k, whose loss was judged.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from ...record import Anomaly, by_cause, cause_reference, followed_key, follows_key, make_anomaly, rebuilt
from .step_checks import named_by_registration

_FORWARD = "nonfinite made in a forward"
"""The role of a forward's ``nonfinite`` (:func:`made_in_forward`) among the step's causes; no kind."""
CAUSE_WINDOW = 10
"""Monitored steps during which a learning-rate jump (or an oversized update) explains a later
NaN loss, loss spike or gradient explosion."""

_CAUSED_BY = {
    "nonfinite_loss": (_FORWARD, "nonfinite_input", "nonfinite_loss_weight"),
    "nonfinite_input": (_FORWARD,),  # at a trained model's argument: another trained model's output
    "nonfinite": ("nonfinite_input", "nonfinite_loss_weight", "nonfinite_loss"),
    "gradient_explosion": ("nonfinite_input", "nonfinite_loss_weight", "nonfinite_loss"),
    "loss_spike": ("sample_loss_outlier",),
}
"""Same step: what each kind (:func:`_role`) follows from."""
_CONSEQUENCES = ("nonfinite_loss", "nonfinite", "gradient_explosion", "loss_spike", "gradient_vanishing", "lr_spike")
"""Kinds an earlier step can explain (an ``lr_spike`` only by its update: a jump of the lr is a cause)."""
_PARAMETERS_KEPT = 20
_WEIGHTS_EXPLAIN = ("nonfinite_loss", "nonfinite", "nonfinite_input")
"""Kinds this rank's non-finite weights explain (a ``nonfinite_input`` only at a trained model's argument)."""


def made_in_forward(anomaly: Anomaly) -> bool:
    """Whether ``anomaly`` is a ``nonfinite`` that launch's replay of a trained model's forward found at
    its producer (``details["localized_by"] == "forward replay"``): a cause of its step's NaN loss, where
    the step's NaN gradients (the same kind, a ``parameter`` named) follow that loss."""
    return anomaly.kind == "nonfinite" and anomaly.details.get("localized_by") == "forward replay"


def _role(anomaly: Anomaly) -> str:
    """The kind as cause and consequence see it: a forward's ``nonfinite`` (:func:`made_in_forward`) is
    not its step's NaN gradients."""
    return _FORWARD if made_in_forward(anomaly) else anomaly.kind


def at_trained_arguments(anomaly: Anomaly) -> bool:
    """Whether ``anomaly`` is a ``nonfinite_input`` seen first at a trained model's argument (launch's
    ``unet(encoder_hidden_states)``, ``details["trained_argument"]``), neither the batch
    (``batch[...]``, ``inputs[...]``) nor a frozen model's output (its component) nor a frozen
    model's argument (``vae.encoder(input)``: counted before any trained forward of its micro-step):
    a trained text encoder made it when its weights are non-finite."""
    return anomaly.kind == "nonfinite_input" and anomaly.details.get("trained_argument") is True


def trace_causes(anomalies: list[Anomaly]) -> list[Anomaly]:
    """The step's anomalies, cause before consequence (``record.by_cause``), with each NaN loss
    and NaN gradient that follows a NaN input or loss of the same step saying so
    (``details["follows"]``: the kind and rank of the first cause)."""
    ordered = by_cause(anomalies)
    out: list[Anomaly] = []
    for a in ordered:
        cause = _same_step_cause(a, ordered)
        if cause is not None and "follows" not in a.details:
            follows = {"kind": cause.kind, "rank": cause.rank}
            if cause.kind == "nonfinite_input" and cause.component != "input":  # a frozen model made it
                follows["component"] = cause.component
            elif made_in_forward(cause):  # a module of a trained model's forward made it
                follows.update(component=cause.component, module=cause.module)
            a = rebuilt(a, details={**a.details, "follows": follows})
        if cause is not None and a.kind == "nonfinite" and not made_in_forward(a):
            a = named_by_registration(a)
        if cause is not None and "cause" in cause.details and "cause" not in a.details:
            a = rebuilt(a, details={**a.details, "cause": cause.details["cause"]})  # one root for the whole chain
        out.append(a)
    return out


def _same_step_cause(anomaly: Anomaly, anomalies: list[Anomaly]) -> Anomaly | None:
    causes = _CAUSED_BY.get(_role(anomaly), ())
    if anomaly.kind == "nonfinite_input":  # only its own rank's trained forward feeds a trained model's argument
        if not at_trained_arguments(anomaly):
            return None
        return next(
            (c for c in anomalies if _role(c) in causes and (c.step, c.rank) == (anomaly.step, anomaly.rank)), None
        )
    return next((c for c in anomalies if _role(c) in causes and c.step == anomaly.step and c is not anomaly), None)


@dataclass
class NonfiniteWeights:
    """This rank's weights found non-finite, and the optimizer step that made them so."""

    update_step: Any
    """The monitored step whose ``optimizer.step()`` made them non-finite (None: they were
    non-finite at the first monitored step)."""
    count: int
    parameters: list[str]
    cause: dict[str, Any] | None = None
    """``cause_reference`` of what explains that update."""

    def details(self) -> dict[str, Any]:
        return {"update_step": self.update_step, "nonfinite_parameters": self.count, "parameters": self.parameters}


class CauseTracker:
    """The causes of the last :data:`CAUSE_WINDOW` monitored steps, and this rank's weights once
    found non-finite; links a step's consequences to them (see the module docstring)."""

    def __init__(self, shared_weights: bool = False) -> None:
        self.shared_weights = shared_weights
        """The weights are sharded over the ranks (FSDP2): one rank's non-finite update reaches every
        rank's forward through the all-gather, though the other ranks' own shards stay finite."""
        self._recent: deque[tuple[int, Anomaly]] = deque(maxlen=64)
        self.weights: NonfiniteWeights | None = None
        self.unwatched: dict[str, Any] | None = None
        """The main process's ``unwatched_parameters`` warning (``cause_reference``) when the optimizer
        trains parameters outside the watched models: what a NaN loss nothing watched explains follows."""

    def weights_found(
        self, parameters: list[str], module: str, update_step: Any, step: Any, rank: int
    ) -> Anomaly | None:
        """This rank's weights checked at ``step`` (``parameters``: the non-finite ones in
        registration order, the first in ``module``). Returns a ``nonfinite_update`` for ``update_step``
        when nothing earlier explains that update, else None."""
        if not parameters:
            self.weights = None
            return None
        if self.weights is not None:  # known since an earlier update: the same finding
            return None
        found = NonfiniteWeights(update_step, len(parameters), parameters[:_PARAMETERS_KEPT])
        self.weights = found
        if update_step is None:
            return None
        explained = self._update_cause(update_step, rank)
        if explained is not None:
            found.cause = root_cause(explained)
            return None
        details = {**found.details(), "detected_at_step": step}
        del details["update_step"]
        update = make_anomaly(
            kind="nonfinite_update",
            component="model",
            module=module,
            parameter=parameters[0],
            step=update_step,
            rank=rank,
            details=details,
        )
        found.cause = cause_reference(update)
        return update

    def _update_cause(self, update_step: Any, rank: int) -> Anomaly | None:
        """What explains the optimizer step of ``update_step``: its NaN gradients (this rank's
        first), or what they follow when it is remembered: the NaN loss, input or loss weight of
        that step (this rank's or another's, which DDP averaged into every rank's gradients), else
        the latest learning-rate jump at or before it."""
        nan_gradients = [a for _, a in self._recent if _role(a) == "nonfinite" and a.step == update_step]
        if nan_gradients:
            return self._followed(min(nan_gradients, key=lambda a: (a.rank != rank, a.rank)), rank)
        return next(
            (a for _, a in reversed(self._recent) if a.kind == "lr_spike" and _before(a.step, update_step, True)), None
        )

    def _followed(self, gradients: Anomaly, rank: int) -> Anomaly:
        """What the remembered NaN ``gradients`` follow in their own step when it is remembered (the
        NaN loss, input or loss weight; for a copy received through the reduction, the NaN gradients
        of the rank that made them), and what that follows in turn (the module of a trained model's
        forward that made the NaN loss), else themselves."""
        found, seen = gradients, set()
        while id(found) not in seen:  # down the chain: a NaN loss that follows a trained model's forward, its module
            seen.add(id(found))
            key = followed_key(found.details.get("follows") or {}, found.step, rank)
            found = next((a for _, a in self._recent if follows_key(a) == key), found)
        return found

    def renamed(self, pairs: list[tuple[Anomaly, Anomaly]]) -> None:
        """Anomalies named again (``watched``: several models): the cause kept for non-finite
        weights follows its ``nonfinite_update`` to its new place."""
        if self.weights is None or self.weights.cause is None:
            return
        for old, new in pairs:
            if old is not new and cause_reference(old) == self.weights.cause:
                self.weights.cause = cause_reference(new)

    def _consequence(self, anomaly: Anomaly, rank: int) -> bool:
        """Whether an earlier step can explain ``anomaly`` (:func:`_consequence`), or its NaN at a
        trained model's argument follows this rank's non-finite weights (:func:`at_trained_arguments`)."""
        if anomaly.kind == "nonfinite_input":
            return self.weights is not None and anomaly.rank == rank and at_trained_arguments(anomaly)
        return _consequence(anomaly)

    def has(self, kind: str, step: Any) -> bool:
        """Whether an anomaly of ``kind`` at ``step`` is among the remembered ones."""
        return any(a.kind == kind and a.step == step for _, a in self._recent)

    def link(self, anomalies: list[Anomaly], *, rank: int, joined: int) -> list[Anomaly]:
        """The step's anomalies, each consequence with no cause in its own step pointing at its
        earliest cause (this rank's non-finite weights first, else a recent learning-rate jump or
        oversized update, followed back to the jump that explains it)."""
        recent = [(j, a) for j, a in self._recent if joined - j <= CAUSE_WINDOW]
        out = list(anomalies)
        # the step's oversized updates first: the NaN loss of this step then finds their root
        for first_pass in (True, False):
            candidates = recent + [(joined, a) for a in out if a.kind == "lr_spike"]
            for i, a in enumerate(out):
                if (a.kind == "lr_spike") != first_pass or not self._consequence(a, rank):
                    continue
                if "cause" not in a.details and _same_step_cause(a, out) is None:
                    out[i] = self._linked(a, rank, candidates, joined)
        return out

    def _linked(self, anomaly: Anomaly, rank: int, candidates: list[tuple[int, Anomaly]], joined: int) -> Anomaly:
        if anomaly.kind == "nonfinite" and anomaly.severity != "error":
            return anomaly  # a GradScaler overflow: the scaler handles it
        details = dict(anomaly.details)
        # the weights are checked on this rank's NaN steps only: a finding is current for its NaN loss and
        # gradients, and for the NaN its trained text encoder fed the trained model
        if self.weights is not None and anomaly.rank == rank and anomaly.kind in _WEIGHTS_EXPLAIN:
            details["weights"] = self.weights.details()
            if self.weights.cause is not None:
                details["cause"] = self.weights.cause
            return rebuilt(anomaly, details=details)
        if self.shared_weights and anomaly.rank == rank and anomaly.kind in ("nonfinite_loss", "nonfinite"):
            # this rank's shards are finite: another rank's NaN gradients, applied to its shard, are
            # in every rank's forward from the next step on: the previous monitored step's (an
            # earlier step's whose update the loop left out, a NaN step skipped, was followed by a
            # finite one), followed back to their root
            applied = [
                a
                for j, a in candidates
                if j == joined - 1
                and a.kind == "nonfinite"
                and a.severity == "error"
                and _before(a.step, anomaly.step, False)
            ]
            if applied:  # a received copy among them (in whatever order the ranks' rows came): its maker's
                details["cause"] = root_cause(self._followed(applied[-1], rank))
                return rebuilt(anomaly, details=details)
        jumps = [a for _, a in candidates if a.kind == "lr_spike" and _before(a.step, anomaly.step, False)]
        if not jumps and self.unwatched is not None and anomaly.kind == "nonfinite_loss":
            details["cause"] = self.unwatched  # the watched weights are finite: the unwatched ones are the suspects
            return rebuilt(anomaly, details=details)
        if not jumps:
            return anomaly
        details["cause"] = root_cause(min(jumps, key=lambda a: a.step))  # the earliest: what started it
        return rebuilt(anomaly, details=details)

    def remember(self, anomalies: list[Anomaly], joined: int, rank: int | None = None) -> None:
        """Keep the step's possible causes (its final list: after the ranks' exchange). Given this
        process's ``rank``, of the other ranks' NaN gradients (as many ranks as there are hold the
        same NaN gradients) only one rank's is kept: the rank that made this rank's, when this rank
        received them through the reduction (the cause of what they did is its), else the rank the
        other ranks' copies follow (with none of this rank's: a shard that stayed finite), else the
        first other rank's, whatever the order of the ranks' rows."""
        origins = ("nonfinite", "nonfinite_update", "nonfinite_loss", "nonfinite_input")
        heads: dict[Any, Any] = {}  # per step, the rank whose NaN gradients are kept besides this rank's own
        # (a clean step builds no set: no comprehension frame, test_op_count's training pin)
        rows = {(a.step, a.rank) for a in anomalies if _role(a) == "nonfinite"} if anomalies else ()
        for a in anomalies if rank is not None else ():
            if _role(a) == "nonfinite" and (a.rank == rank or a.step not in heads):  # this rank's own decides
                follows = a.details.get("follows") or {}
                made = follows.get("rank") if follows.get("kind") == "nonfinite" else a.rank
                heads[a.step] = made if (a.step, made) in rows else a.rank  # the maker's row not here: the copy
        for a in anomalies:
            if _role(a) == "nonfinite" and rank is not None and a.rank != rank:
                if heads[a.step] != a.rank:  # the one other rank's kept stands for them all
                    continue
            if a.kind == "lr_spike" or (a.kind in origins and a.severity == "error"):
                self._recent.append((joined, a))
        while self._recent and joined - self._recent[0][0] > CAUSE_WINDOW:
            self._recent.popleft()


def root_cause(anomaly: Anomaly) -> dict[str, Any]:
    """The ``cause_reference`` of what explains ``anomaly``: the cause it was linked to (itself the
    root: links are made to roots), else itself."""
    cause = anomaly.details.get("cause")
    return dict(cause) if isinstance(cause, dict) else cause_reference(anomaly)


def _consequence(anomaly: Anomaly) -> bool:
    """Whether an earlier step can explain ``anomaly`` (a jump of the lr is a cause, never a consequence)."""
    return anomaly.kind in _CONSEQUENCES and anomaly.details.get("reason") != "lr_jump"


def _before(cause_step: Any, step: Any, or_equal: bool) -> bool:
    """Whether ``cause_step`` comes before ``step`` (steps the user numbered as they liked: only
    numbers are compared)."""
    if not isinstance(cause_step, int) or not isinstance(step, int):
        return False
    return cause_step <= step if or_equal else cause_step < step
