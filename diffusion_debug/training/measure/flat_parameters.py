"""FSDP1 without original parameters (``FullyShardedDataParallel(use_orig_params=False)``, its
default): the model's parameters are its units' ``FlatParameter``\\ s, each this rank's shard of the
flattened parameters of one unit (``down_blocks.1._flat_param``). They are watched and measured as
they are (the norms and the step are the flat shards', which is what the optimizer steps on), but
a NaN/Inf is named at the user's parameter that holds it: the one whose elements in the shard hold
its first non-finite element (``_fqns`` and ``_shard_param_infos``, which FSDP1 keeps on each flat
parameter), in its module, as under ``use_orig_params=True``.

Read only on a step whose gradients hold a NaN/Inf (one host read of that shard's first non-finite
element): a clean step costs nothing here.

Limits: the original parameter is found from FSDP1's private bookkeeping of the flat parameter; where
it is missing or has another shape (another torch), the flat parameter stays the one named. The
element found is the first in the shard, not the first in backward order.
"""

from __future__ import annotations

from typing import Any

import torch

from ...record import Anomaly, rebuilt
from .gradients import TrainableParameters
from .wrappers import wrapper_free

FLAT_NAME = "_flat_param"
"""The last part of a FlatParameter's name (``FullyShardedDataParallel``'s attribute)."""


def original_parameter(flat: Any, name: str, values: torch.Tensor | None = None) -> str | None:
    """The qualified name of the original parameter that holds the first NaN/Inf element of the flat
    parameter ``flat`` (named ``name``) in this rank's shard of its gradient (``values``: of that
    shard of its weights), or None (none found)."""
    fqns, infos = getattr(flat, "_fqns", None), getattr(flat, "_shard_param_infos", None)
    grad = flat.grad if values is None else values
    if fqns is None or infos is None or grad is None or len(fqns) != len(infos):
        return None
    with torch.no_grad():
        bad = (~torch.isfinite(grad.reshape(-1))).nonzero()
    if not bad.numel():
        return None
    first = int(bad[0, 0])
    prefix = name[: -len(FLAT_NAME)] if name.endswith(FLAT_NAME) else ""
    for fqn, info in zip(fqns, infos):
        start = getattr(info, "offset_in_shard", None)
        if getattr(info, "in_shard", False) and start is not None and start <= first < start + info.numel_in_shard:
            return prefix + wrapper_free(fqn)
    return None  # the padding between parameters


def _original(name: str | None, params: TrainableParameters) -> str | None:
    if name is None or not name.endswith(FLAT_NAME) or name not in params.names:
        return None
    return original_parameter(params.params[params.names.index(name)], name)


def named_in_flat(anomaly: Anomaly, params: TrainableParameters) -> Anomaly:
    """``anomaly`` (a ``nonfinite`` named at a flat parameter) named at the original parameter and
    its module instead, the flat parameter kept in ``details["flat_parameter"]``; so is the first
    registered one it keeps (``details["first_registered"]``: named where the NaN follows an
    earlier cause). Any other as it is."""
    details = dict(anomaly.details)
    first = details.get("first_registered")
    original = _original(first.get("parameter"), params) if isinstance(first, dict) else None
    if original is not None:
        module = original.rpartition(".")[0]
        details["first_registered"] = {
            **first,
            "parameter": original,
            "module": module,
            "flat_parameter": first["parameter"],
        }
    original = _original(anomaly.parameter, params)
    if original is None:
        return rebuilt(anomaly, details=details) if details != anomaly.details else anomaly
    details["flat_parameter"] = anomaly.parameter
    return rebuilt(anomaly, parameter=original, module=original.rpartition(".")[0], details=details)


def weights_named_in_flat(indices: list[int], params: TrainableParameters) -> list[str]:
    """The names of the parameters ``indices`` whose weights hold NaN/Inf, each flat parameter's
    by the original parameter that holds its first non-finite weight in this rank's shard."""
    names = []
    for i in indices:
        name = params.names[i]
        flat = params.params[i]
        original = original_parameter(flat, name, flat.detach()) if name.endswith(FLAT_NAME) else None
        names.append(original or name)
    return names
