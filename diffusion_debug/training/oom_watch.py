"""The training debugger's out-of-memory watch (:mod:`~diffusion_debug.core.out_of_memory`): the
model and its blocks, the step in progress, the remedies for a training step. Its hook also sees any other error
leaving a watched model's training forward (in training mode, with gradients): ``step_error``, at the innermost
block on the error's traceback, the step in progress and this rank, flushed at once. A loop that catches the error
and goes on (``except Exception: continue``) has skipped the step, and this is its only record; the error itself
goes on unchanged, and no policy acts on it (a warning). No hook more, nothing more on a step that raises nothing.

Limits: an OOM in backward or in the optimizer step is seen only through ``@tdbg.watch`` or
``with tdbg:`` (no forward hook is on its way out); an error raised outside the watched forward (the loss, backward,
the optimizer step, the data) and caught is not seen (under several processes the stall watch reads one while the
rank handles it: ``hangs.unwinding``); an error raised while backward recomputes a checkpointed forward is
backward's (not recorded: non-reentrant checkpointing stops each recompute with an error of torch's); a
``KeyboardInterrupt`` or ``SystemExit`` is not recorded (torch runs no ``always_call`` hook for a
``BaseException``); a ``RuntimeError`` saying "out of memory" that is not a ``torch.OutOfMemoryError`` is a
``step_error``; the step in progress is the last monitored step plus one, as the user's own numbering may skip.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..core import AnomalySink
from ..core.out_of_memory import OutOfMemoryWatch, Watched
from ..errors import DiffusionDebugError
from ..probes import sentinel_modules
from ..record import make_anomaly
from .hangs.patterns import error_text
from .judges.anomaly_mode import replaying
from .measure.wrappers import is_compiled, unwrap_model
from .watched_models import WatchedModels

_STEP = Watched("model", "training", phase="training step")


def training_oom_watch(
    sink: AnomalySink, watched: WatchedModels, history: Any, step_offset: int, rank: int
) -> OutOfMemoryWatch:
    """The watch over the watched models; ``history`` is the monitor's (its ``previous_step`` and
    ``joined``)."""

    def step() -> Any:
        previous = history.previous_step
        return previous + 1 if isinstance(previous, int) else history.joined + step_offset

    def targets() -> list[Watched]:
        return [
            target
            for name, model in watched.models.items()
            for target in training_oom_targets(model, "model" if watched.single else name)
        ]

    def step_error(error: BaseException, target: Watched, module: str) -> None:
        model = target.modules[0][1]
        if not (model.training and torch.is_grad_enabled()) or isinstance(error, DiffusionDebugError):
            return  # not a training step's forward (validation, sampling), or the debugger's own (policy raise)
        details = {"error": error_text(error), "error_type": type(error).__name__, "phase": "forward"}
        sink.emit(
            make_anomaly(
                "step_error", component=target.component, module=module, step=step(), rank=rank, details=details
            )
        )
        sink.record.flush_to_disk()  # the process may be ending with it

    # a replay's OOM (or error): the debugger's
    return OutOfMemoryWatch(sink, targets, step, _STEP, rank=rank, own=replaying, other=step_error)


def training_oom_targets(model: nn.Module, component: str = "model") -> list[Watched]:
    """The model (as the user calls it) and the blocks of the model it wraps (none when compiled:
    no hook of ours goes inside compiled code), as ``component`` (its name among several models)."""
    blocks = [] if is_compiled(model) else sentinel_modules(unwrap_model(model))
    return [Watched(component, "training", [("", model)] + blocks, phase="training step")]
