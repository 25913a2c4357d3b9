"""Which of the usual causes a run that does not learn looks like (:func:`diagnose`, for
``judges.not_learning``'s stall): an elimination from what the optimizer shows, not a proof."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..measure.deepspeed_fp16_scale import ISSUE
from ..measure.gradients import TrainableParameters, weight_fingerprint
from ..measure.optimizer_state import param_groups, raw_optimizer

_LOW_PRECISION = (torch.float16, torch.bfloat16)
ZEROED_RATIO = 1e-6
"""Gradients that reach ``optimizer.step()`` below this share of the norm the monitor read were zeroed
between the two (a mask, a hook), not applied."""
UNSCALED_LOSS = "deepspeed_fp16_unscaled_loss"
"""``not_learning``'s reason where DeepSpeed's fp16 engine without ZeRO backpropagated the loss unscaled
(``measure.deepspeed_fp16_scale``): found at the first monitored step (``stall_findings.judge_unscaled_loss``)."""


def diagnose(
    optimizer: Any,
    params: TrainableParameters,
    grad_norm: float = math.nan,
    seen: dict[str, Any] | None = None,
    made_with: float | None = None,
) -> dict[str, Any]:
    """Which cause a stalled run looks like (``reason``), with what the optimizer shows
    (``grad_norm``: the gradients' norm over the stalled updates; ``seen``: what its last step
    received, :meth:`StepGradients.read`; ``made_with``: the largest lr its still updates were made
    with, recorded at each, where known: else the lr now, which a scheduler may have moved since)."""
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
    if made_with is not None and known:  # lr_zero only where every still update was made at lr 0
        evidence["lr"] = made_with
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
        evidence["step_ratio"] = _share(evidence["lr"] * grad_norm, params, held)
        if evidence["step_ratio"] < resolution:  # lr x |g| / |w|: a plain gradient step rounds away
            return {"reason": "below_precision", "dtype": "/".join(low), **evidence}
    if seen is None and (not evidence["state_empty"] or getattr(params, "deepspeed", None) is not None):
        # no step seen, and its state shows its steps saw gradients (or DeepSpeed's engine, whose stage 0 in
        # float32 its hook reads: a compiled step's, one given no optimizer): no cause told rather than a wrong one
        return {"reason": "unknown", **evidence}
    if seen is None:  # no step seen: an optimizer without state for them saw no gradient (SGD keeps none anyway)
        return {"reason": "gradients_cleared", **evidence}
    evidence.update(seen)
    if seen["cleared_at_step"] == seen["held_at_step"]:
        return {"reason": "gradients_cleared", **evidence}
    monitored = grad_norm if math.isfinite(grad_norm) else 0.0  # none known: zeroed means exactly 0
    if seen["grad_norm_at_step"] <= ZEROED_RATIO * monitored:
        return {"reason": "gradients_zeroed", **evidence}
    full = sorted({str(p.dtype).removeprefix("torch.") for p in held if p.is_floating_point()})
    if not low and full and evidence["lr"] is not None and math.isfinite(grad_norm):
        # the step received the gradients and the weights did not move: float32 weights round an update away too
        # (lr 1e-12 was ``undone_after_step``). Only after what the step received (an estimate never outweighs it:
        # gradients cleared before step() were told below_precision), and only below a quarter of the epsilon (the
        # smallest half-ulp relative to a weight's norm: 2^-25 in float32): an update surely rounded away
        resolution = max(float(torch.finfo(p.dtype).eps) for p in held if p.is_floating_point()) / 4
        evidence["step_ratio"] = _share(evidence["lr"] * _largest_step(holding, held, grad_norm), params, held)
        if evidence["step_ratio"] < resolution:
            return {"reason": "below_precision", "dtype": "/".join(full), **evidence}
    return {"reason": "undone_after_step", **evidence}


def _share(step: float, params: TrainableParameters, held: list[torch.Tensor]) -> float:
    """``step`` (an update's norm) over the float64 norm of the weights ``held`` (of ``params``: this rank's, in one
    read; inf where that is 0)."""
    ids = {id(p) for p in held}
    norms = weight_fingerprint(params)
    norm = math.sqrt(sum(norms[i] ** 2 for i, p in enumerate(params.params) if id(p) in ids))
    return step / norm if norm > 0 else math.inf


def _largest_step(holding: list[dict], held: list[torch.Tensor], grad_norm: float) -> float:
    """The norm of the largest update per unit of lr an optimizer of ``holding`` (its groups that hold the watched
    ``held``) makes from gradients of norm ``grad_norm``: an adaptive one (Adam's, Adagrad's, Lion's: groups with
    ``eps`` or ``betas``) moves each element by about the lr, sqrt(numel); a plain step ``|g|``, its momentum at
    most ``|g| / (1 - momentum)`` (SGD's)."""
    if any("eps" in g or "betas" in g for g in holding):
        return max(grad_norm, math.sqrt(sum(p.numel() for p in held)))
    momentum = max((float(g.get("momentum") or 0.0) for g in holding), default=0.0)
    return grad_norm / (1 - momentum) if momentum < 1 else math.inf
