"""The one walk over nested values (a module's arguments, a pipeline component's output, a training
batch), on ``torch.utils._pytree``: every tensor, with the path of keys that leads to it, or the
value rebuilt with each tensor changed (:func:`map_tensors`).

>>> import torch
>>> from diffusers.models.unets.unet_2d_condition import UNet2DConditionOutput
>>> value = {"unet": UNet2DConditionOutput(sample=torch.ones(1)), "list": [torch.zeros(1), ("text", 3)]}
>>> [path for path, _ in iter_tensors(value)]
['unet.sample', 'list.0']
>>> [keys for keys, _ in walk_tensors(value)]
[('unet', 'sample'), ('list', 0)]

Plain tuples, lists and dicts take a fast path (a probe walks a module's arguments and output at
every call); anything else is opened by pytree's own registry (namedtuples, diffusers
``BaseOutput``, transformers ``ModelOutput``, any registered node), then as a ``Mapping`` or a
dataclass (pytree does not open those unless registered). pytree's own key paths are not used:
diffusers registers its outputs without the ``flatten_with_keys_fn`` they need.

>>> map_tensors({"a": [torch.ones(1)], "b": (2, torch.zeros(1))}, lambda t: t + 1)
{'a': [tensor([2.])], 'b': (2, tensor([1.]))}

Limits: a registered node that is not a mapping is keyed by position; objects that are none of
these (a tokenizer, a scheduler) hold no tensors as far as the walk goes. Two walks stay apart on
purpose: a repro bundle's skeleton (``diffusion/replay/bundle.py``) keeps every value and its
container type to write them as JSON, and ``diffusion/origins.is_nonfinite`` reads floats and
numpy arrays too, only two levels and 64 items deep (a user's arguments, each read a host sync).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Callable, Iterator

import torch
from torch.utils._pytree import tree_flatten, tree_map_only

from .tensors import absmax, measurable

_SCALARS = (int, float, bool, str, bytes)


def walk_tensors(obj: Any) -> list[tuple[tuple[Any, ...], torch.Tensor]]:
    """``(keys, tensor)`` for every tensor in ``obj``, in order: ``keys`` holds mapping keys,
    sequence indices and dataclass field names (``{"a": [x]}`` gives ``(("a", 0), x)``)."""
    out: list = []
    _walk(obj, (), out)
    return out


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every tensor in ``obj``, in the order of :func:`walk_tensors`, without building paths."""
    out: list = []
    if type(obj) is tuple:  # a module's output tuple (probes read every block's): its tensors taken here
        for item in obj:
            if isinstance(item, torch.Tensor):
                out.append(item)
            elif item is not None and type(item) not in _SCALARS:
                _walk(item, None, out)
        return out
    _walk(obj, None, out)
    return out


def call_tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """:func:`tensors_in` of a call's ``(args, kwargs)``, faster: a tensor passed directly (most
    arguments) is taken without the walk (a full probe reads the arguments of every module call)."""
    found: list[torch.Tensor] = []
    for value in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif value is not None:
            found += tensors_in(value)
    return found


def iter_tensors(obj: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """``(path, tensor)`` for every tensor in ``obj``; paths look like ``0``, ``sample``,
    ``hidden_states.2`` (keys joined by dots, after ``prefix``)."""
    for keys, tensor in walk_tensors(obj):
        yield ".".join(map(str, (prefix, *keys) if prefix else keys)), tensor


def map_tensors(obj: Any, change: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` rebuilt with ``change(t)`` in place of each tensor ``t``: plain tuples, lists and
    dicts directly, pytree's registered nodes (namedtuples, diffusers outputs) by pytree; anything
    else (an unregistered mapping or dataclass too) is kept as it is."""
    if isinstance(obj, torch.Tensor):
        return change(obj)
    kind = type(obj)
    if kind is tuple or kind is list:
        return kind(map_tensors(item, change) for item in obj)
    if kind is dict:
        return {key: map_tensors(item, change) for key, item in obj.items()}
    if obj is None or kind in _SCALARS:
        return obj
    return tree_map_only(torch.Tensor, change, obj)


def _walk(obj: Any, path: tuple[Any, ...] | None, out: list) -> None:
    """Append each tensor of ``obj`` to ``out``, as ``(keys, tensor)``, or alone when ``path`` is None."""
    if isinstance(obj, torch.Tensor):
        out.append(obj if path is None else (path, obj))
        return
    kind = type(obj)
    if kind is tuple or kind is list:
        items: Any = enumerate(obj)
    elif kind is dict:
        items = obj.items()
    elif obj is None or kind in _SCALARS:
        return
    else:
        items = _children(obj)
    for key, item in items:  # a tensor or a plain leaf taken here: a call only for a container
        if isinstance(item, torch.Tensor):
            out.append(item if path is None else (path + (key,), item))
        elif item is not None and type(item) not in _SCALARS:
            _walk(item, None if path is None else path + (key,), out)


def _children(obj: Any) -> list[tuple[Any, Any]]:
    """``(key, child)`` one level down: by pytree's registry, else as a mapping or a dataclass."""
    children, spec = tree_flatten(obj, is_leaf=lambda node: node is not obj)  # one level: only obj is opened
    if not spec.is_leaf():
        if isinstance(obj, Mapping) and len(obj) == len(children):  # pytree gives a mapping's values in key order
            return list(zip(obj.keys(), children))
        return list(enumerate(children))
    if isinstance(obj, Mapping):
        return list(obj.items())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [(field.name, getattr(obj, field.name, None)) for field in dataclasses.fields(obj)]
    return []


def cuda_devices(obj: Any) -> list[int]:
    """The CUDA devices a replay over ``obj`` (tensors, nested outputs, parameters) may draw
    random numbers on: those of its tensors, and the current device when CUDA is initialised (a
    closure may draw noise there). For ``torch.random.fork_rng(devices=...)``."""
    devices = {t.device.index or 0 for t in tensors_in(obj) if t.device.type == "cuda"}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        devices.add(torch.cuda.current_device())
    return sorted(devices)


def absmax_on_device(obj: Any) -> torch.Tensor | None:
    """The largest |value| over every floating tensor in ``obj`` (:func:`absmax`), as a 0-d
    tensor on the first tensor's device: a tensor alone gives its own (in its dtype, float32 for
    fp8: a component's output, measured at every call, with no conversion op), several give float32;
    NaN if any element is NaN, inf if any is infinite.  No host synchronisation; ``None`` when
    ``obj`` holds no :func:`measurable` tensor.
    """
    if isinstance(obj, torch.Tensor):
        return absmax(obj) if measurable(obj) else None
    parts = [absmax(t).float() for t in tensors_in(obj) if measurable(t)]
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]
    device = parts[0].device
    return torch.stack([p.to(device) for p in parts]).amax()
