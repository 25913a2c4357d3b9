"""The dtype a module of a component computes in, as a NaN/Inf's or a near-overflow's advice reads it.

>>> from torch import nn
>>> import torch
>>> root = nn.Sequential(nn.Linear(2, 2).to(torch.float16), nn.ReLU())
>>> computes_in(root, "1"), computes_in(root, "0"), computes_in(root, "no.such")
('float16', 'float16', 'float16')
>>> with torch.no_grad():
...     root[0].weight[0, 0] = float("nan")
>>> weights_finite(root, "0"), weights_finite(root, "1"), weights_finite(root, ""), weights_finite(None, "0")
(False, True, False, True)
"""

from __future__ import annotations

import torch
from torch import nn

from ...stats import dtype_name
from ..replay.copies import layerwise_casting
from .autocast import autocast_dtype, autocast_state, execution_device_type
from .inventory import module_dtype


def computes_in(root: nn.Module, module: str) -> str | None:
    """The dtype ``root.module`` computes in now, read at the module, else at the nearest module above it that
    holds floating weights (a component's dtypes may differ: diffusers < 0.36's ``upcast_vae`` keeps the VAE's
    mid block in float16), fp8-stored weights' layerwise-casting compute dtype; read on a NaN/Inf or a
    near-overflow only, during the call (``force_upcast`` casts the VAE to float32 for the decode alone)."""
    name = module or ""
    while True:
        try:
            sub = root.get_submodule(name) if name else root
        except AttributeError:  # a name no module has
            sub = None
        dtype = module_dtype(sub) if sub is not None else None
        if dtype is not None and dtype.itemsize == 1:  # fp8 storage: layerwise casting computes in another
            return (layerwise_casting(sub) or {}).get("compute_dtype") or dtype_name(dtype)
        if dtype is not None:
            return dtype_name(dtype)
        if not name:
            return None
        name = name.rpartition(".")[0]


def weights_finite(root: nn.Module | None, module: str) -> bool:
    """Whether every parameter of ``root.module`` (and the modules in it) is finite; True where it is not found. A
    NaN/Inf made with a NaN/Inf weight is no overflow: no advice about autocast fits it (:func:`..checks.nonfinite`).
    Read on a NaN/Inf error only, in one host read; a weight it cannot read (on ``meta``, as accelerate's sequential
    offload leaves it; stored in float8, which ``isfinite`` does not take) is no evidence: False, never an error."""
    try:
        sub = None if root is None else root.get_submodule(module) if module else root
    except AttributeError:  # a name no module has
        return True
    if sub is None:
        return True
    try:
        flags = [torch.isfinite(p).all() for p in sub.parameters() if p.is_floating_point()]
        return not flags or bool(torch.stack([f.to(flags[0].device) for f in flags]).all())
    except (RuntimeError, NotImplementedError):
        return False


def autocast_over(root: nn.Module | None) -> str | None:
    """The dtype the ``torch.autocast`` open now computes ``root``'s autocast ops in, on the device type it computes
    on (None: no autocast reaches it; CUDA's leaves a component on the CPU in its own dtype). Read on a NaN/Inf
    only: a float32 VAE under autocast did not run in float32 (:func:`~..checks.nonfinite`'s advice).

    >>> with torch.autocast("cpu", dtype=torch.bfloat16):
    ...     autocast_over(nn.Linear(2, 2)), autocast_over(None)
    ('bfloat16', None)
    """
    under = autocast_dtype(autocast_state(), execution_device_type(root)) if root is not None else None
    return dtype_name(under) if under is not None else None
