"""What a clear run of still updates (``judges.not_learning``'s :class:`StallWatch`) is told as: the
``not_learning`` anomaly of the whole run (:func:`judge_stall`), of one optimizer of several
(:func:`judge_optimizer_stall`), and DeepSpeed's unscaled fp16 loss found at the first step
(:func:`judge_unscaled_loss`). The cause is :func:`~.stall_causes.diagnose`'s, read from the lr each still
update was made with (``StallWatch.run``: a scheduler stepped per iteration, or an lr set by hand, has moved it by
the time the run is clear), one optimizer's as several's. A whole run's stall of several names each still optimizer's
own reason (``still_causes``)."""

from __future__ import annotations

import math
from typing import Any

from ...record import Anomaly, make_anomaly
from ..measure.deepspeed_fp16_scale import ISSUE, LossScaling
from ..measure.gradients import TrainableParameters
from ..measure.optimizer_state import raw_optimizer
from .not_learning import OptimizerStall, StallWatch
from .stall_causes import UNSCALED_LOSS, diagnose
from .step_gradients import named

_OWN_CAUSE = ("reason", "lr", "dtype", "grad_norm_at_step")
"""What ``still_causes`` keeps of each optimizer's diagnosis: its reason and the values its sentence reads."""


def judge_stall(rank: int, watch: StallWatch, step: Any, optimizer: Any, params: TrainableParameters) -> list[Anomaly]:
    """``not_learning`` at ``step``, the monitored step whose reading made the stall clear. Of several
    optimizers, the one whose update the last still reading was is diagnosed and named (``stepped_optimizer``),
    from the reading itself: a compiled step records nothing in its hook; every live one (each has a still update
    in the run) is named (``still_optimizers``) with its own diagnosis (``still_causes``: ``reason``, ``lr`` and
    what its sentence reads), each from the lr its still updates were made with."""
    read = watch.read.ref() if watch.several and watch.read is not None else None
    stepped = read if read is not None else watch.seen.stepped()  # whose step the last still update was
    seen = watch.seen.read(raw_optimizer(read)) if read is not None else watch.seen.read()
    # the lr its still updates were made with (one optimizer's too: at lr 0 for steps 0-4, then raised by hand, it
    # was read at the report, above 0, and told ``undone_after_step``)
    made = _made_with(watch, id(read) if read is not None else watch.pending_optimizer)
    details = {
        **diagnose(optimizer if stepped is None else stepped, params, watch.grad_norm, seen, made),
        "first_step": watch.first_step,
        "last_step": watch.last_step,
        "updates": watch.updates,
        "max_update_ratio": watch.largest,
        "grad_norm": watch.grad_norm,
    }
    if read is not None and watch.read is not None:  # (one alive and no longer given is none of several)
        details["stepped_optimizer"] = named(read, watch.read.held, params)
        # every live optimizer's still update is in the run: each is named, not only the one read last, with the
        # cause its own updates show (a critic at lr 1e-12 read last hid a generator's lr 0)
        live = [watch.each[key] for key in watch.live()]
        details["still_optimizers"] = [named(entry.ref(), entry.held, params) for entry in live]
        details["still_causes"] = [_own_cause(watch, entry, params, details) for entry in live]
    return [
        make_anomaly(
            kind="not_learning", severity="warning", component="optimizer", step=step, rank=rank, details=details
        )
    ]


def _own_cause(
    watch: StallWatch, entry: OptimizerStall, params: TrainableParameters, read: dict[str, Any]
) -> dict[str, Any]:
    """``entry``'s own diagnosis in the whole run's stall (``read``: the one made for the optimizer read last)."""
    optimizer = entry.ref()
    if entry is not watch.read:
        seen = watch.seen.read(raw_optimizer(optimizer))
        read = diagnose(optimizer, params, watch.grad_norm, seen, _made_with(watch, id(optimizer)))
    return {key: read[key] for key in _OWN_CAUSE if key in read}


def _made_with(watch: StallWatch, key: int) -> float | None:
    """The largest lr the still updates in ``watch``'s run of the optimizer ``key`` (the ``id`` of the one given)
    were made with (None: not known)."""
    made = watch.run.get(key, math.nan)
    return None if math.isnan(made) else made


def judge_optimizer_stall(
    rank: int, watch: StallWatch, stalled: OptimizerStall, step: Any, params: TrainableParameters
) -> list[Anomaly]:
    """``not_learning`` at ``step`` of one optimizer of several (``stalled``, named ``stalled_optimizer``), the
    monitored step whose reading made its own run of still updates clear, or the next still one once another
    optimizer's update read in that run moved weights (held back until then: :meth:`StallWatch.update_each`)."""
    optimizer, own = stalled.ref(), stalled.watch
    inner = raw_optimizer(optimizer)
    details = {
        **diagnose(optimizer, params, own.grad_norm, watch.seen.read(inner), _made_with(own, id(optimizer))),
        "first_step": own.first_step,
        "last_step": own.last_step,
        "updates": own.updates,
        "max_update_ratio": own.largest,
        "grad_norm": own.grad_norm,
        "stalled_optimizer": named(inner, stalled.held, params),
        "optimizers": len(watch.live()),
    }
    if not stalled.others_moved:  # told without another's update read moving (``StallWatch.update_each``)
        details["others_moved"] = False
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
