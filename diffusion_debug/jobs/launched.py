"""The process side of ``diffusion-debug launch``: run an unmodified training script with the
training debugger attached through the seams the script already uses.

``accelerate launch`` starts every process as ``python -m diffusion_debug.jobs.launched SCRIPT
ARGS...``; this module runs SCRIPT as ``__main__`` (its own ``sys.argv``, ``sys.path[0]`` and
``__file__``, as ``python SCRIPT`` would) after installing these seams:

- ``Accelerator.prepare``: the trainable models and the optimizers it returns are watched
  (models with no trainable parameter, a VAE or a frozen text encoder, are not trained: what they
  make for the trained model is checked as its inputs, below);
- ``Accelerator.backward`` (else ``Tensor.backward`` or ``torch.autograd.backward``, of one loss or
  several, :mod:`~diffusion_debug.jobs.launch_plain`): the loss, and each micro-step of gradient
  accumulation (Accelerate's, or every backward before the optimizer step but its last, unless a
  ``zero_grad``, ``p.grad = None`` or ``p.grad.zero_()`` dropped its gradients before the step;
  where only some optimizer's were dropped, a GAN's discriminator's, it is the other optimizer's
  step, and each of the two steps judges the gradients its own optimizer steps; a plain backward
  that reached no watched parameter, an EMA model's loss, is no loss of the step);
- DeepSpeed's ``backward`` and ``step``, under Accelerate's plugin (``DeepSpeedEngineWrapper``) or
  on a raw ``deepspeed.initialize`` engine (:mod:`~diffusion_debug.jobs.launch_deepspeed`);
- the optimizer's ``step``, or ``Accelerator.clip_grad_norm_`` when the script clips first:
  gradients are read there, once per step (its backwards since the last), when they are complete and after anything
  the script did to them since (before clipping, with its ``max_norm``, so that a NaN is still
  where it was made);
- a plain ``torch.optim`` optimizer (no Accelerate) through torch's global step pre-hook: the
  models are the modules that hold the parameters of the optimizers alive at its first step
  (:mod:`~diffusion_debug.jobs.launch_plain`; the live ones are those noted as the script made them,
  :mod:`~diffusion_debug.training.judges.live_objects`, never a walk of its heap); under a
  GradScaler, its ``step`` (a step it skips calls no optimizer step) and the loss it scaled (not the
  scaled one);
- what reaches the trained model (:mod:`~diffusion_debug.jobs.launch_inputs`): the prepared
  DataLoaders' batches, the frozen models' outputs that feed it and its own arguments, counted on
  the device and passed as each step's ``inputs=``, so a bad batch or a text encoder's NaN is the
  headline at its step rather than the NaN loss it causes.

Several optimizers: a training step is the first optimizer step after a ``backward``, and every
trainable model prepared (or held by a live optimizer) is watched: a GAN's discriminator and
generator steps, each after its own ``backward``, are two training steps; a text encoder's
optimizer stepping on the UNet's ``backward`` is part of its step. A model prepared, or an
optimizer made, once the debugger is made is not watched, and one line says so.

The debugger is made as a prepared model's first forward under grad begins (so that an error of
step 0's forward, out of memory, is step 0's and the run is saved with it; under the DeepSpeed plugin the
prepared engine's, not under the FSDP plugin), else before the first ``Accelerator.backward`` (so that each
rank's check of its own gradients attaches before step 0's reduction; DeepSpeed: ``launch_deepspeed``).
With no Accelerator, as the first forward under grad begins of the model that holds a torch optimizer's
parameters (made before it: DDP, FSDP2) or of a DeepSpeed engine (``deepspeed.initialize``), through a
pre-hook that runs before the model's own (FSDP2's unshard, ZeRO-3's fetch), given as the optimizer or the
engine is made (:meth:`LaunchWatch._optimizer_made`);
else at the first optimizer step, taking the count of the check ``launch_plain`` attached before the
first ``backward``: a NaN made in step 0's backward names its rank.

When the script ends, raises or is interrupted (:mod:`.launch_end`), the run is saved with how it
ended (``end`` in summary.json) and the main process prints its summary; when it cannot watch (bad
settings, an unwritable run directory, no seam reached), one line says why.

A script that makes its own ``TrainingDebugger`` wins, as an ``Accelerator`` argument written in
the script wins over ``accelerate launch``'s option: launch steps aside before that debugger is made
(its seams go, it makes none of its own) and one line says so, so the run has one debugger, one run
directory and one set of logs; launch still saves that run with how the script ended
(:meth:`LaunchWatch.adopt`). A debugger made after launch's own (after the first ``backward``) stops
launch's, whose run keeps the steps it watched. An error of that debugger's constructor goes up with its
traceback as without launch (no frame of launch's between the script's line and the raise). A
``DiffusionModelDebugger`` of the script's (its validation pipeline calls) keeps its own run: the
last line names it (:func:`pipeline_runs`).

Limits: a script stepping with no ``backward`` (``torch.autograd.grad``) gives no loss, so it is not watched.

Long because :class:`LaunchWatch` is the one state every seam reads and changes (the models, the
loss, the debugger, the give-up and the end): the seams of its own modules call back into it.
"""

from __future__ import annotations

import functools
import json
import math
import os
import runpy
import sys
import types
import weakref
from pathlib import Path
from threading import get_ident
from typing import Any, Callable

from .launch_end import leave_launcher_group

if __name__ == "__main__":  # the script's process: out of the launcher's group before torch's import (seconds)
    leave_launcher_group()

import torch
from torch import nn

from ..probes.tracing import compile_callback, compile_wrapper, eager_frame, eager_module, run_eagerly
from .launch import ENVIRONMENT
from .launch_deepspeed import inner_optimizers, patch_engine_backward
from .launch_end import (
    Interrupted,
    Signals,
    describe_end,
    die_with_parent,
    end_by_signal,
    saved_line,
    writes_html,
)
from .launch_first_forward import FirstForwardHooks
from .launch_inputs import InputWatch, frozen_models, script_modules
from .launch_plain import (
    GIVEN_GRADIENTS,
    EarlyCheck,
    ThisThread,
    holds_unwatched,
    keep,
    model_of,
    patch_backward,
    patch_clip,
    patch_scaler,
    patch_zero_grad,
    plain_models,
    put_back,
)

NOTHING_STEPPED = "it stepped no optimizer of a model it trains (Accelerator.prepare or torch.optim)"
ENDED = "the script ended"
"""``failed`` once :meth:`LaunchWatch.finish` ran: nothing more is watched."""


def _unstepped(end: dict[str, Any]) -> str:
    """Why a script that launch did not give up on was not watched, from how it ended (``end``): one
    that raised or was interrupted before its first training step (an error in step 0's forward, a
    model or option the script refuses), else :data:`NOTHING_STEPPED`."""
    if end.get("status") == "raised":
        where = f" ({end['where']})" if end.get("where") else ""
        return f"it raised {end.get('exception')} before its first training step{where}"
    if end.get("status") == "interrupted":
        return f"it was interrupted ({end.get('signal')}) before its first training step"
    return NOTHING_STEPPED


def _is_main_process() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _say(text: str, main: bool | None = None) -> None:
    """One line of ours on the main process (``main``: whether this one is, where the debugger knows)."""
    if _is_main_process() if main is None else main:
        print(f"diffusion-debug launch: {text}", file=sys.stderr, flush=True)


def _live_optimizer_of(model: nn.Module) -> Any:
    """A live torch optimizer that steps only ``model``'s parameters, or None."""
    from ..training.judges.optimizer_coverage import live_objects

    held = {id(p) for p in model.parameters()}
    for optimizer in live_objects(torch.optim.Optimizer):
        stepped = [id(p) for group in getattr(optimizer, "param_groups", ()) for p in group["params"]]
        if stepped and all(i in held for i in stepped):
            return optimizer
    return None


def _trainable(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


def _model_names(models: list[nn.Module]) -> Any:
    """One model as itself (``component="model"``); several by their class, e.g. ``unet``."""
    if len(models) == 1:
        return models[0]
    roles = {"UNet2DConditionModel": "unet", "CLIPTextModel": "text_encoder", "T5EncoderModel": "text_encoder"}
    named: dict[str, nn.Module] = {}
    for model in models:
        inner = eager_module(model)  # compiled after prepare: compiled_as
        inner = getattr(inner, "module", inner)
        base = roles.get(type(inner).__name__, type(inner).__name__.lower())
        name, n = base, 2
        while name in named:
            name, n = f"{base}_{n}", n + 1
        named[name] = model
    return named


class LaunchWatch:
    """The seams of one process, and the debugger made at its first optimizer step."""

    def __init__(self, settings: dict[str, Any], script: str = "the script"):
        self.settings = settings
        self.script = script
        self.config: Any = None
        self.models: list[nn.Module] = []
        self.optimizers: list[Any] = []
        self.accelerator: Any = None
        self.debugger: Any = None
        self.adopted: Any = None
        """The script's own ``TrainingDebugger``, for which launch stepped aside (:meth:`adopt`)."""
        self.runs_before = _runs_made()
        """The pipeline runs this process's debuggers had made before the script ran (where launch runs
        in a process that made some: :func:`pipeline_runs` names the script's only)."""
        self._making = False
        """Whether launch is making its own debugger (not the script's: :meth:`adopt` lets it be)."""
        self.thread = ThisThread()
        """What each thread is doing (:class:`~.launch_plain.ThisThread`): inside a backward, its loss
        (:attr:`loss`) and its earlier backwards' since its last step, its loss from Accelerate, the
        losses its GradScaler scaled that no backward took yet, and that scaler."""
        self.steps = 0
        """Training steps monitored so far (the next one's number)."""
        self.failed: str | None = None
        self.said = False
        """Whether the line saying why nothing is watched was printed already."""
        self.end: dict[str, Any] = {"status": "finished"}
        self._undo: list[Any] = []
        self._inner_optimizers: weakref.WeakSet = weakref.WeakSet()
        self._told: set[str] = set()
        self.inputs = InputWatch()
        self._input_error_said = False
        self.early = EarlyCheck()
        """No Accelerator: the check of this rank's gradients attached before the first ``backward``."""
        self._step_hook: Any = None
        """torch's global optimizer step pre-hook's handle (:meth:`_plain_step`), while installed."""
        self._stepping: list[int] = []
        """The threads running :meth:`_plain_step` (its hook cannot be removed while one is: torch
        iterates over its dict of them), by ident, once each time they entered it."""
        self._first_forward = FirstForwardHooks()
        """No Accelerator: on each model holding a torch optimizer's parameters, the pre-hook that makes
        the debugger at its first forward under grad (:meth:`_first_forward_call`), out of dynamo's traces."""
        self._searched_at_clip = False
        """Whether a clip before any optimizer step looked for its optimizer (once: a script whose
        update is no torch optimizer's would look through the live optimizers at every clip)."""
        self.marks: tuple[Any, ...] = ()
        """The parameters whose gradients each ``backward`` marks (:meth:`_mark`), so that the next
        one sees a gradient zeroed in place by hand (:meth:`dropped_by_hand`)."""
        self._others: dict[int, frozenset[int] | None] = {}
        """By watched optimizer (``id``): :meth:`_stepped_by_others`."""
        self._zeroed_before_step: list[weakref.ref] | None = None
        """The trainable parameters of the live optimizers, looked up once, at the first ``zero_grad``
        or second ``backward`` that may drop a loss before the models are known (:meth:`_trained`)."""

    @property
    def loss(self) -> torch.Tensor | None:
        """This thread's last ``backward``'s loss, until a step reads it (then None: another optimizer
        stepping on the same gradients is part of that step)."""
        return self.thread.loss

    @loss.setter
    def loss(self, loss: torch.Tensor | None) -> None:
        self.thread.loss, self.thread.dropped = loss, False

    def dropped_by(self, owner: Any) -> set[int]:
        """The trainable parameters of the watched models (by id) whose gradients are gone after a
        ``zero_grad`` of ``owner`` (an optimizer or a module), which has just run: its own and any
        with no gradient; none where it holds none of them (:func:`~.launch_plain.patch_zero_grad`).
        All of them: the backwards kept so far are no loss of the step; some (a GAN's discriminator's,
        a submodule's): theirs are set aside for the optimizer that steps on the rest."""
        if isinstance(owner, nn.Module):
            held = owner.parameters()
        else:
            held = (p for group in getattr(owner, "param_groups", ()) for p in group["params"])
        ids = {id(p) for p in held if getattr(p, "requires_grad", False)}
        trained = self._trained()
        if not any(id(p) in ids for p in trained):
            return set()
        return {id(p) for p in trained if id(p) in ids or p.grad is None}

    def dropped_by_hand(self, state: Any) -> None:
        """Before a ``backward`` while this thread holds an earlier one's loss that no step read:
        the gradients the script set to None since (``p.grad = None`` for every parameter, after a
        probing backward), as :meth:`dropped_by` finds a ``zero_grad``'s. One pass over the
        parameters, on a step's second backward only. Gradients zeroed in place by hand
        (``p.grad.zero_()``, ``p.grad.detach_(); p.grad.zero_()``) or replaced (``p.grad =
        torch.zeros_like(p)``) are seen through :attr:`marks`: when the gradient of one of them
        moved since the last backward (another tensor, or its ``_version``), one read says which
        gradients hold only zeros (a gradient of zeros carries no loss's share, dropped or not).
        Before any optimizer is known (a plain script's step 0) there is no mark: that read is made
        at each of the step's later backwards. Not under FSDP2 (its parameters' ``.grad`` stays
        None while ``set_requires_gradient_sync(False)`` accumulates elsewhere); a part zeroed by
        hand that holds none of :attr:`marks` (one layer's) is not seen."""
        try:
            trained = self._trained()
            if trained and not self._sharded(trained):
                ids = {id(p) for p in trained if p.grad is None}
                if self._moved(state.marked):
                    ids |= _only_zeros(trained)
                self.note_dropped(state, ids)
        except Exception as error:  # the script's backward is never broken by ours
            self.give_up(f"the debugger could not look at the gradients before a backward ({_reason(error)})")

    def _moved(self, marked: list | None) -> bool:
        """Whether the gradient of one of :attr:`marks` is not the one this thread's last backward
        left (``marked``, :attr:`~.launch_plain.ThisThread.marked`; None: not known)."""
        if marked is None or len(marked) != len(self.marks):
            return True
        for param, mark in zip(self.marks, marked):
            grad = param.grad
            if mark is None or grad is None:
                if mark is not grad:  # one of them None, the other not
                    return True
            elif mark[0]() is not grad or grad._version != mark[1]:
                return True
        return False

    def reaches_watched(self, tensors: Any) -> bool:
        """Whether the backward of ``tensors`` (a tensor or a list of them) reached a trainable
        parameter of the watched models: a walk of its graph (its nodes outlive the backward), made
        only for a backward that moved none of :attr:`marks`. A node of a custom ``Function``
        (``torch.utils.checkpoint``'s reentrant one, whose graph is made inside its backward) may
        reach any: it counts as reaching one. When unsure (a failure; sharded parameters, whose
        graph holds others), it reached one."""
        try:
            params = self._trained()
            if not params or self._sharded(params):  # FSDP2's graph holds its unsharded parameters
                return True
            trained = {id(p) for p in params}
            given = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
            stack = [t.grad_fn if t.grad_fn is not None else t for t in given if isinstance(t, torch.Tensor)]
            custom = torch.autograd.function.BackwardCFunction
            seen: set[int] = set()
            while stack:
                node = stack.pop()
                if node is None or id(node) in seen:
                    continue
                seen.add(id(node))
                if isinstance(node, torch.Tensor):  # a leaf backwarded itself
                    if id(node) in trained:
                        return True
                    continue
                variable = getattr(node, "variable", None)
                if (variable is not None and id(variable) in trained) or isinstance(node, custom):
                    return True
                stack.extend(next_node for next_node, _ in node.next_functions)
            return False
        except Exception:  # the script's backward is never broken by ours: its loss kept, as before
            return True

    def _mark(self, optimizers: list[Any] | None = None) -> None:
        """:attr:`marks`: the first trainable parameter of each watched optimizer, once they are known
        (``optimizers``: of those, before: a plain script's step 0, every live one)."""
        marks: list[Any] = []
        for optimizer in self.optimizers if optimizers is None else optimizers:
            held = (p for group in optimizer.param_groups for p in group["params"] if p.requires_grad)
            first = next(held, None)
            if first is not None and not any(first is m for m in marks):
                marks.append(first)
        self.marks = tuple(marks)

    def zeroed(self, state: Any, owner: Any) -> None:
        """A ``zero_grad`` of ``owner`` ran while this thread holds a loss no step read, or losses set
        aside: the gradients it dropped (:meth:`dropped_by`, :meth:`note_dropped`)."""
        try:
            self.note_dropped(state, self.dropped_by(owner))
        except Exception as error:  # the script's zero_grad is never broken by ours
            self.give_up(f"the debugger could not look at the gradients after a zero_grad ({_reason(error)})")

    def note_dropped(self, state: Any, ids: set[int]) -> None:
        """The gradients of the parameters ``ids`` are gone: every one of the watched models', and
        the losses this thread holds are no loss of the step (``state.dropped``); some, and they are
        set aside at the next backward for an optimizer that keeps the others
        (``state.dropped_params``). Losses set aside before whose every gradient is gone now go."""
        if not ids:
            return
        trained = self._trained()
        if state.loss is not None:
            ids = ids | (state.dropped_params or set())
            if all(id(p) in ids for p in trained):
                state.dropped, state.dropped_params = True, None
            else:
                state.dropped_params = ids
        aside = state.aside
        if aside is not None:
            aside.dropped |= ids
            if all(id(p) in aside.dropped for p in trained):
                state.aside = None

    def _trained(self) -> list[Any]:
        """The trainable parameters of the watched models (the debugger's list once it is made);
        before the models are known (a plain script's step 0), those of every live optimizer
        (:mod:`~diffusion_debug.training.judges.live_objects`, looked up once: a script whose update
        is no torch optimizer's would look at every ``zero_grad``)."""
        if self.debugger is not None:
            return self.debugger.params.params
        if self.models:
            return [p for model in self.models for p in model.parameters() if p.requires_grad]
        if self._zeroed_before_step is None:
            from ..training.judges.optimizer_coverage import live_objects

            live = [o for o in live_objects(torch.optim.Optimizer) if o not in self._inner_optimizers]
            groups = [group for o in live for group in getattr(o, "param_groups", ())]
            params = [p for group in groups for p in group["params"] if getattr(p, "requires_grad", False)]
            self._zeroed_before_step = [weakref.ref(p) for p in params]  # not kept alive by us
            if not self.marks:  # step 0's later backwards are marked too (the optimizers' at their step)
                self._mark([o for o in live if getattr(o, "param_groups", None)])
        return [p for p in (ref() for ref in self._zeroed_before_step) if p is not None]

    def _sharded(self, trained: list[Any]) -> bool:
        """Whether the gradients live outside ``.grad`` between backwards (FSDP2's ``DTensor``
        parameters; DeepSpeed ZeRO's partitions)."""
        if self.debugger is not None:
            return self.debugger.params.sharded
        from ..training.measure.wrappers import local_part

        return any(local_part(p) is not p for p in trained[:1])

    # -- giving up -------------------------------------------------------------------------------
    def give_up(self, why: str) -> None:
        """Stop watching, once, and say why (the script runs on as under a plain launch; a debugger
        made already is closed, its run saved at the end with the steps it monitored)."""
        if self.failed is None:
            self.failed = why
        self._let_go()
        if not self.said:
            self.said = True
            if self.debugger is None:
                _say(f"not watching {self.script}: {why}; it runs unwatched, as under accelerate launch.")
            else:
                said = f"stopped watching {self.script} after {self.steps} step(s): {why}; it runs on unwatched."
                _say(said, _main_of(self.debugger))

    def _let_go(self) -> None:
        """Nothing more is monitored (``failed`` is set): no count on the script's tensors, no
        bucket of its gradients read, no loss kept (a detached tensor of the script's, on its device),
        torch, Accelerate and DeepSpeed get their own functions back (:meth:`uninstall`), and a
        debugger made already is closed (its hooks go; :meth:`finish` saves its run)."""
        self.loss = None
        try:
            self.uninstall()
        except Exception:  # pragma: no cover - setattr back cannot fail in practice
            pass
        if self.debugger is not None:  # kept for its report
            _close(self.debugger, _main_of(self.debugger))

    def _tell(self, note: str) -> None:
        if note not in self._told:
            self._told.add(note)
            _say(note)

    def check_settings(self) -> None:
        """The launcher's settings as a DebugConfig, before the script starts (else: give up)."""
        from ..config import DebugConfig, read_config_file

        try:
            if not isinstance(self.settings, dict):
                raise ValueError(f"{ENVIRONMENT} holds {type(self.settings).__name__}, not a JSON object")
            data = read_config_file(Path(self.settings["config"])) if self.settings.get("config") else {}
            for key in ("level", "policy", "output_dir"):
                if self.settings.get(key):
                    data[key] = self.settings[key]
            self.config = DebugConfig.from_dict(data)
        except Exception as error:
            self.give_up(f"its settings in {ENVIRONMENT} are wrong ({_reason(error)})")

    # -- seams -----------------------------------------------------------------------------------
    def install(self) -> None:
        watch = self
        from ..training.judges.live_objects import LiveObjects

        # the script's models and optimizers, noted as it makes them: looked up with no walk of its heap
        self._undo.append(LiveObjects(on_optimizer=self._optimizer_made).install().remove)
        self._undo.append(patch_backward(self))
        self._undo.append(patch_scaler(self))
        self._undo.append(patch_clip(self))
        self._undo.append(patch_zero_grad(self))
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        self._step_hook = register_optimizer_step_pre_hook(self._plain_step)
        self._undo.append(self._patch_own_debugger())
        try:
            import accelerate
        except ImportError:
            return
        original_prepare = accelerate.Accelerator.prepare

        def prepare(accelerator: Any, *args: Any, **kwargs: Any) -> Any:
            result = original_prepare(accelerator, *args, **kwargs)
            if not watch.failed:
                try:
                    watch._prepared(accelerator, result if isinstance(result, tuple) else (result,))
                except Exception as error:  # the script's prepare is never broken by ours
                    watch.give_up(f"the debugger could not watch Accelerator.prepare ({_reason(error)})")
            return result

        accelerate.Accelerator.prepare = prepare
        self._undo.append(lambda: put_back(accelerate.Accelerator, "prepare", prepare, original_prepare))
        self._undo.append(patch_engine_backward(self))  # DeepSpeed's step, inside backward

    def _patch_own_debugger(self) -> Callable[[], None]:
        """``TrainingDebugger.__init__`` tells :meth:`adopt` of a debugger the script makes (not
        launch's own); returns the undo."""
        from ..training import TrainingDebugger

        watch, original = self, TrainingDebugger.__init__

        def init(debugger: Any, *args: Any, **kwargs: Any) -> None:
            if watch._making:
                original(debugger, *args, **kwargs)
                return
            try:
                watch.adopt(debugger, lambda: original(debugger, *args, **kwargs))
            except BaseException as error:  # the constructor's error, its traceback as without launch
                error.__traceback__ = _without_ours(error.__traceback__)
                raise  # a bare raise adds no frame of this one

        TrainingDebugger.__init__ = init  # type: ignore[method-assign]
        return lambda: put_back(TrainingDebugger, "__init__", init, original)

    def uninstall(self) -> None:
        """Put back what :meth:`install` changed (idempotent). torch's global optimizer pre-hook is
        removed unless it is running (torch iterates over its dict of them: a removal then raises
        in the script's ``step``); then :meth:`finish` removes it, and till then it returns at once."""
        self.inputs.remove()
        self.early.release()
        self._first_forward.remove()
        self.loss = None
        self.thread = ThisThread()  # every thread's scaled loss and scaler let go
        while self._undo:
            self._undo.pop()()
        if self._step_hook is not None and not self._stepping:  # no thread runs it
            hook, self._step_hook = self._step_hook, None
            hook.remove()

    def _prepared(self, accelerator: Any, objects: tuple[Any, ...]) -> None:
        from accelerate.optimizer import AcceleratedOptimizer

        if self.accelerator is None:
            self.accelerator = accelerator
            self._first_forward.remove()  # the optimizers made before it: Accelerate's seams watch them
            self._wrap_accelerator(accelerator)
            # not under the FSDP plugin: FSDP2's pre-hooks, before launch's, unshard the parameters; a prepended
            # hook (as with no Accelerator) is untested there (the plugin needs GPUs: Accelerate keeps MULTI_CPU)
            if getattr(getattr(accelerator, "distributed_type", None), "value", None) != "FSDP":
                self.inputs.first_training_call = self._first_training_call
        frozen = []
        for obj in objects:
            if isinstance(obj, nn.Module) and _trainable(obj) and not any(obj is m for m in self.models):
                if self.debugger is not None:
                    name = type(getattr(obj, "module", obj)).__name__
                    self._tell(f"{name} was prepared after the first training step, so it is not watched.")
                    continue
                self.models.append(obj)
            elif isinstance(obj, nn.Module):
                frozen.append(obj)  # prepared without trainable parameters: a text encoder, a VAE
            elif isinstance(obj, AcceleratedOptimizer) and not any(obj is o for o in self.optimizers):
                self.optimizers.append(obj)
                self._inner_optimizers.update(inner_optimizers(obj))
                self._wrap_step(obj)
            elif isinstance(obj, torch.utils.data.DataLoader):
                self.inputs.watch_loader(obj)
        self._mark()
        self._watch_inputs(frozen)

    def _watch_inputs(self, prepared_frozen: list[nn.Module]) -> None:
        """Hook what feeds the trained models (``launch_inputs``), by the names the script gives
        them; a failure stops that watch (a ``debugger_error`` at the next step), never the script."""
        if not self.models or self.inputs.error is not None:
            return
        try:
            self._hook_inputs(script_modules(), prepared_frozen)
        except Exception as error:
            self.inputs.error = error
            self.inputs.remove()

    def _hook_inputs(self, held: dict[int, tuple[str, nn.Module]], prepared_frozen: list[nn.Module]) -> None:
        names = {key: name for key, (name, _) in held.items()}
        trained = set()
        for model in self.models:
            inner = getattr(model, "module", model)
            self.inputs.watch_trained(model, names.get(id(model)) or names.get(id(inner)) or "model")
            trained.update((id(model), id(inner)))
        for name, module in held.values():  # torch.compile(model): its hooks run before the compiled code
            if compile_wrapper(module) and id(module._orig_mod) in trained:
                self.inputs.watch_trained(module, name)
        for module in prepared_frozen:
            inner = getattr(module, "module", module)
            held.setdefault(id(inner), (names.get(id(module)) or type(inner).__name__, module))
        for name, module in frozen_models(self.models, held):
            self.inputs.watch_frozen(module, name)

    def _wrap_accelerator(self, accelerator: Any) -> None:
        watch = self
        backward, clip = accelerator.backward, accelerator.clip_grad_norm_

        def watched_backward(loss: torch.Tensor, **kwargs: Any) -> Any:
            state = watch.thread
            state.loss_from_accelerator = True
            state.engine_stepped = False
            if watch.optimizers and not watch.failed:
                watch._debugger_ready()  # before the first: each rank's check attaches before its reduction
                if state.loss is not None:  # an earlier backward's loss waits for the step
                    watch.dropped_by_hand(state)
            held = _marked(watch.marks)
            result = backward(loss, **kwargs)
            if state.engine_stepped or watch.failed:  # DeepSpeed's engine wrapper watched it, its step too
                return result
            watch.inputs.end_backward()
            state.marked = marked = _marked(watch.marks)
            kept = loss.detach()
            if marked and not _moved_between(held, marked) and not watch.reaches_watched(loss):
                kept = GIVEN_GRADIENTS  # an EMA model's or a frozen branch's: no loss of the step
            keep(state, kept, watch.inputs)  # a second backward before the step: the first a micro-step of it
            if not accelerator.sync_gradients and watch._debugger_ready():
                watch._monitor(None)  # a micro-step: its loss joins the optimizer step's mean
            return result

        def watched_clip(parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
            # read before clipping: the gradients are complete, and a NaN is still where it was made
            # (clipping by a NaN norm spreads it to every gradient)
            if accelerator.sync_gradients and watch.optimizers and watch.loss is not None and not watch.failed:
                parameters = parameters if isinstance(parameters, torch.Tensor) else list(parameters)
                watch._optimizer_step(watch._optimizer_of(parameters), max_norm=float(max_norm))
            return clip(parameters, max_norm, norm_type=norm_type)

        accelerator.backward = watched_backward
        accelerator.clip_grad_norm_ = watched_clip

        def undo() -> None:
            put_back(accelerator, "backward", watched_backward)
            put_back(accelerator, "clip_grad_norm_", watched_clip)

        self._undo.append(undo)

    def _plain_clip(self, parameters: Any, max_norm: Any) -> None:
        """A plain script's ``clip_grad_norm_`` (:func:`~.launch_plain.patch_clip`): the step read
        before the clip when the first of ``parameters`` is a watched optimizer's (the step reads it
        otherwise); the scaler is this thread's last one that scaled a loss (its step finds the step
        read). Before any optimizer stepped (step 0 of a plain script) the optimizer is found here
        (:meth:`_found_at_clip`), so that step 0 too is read before the clip spreads a NaN."""
        optimizer = self._holding(parameters)
        if optimizer is None and not (self.optimizers or self.debugger or self.accelerator or self._searched_at_clip):
            self._searched_at_clip = True
            try:
                optimizer = self._found_at_clip(parameters)
            except Exception as error:  # the script's clip is never broken by ours
                self.give_up(f"the debugger could not find the optimizer of the clipped parameters ({_reason(error)})")
                return
        if optimizer is not None:
            self._optimizer_step(optimizer, max_norm=float(max_norm), scaler=self.thread.scaler)

    def _found_at_clip(self, parameters: Any) -> Any:
        """The live torch optimizer that holds the first of ``parameters``, made the first watched one
        with the models of every live optimizer, as the first step's pre-hook does (:meth:`_plain_step`);
        None where none holds them or no module holds its parameters (the step then reads, or fails,
        as before). One look through the live optimizers, at step 0's clip."""
        from ..training.judges.optimizer_coverage import live_objects

        first = _first_of(parameters)
        for optimizer in live_objects(torch.optim.Optimizer):
            groups = getattr(optimizer, "param_groups", ())  # none: half-built (its __init__ raised), kept alive
            if optimizer not in self._inner_optimizers and any(p is first for g in groups for p in g["params"]):
                models, optimizers = plain_models(optimizer)
                if not models:
                    return None
                self.models, self.optimizers = models, optimizers
                self._mark()
                self._watch_inputs([])
                return optimizer
        return None

    def _holding(self, parameters: Any) -> Any:
        """The watched optimizer that holds the first of ``parameters`` (a tensor or a list), or None."""
        first = _first_of(parameters)
        for optimizer in self.optimizers:
            if any(p is first for group in optimizer.param_groups for p in group["params"]):
                return optimizer
        return None

    def _optimizer_of(self, parameters: Any) -> Any:
        """The prepared optimizer that holds the first of ``parameters`` (the first one prepared if none)."""
        optimizer = self._holding(parameters)
        return self.optimizers[0] if optimizer is None else optimizer

    def _wrap_step(self, optimizer: Any) -> None:
        watch = self
        step = optimizer.step

        def watched_step(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not watch.failed and (watch.accelerator is None or watch.accelerator.sync_gradients):
                watch._optimizer_step(optimizer)
            return step(*args, **kwargs)

        # a bound method, as the optimizer's own step is: torch's LR scheduler made after prepare
        # wraps ``optimizer.step.__func__`` (a plain function raised AttributeError in the script)
        optimizer.step = ours = types.MethodType(watched_step, optimizer)
        self._undo.append(lambda: put_back(optimizer, "step", ours))

    def _plain_step(self, optimizer: Any, args: Any = (), kwargs: Any = None, scaler: Any = None) -> None:
        """torch's global pre-hook: an optimizer that Accelerate did not prepare; and
        ``GradScaler.step`` (``scaler``), before it, which a skipped step reaches alone
        (:func:`~.launch_plain.patch_scaler`; the pre-hook then finds the step read already)."""
        if optimizer in self._inner_optimizers or self.failed:
            return
        thread = get_ident()
        self._stepping.append(thread)
        try:
            if self.debugger is None and not self.optimizers:
                self.models, self.optimizers = plain_models(optimizer)
                if not self.models:
                    self.failed = "no module holds the parameters its optimizer steps"
                    self._let_go()
                    return
                self._mark()
                self._watch_inputs([])
            if any(optimizer is o for o in self.optimizers):
                self._optimizer_step(optimizer, scaler=scaler)
            elif self.debugger is not None and holds_unwatched(optimizer, self.models):
                name = type(optimizer).__name__
                self._tell(f"a {name} made after the first training step trains parameters that are not watched.")
        finally:
            self._stepping.remove(thread)

    # -- monitoring ------------------------------------------------------------------------------
    def _optimizer_step(self, optimizer: Any, max_norm: float | None = None, scaler: Any = None) -> None:
        """Read this ``backward``'s gradients, once (at the clip or at the first optimizer step)."""
        if self.failed:
            return
        if self.loss is None:  # read already: another optimizer steps on the same backward
            aside = self.thread.aside  # unless the losses set aside for it are its own (a GAN's generator's)
            if aside is not None and aside.counts_for(optimizer) and self._debugger_ready():
                self.thread.aside = None
                losses = list(aside.losses)
                inputs = self.inputs.take(aside.inputs, own=False)
                others = self._stepped_by_others(optimizer)
                self._monitor_losses(optimizer, losses[-1], losses[:-1], inputs, max_norm, scaler, others)
                return
            if self.debugger is None and self.steps == 0:
                self.failed = "its optimizer stepped before any backward"
                self._let_go()
            return
        if self._debugger_ready():
            self._monitor(optimizer, max_norm, scaler)

    def _debugger_ready(self) -> bool:
        if self.debugger is None and not self.failed:
            if not self.models:
                self.failed = "Accelerator.prepare returned no model with trainable parameters"
                self._let_go()
                return False
            self._watch_inputs([])  # the models made since prepare
            try:
                self.debugger = self._make_debugger()
            except Exception as error:  # an unwritable or full disk, a port in use: the script runs on
                self.give_up(f"the debugger could not be made ({_reason(error)})")
            # made (at the first step where no first forward made it): no hook of the first forward is
            # left to change a module's hooks later, which a compile since then would be guarded on
            self._first_forward.remove()
        return self.debugger is not None

    def _first_training_call(self) -> None:
        """A prepared model's first forward under grad begins: the debugger is made there rather than
        at the first ``backward``, so that an error of step 0's forward (out of memory) is recorded as
        step 0's and the run saved with it; under the DeepSpeed plugin too (the prepared model is the
        engine, whose hooks of its own, ZeRO-3's fetch, are on the model inside it: this one runs first).
        Not under FSDP (whose forward pre-hooks, before this one, unshard the parameters): made at the
        first ``backward``."""
        if self.debugger is None and self.optimizers and not self.failed:
            self._debugger_ready()

    def _optimizer_made(self, optimizer: Any) -> None:
        """No Accelerator (yet): a torch optimizer made before the debugger. The model that holds its
        parameters (:func:`~.launch_plain.model_of`) gets a pre-hook that makes the debugger as its
        first forward under grad begins (:meth:`_first_forward_call`)."""
        if self.accelerator is None and self.debugger is None and not self.failed and not self.optimizers:
            try:
                model = model_of(optimizer)
            except Exception as error:  # the script's optimizer is never broken by ours
                self.give_up(f"the debugger could not find the model of an optimizer ({_reason(error)})")
                return
            if model is not None:
                self._hook_first_forward(model, weakref.ref(optimizer))

    def engine_made(self, engine: Any) -> None:
        """A DeepSpeed engine was made (``deepspeed.initialize``): its first forward under grad makes
        the debugger, the engine the model (:meth:`_first_forward_call`)."""
        if self.accelerator is None and self.debugger is None and not self.failed and not self.optimizers:
            if isinstance(engine, nn.Module):  # (a DeepSpeed unlike the one we know: its first backward)
                self._hook_first_forward(engine, None)

    def _hook_first_forward(self, model: nn.Module, optimizer: Any) -> None:
        if model not in self._first_forward:
            # before every hook of its own: FSDP2's unshard, DeepSpeed ZeRO-3's fetch, its casts
            self._first_forward.add(
                model, functools.partial(eager_frame(LaunchWatch._first_forward_call), self, optimizer)
            )

    def _first_forward_call(self, optimizer: Any, module: nn.Module, args: Any, eager: bool = False) -> None:
        """No Accelerator: a model of a plain script's optimizer (``optimizer``, a weak reference), or a
        DeepSpeed engine (``optimizer`` None), begins a forward under grad, eagerly, before any step: the
        models are found as at the first step (:meth:`_plain_step`; the engine as at its first
        ``backward``) and the debugger is made, its hooks on them before their own run, so that an
        out-of-memory error of step 0's forward is step 0's, as under Accelerate, on every engine a plain
        script runs (DDP, FSDP2, DeepSpeed). Its hook goes then; a model whose call dynamo traces (a script's
        compiled step) has none in its trace (:mod:`.launch_first_forward`): the first step makes the
        debugger, as before.
        Where the optimizer's parameters are held by no trainable model (ZeRO replaced them with its own
        partitions), nothing is found here."""
        # compiling(), inline: a Python call here is a frame dynamo traces under module.compile()
        if torch.compiler.is_dynamo_compiling() or torch.compiler._is_compiling_flag:
            return  # traced inside a compiled model's code: nothing there (no break, no recompile)
        if not eager and compile_callback is not None and compile_callback() is not None:
            if module.__dict__.get("_compiled_call_impl") is not None:  # module.compile(): eager_frame
                run_eagerly(lambda: self._first_forward_call(optimizer, module, args, True))
            return  # else run eagerly inside another's compiled call: as compiled code
        if not torch.is_grad_enabled():
            return
        self._first_forward.pop(module)
        if self.accelerator is not None or self.debugger is not None or self.failed or self.optimizers:
            return
        try:
            if optimizer is None:  # a DeepSpeed engine, its ZeRO optimizer the optimizer
                if module.optimizer is None:
                    return
                self.models, self.optimizers = [module], [module.optimizer]
                self._inner_optimizers.update(inner_optimizers(module))
            else:
                optimizer = optimizer() or _live_optimizer_of(module)  # (made again: the first one dropped)
                if optimizer is None or optimizer in self._inner_optimizers:
                    return
                models, optimizers = plain_models(optimizer)
                if not models or not all(_trainable(m) for m in models):
                    return  # found at the first step (or not), as before
                self.models, self.optimizers = models, optimizers
                self._mark()
        except Exception as error:  # the script's forward is never broken by ours
            self.give_up(f"the debugger could not find the models of the script's optimizers ({_reason(error)})")
            return
        self._debugger_ready()

    def _make_debugger(self) -> Any:
        from ..training import TrainingDebugger

        models = _model_names([self.inputs.compiled_as(model) for model in self.models])
        accelerator, config = self.accelerator, self.config
        self._making = True
        try:
            return self.early.hand_over(lambda: TrainingDebugger(models, accelerator=accelerator, config=config))
        finally:
            self._making = False

    def adopt(self, debugger: Any, make: Callable[[], None]) -> None:
        """The script makes its own ``TrainingDebugger`` (``make()`` runs its constructor on
        ``debugger``): launch steps aside first (no seam of ours left for it to meet, no second record
        of the same steps), then says which debugger watches the run, once; :meth:`finish` saves that
        run with how the script ended. A debugger of launch's made already stops, its run kept."""
        if self.failed:  # launch stepped aside already, or never watched
            make()
            return
        mine, steps = self.debugger, self.steps
        self.failed, self.said = "the script makes its own TrainingDebugger", True
        self._let_go()
        try:
            make()
        except BaseException as error:  # the script's own error: it goes on up, as without launch
            _say(f"{self.script}'s own TrainingDebugger could not be made ({_reason(error)}); launch watches nothing.")
            raise
        self.adopted = debugger
        where = debugger.record.run_dir
        if mine is None:
            said = f"{self.script} makes its own TrainingDebugger, so launch steps aside: the script's debugger "
            said += f"watches the run, in {where} (launch's --debug-output-dir, --level, --policy and "
            said += "--debug-config do not apply to it)."
        else:
            said = f"{self.script} made its own TrainingDebugger after launch's watched {steps} step(s): launch "
            said += f"stopped (its run: {mine.record.run_dir}); the script's debugger watches the rest, in {where}."
        _say(said, _main_of(debugger))

    def _monitor(self, optimizer: Any, max_norm: float | None = None, scaler: Any = None) -> None:
        """This thread's loss monitored (``optimizer`` None: a micro-step of Accelerate's or
        DeepSpeed's), after its earlier backwards since its last step, each a micro-step of this one
        (:func:`~.launch_plain.keep`): their mean is the step's loss, as Accelerate's micro-steps'. A
        step whose backwards had no scalar (:data:`~.launch_plain.GIVEN_GRADIENTS`) has no loss. Losses
        set aside for another optimizer (:class:`~.launch_plain.SetAside`) come first where this one
        steps on them too."""
        state = self.thread
        loss, state.loss = state.loss, None
        micro, state.micro, state.dropped, state.dropped_params = state.micro, None, False, None
        aside, earlier, others = state.aside, [], None
        if aside is not None and optimizer is not None:
            if aside.counts_for(optimizer):  # it steps on them too
                state.aside, micro, earlier = None, [*aside.losses, *(micro or ())], aside.inputs
            else:  # they wait for another optimizer's step: its gradients are judged there
                others = self._stepped_by_others(optimizer)
        self._monitor_losses(optimizer, loss, micro, self.inputs.take(earlier), max_norm, scaler, others)

    def _stepped_by_others(self, optimizer: Any) -> frozenset[int] | None:
        """The watched parameters (by ``id``) that another watched optimizer steps and ``optimizer``
        does not (None: none), for a step whose gradients are judged apart from the others': a GAN's
        discriminator's step, while the generator's losses wait for its own (:class:`SetAside`),
        judges the discriminator's gradients; the generator's step, its own. Made once for each
        optimizer (the watched optimizers are fixed once the debugger is made)."""
        key = id(optimizer)
        if key not in self._others:
            mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
            held = (p for o in self.optimizers if o is not optimizer for g in o.param_groups for p in g["params"])
            self._others[key] = frozenset(id(p) for p in held if id(p) not in mine) or None
        return self._others[key]

    def _monitor_losses(
        self,
        optimizer: Any,
        loss: Any,
        micro: Any,
        inputs: Any,
        max_norm: float | None,
        scaler: Any,
        others: frozenset[int] | None = None,
    ) -> None:
        """``loss`` monitored as a step of ``optimizer`` (None: a micro-step), after ``micro``, the
        earlier losses it steps on, each a micro-step of it; ``inputs``: the step's input counts;
        ``others``: the parameters whose gradients another optimizer's step judges, not this one
        (:meth:`_stepped_by_others`)."""
        from ..training.measure.loss import NO_LOSS

        step = self.steps
        if optimizer is not None:
            self.steps += 1
        if self.inputs.error is not None and not self._input_error_said:
            self._input_error_said = True
            rank = getattr(getattr(self.debugger, "_ctx", None), "rank", 0)
            self.debugger.sink.debugger_error("watching the inputs", self.inputs.error, step=step, rank=rank)
        for earlier in micro or ():
            self.debugger.monitor_training_step(
                earlier, optimizer=optimizer or self.optimizers[0], step=step, inputs=inputs, accumulating=True
            )
            inputs = None  # the step's inputs so far, given once: they join the step's counts
        if others is not None:  # taken by the step's measurement (a micro-step measures no gradient)
            self.debugger._steps.measurer.not_judged = others
        self.debugger.monitor_training_step(
            NO_LOSS if loss is GIVEN_GRADIENTS else loss,
            optimizer=optimizer if optimizer is not None else self.optimizers[0],
            step=step,
            max_grad_norm=max_norm,
            scaler=scaler,
            inputs=inputs,
        )

    # -- the end ---------------------------------------------------------------------------------
    def finish(self, signals: Signals | None = None) -> None:
        """Save the run with how it ended, and print its summary on the main process. Never raises:
        the script's own exit status and exception are what the job ends with."""
        if signals is not None:
            signals.saving = True  # a second Ctrl-C does not cut the files being written
        # from here every wrapper of ours still called (one left inside someone else's, a thread
        # still training) passes through: the original runs, nothing is recorded, no debugger made
        why, self.failed = self.failed, self.failed or ENDED
        try:
            self.uninstall()
        except Exception:  # pragma: no cover - setattr back cannot fail in practice
            pass
        if self.debugger is None and self.adopted is None:
            if not self.said:
                _say(f"nothing was watched in {self.script}: {why or _unstepped(self.end)}; the script ran unchanged.")
        else:
            ran = [self.debugger, self.adopted]
            self.debugger = self.adopted = None
            for debugger in ran:
                if debugger is not None:
                    self._save(debugger)
        said = pipeline_runs(self.runs_before)
        if said:
            _say(said)

    def _save(self, debugger: Any) -> None:
        """Save ``debugger``'s run with how the script ended (also one the script saved: its summary
        gets the ``end``), print its summary on the main process, close it."""
        # the debugger's own main process: a process that trains alone (world size 1, a split
        # launch) is the main process of its run and saves its summary too
        main = _main_of(debugger)
        try:
            _judge_last_skip(debugger)
            report = debugger.report()
            report.summary["end"] = self.end
            if main:
                from ..record import load_run
                from ..report.terminal import render_terminal, table_width

                html = writes_html()
                run_dir = report.save(html=html)
                print(render_terminal(load_run(run_dir), table_width(sys.stderr)), file=sys.stderr)
                _say(saved_line(run_dir, html), main)
            else:
                report.save()  # this rank's events file
        except Exception as error:  # a full disk: the job's own outcome stands
            _say(f"the run could not be saved: {_reason(error)}.", main)
        finally:
            _close(debugger, main)


def _runs_made() -> dict[Any, list[Any]]:
    """:data:`~diffusion_debug.diffusion.debugger.RUNS_MADE` now (a copy; empty where this process has
    not imported that module: a launched process that does not imports none of it)."""
    made = getattr(sys.modules.get("diffusion_debug.diffusion.debugger"), "RUNS_MADE", None) or {}
    return {folder: list(entry) for folder, entry in made.items()}


def pipeline_runs(before: dict[Any, list[Any]] | None = None) -> str | None:
    """One sentence naming the runs of the script's own ``DiffusionModelDebugger`` (its validation
    pipeline calls) made since ``before`` (:func:`_runs_made`), which are no part of the training run;
    None when it made none."""
    before = before or {}
    made = {
        folder: [count - before.get(folder, [0])[0], last]
        for folder, (count, last) in _runs_made().items()
        if count > before.get(folder, [0])[0]
    }
    if not made:
        return None
    total = sum(count for count, _ in made.values())
    where = "; ".join(
        f"{last}" if n == 1 else f"{n} in {folder} (the last {last})" for folder, (n, last) in made.items()
    )
    runs = "a run" if total == 1 else f"{total} runs"
    return f"the script's own DiffusionModelDebugger wrote its pipeline calls to {runs} apart from this one: {where}."


def _without_ours(trace: Any) -> Any:
    """``trace`` from its first frame that is not this module's (itself when every frame is ours: an
    error of launch's keeps where it was made)."""
    inner = trace
    while inner is not None and inner.tb_frame.f_code.co_filename == __file__:
        inner = inner.tb_next
    return trace if inner is None else inner


def _marked(params: tuple[Any, ...]) -> list[Any]:
    """The gradient of each of ``params`` as a mark: a weak reference and its ``_version`` (None: none)."""
    return [None if p.grad is None else (weakref.ref(p.grad), p.grad._version) for p in params]


def _moved_between(before: list[Any], after: list[Any]) -> bool:
    """Whether a gradient marked ``before`` is another tensor, or changed, ``after``."""
    for old, new in zip(before, after):
        if (old is None) != (new is None) or (old is not None and (old[0]() is not new[0]() or old[1] != new[1])):
            return True
    return False


def _only_zeros(params: list[Any]) -> set[int]:
    """The parameters (by ``id``) whose gradient holds only zeros: one read, of each dense
    gradient's largest magnitude (fused by device and dtype; no underflow as a norm's squares have)."""
    from ..stats import read_now

    groups: dict[tuple, list[Any]] = {}
    for p in params:
        grad = p.grad
        if grad is not None and not grad.is_sparse:
            groups.setdefault((grad.device, grad.dtype), []).append(p)
    if not groups:
        return set()
    device = next(iter(groups))[0]
    largest = [torch.stack(torch._foreach_norm([p.grad for p in group], math.inf)) for group in groups.values()]
    largest = read_now(torch.cat([values.to(device, torch.float32) for values in largest]))
    held = [p for group in groups.values() for p in group]
    return {id(p) for p, value in zip(held, largest) if value == 0}


def _first_of(parameters: Any) -> Any:
    """The first of ``parameters`` (a tensor, or a list of them), or None."""
    return parameters if isinstance(parameters, torch.Tensor) else next(iter(parameters), None)


def _main_of(debugger: Any) -> bool:
    """Whether the debugger's process is its run's main one (see :meth:`LaunchWatch.finish`)."""
    return getattr(getattr(debugger, "_ctx", None), "is_main", _is_main_process())


def _judge_last_skip(debugger: Any) -> None:
    """The last step's skip (a GradScaler's, DeepSpeed's), which no later step shows and ``close`` judges:
    judged before the run is saved, so that summary.json counts it (``close`` then finds it judged)."""
    steps = getattr(debugger, "_steps", None)
    if steps is not None:
        steps.judge_last_skip()


def _close(debugger: Any, main: bool) -> None:
    """Close ``debugger`` unless it was (at a give-up); what goes wrong there is said, never raised."""
    if getattr(debugger, "_closed", False):
        return
    try:
        debugger.close()
    except Exception as error:
        _say(f"the debugger did not close cleanly: {_reason(error)}.", main)


def _reason(error: BaseException) -> str:
    """An error on one line: our own sentences as they are, anything else with its type."""
    from ..errors import DiffusionDebugError

    text = str(error) if isinstance(error, DiffusionDebugError) else f"{type(error).__name__}: {error}"
    flat = " ".join(text.split()).rstrip(".")
    return flat if len(flat) <= 500 else flat[:497] + "..."


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    as_module = args[:1] == ["--module"]
    if as_module:
        args = args[1:]
    script, script_args = args[0], args[1:]
    leave_launcher_group()  # the one-process script outside a terminal (done already where run as __main__)
    die_with_parent()  # a launcher killed with SIGKILL leaves no process running on
    try:
        settings = json.loads(os.environ.get(ENVIRONMENT, "{}"))
    except ValueError as error:
        watch = LaunchWatch({}, script)
        watch.give_up(f"{ENVIRONMENT} is not valid JSON ({_reason(error)})")
    else:
        watch = LaunchWatch(settings, script)
        watch.check_settings()
    if not watch.failed:
        try:
            watch.install()
        except Exception as error:  # the script runs, watched or not
            watch.uninstall()
            watch.give_up(f"the debugger could not attach ({_reason(error)})")
    signals = Signals(unwatched=lambda: watch.debugger is None and watch.adopted is None and watch.failed is not None)
    if not watch.failed:
        signals.install()
    sys.argv = [script, *script_args]
    error: BaseException | None = None
    try:
        if as_module:
            runpy.run_module(script, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = str(Path(script).resolve().parent)
            runpy.run_path(script, run_name="__main__")
    except BaseException as raised:
        error = raised
        raise
    finally:
        watch.end = describe_end(error, signals.received)
        try:
            watch.finish(signals)
        finally:
            signals.uninstall()


if __name__ == "__main__":
    try:
        main()
    except Interrupted as stopped:
        end_by_signal(stopped)
