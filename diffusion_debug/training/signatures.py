"""Wrong calls of the training debugger answered up front, with one clear error that names the
right call: an ``accelerator=`` that is not an Accelerator, models with nothing to train, policy
``skip`` where the gradients cannot be zeroed (DeepSpeed ZeRO-3, Accelerate's DeepSpeed plugin), and a
``monitor_training_step`` whose first argument is not the loss (``(model, loss, step)``, the
model-first guess, or neither a tensor nor a number).

Limits: only the argument kinds are checked; a wrong but well-typed value (another batch's loss)
is not detected.
"""

from __future__ import annotations

import decimal
import numbers
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError, DiffusionDebugError
from .measure.gradients import TrainableParameters
from .measure.loss import NO_LOSS
from .measure.optimizer_state import is_accelerator
from .measure.wrappers import unwrap_model
from .watched_models import WatchedModels

MONITOR_CALL = "tdbg.monitor_training_step(loss, optimizer=optimizer, step=step)"


def check_accelerator(accelerator: Any) -> None:
    """``accelerator=`` is an ``accelerate.Accelerator`` or None."""
    if accelerator is not None and not is_accelerator(accelerator):
        raise DiffusionDebugError(
            f"accelerator must be an accelerate.Accelerator (or None), not {type(accelerator).__name__}."
        )


def check_trainable(watched: WatchedModels, params: TrainableParameters) -> None:
    """The watched models have parameters to train (``requires_grad``)."""
    if not len(params):
        names = " / ".join(type(unwrap_model(m)).__name__ for m in watched.models.values())
        raise DiffusionDebugError(
            f"{names} has no trainable parameters (every requires_grad is "
            "False): unfreeze the weights or adapters you train before creating the TrainingDebugger."
        )


def check_policy(config: Any, deepspeed: Any) -> None:
    """Policy ``skip`` only where the debugger can zero the gradients the next optimizer step
    applies (``deepspeed``: ``TrainableParameters.deepspeed``, ``deepspeed_zero.DeepSpeedSteps``, or None)."""
    reason = deepspeed.unzeroable() if deepspeed is not None and config.policy == "skip" else None
    if reason:
        raise ConfigError(
            f"policy 'skip' cannot zero this run's gradients ({reason}): use policy 'stop', 'raise' or 'record'."
        )


def check_loss(loss: Any) -> None:
    """``monitor_training_step``'s first argument is the loss: a TypeError naming the right call."""
    if isinstance(loss, nn.Module):  # monitor_training_step(model, loss, step), the model-first guess
        raise TypeError(
            "monitor_training_step takes the loss first: the model was given to TrainingDebugger(model, ...); "
            f"call {MONITOR_CALL}."
        )
    if not isinstance(loss, (torch.Tensor, numbers.Real, decimal.Decimal)) and loss is not NO_LOSS:  # numpy's too
        raise TypeError(
            f"monitor_training_step needs the loss (a tensor or a number), not {type(loss).__name__}; "
            f"call {MONITOR_CALL}."
        )
