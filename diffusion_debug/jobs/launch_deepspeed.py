"""``launch`` under Accelerate's DeepSpeed plugin, where the optimizer step runs inside ``backward``:
``accelerator.backward(loss)`` calls ``DeepSpeedEngineWrapper.backward``, which runs
``engine.backward(loss)`` and then, at a gradient accumulation boundary, ``engine.step()``; the
prepared optimizer's ``step()`` that the script calls next does nothing. That class's ``backward``
is the launcher's seam (patched on the class, as ``Accelerator.prepare`` is; put back on undo):

- before it, the debugger is made, at the first: the ZeRO optimizer's ``step`` then keeps this
  rank's gradient fragments just before each update (``training.measure.deepspeed_zero``), each
  rank's own gradients are checked before ZeRO reduces them, and DeepSpeed's overflow skips are
  read, from the first step on;
- after it, the step is monitored with its loss (a micro-step of gradient accumulation joins the
  step's mean), and ``engine_stepped`` tells ``Accelerator.backward``'s seam and the no-op
  ``optimizer.step()`` that this ``backward`` was watched already.

Limits: the step has run when the monitor reads it, so policy ``skip`` cannot undo it, and a
skipped step is named at the next step (its overflow flag is read then), as by the in-script
debugger under the plugin. The tests run ZeRO-2 (two CPU processes, gloo); stages 1 and 3 under the
plugin are not run.
"""

from __future__ import annotations

from typing import Any, Callable


def inner_optimizers(optimizer: Any) -> list[Any]:
    """The optimizers inside a prepared one: Accelerate's wrapper holds the torch optimizer;
    DeepSpeed's holds its ZeRO optimizer, which holds the torch one (which steps inside the engine)."""
    out = []
    inner = getattr(optimizer, "optimizer", None)
    while inner is not None and all(inner is not o for o in out):
        out.append(inner)
        inner = getattr(inner, "optimizer", None)
    return out


def patch_engine_backward(watch: Any) -> Callable[[], None]:
    """Watch each ``DeepSpeedEngineWrapper.backward`` for ``watch`` (a ``launched.LaunchWatch``);
    returns what puts the class back (nothing to do where accelerate has no such class)."""
    try:
        from accelerate.utils.deepspeed import DeepSpeedEngineWrapper
    except ImportError:  # an accelerate without the plugin
        return lambda: None
    original = DeepSpeedEngineWrapper.backward

    def backward(wrapper: Any, loss: Any, sync_gradients: bool = True, **kwargs: Any) -> Any:
        watch.loss_from_accelerator = True
        if not watch.failed:
            watch._debugger_ready()  # before the engine's first step: it keeps the gradients for us
        result = original(wrapper, loss, sync_gradients=sync_gradients, **kwargs)
        watch.engine_stepped = True
        if not watch.failed:
            watch.loss = loss.detach()
            optimizer = _engine_optimizer(watch.optimizers, wrapper.engine)
            if not sync_gradients and watch._debugger_ready():
                watch._monitor(None)  # a micro-step: its loss joins the step's mean
            elif sync_gradients and optimizer is not None:
                watch._optimizer_step(optimizer)
        return result

    DeepSpeedEngineWrapper.backward = backward
    return lambda: setattr(DeepSpeedEngineWrapper, "backward", original)


def _engine_optimizer(prepared: list[Any], engine: Any) -> Any:
    """The prepared optimizer around the engine's own (else the engine's own, or None)."""
    inner = getattr(engine, "optimizer", None)
    return next((o for o in prepared if getattr(o, "optimizer", None) is inner), inner)
