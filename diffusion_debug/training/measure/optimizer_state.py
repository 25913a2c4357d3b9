"""What the training debugger reads from the user's optimizer, GradScaler and Accelerator
without owning them: the torch optimizer inside Accelerate's wrapper, its learning rates, the
scaler in use and whether it skipped the step, and Accelerate's gradient-sync and tracking flags.

The GradScaler is read, never driven: the step's gradient norms are divided by its current scale
(:func:`scale_tensor`, unless :func:`scaler_already_unscaled`), and the debugger never calls
``unscale_`` itself, because Accelerate's ``clip_grad_norm_`` calls it unconditionally and torch
raises on a second ``unscale_`` in the same step.
"""

from __future__ import annotations

import gc
from typing import Any

import torch


def gradients_incomplete(accumulating: bool, accelerator: Any, deepspeed: Any = None, fsdp_groups: Any = ()) -> Any:
    """Why the gradients do not hold a whole optimizer step on this call (None: they do), the first reason that
    holds, read once a call: ``accumulating`` (the caller's ``accumulating=True``); ``fsdp2_gradient_sync``, some
    of ``fsdp_groups`` (FSDP2's parameter groups) reduces no gradient (``set_requires_gradient_sync(False)``,
    FSDP2's gradient accumulation: its sharded ``.grad`` is not made until the synced micro-step);
    ``hsdp_all_reduce``, under HSDP one does not all-reduce them across replicas (``set_requires_all_reduce(False)``);
    ``accelerate_sync_gradients``, Accelerate's ``sync_gradients`` False (the micro-steps of its gradient
    accumulation); else ``deepspeed_boundary``, a raw DeepSpeed engine's (``deepspeed``: ``DeepSpeedSteps``, ZeRO's
    or stage 0's) accumulation boundary not reached, or ``deepspeed_unmanaged``, never reached at a monitor
    (``managed_gradient_accumulation`` false: :meth:`DeepSpeedSteps.unmanaged`). (``step.sync_off.held_by`` says
    each in words.)

    >>> class Group: reduce_grads = False
    >>> gradients_incomplete(False, None, None, [Group()]), gradients_incomplete(False, None)
    ('fsdp2_gradient_sync', None)
    """
    if accumulating:
        return "accumulating"
    for group in fsdp_groups:  # HSDP's accumulation (set_requires_all_reduce(False)) leaves replicas unreduced
        if not getattr(group, "reduce_grads", True):
            return "fsdp2_gradient_sync"
        if not getattr(group, "all_reduce_grads", True):
            return "hsdp_all_reduce"
    if accelerator is not None:
        return None if getattr(accelerator, "sync_gradients", True) else "accelerate_sync_gradients"
    if deepspeed is None or deepspeed.at_boundary():
        return None
    return "deepspeed_unmanaged" if deepspeed.unmanaged() else "deepspeed_boundary"


def find_scaler(accelerator: Any, optimizer: Any, scaler: Any) -> Any:
    """The GradScaler in use: the one passed, the optimizer's (AcceleratedOptimizer) or the
    Accelerator's; ``None`` when there is none or it is disabled."""
    for candidate in (scaler, getattr(optimizer, "scaler", None), getattr(accelerator, "scaler", None)):
        if candidate is not None and getattr(candidate, "is_enabled", lambda: False)():
            return candidate
    return None


def raw_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside Accelerate's AcceleratedOptimizer wrapper(s) (a subclass of
    ``torch.optim.Optimizer`` itself, unwrapped by its ``optimizer``: the one the GradScaler keys
    its state by) and DeepSpeed's."""
    while optimizer is not None:  # no helper's call: a monitored step reads it several times
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or (isinstance(optimizer, torch.optim.Optimizer) and not hasattr(inner, "param_groups")):
            return optimizer
        optimizer = inner
    return optimizer


def steps_by_its_gradient(optimizer: Any) -> bool:
    """True where ``optimizer.step()`` moves a weight by lr x its gradient (SGD with or without
    momentum, ASGD, a subclass of either whatever its name, schedule-free SGD, bitsandbytes' SGD8bit):
    there lr x gradient norm / weight norm foretells the update. An adaptive optimizer (Adam, AdamW
    fused or 8-bit, Prodigy, whose lr is 1.0 and whose step is d x lr, Adafactor, Lion, Muon) divides
    the gradient out: its update is about lr a weight whatever the gradient's size, and only the update
    measured from the weights says how far it moved them. So does D-Adaptation's ``DAdaptSGD``: SGD in
    its name, but lr 1.0 times its estimate d (kept in its param groups, as Prodigy's). Inside a
    ``ZeroRedundancyOptimizer``: its ``optim``, the local optimizer that steps this rank's shard."""
    raw = raw_optimizer(optimizer)
    raw = getattr(raw, "optim", raw)
    groups = getattr(raw, "param_groups", None)
    if groups and "d" in groups[0]:
        return False
    return isinstance(raw, (torch.optim.SGD, torch.optim.ASGD)) or "SGD" in type(raw).__name__


def scaler_already_unscaled(scaler: Any, optimizer: Any) -> bool:
    """True when the user called ``scaler.unscale_(optimizer)`` (or Accelerate's
    ``clip_grad_norm_``) before monitoring: the gradients are then already true values."""
    raw = raw_optimizer(optimizer)
    if scaler is None or raw is None:
        return False
    state = getattr(scaler, "_per_optimizer_states", {}).get(id(raw))
    if not state:
        return False
    from torch.amp.grad_scaler import OptState

    return state.get("stage") is OptState.UNSCALED


def scale_tensor(scaler: Any) -> torch.Tensor | None:
    """The scaler's current scale as its device tensor (no synchronisation), or None before the
    first ``scaler.scale(loss)``."""
    return getattr(scaler, "_scale", None)


def step_was_skipped(optimizer: Any) -> bool | None:
    """Accelerate's own record of whether the last ``optimizer.step()`` was skipped by the
    GradScaler; None when the optimizer is not an AcceleratedOptimizer."""
    flag = getattr(optimizer, "step_was_skipped", None)
    return bool(flag) if isinstance(flag, bool) else None


def tracking_enabled(accelerator: Any) -> bool:
    return accelerator is not None and bool(getattr(accelerator, "trackers", None))


def is_accelerator(obj: Any) -> bool:
    try:
        from accelerate import Accelerator
    except ImportError:  # pragma: no cover
        return False
    return isinstance(obj, Accelerator)


def param_groups(optimizer: Any) -> list[dict] | None:
    """The torch optimizer's ``param_groups`` (inside Accelerate's wrapper), or None."""
    raw = raw_optimizer(optimizer)
    return None if raw is None else raw.param_groups


def learning_rates(optimizer: Any) -> list[float]:
    """Each group's lr; a group whose lr is None (transformers' Adafactor with ``relative_step``,
    which computes its own) has none to read."""
    return [float(g["lr"]) for g in param_groups(optimizer) or [] if "lr" in g and g["lr"] is not None]


def warming_up_from_zero(optimizer: Any, groups: list[dict]) -> bool:
    """Of ``groups`` (``optimizer``'s), one is at lr 0 from a base lr above 0 (``initial_lr``) that an LR scheduler
    not stepped since it was built (``last_epoch`` 0: a warmup from 0 at its start, stepped once an epoch or a GAN's
    iteration) set and that is still there: its ``_last_lr``, not an lr set by hand since. Not a schedule stepped
    past its start (one that decayed or ended at 0, or held at 0 by a lambda). The scheduler is found among the
    objects that refer to the optimizer (``gc.get_referrers``: a heap scan, asked only of such a group)."""
    held = [g for g in groups if g.get("lr") == 0 and (g.get("initial_lr") or 0) > 0]
    raw = raw_optimizer(optimizer)
    if not held or raw is None:
        return False
    given = {id(optimizer): optimizer, id(raw): raw}
    for referrer in gc.get_referrers(*given.values()):
        if isinstance(referrer, torch.optim.lr_scheduler.LRScheduler):  # torch's (not a frame, a list, a wrapper)
            scheduler = {key: getattr(referrer, key, None) for key in ("optimizer", "last_epoch", "_last_lr")}
        elif isinstance(referrer, dict) and "_last_lr" in referrer:  # its ``__dict__``, once its state_dict() made it
            scheduler = referrer
        else:
            continue
        if id(scheduler.get("optimizer")) not in given or scheduler.get("last_epoch") != 0:
            continue
        last = scheduler.get("_last_lr") or ()
        if any(g is group and set_lr == 0 for group, set_lr in zip(raw.param_groups, last) for g in held):
            return True
    return False
