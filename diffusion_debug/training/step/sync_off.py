"""A loop that turned gradient sync off and never back on (:class:`SyncOffWatch`): every call then reads as a
micro-step of gradient accumulation, nothing is measured, and no optimizer step follows. Said once a stretch,
as ``not_learning`` of reason ``gradient_sync_off`` (the run does not learn: the weights never move), naming
what holds the sync off: FSDP2's ``set_requires_gradient_sync(False)`` (HSDP's ``set_requires_all_reduce``),
Accelerate's ``sync_gradients`` never True, a raw DeepSpeed engine's accumulation boundary never reached or the
caller's ``accumulating=True``. (DDP's ``no_sync()`` is no micro-step: Local SGD and a GAN's other-model step
run under it and do step the optimizer.)

>>> watch = SyncOffWatch()
>>> watch.at  # no optimizer step seen yet: the floor
256
>>> watch.run = 99
>>> watch.ended()  # a stretch of 99 micro-steps and its synced call
>>> watch.at, watch.run
(400, 0)
>>> SyncOffWatch(known=300).at  # Accelerate's or DeepSpeed's gradient_accumulation_steps of 300
1200
"""

from __future__ import annotations

from typing import Any

from ...record import Anomaly, make_anomaly

FLOOR = 256
"""Micro-steps in a row before any optimizer step was seen that are no accumulation: above every
``gradient_accumulation_steps`` a diffusion fine-tuning script uses (1 to 16 usually, 64 or 128 for large
effective batches), so a long accumulation that does step is never told it does not."""
FACTOR = 4
"""Once a stretch ended in an optimizer step, a stretch this many times the longest seen is no accumulation:
a loop's accumulation length is fixed (an epoch's last stretch is shorter, never longer), so four times it
is a loop that stopped stepping, while a stretch a little longer (a length changed mid-run) stays quiet."""


class SyncOffWatch:
    """The micro-steps in a row since the last optimizer step (``run``, from step ``since``), the longest
    stretch (micro-steps plus its synced call) that ended in one, and ``at``: the micro-step of a stretch
    that is said (once a stretch: a micro-step compares two integers, no call)."""

    __slots__ = ("run", "since", "longest", "at")

    def __init__(self, known: int | None = None) -> None:
        """``known``: the accumulation length the loop declares (:func:`accumulation_steps`), a stretch's
        length before any optimizer step is seen."""
        self.run = 0
        self.since: Any = None
        self.longest = known or 0
        self.at = max(FLOOR, FACTOR * self.longest)

    def ended(self) -> None:
        """An optimizer step's call (gradients complete) after micro-steps ends the stretch."""
        self.longest = max(self.longest, self.run + 1)
        self.run, self.at = 0, max(FLOOR, FACTOR * self.longest)


def _engine_steps(deepspeed: Any) -> Any:
    """A raw DeepSpeed engine's ``gradient_accumulation_steps()`` (``deepspeed``: ``DeepSpeedSteps``, ZeRO's or
    stage 0's; None: no engine)."""
    if deepspeed is None or not getattr(deepspeed, "engines", None):
        return None
    engine = deepspeed.engines[0]
    engine = engine[0] if isinstance(engine, tuple) else engine
    return getattr(engine, "gradient_accumulation_steps", lambda: None)()


def accumulation_steps(accelerator: Any, deepspeed: Any) -> int | None:
    """The accumulation length the loop declares: Accelerate's ``gradient_accumulation_steps``, else a raw
    DeepSpeed engine's (None: neither, or not an integer)."""
    steps = getattr(accelerator, "gradient_accumulation_steps", None) if accelerator is not None else None
    steps = steps if steps is not None else _engine_steps(deepspeed)
    return steps if isinstance(steps, int) and steps > 0 else None


HELD_BY = {
    "accumulating": "the loop passes accumulating=True to every call",
    "fsdp2_gradient_sync": "FSDP2 set_requires_gradient_sync(False)",
    "hsdp_all_reduce": "HSDP set_requires_all_reduce(False)",
    "accelerate_sync_gradients": "Accelerate's sync_gradients stays False",
    "deepspeed_boundary": "DeepSpeed's gradient-accumulation boundary not reached",
    "deepspeed_unmanaged": "DeepSpeed's managed_gradient_accumulation is false (a boundary only in engine.step())",
}
"""What each of :func:`~..measure.optimizer_state.gradients_incomplete`'s reasons holds the sync off with
(:func:`held_by` adds the accumulation length, and to ``deepspeed_boundary`` "monitor before engine.step()": a
loop that monitors after the engine's step reads every call off the boundary)."""


def held_by(cause: str, accelerator: Any, deepspeed: Any) -> dict:
    """What holds the gradients incomplete, ``cause`` (the call's :func:`~..measure.optimizer_state.
    gradients_incomplete`), with what the message names: Accelerate's or the engine's accumulation length too."""
    said = HELD_BY[cause]
    if cause == "accelerate_sync_gradients":
        steps = getattr(accelerator, "gradient_accumulation_steps", None)
        said += f", gradient_accumulation_steps={steps}" if steps is not None else ""
    elif cause == "deepspeed_boundary":
        steps = _engine_steps(deepspeed)
        said += f", gradient_accumulation_steps={steps}" if steps else ""
        said += "; monitor before engine.step()"  # after it, the boundary has passed: every call reads off it
    return {"cause": cause, "held_by": said}


def sync_off(watch: SyncOffWatch, step: Any, rank: int, cause: dict, last: Any) -> Anomaly:
    """The stretch's ``not_learning`` (a warning): ``backward_passes`` calls since step ``since_step``; ``last``:
    the last optimizer step's (None: none yet)."""
    details = {
        "reason": "gradient_sync_off",
        "backward_passes": watch.run,
        "since_step": watch.since,
        "last_optimizer_step": last,
        "longest_accumulation": watch.longest or None,  # (or the declared length)
        **cause,
        "stalled_optimizer": "none: gradient sync off",  # never folds with another not_learning at the model
    }
    return make_anomaly("not_learning", severity="warning", component="model", step=step, rank=rank, details=details)
