"""Wrong calls of the training debugger answered up front, with one clear error that names the
right call: an ``accelerator=`` that is not an Accelerator, models with nothing to train, policy
``skip`` where the gradients cannot be zeroed (DeepSpeed ZeRO-3, Accelerate's DeepSpeed plugin), and a
``monitor_training_step`` whose first argument is not the loss (``(model, loss, step)``, the
model-first guess, or neither a tensor nor a number). A ``GradScaler`` the loop scales its loss with but did not
pass is found at the first call, read as passed for that call's optimizer and named (``scaler_not_passed``): read as
they are, its gradients were its scale times too large and its skips NaN gradient errors.

Limits: only the argument kinds are checked; a wrong but well-typed value (another batch's loss)
is not detected. A GradScaler not passed is looked for once, at the first call (it has scaled a loss by then), and
only where that call's code or its callers' hold it (a variable, an attribute of ``self``); a second optimizer that
scales with it (a GAN's, monitored later) is read unscaled, as before.
"""

from __future__ import annotations

import decimal
import numbers
import sys
from typing import Any

import torch
from torch import nn

from ..core import AnomalySink
from ..errors import ConfigError, DiffusionDebugError
from ..record import make_anomaly
from .measure.gradients import TrainableParameters
from .measure.loss import NO_LOSS
from .measure.optimizer_state import find_scaler, is_accelerator, scaler_in_frames
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


def unpassed_scaler(sink: AnomalySink, accelerator: Any, optimizer: Any, step: Any, ctx: Any) -> Any:
    """At the first ``monitor_training_step`` given no ``scaler=``, where neither Accelerate nor the optimizer gives
    one: the GradScaler the loop scales its loss with (``scaler_in_frames``, from the caller), named
    (``scaler_not_passed`` at ``step``), or None."""
    with sink.guard("looking for a GradScaler not passed", step=step, rank=ctx.rank):
        if find_scaler(accelerator, optimizer, None) is None and (found := scaler_in_frames(sys._getframe(1))):
            details = {"scale": float(found.get_scale())}
            sink.emit(
                make_anomaly("scaler_not_passed", component="optimizer", step=step, rank=ctx.rank, details=details)
            )
            return found
    return None
