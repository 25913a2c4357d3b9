"""Repro bundles: the inputs of one failing component call, saved for an offline replay.

A bundle is a folder ``bundles/<name>/`` with ``inputs.safetensors`` (every tensor argument)
and ``meta.json`` (component, class and config, step, timestep, module, dtypes, versions, the run's
``overflow_fraction``, and the structure of the arguments).  The component's weights are NOT saved:
:func:`replay` takes the model (load the same checkpoint, or keep the pipeline around).

>>> # replay("debug_output/run-.../bundles/unet-step3", pipe.unet)["module"]
>>> # 'up_blocks.1.resnets.0.conv2'
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from ...config import DebugConfig
from ...errors import DiffusionDebugError
from ...record import dumps, load_json, versions, write_atomic
from ...stats import dtype_name
from ..checks import find_producer, first_nonfinite
from ..components.autocast import (
    UNKNOWN_DEVICE,
    AutocastState,
    autocast_as,
    execution_device_type,
    state_fields,
    state_from_fields,
)
from ..components.cache_hooks import hook_state_kept
from ..components.cache_timestep import timestep_kept
from ..components.compiled import eager_module, replay_readings
from ..components.kept_calls import _OBJECT_DEPTH, _plain
from .bundle_objects import made_object, own_classes
from .copies import (
    context_fields,
    context_from_fields,
    hook_groups,
    hooks_passed,
    isolated_copy,
    layerwise_casting,
)
from .near_max import near_max_maker

_TENSOR = "__tensor__"
_OBJECT = "__object__"
PARAMETER_DTYPES = ("float32", "float16", "bfloat16")


def _pack(
    obj: Any,
    path: str,
    tensors: dict[str, torch.Tensor],
    classes: dict[str, type],
    depth: int = 0,
    within: frozenset[int] = frozenset(),
) -> Any:
    """A JSON skeleton of ``obj`` with tensors replaced by references into ``tensors``. Its own walk,
    not stats.nested's: a skeleton keeps every value and its container type. A tensor's reference is
    its path, one part a container: a list's index, a string key that holds no ``.`` and does not
    start with ``#`` (``kwargs.added_cond_kwargs.text_embeds``), else ``#`` and the item's position
    (``#<i>k`` for what its key holds: a tensor key). No part holds a ``.`` and a container's parts
    differ, so two tensors never share a path: ``{0: a, "0": b}``, a key ``"x.y"`` beside ``{"x": {"y":
    ...}}`` and two tensor keys with the same values wrote one name for two tensors (one lost). A plain object
    (a component's own state: GLM-Image's ``kv_caches``) of a class among ``classes`` (the component module's own,
    the only ones its replay makes: :func:`~.bundle_objects.own_classes`) keeps its class's name and its
    attributes, four objects deep (:func:`~.bundle_objects.made_object`); any other is written unsupported
    (transformers' ``DynamicCache``: no layer's keys and values copied to be replayed as None), and so is a
    container or object met again on its own path (``within``: a list holding itself)."""
    if isinstance(obj, torch.Tensor):
        tensors[path] = obj.detach().contiguous().cpu()
        return {_TENSOR: path}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if id(obj) in within:  # a cycle (a list holding itself): no end to a walk down it
        return {"__unsupported__": f"a cycle back to a {type(obj).__name__}"}
    within = within | {id(obj)}  # (the ids of the containers and objects on the path to it)

    def pack(value: Any, part: str, deeper: int = depth) -> Any:
        return _pack(value, part, tensors, classes, deeper, within)

    if isinstance(obj, dict):
        if all(type(k) is str for k in obj):
            return {"__dict__": {k: pack(v, f"{path}.{_part(k, i)}") for i, (k, v) in enumerate(obj.items())}}
        # keys of other types as they were (AnyFlow FAR's kv_cache: layer indices): a pair each
        return {
            "__items__": [[pack(k, f"{path}.#{i}k"), pack(v, f"{path}.#{i}")] for i, (k, v) in enumerate(obj.items())]
        }
    if isinstance(obj, (list, tuple)):
        return {
            "__list__" if isinstance(obj, list) else "__tuple__": [pack(v, f"{path}.{i}") for i, v in enumerate(obj)]
        }
    if depth < _OBJECT_DEPTH and _plain(obj) and classes.get(type(obj).__name__) is type(obj):
        return {_OBJECT: type(obj).__name__, "attributes": pack(vars(obj), path, depth + 1)}
    return {"__unsupported__": repr(obj)[:200]}


def _part(key: str, position: int) -> str:
    """A string key's part of a tensor's path (:func:`_pack`).

    >>> _part("sample", 0), _part("a.b", 1), _part("#0", 2)
    ('sample', '#1', '#2')
    """
    return f"#{position}" if "." in key or key.startswith("#") else key


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with each one that shares memory with an earlier one copied: safetensors refuses
    shared memory, and a call may pass one tensor twice (LTX-2's ``timestep`` and ``sigma``)."""
    seen: set[int] = set()
    out = {}
    for key, tensor in tensors.items():
        storage = tensor.untyped_storage().data_ptr() if tensor.numel() else None
        out[key] = tensor.clone() if storage in seen else tensor
        if storage is not None:
            seen.add(storage)
    return out


def _unpack(skeleton: Any, tensors: dict[str, torch.Tensor], classes: dict[str, type]) -> Any:
    if isinstance(skeleton, dict):
        if _TENSOR in skeleton:
            return tensors[skeleton[_TENSOR]]  # every reference was checked by read_bundle
        if "__dict__" in skeleton:
            return {k: _unpack(v, tensors, classes) for k, v in skeleton["__dict__"].items()}
        if "__items__" in skeleton:
            return {_unpack(k, tensors, classes): _unpack(v, tensors, classes) for k, v in skeleton["__items__"]}
        if "__list__" in skeleton:
            return [_unpack(v, tensors, classes) for v in skeleton["__list__"]]
        if "__tuple__" in skeleton:
            return tuple(_unpack(v, tensors, classes) for v in skeleton["__tuple__"])
        if _OBJECT in skeleton:
            return made_object(skeleton[_OBJECT], _unpack(skeleton["attributes"], tensors, classes), classes)
        if "__unsupported__" in skeleton:
            return None
    return skeleton


def _module_config(module: nn.Module) -> Any:
    config = getattr(module, "config", None)
    if config is None:
        return None
    if hasattr(config, "to_dict"):
        try:
            return config.to_dict()
        except Exception:  # transformers configs may hold odd objects
            return repr(config)[:2000]
    return dict(config)


def _parameter_dtype(module: nn.Module) -> str:
    """The dtype the component computes in: its first float32/float16/bfloat16 parameter's (under
    diffusers' layerwise casting the cast layers are stored in fp8, the others are not)."""
    names = (dtype_name(p.dtype) for p in module.parameters())
    return next((name for name in names if name in PARAMETER_DTYPES), "float32")


def save_bundle(
    bundle_dir: str | os.PathLike,
    *,
    component: str,
    component_module: nn.Module,
    call_prefix: str,
    args: tuple,
    kwargs: dict,
    step: int | None,
    timestep: float | None,
    module: str,
    anomaly_kind: str,
    cache_context: Any = None,
    guider_hooks: dict[str, list[str]] | None = None,
    overflow_fraction: float = DebugConfig.overflow_fraction,
    autocast: AutocastState = (),
) -> Path:
    """Write ``inputs.safetensors`` and ``meta.json``; return the folder. ``guider_hooks``: per module,
    the hooks a guider placed for the call only (:func:`~..components.cache_hooks.placed_for_the_call`);
    ``overflow_fraction``: the run's, so a replay names the near-max maker the run named; ``autocast``: the
    autocast the call ran under, entered again by its replays (``[["cuda", "float16"]]``)."""
    from safetensors.torch import save_file

    bundle_dir = Path(bundle_dir)
    bundle_dir.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    classes = own_classes(eager_module(component_module))  # (packed only if its replay can make them)
    skeleton = {
        "args": _pack(tuple(args), "args", tensors, classes),
        "kwargs": _pack(dict(kwargs), "kwargs", tensors, classes),
    }
    save_file(_unshared(tensors), str(bundle_dir / "inputs.safetensors"))
    meta = {
        "component": component,
        "class": type(component_module).__name__,
        "config": _module_config(component_module),
        "call_prefix": call_prefix,
        "step": step,
        "timestep": timestep,
        "module": module,
        "anomaly_kind": anomaly_kind,
        "overflow_fraction": overflow_fraction,
        "autocast": state_fields(autocast),
        "cache_context": context_fields(cache_context),
        "guider_hooks": dict(guider_hooks or {}),
        "dtypes": {k: dtype_name(v.dtype) for k, v in tensors.items()},
        "shapes": {k: list(v.shape) for k, v in tensors.items()},
        "parameter_dtype": _parameter_dtype(component_module),
        "layerwise_casting": layerwise_casting(eager_module(component_module)),
        "call": skeleton,
        "versions": versions(),
    }
    write_atomic(bundle_dir / "meta.json", dumps(meta, indent=1))
    return bundle_dir


def save_anomaly_bundle(
    record: Any,
    anomaly: Any,
    *,
    call_prefix: str,
    component_module: nn.Module,
    args: tuple,
    kwargs: dict,
    cache_context: Any = None,
    guider_hooks: dict[str, list[str]] | None = None,
    overflow_fraction: float = DebugConfig.overflow_fraction,
    autocast: AutocastState = (),
) -> Path:
    """The bundle of the call where ``anomaly`` happened, in ``<run_dir>/bundles/<component>-step<N>``
    of ``record``'s run; ``anomaly.details["bundle"]`` then names it (relative to the run directory),
    and so does an ``anomaly_bundle`` event: the anomaly's own event is written already, and a run
    killed before its summary is rebuilt from the events (:func:`~diffusion_debug.record.run_dir.rebuild_summary`)."""
    name, step, run_dir = anomaly.component, anomaly.step, Path(record.run_dir)
    label = f"{name}-step{step}" if step is not None else f"{name}-{call_prefix or 'call'}"
    path = save_bundle(
        run_dir / "bundles" / label,
        component=name,
        component_module=component_module,
        call_prefix=call_prefix,
        args=args,
        kwargs=kwargs,
        step=step,
        timestep=anomaly.timestep,
        module=anomaly.module,
        anomaly_kind=anomaly.kind,
        cache_context=cache_context,
        guider_hooks=guider_hooks,
        overflow_fraction=overflow_fraction,
        autocast=autocast,
    )
    anomaly.details["bundle"] = f"bundles/{label}"
    place = {key: getattr(anomaly, key) for key in ("kind", "rank", "component", "module", "parameter")}
    record.add_event("anomaly_bundle", **place, bundle=anomaly.details["bundle"])
    return path


def _references(skeleton: Any, depth: int = 0) -> Iterator[Any]:
    """Every tensor reference in a call skeleton (a bound on nesting: a crafted file is data)."""
    if depth > 64:
        raise ValueError("nested more than 64 levels")
    if isinstance(skeleton, dict):
        if _TENSOR in skeleton:
            yield skeleton[_TENSOR]
            return
        for value in skeleton.values():
            yield from _references(value, depth + 1)
    elif isinstance(skeleton, list):
        for value in skeleton:
            yield from _references(value, depth + 1)


def read_bundle(bundle_dir: str | os.PathLike) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(meta, tensors)`` of a bundle, checked: one DiffusionDebugError naming the file and the
    field for a missing file, a ``meta.json`` that is not the bundle layout, a dtype that is not
    one of ours, or an ``inputs.safetensors`` that does not load or lacks a tensor the call names.
    Nothing in a bundle is executed: JSON and safetensors only (no pickle)."""
    from safetensors.torch import load_file

    bundle_dir = Path(bundle_dir)
    name = repr(str(bundle_dir))
    meta_path, inputs_path = bundle_dir / "meta.json", bundle_dir / "inputs.safetensors"
    if not meta_path.is_file():
        raise DiffusionDebugError(f"{name} is not a repro bundle: it has no meta.json.")
    try:
        meta = load_json(meta_path)
    except (OSError, ValueError, RecursionError) as error:
        raise DiffusionDebugError(f"{name}: meta.json is not valid JSON ({type(error).__name__}).") from None
    if not isinstance(meta, dict):
        raise DiffusionDebugError(f"{name}: meta.json is not a JSON object.")
    call = meta.get("call")
    for field, ok, expected in (
        ("component", isinstance(meta.get("component"), str) and meta.get("component"), "a component name"),
        (
            "call",
            isinstance(call, dict) and isinstance(call.get("args"), dict) and isinstance(call.get("kwargs"), dict),
            "the packed arguments {args, kwargs}",
        ),
        ("call_prefix", isinstance(meta.get("call_prefix", ""), (str, type(None))), "a module path or empty"),
        ("parameter_dtype", meta.get("parameter_dtype") in (None, *PARAMETER_DTYPES), ", ".join(PARAMETER_DTYPES)),
        ("dtypes", isinstance(meta.get("dtypes", {}), dict), "an object of dtype names"),
        ("overflow_fraction", _is_fraction(meta.get("overflow_fraction", 1)), "a number in (0, 1]"),
        ("autocast", state_from_fields(meta.get("autocast")) is not None, "[device type, dtype] pairs"),
    ):
        if not ok:
            shown = repr(meta.get(field))[:60]
            raise DiffusionDebugError(f"{name}: meta.json field {field!r} is {shown}, expected {expected}.")
    if not inputs_path.is_file():
        raise DiffusionDebugError(f"{name}: the bundle has no inputs.safetensors.")
    try:
        tensors = load_file(str(inputs_path))
    except Exception as error:  # safetensors raises its own error types for damaged files
        reason = " ".join(str(error).split())[:120]
        raise DiffusionDebugError(
            f"{name}: inputs.safetensors is not a readable safetensors file ({reason})."
        ) from None
    try:
        references = list(_references(call))
    except ValueError as error:
        raise DiffusionDebugError(f"{name}: meta.json field 'call' is {error}.") from None
    for reference in references:
        if not isinstance(reference, str) or reference not in tensors:
            raise DiffusionDebugError(
                f"{name}: meta.json's call names tensor {str(reference)[:60]!r}; inputs.safetensors lacks it."
            )
    for key, dtype in (meta.get("dtypes") or {}).items():
        if key in tensors and dtype != dtype_name(tensors[key].dtype):
            raise DiffusionDebugError(
                f"{name}: meta.json field 'dtypes' says {str(key)[:60]!r} is {str(dtype)[:30]!r}, "
                f"inputs.safetensors holds {dtype_name(tensors[key].dtype)}."
            )
    return meta, tensors


def _is_fraction(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 1


def bundle_fraction(meta: dict[str, Any]) -> float:
    """The ``overflow_fraction`` the bundle's run had (read_bundle checked it); a bundle saved before
    meta.json held it: the default.

    >>> bundle_fraction({"overflow_fraction": 0.2}), bundle_fraction({})
    (0.2, 0.5)
    """
    return float(meta.get("overflow_fraction", DebugConfig.overflow_fraction))


def load_call(
    bundle_dir: str | os.PathLike, model: nn.Module, device: str | torch.device | None = None
) -> tuple[dict[str, Any], tuple | list, dict]:
    """``(meta, args, kwargs)`` of a bundle's call, the tensors on ``device`` (default: where
    ``model``'s weights are); a damaged bundle or a model that is not a module is one DiffusionDebugError."""
    meta, loaded = read_bundle(bundle_dir)
    if not isinstance(model, nn.Module):
        raise DiffusionDebugError(
            f"replay needs the bundle's component ({meta.get('class')}) as an nn.Module, not {type(model).__name__}."
        )
    if device is None:
        device = next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
    tensors = {k: v.to(device) for k, v in loaded.items()}
    try:
        classes = own_classes(eager_module(model))
        args = _unpack(meta["call"]["args"], tensors, classes)
        kwargs = _unpack(meta["call"]["kwargs"], tensors, classes)
    except (TypeError, AttributeError, KeyError):
        raise DiffusionDebugError("meta.json field 'call' is not the packed layout of a call.") from None
    if not isinstance(args, (list, tuple)) or not isinstance(kwargs, dict):
        raise DiffusionDebugError("meta.json field 'call' is not the packed layout of a call.")
    return meta, args, kwargs


def replay(
    bundle_dir: str | os.PathLike, model: nn.Module, device: str | torch.device | None = None
) -> dict[str, Any]:
    """Re-run ``model`` (the bundle's component, weights loaded by the caller: bundles hold no
    weights) on the saved inputs with full probes.

    Returns ``{"module": producer or None, "first_nonfinite": name or None, "output_finite": bool,
    "overflowed_in": name or None, "note": str, "meta": meta.json}``; ``module`` is the first module
    whose output is non-finite while its inputs were finite, named inside the component as in the
    anomaly: where that module (then ``overflowed_in``) made it from finite values near the dtype's max,
    the module that made those (:func:`~.near_max.near_max_maker`, at the run's ``overflow_fraction``:
    :func:`bundle_fraction`). A damaged bundle is one DiffusionDebugError (see :func:`read_bundle`).
    ``model``'s stateful diffusers hooks (caches) run in the bundled call's cache context
    (``meta.json``'s ``cache_context``: the pipeline's ``cache_context`` has ended, and TaylorSeer or
    FirstBlockCache refuse a call outside one) from their live state, and are left as the replay found
    them: the next pipeline call does not start from the replay's. A
    caching hook's ``current_timestep_callback`` (PyramidAttentionBroadcast, FasterCache: ``lambda:
    pipe.current_timestep``, None once the call ended) answers the bundled step's ``timestep`` during the
    replay (:func:`~..components.cache_timestep.timestep_kept`). A bundle without one, or whose replay from
    the live cache fails (a bundle holds no cache: FasterCache's, reset at the call's end, fails a block that
    approximates), is replayed with the caching hooks passed through (in place, no copy), and ``note`` says
    so ("" otherwise). The call's autocast (``meta.json``'s ``autocast``) is entered again, none closing the
    caller's; one that does not reach the device ``model`` computes on here (CUDA's, on the CPU) is not, and
    ``note`` says so too (:func:`reached_autocast`).
    """
    meta, args, kwargs = load_call(bundle_dir, model, device)
    prefix = meta.get("call_prefix") or ""
    try:
        target = model.get_submodule(prefix) if prefix else model
    except AttributeError:
        raise DiffusionDebugError(
            f"meta.json field 'call_prefix' names {prefix[:80]!r}, which {type(model).__name__} does not have."
        ) from None
    context = context_from_fields(meta.get("cache_context"))
    autocast, reach = reached_autocast(bundled_autocast(meta), eager_module(model))
    note, name = "", str(meta.get("component"))
    with (
        autocast_as(autocast, outside=True),
        timestep_kept(eager_module(model), bundled_timestep(meta)) as replayable,
    ):
        try:
            if not replayable:
                raise _Uncached(uncached_note(name))
            with hook_state_kept(eager_module(model), context):  # a live component's caches as its last call left
                readings = replay_readings(target, tuple(args), dict(kwargs), prefix)
        except Exception as error:
            if "caching" not in hook_groups(eager_module(model)):
                raise
            failed = "" if isinstance(error, _Uncached) else f"{type(error).__name__}: {error}"
            note = uncached_note(name, failed)
            with hooks_passed(eager_module(model), "caching") as passed:  # in place: a copy doubles its memory
                if not passed:  # (a diffusers whose hooks hold no fn_ref)
                    model = isolated_copy(model, drop_hooks="caching")
                    target = model.get_submodule(prefix) if prefix else model
                readings = replay_readings(target, tuple(args), dict(kwargs), prefix)
    producer = find_producer(readings)
    first = first_nonfinite(readings)
    top = [r for r in readings if r.module == prefix]
    near = near_max_maker(readings, producer, bundle_fraction(meta)) if producer else None
    return {
        "module": (near or producer).module if producer else None,
        "first_nonfinite": first.module if first else None,
        "output_finite": all(r.output_finite for r in top) if top else first is None,
        "overflowed_in": producer.module if near else None,
        "note": "; ".join(filter(None, (reach, note))),
        "meta": meta,
    }


def bundled_autocast(meta: dict[str, Any]) -> AutocastState:
    """The autocast the bundled call ran under (``meta.json``'s ``autocast``, checked by :func:`read_bundle`; a
    bundle saved before it was kept: none)."""
    return state_from_fields(meta.get("autocast")) or ()


def reached_autocast(state: AutocastState, model: nn.Module) -> tuple[AutocastState, str]:
    """``state``, or none with a note where none of its regions reaches the device type ``model`` computes on here
    (a bundle saved under CUDA's autocast, replayed on the CPU: entered, it would compute nothing in float16, and
    warn where CUDA is not available)."""
    device = execution_device_type(model)
    if not state or device == UNKNOWN_DEVICE or any(d == device for d, _ in state):
        return state, ""
    regions = ", ".join(f"{d} {dtype_name(t)}" for d, t in state)
    reach = f"the call ran under {regions} autocast, which does not reach {device}, where the model is"
    return (), f"{reach}: replayed outside it"


def bundled_timestep(meta: dict[str, Any]) -> float | None:
    """The bundled call's timestep (``meta.json``'s ``timestep``: the pipeline's ``current_timestep`` of
    that step), None when it holds no number (a crafted file is data)."""
    value = meta.get("timestep")
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


class _Uncached(Exception):
    """The bundle's call cannot be replayed with the component's caching hooks (its message: why)."""


def uncached_note(component: str, failed: str = "") -> str:
    """The one sentence of a replay run without the component's caching hooks: they ask a timestep the
    bundle does not hold, or the replay from the cache they hold now (``failed``) raised (a bundle holds
    no cache: after a call's end, FasterCache's reset cache fails a block that approximates)."""
    if not failed:
        return (
            f"{component} was replayed without its caching hooks: they ask the pipeline's current timestep, "
            "which is unset once its call has ended, and the bundle holds none"
        )
    return (
        f"{component} was replayed without its caching hooks: the replay from the cache they hold now "
        f"failed ({failed[:160]}), and a bundle holds no cache"
    )


def lost_state_note(component: str, lost: int) -> str:
    """The one sentence of a replay from a kept hooks' state with ``lost`` objects that could not be put back
    (:func:`~..components.cache_hooks.lost_values`)."""
    objects = "object" if lost == 1 else "objects"
    return (
        f"{lost} {objects} of {component}'s hooks' state as the call began could not be put back (held weakly, "
        "as they may reach the module, and replaced by the hooks since): the replays ran with the hooks' objects "
        "of now"
    )
