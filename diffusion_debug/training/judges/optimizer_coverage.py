"""What the optimizer trains against what the debugger watches, checked once, at the first
monitored call that has an optimizer: trainable parameters an optimizer holds outside the
watched model(s) (their NaN gradients and updates go unseen, or surface a step later on the
watched ones), and watched trainable parameters no optimizer holds (they never change; not the
input embeddings (``get_input_embeddings()``) of a model whose LoRA adapters an optimizer holds, trainable for gradient
checkpointing in diffusers' DreamBooth LoRA scripts). Both
are named in ONE ``unwatched_parameters`` warning, grouped by model and module prefix.

The optimizers are the one passed to ``monitor_training_step`` and those the Accelerator
prepared that train a watched parameter; a watched parameter none of them holds counts as held
when another live optimizer does (a plain loop with one optimizer per model passes one). A
parameter outside the watched models is named by the
model that holds it: one the Accelerator prepared, else any ``nn.Module`` alive in the process
(:func:`~.live_objects.live_objects`, looked up once: only when such parameters exist).

>>> import torch
>>> unet, text_encoder = torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.Linear(2, 2))
>>> optimizer = torch.optim.SGD([*unet.parameters(), *text_encoder.parameters()], lr=0.1)
>>> from diffusion_debug.training.watched_models import WatchedModels
>>> watched = WatchedModels.of(unet)
>>> anomaly = judge_coverage(watched.parameters(), [optimizer], [], step=0, rank=0)
>>> anomaly.details["outside"]["groups"]
{'Sequential 0': 2}

DeepSpeed ZeRO's optimizer trains flat partitions of the model's parameters (stage 3 hands them to
its torch optimizer only inside ``step()``): it counts as holding the model parameters it
partitions (``TrainableParameters.partitions``), and its flat partitions as none outside; likewise
the float32 copies that an engine without ZeRO (stage 0, bf16 or fp16) trains in the model
parameters' place (``deepspeed_zero.trained_copies``).

The live objects are whatever the process holds, finished or not: an optimizer or a module whose
``__init__`` raised (kept alive by a traceback) is read as holding none. Both kinds are looked up
together, at most once a check (with no ``LiveObjects`` installed, as launch installs one, a walk
of the garbage collector's list); nothing is collected first, so one the script let go of that the
collector has not freed yet is among them.

Limits: another optimizer whose parameter groups do not hold the model's own parameter objects
is reported as holding parameters outside the model; a parameter held by no live module is
counted as "in no module" (a module dropped but not yet collected still names its parameters).
"""

from __future__ import annotations

from collections import Counter
from functools import cache
from typing import Any, Callable, Iterable

import torch
from torch import nn

from ...record import Anomaly, make_anomaly
from ..measure.deepspeed_zero import trained_copies
from ..measure.gradients import TrainableParameters
from ..measure.optimizer_state import param_groups
from ..measure.wrappers import unwrap_model, wrapper_free
from .live_objects import live_objects

GROUPS_KEPT = 12
"""Module-prefix groups named per direction (the rest are counted together)."""
PREFIX_DEPTH = 2
"""Module-path parts that make a group: ``text_model.encoder``, ``down_blocks.0``."""


def optimizers_of(optimizer: Any, accelerator: Any, watched: set[int]) -> list[Any]:
    """The optimizer passed, and those the Accelerator prepared that train a ``watched`` parameter
    (by ``id``: another model's optimizer in the same process is not this run's), each once."""
    out, seen = [], set()
    prepared = getattr(accelerator, "_optimizers", None) or []
    for candidate in [optimizer, *prepared]:
        groups = param_groups(candidate) if candidate is not None else None
        if groups is None or id(groups) in seen:
            continue
        if candidate is not optimizer and not any(id(p) in watched for g in groups for p in g.get("params", [])):
            continue
        seen.add(id(groups))
        out.append(candidate)
    return out


def check_coverage(
    params: TrainableParameters,
    watched: Any,
    optimizer: Any,
    accelerator: Any,
    step: Any,
    ctx: Any,
    frozen_then: frozenset[int] | None = None,
) -> tuple[bool, Anomaly | None]:
    """``(checked, finding)``: not checked while no optimizer is known (none passed, none prepared).
    ``frozen_then``: the watched models' parameters (by ``id``) frozen when the debugger was made."""
    optimizers = optimizers_of(optimizer, accelerator, {id(p) for p in params.params})
    if not optimizers:
        return False, None
    models = getattr(accelerator, "_models", None) or []
    flat, trained = (
        params.deepspeed.trained(optimizers) if params.deepspeed is not None else trained_copies(optimizers)
    )
    return True, judge_coverage(
        params,
        optimizers,
        models,
        step=step,
        rank=ctx.rank,
        split=watched.split,
        flat=flat,
        trained=trained,
        watched_models=watched.models.values(),
        frozen_then=frozen_then,
    )


def judge_coverage(
    params: TrainableParameters,
    optimizers: list[Any],
    models: Iterable[nn.Module],
    *,
    step: Any,
    rank: int,
    split: Any = None,
    flat: set[int] = frozenset(),
    trained: list[torch.Tensor] = (),
    watched_models: Iterable[nn.Module] = (),
    frozen_then: frozenset[int] | None = None,
) -> Anomaly | None:
    """The ``unwatched_parameters`` warning, or None when every trainable parameter the optimizers
    hold is watched and every watched one is held. ``models``: modules to name outside parameters
    by before the live ones (the Accelerator's); ``split(name) -> (component,
    name)`` names a watched parameter's model (several watched models); DeepSpeed ZeRO's optimizers
    train the ``flat`` partitions (by ``id``) of the ``trained`` parameters. An outside parameter
    that one of the ``watched_models`` holds was frozen when the debugger was made and unfrozen
    since (``details["outside"]["unfrozen"]``: the advice is then to make the debugger after
    unfreezing, not to watch another model); with ``frozen_then`` (the ids of those frozen then), one
    not among them was added since (a LoRA adapter: ``details["outside"]["added"]``)."""
    if not optimizers:
        return None
    live = cache(lambda: live_objects((torch.optim.Optimizer, nn.Module)))  # both kinds, at most one lookup
    held: dict[int, torch.Tensor] = {id(p): p for p in trained}  # frozen ones too: no finding if frozen since
    for optimizer in optimizers:
        for group in param_groups(optimizer) or []:
            for p in group.get("params", []):
                if isinstance(p, torch.Tensor) and id(p) not in flat:
                    held.setdefault(id(p), p)
    watched = {id(p) for p in params.params}
    outside = [p for key, p in held.items() if key not in watched and p.requires_grad]
    # a watched parameter frozen after the debugger was made is not trained on purpose
    trainable = [(name, p) for name, p in zip(params.names, params.params) if p.requires_grad]
    missing = [name for name, p in trainable if id(p) not in held]
    if missing:  # trained by an optimizer the debugger was not given (plain PyTorch, one per model)?
        held.update(_held_by_other_optimizers(params.params, held, optimizers, live))
        missing = [name for name, p in trainable if id(p) not in held]
    if missing:
        beside = _embeddings_beside_adapters(watched_models, held)
        missing = [name for name, p in trainable if id(p) not in held and id(p) not in beside]
    if not outside and not missing:
        return None
    details: dict[str, Any] = {}
    if outside:
        details["outside"] = _described(_owner_names(outside, models, live))
        details["outside"]["values"] = sum(p.numel() for p in outside)
        inside = {id(p) for model in watched_models for p in unwrap_model(model).parameters()}
        unfrozen = sum(id(p) in inside for p in outside)
        added = 0 if frozen_then is None else sum(id(p) in inside and id(p) not in frozen_then for p in outside)
        if unfrozen - added:
            details["outside"]["unfrozen"] = unfrozen - added
        if added:
            details["outside"]["added"] = added
        nonfinite = _nonfinite_gradients(outside)
        if nonfinite:  # the step that finds them unfrozen (or added) reads their gradients once
            details["outside"]["nonfinite_gradients"] = nonfinite
    if missing:
        split = split or (lambda name: ("model", name))
        details["not_optimized"] = _described([split(name) for name in missing])
    return make_anomaly(kind="unwatched_parameters", component="optimizer", step=step, rank=rank, details=details)


def _nonfinite_gradients(params: list[torch.Tensor]) -> int:
    """How many of ``params`` hold a NaN/Inf gradient now (one read of one flag each, in one transfer
    per device; a sparse gradient by its values): read only where the check finds parameters outside
    the watch, whose gradients the steps do not read."""
    grads = [p.grad for p in params if p.grad is not None]
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        values = g.coalesce()._values() if g.is_sparse else g
        by_device.setdefault(values.device, []).append((~torch.isfinite(values.detach())).any())
    return sum(int(torch.stack(flags).sum().item()) for flags in by_device.values())


def _embeddings_beside_adapters(models: Iterable[nn.Module], held: dict[int, torch.Tensor]) -> set[int]:
    """The parameters (by ``id``) of the input embeddings of each watched model whose LoRA adapters
    (``lora_`` in their names) an optimizer holds: diffusers' SDXL, Flux and SD3 DreamBooth LoRA
    scripts set a text encoder's input embeddings trainable so that gradient checkpointing has an
    input that requires grad, and train its adapters only; those embeddings stay as they are on
    purpose. Not any other ``nn.Embedding`` (a UNet's class embedding made trainable and left out of
    the optimizer is a mistake, named)."""
    beside: set[int] = set()
    for model in models:
        inner = unwrap_model(model)
        if any("lora_" in name and id(p) in held for name, p in inner.named_parameters()):
            for module in _input_embeddings(inner):
                beside.update(id(p) for p in module.parameters(recurse=False))
    return beside


def _input_embeddings(model: nn.Module) -> list[nn.Module]:
    """A transformers model's input embeddings (``get_input_embeddings()``), with the ``nn.Embedding``
    modules beside it in its own parent (CLIP's position embedding: diffusers' scripts set
    ``text_model.embeddings`` trainable) unless that parent is the model itself; none for a model
    without them (a diffusers UNet or transformer)."""
    get = getattr(model, "get_input_embeddings", None)
    try:
        token = get() if callable(get) else None
    except Exception:  # NotImplementedError: a model without input embeddings
        return []
    if not isinstance(token, nn.Module):
        return []
    parent = next((m for m in model.modules() if any(c is token for c in m.children())), model)
    if parent is model:
        return [token]
    return [token, *(c for c in parent.children() if c is not token and isinstance(c, nn.Embedding))]


def _described(names: list[tuple[str, str]]) -> dict[str, Any]:
    """``{"count": n, "groups": {"<owner> <module prefix>": count, ...}}`` from ``(owner, qualified
    name)`` pairs, largest groups first."""
    counts = Counter(_group(owner, name) for owner, name in names)
    groups = dict(counts.most_common(GROUPS_KEPT))
    rest = sum(counts.values()) - sum(groups.values())
    if rest:
        groups[f"{len(counts) - len(groups)} other groups"] = rest
    return {"count": len(names), "groups": groups}


def _group(owner: str, name: str) -> str:
    """``CLIPTextModel text_model.encoder`` for ``text_model.encoder.layers.0.fc1.weight`` in a CLIPTextModel."""
    if not name:
        return owner
    module = name.rpartition(".")[0]
    prefix = ".".join(module.split(".")[:PREFIX_DEPTH]) if module else "(root)"
    return f"{owner} {prefix}"


def _owner_names(
    outside: list[torch.Tensor], models: Iterable[nn.Module], live: Callable[[], list[Any]]
) -> list[tuple[str, str]]:
    """``(owner class, qualified name)`` of each parameter (``("(in no module)", "")`` if none);
    ``live()``: the live optimizers and modules."""
    names: dict[int, tuple[str, str]] = {}
    _name_from(outside, list(models), names)
    if len(names) < len(outside):
        _name_from([p for p in outside if id(p) not in names], _live_roots(live()), names)
    return [names.get(id(p), ("(in no module)", "")) for p in outside]


def _name_from(wanted: list[torch.Tensor], roots: list[nn.Module], names: dict[int, tuple[str, str]]) -> None:
    """Name each wanted parameter by the root that holds the most of them."""
    ids = {id(p) for p in wanted}
    found = []
    for root in roots:
        try:
            inner = unwrap_model(root)
            held = [(wrapper_free(name), p) for name, p in inner.named_parameters() if id(p) in ids]
        except (AttributeError, RuntimeError, TypeError):  # a live wrapper left half-built (its __init__ raised)
            continue
        if held:
            found.append((type(inner).__name__, held))
    for owner, held in sorted(found, key=lambda item: -len(item[1])):
        for name, p in held:
            names.setdefault(id(p), (owner, name))


def _held_by_other_optimizers(
    params: list[torch.Tensor], held: dict[int, torch.Tensor], known: list[Any], live: Callable[[], list[Any]]
) -> dict[int, torch.Tensor]:
    """The ``params`` not ``held`` by the ``known`` optimizers that another live torch optimizer
    (of ``live()``) holds, by id."""
    wanted = {id(p): p for p in params if id(p) not in held}
    skip = {id(o) for o in known} | {id(getattr(o, "optimizer", None)) for o in known}
    optimizers = [o for o in live() if issubclass(type(o), torch.optim.Optimizer) and id(o) not in skip]
    return {id(p): wanted[id(p)] for o in optimizers for p in _held_by(o) if id(p) in wanted}


def _held_by(optimizer: torch.optim.Optimizer) -> list[Any]:
    """The parameters a live optimizer holds; none for one whose ``__init__`` never finished."""
    try:
        return [p for group in optimizer.param_groups for p in group["params"]]
    except (AttributeError, KeyError, TypeError):
        return []


def _live_roots(live: list[Any]) -> list[nn.Module]:
    """The modules of ``live`` (every one alive in the process) that are no other module's child."""
    modules = [m for m in live if issubclass(type(m), nn.Module) and _built(m)]
    children = {id(child) for m in modules for child in m.children()}
    return [m for m in modules if id(m) not in children]


def _built(module: nn.Module) -> bool:
    """Whether ``nn.Module.__init__`` ran for ``module`` (one whose own ``__init__`` raised before it
    has no children or parameters to list: reading them raises)."""
    state = getattr(module, "__dict__", None)
    return isinstance(state, dict) and all(k in state for k in ("_modules", "_parameters", "_buffers"))
