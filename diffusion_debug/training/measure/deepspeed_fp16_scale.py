"""DeepSpeed fp16 without ZeRO (stage 0): whether ``engine.backward`` scaled the loss by the loss
scale that the optimizer's ``step`` divides every gradient by.

``FP16_Optimizer`` and ``FP16_UnfusedOptimizer`` unscale the gradients in ``step`` by their loss
scale (``cur_scale``, 2**16 by default), but ``engine.backward`` scales the loss only for a ZeRO
optimizer (DeepSpeed's open bug, deepspeedai/DeepSpeed#8393; bf16's was fixed in #7839): the
loss goes to ``loss.backward()`` as it is, the gradients are the true ones, and every update is
``cur_scale`` times too small. No release fixes it, so it is found by what the engine does, not
by its version: the first ``engine.backward`` of each such engine after the debugger attaches is
wrapped once (an instance attribute, removed before it runs the engine's own, or after the first
monitored step that saw none (the second: ``launch`` makes the debugger inside the first backward),
or at detach: whichever comes first), and a hook on the loss it is given keeps the
gradient that reaches that loss: ``1 / gradient_accumulation_steps`` unscaled, ``cur_scale`` times
that where the engine scaled it (the optimizer's own ``backward``, or #8393's fix). It is read once,
at the monitored step after it (one host read): :meth:`LossScaling.unscaled`. A bf16 or float32 engine,
or one under ZeRO, is never wrapped.

A loss the user multiplied by the scale before ``engine.backward`` (#8393's workaround) is read as
scaled (:func:`_times`). Limits: a loop that calls ``engine.scale(loss).backward()`` (no ``engine.backward``)
is not seen (the scale is then divided out of the norms, as before); the first call decides for the run.
"""

from __future__ import annotations

from typing import Any

import torch

from ...core.instance_methods import StackedOnInstance
from ...probes import ProbeHandle
from .deepspeed_zero import _deepspeed_class

ISSUE = "deepspeedai/DeepSpeed#8393"
"""DeepSpeed's pull request that makes ``engine.backward`` scale the loss for these optimizers."""
_FP16_WRAPPERS = (
    "deepspeed.runtime.fp16.fused_optimizer:FP16_Optimizer",
    "deepspeed.runtime.fp16.unfused_optimizer:FP16_UnfusedOptimizer",
)
_CLOSE = 0.01
"""Relative tolerance on the gradient reaching the loss (an fp16 loss rounds 1/3 by 2e-4)."""


def fp16_wrapper(engine: Any) -> Any:
    """The engine's fp16 optimizer without ZeRO (``FP16_Optimizer``, ``FP16_UnfusedOptimizer``) whose loss
    scale is above 1, or None (bf16 on the CPU runs ``FP16_UnfusedOptimizer`` too, at scale 1: nothing divided)."""
    optimizer = getattr(engine, "optimizer", None)
    for path in _FP16_WRAPPERS:
        cls = _deepspeed_class(path)
        if cls is not None and isinstance(optimizer, cls):
            try:
                return optimizer if float(optimizer.loss_scale) > 1 else None
            except (AttributeError, TypeError, ValueError):
                return None
    return None


class LossScaling:
    """What the first ``engine.backward`` of an fp16 stage-0 engine did with the loss (see the module)."""

    def __init__(self, engines: list[Any]):
        self.engines = [(e, w) for e in engines if (w := fp16_wrapper(e)) is not None]
        self._kept: tuple[torch.Tensor, float, float, str] | None = None
        """(the gradient that reached the loss, its unscaled value, the loss scale, the optimizer's class)"""
        self._handle = ProbeHandle()
        self._verdict: dict[str, Any] | None = None
        self._read = False
        self._waited = False

    @classmethod
    def of(cls, engines: list[Any]) -> LossScaling | None:
        found = cls(engines)
        return found if found.engines else None

    def attach(self) -> ProbeHandle:
        """Wrap each engine's ``backward`` for its next call, until a monitored step has read it."""
        if self._read or self._kept is not None:
            return ProbeHandle()
        self._handle = ProbeHandle([_BackwardOnce(e, w, self._keep) for e, w in self.engines])
        return self._handle

    def _keep(self, kept: tuple[torch.Tensor, float, float, str]) -> None:
        if self._kept is None:
            self._kept = kept
        self._handle.remove()  # one call of one engine decides: the others' wrappers go too

    def unscaled(self) -> dict[str, Any] | None:
        """``{"loss_scale", "optimizer"}`` where the engine backpropagated the loss unscaled while its
        optimizer's step divides by ``loss_scale``, else None (scaled, not seen yet, or a scale of 1).
        Read once (one host read), when the first call was seen; cached."""
        if self._read or self._kept is None:
            return self._verdict
        self._read = True
        grad, unscaled, scale, name = self._kept
        reached = float(grad.reshape(-1)[0]) / unscaled if grad.numel() == 1 else float("nan")
        if scale > 1 and abs(reached - 1) <= _CLOSE:
            self._verdict = {"loss_scale": scale, "optimizer": name}
        return self._verdict

    def waiting(self) -> LossScaling | None:
        """After each monitored step is judged: itself while no ``engine.backward`` was seen yet, for one
        more step at most (``launch`` makes the debugger inside step 0's); else None, the wrapping removed."""
        if self._read or self._kept is not None or self._waited:
            self._read = self._read or self._kept is None  # never seen: settled as not found
            self._handle.remove()
            return None
        self._waited = True
        return self


def _times(loss: Any, scale: float) -> bool:
    """Whether ``loss`` is a product by ``scale`` (within :data:`_CLOSE`): #8393's workaround,
    ``engine.backward(loss * engine.optimizer.cur_scale)``, whose gradients do hold the scale. Reads only a
    product's factor held on the host (a Python number, or a CPU scalar): never a device sync."""
    node = getattr(loss, "grad_fn", None)
    if type(node).__name__ != "MulBackward0":
        return False
    for name in ("_saved_other", "_saved_self"):
        factor = getattr(node, name, None)
        if isinstance(factor, torch.Tensor) and factor.numel() == 1 and factor.device.type == "cpu":
            if abs(float(factor) / scale - 1) <= _CLOSE:
                return True
    return False


class _BackwardOnce(StackedOnInstance):
    """``engine.backward`` for one call: it takes itself out, then runs what was there with a hook on the
    loss that keeps the gradient reaching it (returns None: changes nothing)."""

    def __init__(self, engine: Any, wrapper: Any, keep: Any):
        self.engine, self.wrapper, self.keep = engine, wrapper, keep
        super().__init__(engine, "backward")

    def _call(self, loss: Any, *args: Any, **kwargs: Any) -> Any:
        if not self.active:  # removed, but wrapped over by another since: a plain pass-through
            return self.original(loss, *args, **kwargs)
        self.remove()
        seen: list[torch.Tensor] = []
        handle, facts = None, None
        try:
            scale = float(self.wrapper.loss_scale)
            if isinstance(loss, torch.Tensor) and loss.requires_grad and loss.numel() == 1 and not _times(loss, scale):
                by_steps = kwargs.get("scale_wrt_gas", args[1] if len(args) > 1 else True)
                steps = float(self.engine.gradient_accumulation_steps()) if by_steps else 1.0
                facts = (1.0 / steps, scale, type(self.wrapper).__name__)
                handle = loss.register_hook(seen.append)
        except Exception:  # never the user's run: unread, the scale is divided out as before
            handle = None
        try:
            return self.original(loss, *args, **kwargs)
        finally:
            if handle is not None:
                handle.remove()
                if seen and facts is not None:
                    self.keep((seen[0].detach(), *facts))
