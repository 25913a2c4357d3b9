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

A parameter the model replaces with a new one (``load_state_dict(..., assign=True)``, peft's
``low_cpu_mem_usage`` reload, ``module.weight = nn.Parameter(...)``) is watched in its place from
the next monitored step on where the optimizer was given it (a new optimizer, new ``params``
lists in its groups, or the new one in the old one's place in its list), else within
:data:`SWAP_CHECK_EVERY` monitored steps (:class:`ParameterSwaps`, a check between steps: no hook
in torch), and so are the parameters of a submodule replaced by a
new one (``unet.conv_in = nn.Conv2d(...)``), each in the place of the old parameter of the same name
(one the new submodule lacks stays the old, stale one: make the debugger again after changing the
model's structure). Compiled models too: the check reads the modules' dicts between steps, nothing
a compiled forward reads.

Limits: a parameter shared by two watched models is watched once, under the first name; a
model's name is a Python identifier (it prefixes qualified names, which are dotted). A parameter of
the watched models frozen when the debugger was made and trained later (unfrozen where the optimizer
held it, a module or adapter added and given to it or to a new optimizer) joins the watch at the first
step it trains (:attr:`ParameterSwaps.joining`, ``TrainableParameters.join``); on several processes,
under DeepSpeed and with sharded parameters it stays unwatched (the ``unwatched_parameters`` warning
names it, with the advice to make the debugger after unfreezing). FSDP2's and ZeRO's
parameters are not followed when replaced (they swap their own each forward); FSDP1's
(``FullyShardedDataParallel(use_orig_params=True)``) are, as a replicated model's: it keeps each
parameter object and gives it back its shard after each forward and backward. FSDP1's units and
checkpoint wrappers inside a model are not in the names reported (``conv_out.weight``, not
``_fsdp_wrapped_module.conv_out.weight``: ``wrappers.wrapper_free``); the check walks the modules
by their own (``TrainableParameters.paths``).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from itertools import chain, compress, repeat
from operator import and_, attrgetter, is_, not_, or_
from typing import Any, Iterator, Mapping

from torch import nn

from ..errors import DiffusionDebugError
from ..record import Anomaly, cause_reference, rebuilt
from .measure.gradients import TrainableParameters, embedding_tables
from .measure.optimizer_state import raw_optimizer
from .measure.wrappers import fsdp1_type, unwrap_model

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
        tables = embedding_tables(*map(unwrap_model, self.models.values()))
        return TrainableParameters.from_named(self._named(), tables=tables)

    def flat_sharded(self) -> bool:
        """Some watched model holds an FSDP1 unit (``FullyShardedDataParallel``): each of its
        parameters is this rank's shard (a view of its part of a flat parameter with
        ``use_orig_params=True``; the flat parameter itself otherwise), different on every rank.
        Looked for only where the process imported FSDP1 (no import here)."""
        fsdp = fsdp1_type()
        return fsdp is not None and any(isinstance(m, fsdp) for model in self.models.values() for m in model.modules())

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Every parameter of the watched models now, named as :meth:`parameters` names them (frozen ones too)."""
        if self.single:
            return unwrap_model(self.models[SINGLE]).named_parameters()
        return self._named()

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


_OFF: tuple[tuple, tuple, tuple] = ((), (), ())
"""The check of a watch that is off (FSDP2's and ZeRO's parameters, which they swap themselves):
always the same."""

SWAP_CHECK_EVERY = 10
"""Monitored steps between two whole checks of :class:`ParameterSwaps` while the optimizer's groups
hold the same lists (its quick check in between): a replacement the optimizer was not given (an
optimizer training the old parameters: an error of the user's) is found within as many steps."""


class _Gone:
    pass


_NO_OPTIMIZER = weakref.ref(_Gone())
"""A dead reference (it answers None): no optimizer followed yet."""
_GRAD = attrgetter("grad")
_NOTHING_FOLLOWED: tuple[list, int, tuple] = ([], 0, ())
""":attr:`ParameterSwaps.trained` with no optimizer followed: always the same."""


class ParameterSwaps:
    """Keeps the watched parameters the ones the models hold (see the module docstring), with no
    hook in torch: the debugger asks :attr:`check` at a monitored step, before it reads any
    gradient, whether every watched parameter is still where it was, with no Python call::

        dicts, keys, held = swaps.check
        same = all(map(is_, map(dict.get, dicts, keys), held))

    The same line with :attr:`quick` (made by :meth:`follow` once a whole check passed with an
    optimizer) checks only each of that optimizer's groups' ``params`` list: the objects they were,
    and (:attr:`quick_items`) the parameters in them. The debugger takes it
    at a step with the optimizer :attr:`optimizer` refers to, but for every
    :data:`SWAP_CHECK_EVERY`-th monitored step (and a step with no optimizer), which takes the
    whole :attr:`check`. A replacement that the optimizer is given in a new list, in its old list
    (in place) or a new optimizer is seen at the next step; one the optimizer was not given within
    :data:`SWAP_CHECK_EVERY` steps. The whole check of an SD UNet, run after the backward with its
    caches cold, was ~0.3 ms of a monitored step's host time.

    ``dicts``/``keys``/``held``: (a) each watched parameter's owning module's ``_parameters``, its
    name there and the parameter object; (b) each module on the path from a model's root to a module
    owning watched parameters: its parent's ``_modules``, its name there and the module (a replaced
    submodule keeps its own ``_parameters``, which (a) alone still finds unchanged). Only when one
    differs is :meth:`refresh` called: each watched name is looked up again from the model's root,
    the parameter now there put in that name's place in every list of ``lists`` (the same
    positions: every figure indexed by position stays right), :attr:`replaced` set if any was new
    (the debugger then drops what it cached about the old ones), and the check made again. A name
    the model no longer has (a new submodule without it) keeps the old, stale parameter.

    >>> from operator import is_
    >>> model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    >>> watched = WatchedModels.of(model)
    >>> params = watched.parameters()
    >>> swaps = ParameterSwaps(watched, params.names, [params.params])
    >>> def same():
    ...     dicts, keys, held = swaps.check
    ...     return all(map(is_, map(dict.get, dicts, keys), held))
    >>> model[1] = nn.Linear(2, 1)  # a new submodule: the old one's _parameters are unchanged
    >>> same()
    False
    >>> swaps.refresh()
    >>> swaps.replaced, params.params[2] is model[1].weight, same()
    (True, True, True)

    Cost, the check alone (``timeit``, median of 15 runs of 2,000 checks, process CPU time, on a
    2-core CPU shared at load 5): the tiny SD UNet's 286 trainable parameters are 550 entries, 36 us
    a step (21 us at the fastest run); an SD1.5-shaped UNet's (``benchmarks.models.sd15_shaped_pipeline``)
    684 are 1,296 entries, 93 us (55 us): 40 to 70 ns an entry, under 0.1% of an SD1.5 training
    step on a GPU. No Python call (the training pins are unchanged), nothing registered in torch (no
    compiled module is recompiled, no forward pays for it), and nothing between steps: a
    replacement is seen at the next monitored step."""

    __slots__ = (
        "roots",
        "names",
        "lists",
        "check",
        "replaced",
        "error",
        "optimizer",
        "quick",
        "quick_items",
        "trained",
        "joining",
        "outside",
        "gone",
    )

    def __init__(self, watched: WatchedModels, names: list[str], lists: list[list], *, on: bool = True):
        self.roots = {component: unwrap_model(model) for component, model in watched.models.items()}
        """Per watched model, the module its parameters are named from."""
        self.names = [name if watched.single else name.partition(".") for name in names]
        self.lists = lists
        self.replaced = False
        self.gone: set[int] = set(range(len(self.names)))
        """The positions whose parameter the watched models no longer hold (a LoRA adapter deleted,
        ``delete_adapters``; a module removed): in the lists, a frozen empty stand-in in its place (the
        parameter let go, no hook on it, its module not judged); set with :attr:`replaced`. All at first:
        one the first resolution does not find keeps its parameter (as before a name it cannot follow)."""
        self.error: Exception | None = None
        """An error of ours in the check (a module's ``_parameters`` made something else), kept by
        the debugger's step and raised by :meth:`refresh`, inside the debugger's guard: a
        ``debugger_error`` at that step."""
        self.check: tuple[Any, Any, Any] = _OFF
        self.optimizer: weakref.ref = _NO_OPTIMIZER
        """The optimizer :attr:`quick` checks (a weak reference: the user's to drop; dead: none)."""
        self.quick: tuple[Any, Any, Any] = _OFF
        self.quick_items: tuple[tuple, tuple] = ((), ())
        """With :attr:`quick`: the groups' ``params`` lists and the parameters they held, in order, checked
        by identity (``all(map(is_, chain.from_iterable(lists), items))``): a parameter put in another's
        place in the same list (``params[0] = new``, ``params[:] = ...``) is seen at the next step."""
        self.trained: tuple[list, int, tuple] = _NOTHING_FOLLOWED
        """What the optimizer :attr:`optimizer` may start to train (:meth:`follow`): its ``param_groups``
        list, how many groups it held, and the parameters in them that were frozen with no gradient.
        The debugger checks at every step, with no Python call, that it holds as many groups and that
        none of those parameters has a gradient::

            groups, count, frozen = swaps.trained
            same = len(groups) == count and all(map(is_, map(attrgetter("grad"), frozen), repeat(None)))

        else more parameters train than it watches since (``add_param_group``: a LoRA adapter added; a
        part the optimizer holds unfrozen, ``text_encoder.requires_grad_(True)``): the optimizer is compared
        with the watched parameters at that step (those of the watched models join the watch: :attr:`joining`;
        others are ``unwatched_parameters``, before the NaN loss a NaN gradient of theirs makes at the next). A
        part unfrozen that the optimizer does not hold trains nothing; a new optimizer is followed at its first
        step (:meth:`follow`), and its parameters new to the watch are taken then."""
        self.joining = False
        """Set by :meth:`follow` where the optimizer trains parameters the watch lacks that it had not seen: a new
        optimizer's, a group added, a part it holds unfrozen (``trained`` tells the step first). The debugger
        takes it (``TrainingDebugger._parameters_joined``): those of the watched models join the watch."""
        self.outside: frozenset[int] = frozenset()
        """The ids of the trained parameters outside the watch that :meth:`follow` has seen (a GAN's other
        model's: seen once, not joined again at each of its optimizer's turns)."""
        if on:
            self.check = self._resolved()

    def join(self, watched: WatchedModels, names: list[str]) -> None:
        """Parameters added at the end of the watched lists (``TrainableParameters.join``), by their paths:
        checked from :meth:`refresh` on, as those watched from the start."""
        self.names += [name if watched.single else name.partition(".") for name in names]

    def follow(self, optimizer: Any) -> None:
        """After a whole check passed at a step with ``optimizer``: :attr:`quick` made of its torch
        optimizer's (inside Accelerate's wrapper) ``param_groups``' ``params`` lists. None where they
        are not plain attributes and dicts (every step then takes the whole check)."""
        self.optimizer, self.quick, self.quick_items, self.trained = _NO_OPTIMIZER, _OFF, ((), ()), _NOTHING_FOLLOWED
        if self.check is _OFF:  # the watch is off: its whole check is free
            return
        raw = raw_optimizer(optimizer)
        groups = vars(raw).get("param_groups") if hasattr(raw, "__dict__") else None
        if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
            return
        try:
            reference = weakref.ref(optimizer)
        except TypeError:  # an optimizer that takes no weak reference: no quick check
            return
        lists = [g.get("params") for g in groups]
        if not all(type(found) is list for found in lists):  # (torch's are lists)
            return
        # not the optimizer's own dict (its ``param_groups`` list reassigned is seen by the whole check, or by a
        # watched parameter left with no gradient): held here, it kept its ``state`` (Adam's moments) alive
        self.quick = (tuple(groups), ("params",) * len(groups), tuple(lists))
        items = tuple(chain.from_iterable(lists))
        self.quick_items = (tuple(lists), items)
        # the unwatched frozen ones with no gradient, in C (a GAN's optimizers take turns: follow runs each step)
        watched = list(map(set(map(id, self.lists[0])).__contains__, map(id, items)))
        trains = list(map(attrgetter("requires_grad"), items))
        frozen = map(not_, map(or_, watched, trains))
        gradless = map(is_, map(_GRAD, items), repeat(None))
        self.trained = (groups, len(groups), tuple(compress(items, map(and_, frozen, gradless))))
        outside = frozenset(map(id, compress(items, map(and_, map(not_, watched), trains))))
        if not outside <= self.outside:  # trained and unwatched, new here: joined where the watched models hold them
            self.outside, self.joining = self.outside | outside, True
        self.optimizer = reference

    def refresh(self) -> None:
        """After :attr:`check` failed: each watched position's parameter as the model holds it now
        (:attr:`replaced` set when one is new), and the check made again. An error of ours here
        (or one :attr:`error` kept) leaves the watch off from then on: recorded once."""
        self.check, self.optimizer, self.quick, self.quick_items = _OFF, _NO_OPTIMIZER, _OFF, ((), ())  # all next
        self.trained = _NOTHING_FOLLOWED
        error, self.error = self.error, None
        if error is not None:
            raise error
        self.check = self._resolved()

    def _resolved(self) -> tuple[tuple, tuple, tuple]:
        dicts: list[dict] = []
        keys: list[str] = []
        held: list[Any] = []
        seen: set[tuple[int, str]] = set()  # each module on a path once
        first = self.lists[0]
        for position, name in enumerate(self.names):
            component, _, rest = (SINGLE, "", name) if isinstance(name, str) else name
            *path, key = rest.split(".")
            module: Any = self.roots[component]
            for part in path:
                children = module._modules
                module = children.get(part)
                if (id(children), part) not in seen:
                    seen.add((id(children), part))
                    dicts.append(children)
                    keys.append(part)
                    held.append(module)
                if not isinstance(module, nn.Module):
                    now = None
                    break
            else:
                parameters = module._parameters
                now = parameters.get(key)
                dicts.append(parameters)
                keys.append(key)
                held.append(now)
            if now is None:  # gone from the model (its checked entries still tell when it comes back)
                now = None if position in self.gone else first[position].detach().new_empty(0)
                self.gone.add(position)
            else:
                self.gone.discard(position)
                now = now if now is not first[position] else None
            if now is not None:
                for kept in self.lists:
                    kept[position] = now
                self.replaced = True
        return tuple(dicts), tuple(keys), tuple(held)


def _reference_key(reference: Mapping[str, Any]) -> tuple:
    distinct = reference.get("distinct")  # (``record.cause_reference``: a kind told apart at one place by its details)
    return (*(reference.get(k) for k in ("kind", "place", "step", "rank")), repr(distinct))


def _cause_moved(anomaly: Anomaly, moved: dict[tuple, dict[str, Any]]) -> Anomaly:
    """``anomaly`` pointing at its cause's new place, when that cause was named again in the same step."""
    reference = anomaly.details.get("cause")
    new = moved.get(_reference_key(reference)) if isinstance(reference, Mapping) else None
    if new is None:
        return anomaly
    details = {**anomaly.details, "cause": new}
    return rebuilt(anomaly, details=details)
