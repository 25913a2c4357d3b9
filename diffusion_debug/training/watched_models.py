"""The model(s) a :class:`~.debugger.TrainingDebugger` watches: one module (its anomalies say
``component="model"``, as always) or several by name, ``{"unet": unet, "text_encoder":
text_encoder}``, whose anomalies on a parameter or module name that model as their ``component``.

Inside the debugger the trainable parameters of several models are one list, each named
``<model>.<name in that model>``; :meth:`WatchedModels.name_components` turns that back into
``component`` + ``parameter`` / ``module`` on the way out of a judged step.

>>> import torch
>>> watched = WatchedModels.of({"unet": torch.nn.Linear(2, 2), "text_encoder": torch.nn.Linear(2, 1)})
>>> watched.parameters().names
['unet.weight', 'unet.bias', 'text_encoder.weight', 'text_encoder.bias']
>>> watched.split("text_encoder.weight"), watched.split("text_encoder")
(('text_encoder', 'weight'), ('text_encoder', ''))

A parameter the model replaces with a new one while the debugger is attached
(``load_state_dict(..., assign=True)``, ``module.weight = nn.Parameter(...)``) is watched in its
place from then on (:class:`ParameterSwaps`), and so are the parameters of a submodule replaced by
a new one (``unet.conv_in = nn.Conv2d(...)``), each in the place of the old parameter of the same
name (one the new submodule lacks stays the old, stale one: make the debugger again after changing
the model's structure).

Limits: a parameter shared by two watched models is watched once, under the first name; a
model's name is a Python identifier (it prefixes qualified names, which are dotted). A parameter
frozen when the debugger was made and unfrozen later is not watched (the ``unwatched_parameters``
warning names it, with the advice to make the debugger after unfreezing). A model already compiled
when the debugger is made (``torch.compile``, ``module.compile()``) has no replacement watched: torch's
registration hooks are global, a compiled UNet's forward reads them, and adding ours recompiled it.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from functools import partial
from typing import Any, Iterator, Mapping

from torch import nn
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)

from ..errors import DiffusionDebugError
from ..record import Anomaly, cause_reference, rebuilt
from .measure.gradients import TrainableParameters, unwrap_model

SINGLE = "model"
"""The component of a debugger that watches one module (DESIGN.md: ``model`` for training)."""


@dataclass(frozen=True)
class WatchedModels:
    """The watched models by name (as given: wrapped by ``accelerator.prepare`` or not)."""

    models: dict[str, nn.Module]
    single: bool

    @classmethod
    def of(cls, model: Any) -> "WatchedModels":
        """One ``nn.Module``, or a mapping of names to modules; anything else is a clear error."""
        if isinstance(model, nn.Module):
            return cls({SINGLE: model}, True)
        if not isinstance(model, Mapping):
            raise DiffusionDebugError(
                f"model must be a torch.nn.Module or a dict of them by name, not {type(model).__name__}."
            )
        if not model:
            raise DiffusionDebugError('The dict of models is empty: pass {"unet": unet, ...}.')
        for name, module in model.items():
            if not isinstance(name, str) or not name.isidentifier():
                raise DiffusionDebugError(
                    f"Each watched model is named by an identifier such as 'unet' or 'text_encoder', not {name!r}."
                )
            if not isinstance(module, nn.Module):
                raise DiffusionDebugError(f"model[{name!r}] must be a torch.nn.Module, not {type(module).__name__}.")
        return cls(dict(model), False)

    def parameters(self) -> TrainableParameters:
        """The trainable parameters of every watched model, in order (``<model>.<name>`` with several)."""
        if self.single:
            return TrainableParameters.of(self.models[SINGLE])
        return TrainableParameters.from_named(self._named())

    def _named(self) -> Iterator[tuple[str, nn.Parameter]]:
        seen: set[int] = set()
        for component, model in self.models.items():
            for name, param in unwrap_model(model).named_parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    yield f"{component}.{name}", param

    def split(self, qualified: str) -> tuple[str, str]:
        """``(component, name inside it)`` of an internal qualified name."""
        if self.single:
            return SINGLE, qualified
        component, _, rest = qualified.partition(".")
        return (component, rest) if component in self.models else (SINGLE, qualified)

    def name_components(self, anomalies: list[Anomaly]) -> list[Anomaly]:
        """Each anomaly on a parameter or module of a watched model, with ``component`` that model's
        name and its ``parameter`` / ``module`` named inside it (its message built again); the
        others (the loss, the optimizer, memory) as they are. With one model: unchanged."""
        if self.single:
            return anomalies
        renamed = [self._named_component(a) for a in anomalies]
        moved = {
            _reference_key(cause_reference(a)): cause_reference(b) for a, b in zip(anomalies, renamed) if a is not b
        }
        return [_cause_moved(a, moved) for a in renamed] if moved else renamed

    def name_judged(self, judged: Any) -> list[tuple[Anomaly, Anomaly]]:
        """:meth:`name_components` on a judged step's anomalies (``local_judging.Judgement``);
        returns ``(before, after)`` pairs."""
        if self.single:
            return []
        renamed = self.name_components(judged.anomalies)
        pairs = list(zip(judged.anomalies, renamed))
        judged.anomalies = renamed
        return pairs

    def _named_component(self, anomaly: Anomaly) -> Anomaly:
        if anomaly.component != SINGLE or not (anomaly.parameter or anomaly.module):
            return anomaly
        component, _ = self.split(anomaly.parameter or anomaly.module)
        if component not in self.models:  # not on a watched model's parameter (a model may be named "model")
            return anomaly
        changes: dict[str, Any] = {"component": component, "module": self._inside(component, anomaly.module)}
        if anomaly.parameter:
            changes["parameter"] = self._inside(component, anomaly.parameter)
        return rebuilt(anomaly, **changes)

    @staticmethod
    def _inside(component: str, qualified: str) -> str:
        if qualified == component:
            return ""
        return qualified[len(component) + 1 :] if qualified.startswith(component + ".") else qualified

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Every watched model's ``no_sync`` (DDP): a replay on one rank all-reduces nothing."""
        with contextlib.ExitStack() as stack:
            for model in self.models.values():
                no_sync = getattr(model, "no_sync", None)
                if callable(no_sync):
                    stack.enter_context(no_sync())
            yield

    @property
    def replay_target(self) -> Any:
        """What a ``closure=`` replay runs ``no_sync`` on and keeps the buffers of: the model
        itself, or all of them."""
        return self.models[SINGLE] if self.single else self

    def modules(self) -> Iterator[Any]:
        """Every module of every watched model (as ``nn.Module.modules()``, for the replay)."""
        for model in self.models.values():
            yield from model.modules()

    def component_summary(self, params: TrainableParameters) -> dict[str, Any]:
        """The report's ``components["model"]`` facts (with several models also ``models``: each one's)."""
        out = {
            "class": ", ".join(type(unwrap_model(m)).__name__ for m in self.models.values()),
            "trainable_parameters": sum(p.numel() for p in params.params),
            "trainable_tensors": len(params),
            "modules_with_trainable_parameters": len(params.module_names),
        }
        if not self.single:
            out["models"] = self.summary(params)
        return out

    def summary(self, params: TrainableParameters) -> dict[str, dict[str, Any]]:
        """Per watched model: its class and trainable parameters."""
        out = {}
        for component, model in self.models.items():
            held = [p for name, p in zip(params.names, params.params) if self.split(name)[0] == component]
            out[component] = {
                "class": type(unwrap_model(model)).__name__,
                "trainable_parameters": sum(p.numel() for p in held),
                "trainable_tensors": len(held),
            }
        return out


class ParameterSwaps:
    """Keeps the watched parameters the ones the models hold: torch's global parameter-registration
    hook (while attached) sees a watched module register a new parameter under a watched name, and
    puts it in that parameter's place in every list of ``lists`` (the same positions: every figure
    indexed by position stays right); its global module-registration hook sees a module replace a
    child holding watched parameters, and puts the new child's parameter of each watched name in
    its place (torch calls it before the child is set: the old one is still there to read).
    :attr:`replaced` tells the debugger to drop what it cached about the old ones (one attribute
    read a step; the hooks cost nothing while no parameter or module is registered, and a
    dictionary look-up each while the user builds a module). Both hooks are global in torch (no
    per-model registration exists): they are on only while the debugger is attached."""

    def __init__(self, watched: WatchedModels, names: list[str], lists: list[list]):
        index = {name: i for i, name in enumerate(names)}
        self._slots: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> {name: position}
        for component, model in watched.models.items():
            prefix = "" if watched.single else component + "."
            for path, module in unwrap_model(model).named_modules():
                for name, _ in module.named_parameters(recurse=False):
                    position = index.get(f"{prefix}{path}.{name}" if path else prefix + name)
                    if position is not None:
                        self._slots.setdefault(module, {})[name] = position
        self.lists = lists
        self.replaced = False
        self.error: Exception | None = None
        """An error of ours in a hook, kept (the user's ``setattr`` never sees it) and raised by the
        debugger's next monitor call, inside its guard: a ``debugger_error``."""
        self._handles: list[Any] = []

    def attach(self) -> None:
        if not self._handles:
            self._handles = [
                register_module_parameter_registration_hook(partial(self._guarded, self._registered)),
                register_module_module_registration_hook(partial(self._guarded, self._module_registered)),
            ]

    def _guarded(self, hook: Any, parent: nn.Module, name: str, value: Any) -> None:
        try:
            hook(parent, name, value)
        except Exception as error:  # a defect of ours: told at the next monitor call
            self.error, self.replaced = error, True

    def remove(self) -> None:
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()

    def _registered(self, module: nn.Module, name: str, param: Any) -> None:
        slots = self._slots.get(module)
        position = slots.get(name) if slots is not None else None
        if position is None or param is None:
            return
        for held in self.lists:
            held[position] = param
        self.replaced = True

    def _module_registered(self, parent: nn.Module, name: str, child: Any) -> None:
        old = parent._modules.get(name) if isinstance(child, nn.Module) else None
        if old is None or old is child:
            return
        new_modules = dict(child.named_modules(remove_duplicate=False))
        for path, module in old.named_modules():
            slots = self._slots.get(module)
            new = new_modules.get(path) if slots else None
            if new is None:
                continue
            moved = {key: position for key, position in slots.items() if new._parameters.get(key) is not None}
            for key, position in moved.items():
                for held in self.lists:
                    held[position] = new._parameters[key]
            if moved:
                self._slots.setdefault(new, {}).update(moved)
                self.replaced = True


def _reference_key(reference: Mapping[str, Any]) -> tuple:
    return tuple(reference.get(k) for k in ("kind", "place", "step", "rank"))


def _cause_moved(anomaly: Anomaly, moved: dict[tuple, dict[str, Any]]) -> Anomaly:
    """``anomaly`` pointing at its cause's new place, when that cause was named again in the same step."""
    reference = anomaly.details.get("cause")
    new = moved.get(_reference_key(reference)) if isinstance(reference, Mapping) else None
    if new is None:
        return anomaly
    details = {**anomaly.details, "cause": new}
    return rebuilt(anomaly, details=details)
