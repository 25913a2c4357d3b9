"""The training debugger's out-of-memory watch (:mod:`~diffusion_debug.core.out_of_memory`): the
model and its blocks, the step in progress, the remedies for a training step.

Limits: an OOM in backward or in the optimizer step is seen only through ``@tdbg.watch`` or
``with tdbg:`` (no forward hook is on its way out); the step in progress is the last monitored
step plus one, as the user's own numbering may skip.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..core import AnomalySink
from ..core.out_of_memory import OutOfMemoryWatch, Watched
from ..probes import sentinel_modules
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

    return OutOfMemoryWatch(sink, targets, step, _STEP, rank=rank, own=replaying)  # a replay's OOM: the debugger's


def training_oom_targets(model: nn.Module, component: str = "model") -> list[Watched]:
    """The model (as the user calls it) and the blocks of the model it wraps (none when compiled:
    no hook of ours goes inside compiled code), as ``component`` (its name among several models)."""
    blocks = [] if is_compiled(model) else sentinel_modules(unwrap_model(model))
    return [Watched(component, "training", [("", model)] + blocks, phase="training step")]
