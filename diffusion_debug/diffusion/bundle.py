"""Repro bundles: the inputs of one failing component call, saved for an offline replay.

A bundle is a folder ``bundles/<name>/`` with ``inputs.safetensors`` (every tensor argument)
and ``meta.json`` (component, class and config, step, timestep, module, dtypes, versions, and the
structure of the arguments).  The component's weights are NOT saved: :func:`replay` takes the
model (load the same checkpoint, or keep the pipeline around).

>>> # replay("debug_output/run-.../bundles/unet-step3", pipe.unet)["module"]
>>> # 'up_blocks.1.resnets.0.conv2'
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import DiffusionDebugError
from ..probes import find_producer, first_nonfinite
from ..record import dumps, load_json, versions, write_atomic
from ..stats import dtype_name
from .localize import replay_readings

_TENSOR = "__tensor__"


def _pack(obj: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    """A JSON skeleton of ``obj`` with tensors replaced by references into ``tensors``."""
    if isinstance(obj, torch.Tensor):
        tensors[path] = obj.detach().contiguous().cpu()
        return {_TENSOR: path}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, dict):
        return {"__dict__": {str(k): _pack(v, f"{path}.{k}", tensors) for k, v in obj.items()}}
    if isinstance(obj, (list, tuple)):
        return {
            "__list__" if isinstance(obj, list) else "__tuple__": [
                _pack(v, f"{path}.{i}", tensors) for i, v in enumerate(obj)
            ]
        }
    return {"__unsupported__": repr(obj)[:200]}


def _unpack(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(skeleton, dict):
        if _TENSOR in skeleton:
            return tensors[skeleton[_TENSOR]]
        if "__dict__" in skeleton:
            return {k: _unpack(v, tensors) for k, v in skeleton["__dict__"].items()}
        if "__list__" in skeleton:
            return [_unpack(v, tensors) for v in skeleton["__list__"]]
        if "__tuple__" in skeleton:
            return tuple(_unpack(v, tensors) for v in skeleton["__tuple__"])
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
) -> Path:
    """Write ``inputs.safetensors`` and ``meta.json``; return the folder."""
    from safetensors.torch import save_file

    bundle_dir = Path(bundle_dir)
    bundle_dir.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    skeleton = {"args": _pack(tuple(args), "args", tensors), "kwargs": _pack(dict(kwargs), "kwargs", tensors)}
    save_file(tensors, str(bundle_dir / "inputs.safetensors"))
    meta = {
        "component": component,
        "class": type(component_module).__name__,
        "config": _module_config(component_module),
        "call_prefix": call_prefix,
        "step": step,
        "timestep": timestep,
        "module": module,
        "anomaly_kind": anomaly_kind,
        "dtypes": {k: dtype_name(v.dtype) for k, v in tensors.items()},
        "shapes": {k: list(v.shape) for k, v in tensors.items()},
        "parameter_dtype": dtype_name(next(iter(component_module.parameters()), torch.empty(0)).dtype),
        "call": skeleton,
        "versions": versions(),
    }
    write_atomic(bundle_dir / "meta.json", dumps(meta, indent=1))
    return bundle_dir


def save_anomaly_bundle(
    run_dir: Path, anomaly: Any, *, call_prefix: str, component_module: nn.Module, args: tuple, kwargs: dict
) -> Path:
    """The bundle of the call where ``anomaly`` happened, in ``<run_dir>/bundles/<component>-step<N>``;
    ``anomaly.details["bundle"]`` then names it (relative to the run directory)."""
    name, step = anomaly.component, anomaly.step
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
    )
    anomaly.details["bundle"] = f"bundles/{label}"
    return path


def replay(
    bundle_dir: str | os.PathLike, model: nn.Module, device: str | torch.device | None = None
) -> dict[str, Any]:
    """Re-run ``model`` (the bundle's component, weights loaded by the caller: bundles hold no
    weights) on the saved inputs with full probes.

    Returns ``{"module": producer or None, "first_nonfinite": name or None, "output_finite": bool,
    "meta": meta.json}``; ``module`` is the first module whose output is non-finite while its
    inputs were finite, named inside the component as in the anomaly.
    """
    from safetensors.torch import load_file

    bundle_dir = Path(bundle_dir)
    if not (bundle_dir / "meta.json").is_file():
        raise DiffusionDebugError(f"{str(bundle_dir)!r} is not a repro bundle: it has no meta.json.")
    meta = load_json(bundle_dir / "meta.json")
    if not isinstance(model, nn.Module):
        raise DiffusionDebugError(
            f"replay needs the bundle's component ({meta.get('class')}) as an nn.Module, not {type(model).__name__}."
        )
    if device is None:
        device = next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
    tensors = {k: v.to(device) for k, v in load_file(str(bundle_dir / "inputs.safetensors")).items()}
    args = _unpack(meta["call"]["args"], tensors)
    kwargs = _unpack(meta["call"]["kwargs"], tensors)
    prefix = meta.get("call_prefix") or ""
    target = model.get_submodule(prefix) if prefix else model
    readings = replay_readings(target, tuple(args), dict(kwargs), prefix)
    producer = find_producer(readings)
    first = first_nonfinite(readings)
    top = [r for r in readings if r.module == prefix]
    return {
        "module": producer.module if producer else None,
        "first_nonfinite": first.module if first else None,
        "output_finite": all(r.output_finite for r in top) if top else first is None,
        "meta": meta,
    }
