"""``launch`` under DeepSpeed: Accelerate's DeepSpeed plugin, where the optimizer step runs inside ``backward``:
``accelerator.backward(loss)`` calls ``DeepSpeedEngineWrapper.backward``, which runs
``engine.backward(loss)`` and then, at a gradient accumulation boundary, ``engine.step()``; the
prepared optimizer's ``step()`` that the script calls next does nothing. That class's ``backward``
is the launcher's seam (patched on the class, as ``Accelerator.prepare`` is; put back on undo):

- before it, the debugger is made, at the first, unless the engine's first forward under grad made it
  already (``launched.LaunchWatch._first_training_call``: an out-of-memory error of step 0's forward is
  then step 0's): the ZeRO optimizer's ``step`` then keeps this
  rank's gradient fragments just before each update (``training.measure.deepspeed_zero``; without
  ZeRO the engine's ``step`` keeps its ``.grad``'s, ``deepspeed_stage0``), each
  rank's own gradients are checked before ZeRO reduces them, and DeepSpeed's overflow skips are
  read, from the first step on;
- after it, the step is monitored with its loss (a micro-step of gradient accumulation joins the
  step's mean), and this thread's ``engine_stepped`` tells ``Accelerator.backward``'s seam and the no-op
  ``optimizer.step()`` that this ``backward`` was watched already.

A raw engine (``deepspeed.initialize``, no ``Accelerator.prepare``; ``engine.backward(loss);
engine.step()``): ``DeepSpeedEngine.backward`` and ``step`` are the seams, patched on the class as
soon as ``deepspeed.runtime.engine`` is imported (an import hook: a script that never imports
DeepSpeed never loads it); so is its ``__init__``, which gives the engine a forward pre-hook
(``LaunchWatch.engine_made``). At its first forward under grad (else at the first ``backward``, before
it runs), the engine is the model and its ZeRO optimizer the optimizer, as ``TrainingDebugger(engine)``
in a script has them, and the debugger is made (its checks of each rank's own gradients attach then:
an out-of-memory error of step 0's forward is step 0's); the loss is the one given
to ``engine.backward`` (not the one scaled inside it); ``step``, at a gradient accumulation
boundary, monitors the step before the engine runs it, when the gradients are complete; a
micro-step's loss joins the step's mean.

Limits: under the plugin the step has run when the monitor reads it, so policy ``skip`` cannot undo
it, and a skipped step is named at the next step (its overflow flag is read then), as by the
in-script debugger under the plugin. The tests run ZeRO-2 under the plugin (a NaN at step 12; an
out-of-memory error in step 0's forward) and ZeRO-2 (2 micro-steps a step) and ZeRO-3 on a raw engine
(two CPU processes, gloo); stage 1 is not run under ``launch``.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any, Callable

from .launch_plain import MISSING, put_back

ENGINE_MODULE = "deepspeed.runtime.engine"


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
    """Watch each ``DeepSpeedEngineWrapper.backward``, and each raw ``DeepSpeedEngine``'s backward and
    step, for ``watch`` (a ``launched.LaunchWatch``); returns what puts the classes back."""
    undo_raw = _patch_raw_engine(watch)
    try:
        from accelerate.utils.deepspeed import DeepSpeedEngineWrapper
    except ImportError:  # an accelerate without the plugin
        return undo_raw
    original = DeepSpeedEngineWrapper.backward

    def backward(wrapper: Any, loss: Any, sync_gradients: bool = True, **kwargs: Any) -> Any:
        watch.thread.loss_from_accelerator = True
        if not watch.failed:
            watch._debugger_ready()  # before the engine's first step: it keeps the gradients for us
        result = original(wrapper, loss, sync_gradients=sync_gradients, **kwargs)
        watch.thread.engine_stepped = True
        if not watch.failed:
            watch.loss = loss.detach()
            optimizer = _engine_optimizer(watch.optimizers, wrapper.engine)
            if not sync_gradients and watch._debugger_ready():
                watch._monitor(None)  # a micro-step: its loss joins the step's mean
            elif sync_gradients and optimizer is not None:
                watch._optimizer_step(optimizer)
        return result

    DeepSpeedEngineWrapper.backward = backward

    def undo() -> None:
        put_back(DeepSpeedEngineWrapper, "backward", backward, original)
        undo_raw()

    return undo


def _engine_optimizer(prepared: list[Any], engine: Any) -> Any:
    """The prepared optimizer around the engine's own (else the engine's own, or None)."""
    inner = getattr(engine, "optimizer", None)
    return next((o for o in prepared if getattr(o, "optimizer", None) is inner), inner)


def _patch_raw_engine(watch: Any) -> Callable[[], None]:
    """Patch ``DeepSpeedEngine.backward`` and ``step`` once ``deepspeed.runtime.engine`` is loaded
    (now, if it is already); returns what puts them back and removes the import hook."""
    undo: list[Callable[[], None]] = []

    def patch(module: Any) -> None:
        try:
            undo.append(_patch_engine_class(watch, module.DeepSpeedEngine))
        except Exception as error:  # a DeepSpeed unlike the one we know: the script's import goes on
            watch.give_up(f"the debugger could not attach to DeepSpeed's engine ({type(error).__name__}: {error})")

    if ENGINE_MODULE in sys.modules:
        patch(sys.modules[ENGINE_MODULE])
    else:
        hook = _AfterImport(ENGINE_MODULE, patch)
        sys.meta_path.insert(0, hook)
        undo.append(lambda: sys.meta_path.remove(hook) if hook in sys.meta_path else None)

    def undo_all() -> None:
        while undo:
            undo.pop()()

    return undo_all


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls ``then(module)`` once the module ``name`` has run (found by the other finders)."""

    def __init__(self, name: str, then: Callable[[Any], None]):
        self.name, self.then, self.finding = name, then, False

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name or self.finding:
            return None
        self.finding = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self.finding = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run, then = spec.loader.exec_module, self.then

        def exec_module(module: Any) -> None:
            run(module)
            then(module)

        spec.loader.exec_module = exec_module  # this module's own loader
        return spec


def _patch_engine_class(watch: Any, engine_class: type) -> Callable[[], None]:
    """Watch ``engine_class``'s ``backward`` and ``step`` (and its subclasses', through it); returns
    what puts it back as it was: its own method where it had one, else nothing of ours in its dict
    (the inherited one shows again; a copy of it left there would hide a later change of the base's)."""
    init, backward, step = engine_class.__init__, engine_class.backward, engine_class.step
    own = vars(engine_class)
    own_init, own_backward, own_step = (own.get(name, MISSING) for name in ("__init__", "backward", "step"))

    def raw(engine: Any) -> bool:
        """Whether this engine is the script's own (not under Accelerate's plugin), and watched."""
        if watch.accelerator is not None or watch.failed or getattr(engine, "optimizer", None) is None:
            return False
        if not watch.models:
            watch.models, watch.optimizers = [engine], [engine.optimizer]
            watch._inner_optimizers.update(inner_optimizers(engine))
        watch.thread.loss_from_accelerator = True  # the loss is engine.backward's, not the one scaled inside it
        return any(engine is m for m in watch.models) and watch._debugger_ready()

    def watched_init(engine: Any, *args: Any, **kwargs: Any) -> None:
        init(engine, *args, **kwargs)
        watch.engine_made(engine)  # its first forward under grad makes the debugger

    def watched_backward(engine: Any, loss: Any, *args: Any, **kwargs: Any) -> Any:
        watched = raw(engine)
        result = backward(engine, loss, *args, **kwargs)
        if watched and not watch.failed:
            watch.loss = loss.detach()
            if not engine.is_gradient_accumulation_boundary():
                watch._monitor(None)  # a micro-step: its loss joins the step's mean
        return result

    def watched_step(engine: Any, *args: Any, **kwargs: Any) -> Any:
        if raw(engine) and engine.is_gradient_accumulation_boundary():
            watch._optimizer_step(engine.optimizer)
        return step(engine, *args, **kwargs)

    engine_class.__init__, engine_class.backward, engine_class.step = watched_init, watched_backward, watched_step

    def undo() -> None:
        put_back(engine_class, "__init__", watched_init, own_init)
        put_back(engine_class, "backward", watched_backward, own_backward)
        put_back(engine_class, "step", watched_step, own_step)

    return undo
