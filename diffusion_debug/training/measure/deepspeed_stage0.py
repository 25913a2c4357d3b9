"""DeepSpeed without ZeRO (``zero_optimization.stage`` 0): the engine all-reduces ``.grad`` in
``engine.backward`` and the gradients are read there, as plain ones. Its optimizer is the torch
optimizer (float32) or, in fp16 and bf16, a mixed-precision wrapper of it (``FP16_Optimizer``,
``FP16_UnfusedOptimizer``), built from the optimizer passed to ``deepspeed.initialize`` or from the
config's ``optimizer`` section alike: the wrapper trains float32 copies of the parameters
(``deepspeed_zero.trained_copies``), skips a step whose gradients overflow (its ``overflow`` flag:
:meth:`EngineWithoutZero.step_skipped`) and, in fp16, leaves its loss scale in ``.grad`` until the
step unscales them (:meth:`EngineWithoutZero.loss_scale`), unless ``engine.backward`` never scaled the loss
(DeepSpeed#8393: ``deepspeed_fp16_scale``, :attr:`EngineWithoutZero.scaling`).

Accelerate's DeepSpeed plugin runs ``engine.step`` inside ``accelerator.backward``, which then
zeroes ``.grad``: there the engine's ``step`` keeps the gradients' norms and the loss scale first
and its optimizer's overflow flag after (``deepspeed_zero.DeepSpeedSteps``), and a skip is DeepSpeed's,
not the GradScaler's that Accelerate's ``step_was_skipped`` would say; NaN gradients that step
applied (float32: no overflow check) are the cause of the weights' NaN found at the next step.

Found once, when the debugger is made, from the engines it is given as models or that the
Accelerator prepared (:meth:`EngineWithoutZero.find`); a clean step of any other run reads nothing
of it. A model passed without its engine and without its Accelerator (a raw engine's loop) is read
through the optimizer given to the monitor (:meth:`EngineWithoutZero.of_optimizer`). Limits: given
none, it is trained as a plain one (its loss scale and overflow skip unread).
"""

from __future__ import annotations

import math
import sys
from typing import Any, Iterable

import torch

from ...probes import ProbeHandle
from .deepspeed_fp16_scale import LossScaling
from .deepspeed_zero import (
    DeepSpeedSteps,
    ZeroPartitions,
    deepspeed_optimizer,
    engines_among,
    step_in_backward,
    zero_optimizer,
)


class EngineWithoutZero(DeepSpeedSteps):
    """The watched parameters' engines without ZeRO, and their optimizers (``engine.optimizer``)."""

    def __init__(self, params: list[torch.Tensor], engines: list[Any], capture: bool = False):
        self.params = params
        self.engines = engines
        self.optimizers = [e.optimizer for e in engines if getattr(e, "optimizer", None) is not None]
        """The engines' optimizers: DeepSpeed's mixed-precision wrapper, or the torch optimizer (float32)."""
        self.capture = capture and bool(self.optimizers)
        """The step runs before the monitor (Accelerate's plugin): read what :meth:`attach` kept."""
        self._empty = torch.zeros(0, dtype=params[0].dtype, device=params[0].device)
        self._start()
        self.scaling = LossScaling.of(engines)
        """fp16's engines: whether ``engine.backward`` scaled the loss (``deepspeed_fp16_scale``; None: not fp16)."""

    @classmethod
    def find(
        cls, params: list[torch.Tensor], models: Iterable[Any], accelerator: Any = None
    ) -> EngineWithoutZero | None:
        """The engines without ZeRO among ``models`` and the Accelerator's, else None (made after
        ``deepspeed.initialize`` / ``accelerator.prepare``; ZeRO's are ``deepspeed_zero.ZeroPartitions``)."""
        if "deepspeed" not in sys.modules or not params:
            return None
        engines = [e for e in engines_among(models, accelerator) if zero_optimizer(e) is None]
        return cls(params, engines, capture=step_in_backward(accelerator)) if engines else None

    @classmethod
    def of_optimizer(cls, params: list[torch.Tensor], optimizer: Any) -> EngineWithoutZero | None:
        """DeepSpeed's mixed-precision wrapper inside ``optimizer``, read as :meth:`find`'s engine's (its loss
        scale and overflow skip), else None: a raw engine's model watched without the engine (the ``model`` of
        ``deepspeed.initialize(model=model)``) and given that optimizer at the monitor (``StepMeasurer.measure``,
        looked into as the optimizer changes), as it was read before :meth:`find` ran at the debugger's making."""
        found = deepspeed_optimizer(optimizer) if "deepspeed" in sys.modules and params else None
        if found is None:
            return None
        steps = cls(params, [])
        steps.optimizers = [found]
        return steps

    def _stepping(self) -> list[tuple[Any, Any, Any]]:
        """The engines' own ``step``, before the fp32 clip it runs ahead of its optimizer's step (a
        wrapper clips inside its own): the gradients kept unclipped, as a raw engine's loop reads them."""
        return [(e, e, e.optimizer) for e in self.engines if getattr(e, "optimizer", None) is not None]

    def _step_gradients(self, owned: list[int] | None) -> list[torch.Tensor]:
        params = self.params if owned is None else [self.params[j] for j in owned]
        return [self._empty if p.grad is None else p.grad for p in params]

    def _wrappers(self, optimizer: Any) -> list[Any]:
        """DeepSpeed's optimizer inside the one passed, else the engines'."""
        found = deepspeed_optimizer(optimizer)
        if found is not None:
            return [found]
        return [o for o in map(deepspeed_optimizer, self.optimizers) if o is not None]

    def _live_scale(self, optimizer: Any) -> float | None:
        for found in self._wrappers(optimizer):
            try:
                scale = float(getattr(found, "loss_scale", None))
            except (TypeError, ValueError):
                return None
            return scale if scale != 1.0 and math.isfinite(scale) and scale > 0 else None
        return None

    def loss_scale(self, optimizer: Any) -> float | None:
        """fp16's loss scale (DeepSpeed's dynamic or static) in ``.grad`` until the wrapper's step
        unscales them; None where there is none or it is 1 (bf16, float32). With :attr:`capture`,
        the one kept before the step that ran in backward. Read like ``ZeroPartitions.loss_scale``.
        Where ``engine.backward`` left the loss unscaled (:attr:`scaling`), :attr:`holds_scale` is False."""
        if self.scaling is not None and self.scaling.unscaled() is not None:  # DeepSpeed#8393: .grad unscaled
            self.holds_scale = False
        return self.captured_scale() if self.capture else self._live_scale(optimizer)

    def attach(self) -> ProbeHandle:
        """:meth:`DeepSpeedSteps.attach`'s, and fp16's first ``engine.backward`` watched (:attr:`scaling`)."""
        handle = super().attach()
        return handle if self.scaling is None else ProbeHandle([handle, self.scaling.attach()])

    def step_skipped(self, optimizer: Any) -> bool | None:
        """Whether the wrapper's last ``step()`` skipped the update for non-finite gradients (its
        ``overflow`` flag; None: no wrapper, float32). With :attr:`capture`, the step before the one
        just taken, as ``ZeroPartitions.step_skipped``."""
        if self.capture:
            return self.captured_skip()
        for found in self._wrappers(optimizer):
            flag = getattr(found, "overflow", None)
            if isinstance(flag, bool):
                return flag
        return None


def find_deepspeed(
    params: list[torch.Tensor], models: Iterable[Any], accelerator: Any = None
) -> tuple[ZeroPartitions | None, DeepSpeedSteps | None]:
    """``(ZeRO's partitions, DeepSpeed's word on a step)`` for the debugger of ``params`` in ``models``:
    under ZeRO its ``ZeroPartitions`` twice, without ZeRO ``(None, EngineWithoutZero)``, else ``(None, None)``
    (``TrainableParameters.partitions`` and ``.deepspeed``)."""
    partitions = ZeroPartitions.find(params, models, accelerator)
    return partitions, partitions or EngineWithoutZero.find(params, models, accelerator)
