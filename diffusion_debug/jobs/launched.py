"""The process side of ``diffusion-debug launch``: run an unmodified training script with the
training debugger attached through the seams the script already uses.

``accelerate launch`` starts every process as ``python -m diffusion_debug.jobs.launched SCRIPT
ARGS...``; this module runs SCRIPT as ``__main__`` (its own ``sys.argv``, ``sys.path[0]`` and
``__file__``, as ``python SCRIPT`` would) after installing these seams:

- ``Accelerator.prepare``: the trainable models and the optimizers it returns are watched
  (models with no trainable parameter, a VAE or a frozen text encoder, are left alone);
- ``Accelerator.backward`` (else ``Tensor.backward`` on a scalar): the loss, and each micro-step
  of gradient accumulation;
- the optimizer's ``step``, or ``Accelerator.clip_grad_norm_`` when the script clips first:
  gradients are read there, once per optimizer step, when they are complete and after anything
  the script did to them since ``backward`` (before clipping, with its ``max_norm``, so that a
  NaN is still where it was made); the step is the count of optimizer steps;
- a plain ``torch.optim`` optimizer (no Accelerate) through torch's global step pre-hook: the
  model is the module that holds its parameters;
- what reaches the trained model (:mod:`~diffusion_debug.jobs.launch_inputs`): the prepared
  DataLoaders' batches, the frozen models' outputs that feed it and its own arguments, counted on
  the device and passed as each step's ``inputs=``, so a bad batch or a text encoder's NaN is the
  headline at its step rather than the NaN loss it causes.

The debugger is made at the first optimizer step, when the models and the optimizer are known.
When the script ends, raises or is interrupted, the run is saved and the main process prints its
summary; when no seam was reached, one line says so and the script has run unchanged.

Limits: a script that steps its optimizer without ``backward`` on a scalar (a custom autograd
loop) gives no loss, so it is not watched; DeepSpeed through Accelerate steps inside
``backward``, which this launcher does not watch yet.
"""

from __future__ import annotations

import gc
import json
import os
import runpy
import sys
import warnings
import weakref
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .launch import ENVIRONMENT
from .launch_inputs import InputWatch, frozen_models, script_modules


def _is_main_process() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _say(text: str) -> None:
    if _is_main_process():
        print(f"diffusion-debug launch: {text}", file=sys.stderr, flush=True)


def _trainable(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


def _model_names(models: list[nn.Module]) -> Any:
    """One model as itself (``component="model"``); several by their class, e.g. ``unet``."""
    if len(models) == 1:
        return models[0]
    roles = {"UNet2DConditionModel": "unet", "CLIPTextModel": "text_encoder", "T5EncoderModel": "text_encoder"}
    named: dict[str, nn.Module] = {}
    for model in models:
        inner = getattr(model, "module", model)
        base = roles.get(type(inner).__name__, type(inner).__name__.lower())
        name, n = base, 2
        while name in named:
            name, n = f"{base}_{n}", n + 1
        named[name] = model
    return named


class LaunchWatch:
    """The seams of one process, and the debugger made at its first optimizer step."""

    def __init__(self, settings: dict[str, Any]):
        self.settings = settings
        self.models: list[nn.Module] = []
        self.optimizers: list[Any] = []
        self.accelerator: Any = None
        self.debugger: Any = None
        self.loss: torch.Tensor | None = None
        self.loss_from_accelerator = False
        self.steps = 0
        self.monitored = False
        """Whether this optimizer step's gradients were read already (at ``clip_grad_norm_``)."""
        self.failed: str | None = None
        self._undo: list[Any] = []
        self._inner_optimizers: weakref.WeakSet = weakref.WeakSet()
        self.inputs = InputWatch()
        self._input_error_said = False

    # -- seams -----------------------------------------------------------------------------------
    def install(self) -> None:
        watch = self
        original_backward = torch.Tensor.backward

        def backward(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            result = original_backward(tensor, *args, **kwargs)
            if not watch.loss_from_accelerator and tensor.numel() == 1:
                watch.loss = tensor.detach()
            return result

        torch.Tensor.backward = backward
        self._undo.append(lambda: setattr(torch.Tensor, "backward", original_backward))
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        handle = register_optimizer_step_pre_hook(self._plain_step)
        self._undo.append(handle.remove)
        try:
            import accelerate
        except ImportError:
            return
        original_prepare = accelerate.Accelerator.prepare

        def prepare(accelerator: Any, *args: Any, **kwargs: Any) -> Any:
            result = original_prepare(accelerator, *args, **kwargs)
            watch._prepared(accelerator, result if isinstance(result, tuple) else (result,))
            return result

        accelerate.Accelerator.prepare = prepare
        self._undo.append(lambda: setattr(accelerate.Accelerator, "prepare", original_prepare))

    def uninstall(self) -> None:
        self.inputs.remove()
        while self._undo:
            self._undo.pop()()

    def _prepared(self, accelerator: Any, objects: tuple[Any, ...]) -> None:
        from accelerate.optimizer import AcceleratedOptimizer

        if self.accelerator is None:
            self.accelerator = accelerator
            self._wrap_accelerator(accelerator)
        frozen = []
        for obj in objects:
            if isinstance(obj, nn.Module) and _trainable(obj) and not any(obj is m for m in self.models):
                self.models.append(obj)
            elif isinstance(obj, nn.Module):
                frozen.append(obj)  # prepared without trainable parameters: a text encoder, a VAE
            elif isinstance(obj, AcceleratedOptimizer) and not any(obj is o for o in self.optimizers):
                self.optimizers.append(obj)
                self._inner_optimizers.add(obj.optimizer)
                self._wrap_step(obj)
            elif isinstance(obj, torch.utils.data.DataLoader):
                self.inputs.watch_loader(obj)
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
        for model in self.models:
            inner = getattr(model, "module", model)
            self.inputs.watch_trained(model, names.get(id(model)) or names.get(id(inner)) or "model")
        for module in prepared_frozen:
            inner = getattr(module, "module", module)
            held.setdefault(id(inner), (names.get(id(module)) or type(inner).__name__, module))
        for name, module in frozen_models(self.models, held):
            self.inputs.watch_frozen(module, name)

    def _wrap_accelerator(self, accelerator: Any) -> None:
        watch = self
        backward, clip = accelerator.backward, accelerator.clip_grad_norm_

        def watched_backward(loss: torch.Tensor, **kwargs: Any) -> Any:
            watch.loss_from_accelerator = True
            result = backward(loss, **kwargs)
            watch.loss = loss.detach()
            if not accelerator.sync_gradients and watch._debugger_ready():
                watch._monitor(None)  # a micro-step: its loss joins the optimizer step's mean
            return result

        def watched_clip(parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
            # read before clipping: the gradients are complete, and a NaN is still where it was made
            # (clipping by a NaN norm spreads it to every gradient)
            if accelerator.sync_gradients and watch.optimizers:
                watch._optimizer_step(watch.optimizers[0], max_norm=float(max_norm))
            return clip(parameters, max_norm, norm_type=norm_type)

        accelerator.backward = watched_backward
        accelerator.clip_grad_norm_ = watched_clip
        self._undo.append(lambda: _forget(accelerator, ("backward", "clip_grad_norm_")))

    def _wrap_step(self, optimizer: Any) -> None:
        watch = self
        step = optimizer.step

        def watched_step(*args: Any, **kwargs: Any) -> Any:
            if watch.accelerator is None or watch.accelerator.sync_gradients:
                watch._optimizer_step(optimizer)
                watch.monitored = False
                watch.steps += 1
            return step(*args, **kwargs)

        optimizer.step = watched_step
        self._undo.append(lambda: _forget(optimizer, ("step",)))

    def _plain_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """torch's global pre-hook: an optimizer that Accelerate did not prepare."""
        if optimizer in self._inner_optimizers or self.failed:
            return
        if self.debugger is None and not self.optimizers:
            model = _model_of(optimizer)
            if model is None:
                self.failed = "no module holds the parameters its optimizer steps"
                return
            self.models, self.optimizers = [model], [optimizer]
            self._watch_inputs([])
        if any(optimizer is o for o in self.optimizers):
            self._optimizer_step(optimizer)
            self.monitored = False
            self.steps += 1

    # -- monitoring ------------------------------------------------------------------------------
    def _optimizer_step(self, optimizer: Any, max_norm: float | None = None) -> None:
        """Read this optimizer step's gradients, once (at the clip or at the step, whichever first)."""
        if self.monitored:
            return
        if self.loss is None or self.failed:
            if self.loss is None and not self.failed:
                self.failed = "its optimizer stepped before any backward of a scalar loss"
            return
        if not self._debugger_ready():
            return
        self.monitored = True
        self._monitor(optimizer, max_norm)

    def _debugger_ready(self) -> bool:
        if self.debugger is None and not self.failed:
            if not self.models:
                self.failed = "Accelerator.prepare returned no model with trainable parameters"
            else:
                self._watch_inputs([])  # the models made since prepare
                self.debugger = self._make_debugger()
        return self.debugger is not None

    def _make_debugger(self) -> Any:
        from ..config import DebugConfig, read_config_file
        from ..training import TrainingDebugger

        data = read_config_file(Path(self.settings["config"])) if self.settings.get("config") else {}
        for key in ("level", "policy", "output_dir"):
            if self.settings.get(key):
                data[key] = self.settings[key]
        config = DebugConfig.from_dict(data)
        return TrainingDebugger(_model_names(self.models), accelerator=self.accelerator, config=config)

    def _monitor(self, optimizer: Any, max_norm: float | None = None) -> None:
        loss, self.loss = self.loss, None
        inputs = self.inputs.take()
        if self.inputs.error is not None and not self._input_error_said:
            self._input_error_said = True
            rank = getattr(getattr(self.debugger, "_ctx", None), "rank", 0)
            self.debugger.sink.debugger_error("watching the inputs", self.inputs.error, step=self.steps, rank=rank)
        self.debugger.monitor_training_step(
            loss,
            optimizer=optimizer if optimizer is not None else self.optimizers[0],
            step=self.steps,
            max_grad_norm=max_norm,
            inputs=inputs,
        )

    # -- the end ---------------------------------------------------------------------------------
    def finish(self, script: str) -> None:
        self.uninstall()
        if self.debugger is None:
            why = self.failed or "it stepped no optimizer of a model it trains (Accelerator.prepare or torch.optim)"
            _say(f"nothing was watched in {script}: {why}; the script ran unchanged.")
            return
        debugger, self.debugger = self.debugger, None
        try:
            report = debugger.report()
            # the debugger's own main process: a process that trains alone (world size 1, a split
            # launch) is the main process of its run and saves its summary too
            if getattr(getattr(debugger, "_ctx", None), "is_main", _is_main_process()):
                from ..record import load_run
                from ..report.terminal import render_terminal

                run_dir = report.save()
                print(render_terminal(load_run(run_dir)), file=sys.stderr)
                print(f"diffusion-debug launch: report: {Path(run_dir) / 'report.html'}", file=sys.stderr, flush=True)
        finally:
            debugger.close()


def _forget(obj: Any, names: tuple[str, ...]) -> None:
    for name in names:
        obj.__dict__.pop(name, None)


def _model_of(optimizer: torch.optim.Optimizer) -> nn.Module | None:
    """The smallest module holding every parameter the optimizer steps (searched once)."""
    wanted = {id(p) for group in optimizer.param_groups for p in group["params"]}
    best: tuple[int, nn.Module] | None = None
    with warnings.catch_warnings():  # isinstance on a deprecated module-level object warns
        warnings.simplefilter("ignore")
        modules = [obj for obj in gc.get_objects() if isinstance(obj, nn.Module)]
    for module in modules:
        params = {id(p) for p in module.parameters()}
        if wanted <= params and (best is None or len(params) < best[0]):
            best = (len(params), module)
    return best[1] if best else None


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    as_module = args[:1] == ["--module"]
    if as_module:
        args = args[1:]
    script, script_args = args[0], args[1:]
    watch = LaunchWatch(json.loads(os.environ.get(ENVIRONMENT, "{}")))
    try:
        watch.install()
    except Exception as error:  # the script runs, watched or not
        watch.uninstall()
        watch.failed = f"the debugger could not attach ({type(error).__name__}: {error})"
    sys.argv = [script, *script_args]
    try:
        if as_module:
            runpy.run_module(script, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = str(Path(script).resolve().parent)
            runpy.run_path(script, run_name="__main__")
    finally:
        watch.finish(script)


if __name__ == "__main__":
    main()
