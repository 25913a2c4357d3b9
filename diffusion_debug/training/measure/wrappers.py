"""The model inside the wrappers an engine puts around it (DDP, ``DataParallel``, a DeepSpeed engine,
``torch.compile``, FSDP1's root and units, activation checkpointing), so its parameters are named
as the user wrote them, and the part of a sharded tensor (an FSDP2 ``DTensor``) this process holds.
None of these engines is imported here: a process that did not import one holds none of its wrappers.

>>> import torch
>>> unwrap_model(torch.nn.parallel.DataParallel(torch.nn.Linear(2, 2)))
Linear(in_features=2, out_features=2, bias=True)
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from .deepspeed_zero import is_engine


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this process holds: a ``DTensor``'s local shard (FSDP2), else itself.
    Read locally, it never starts a collective."""
    # a DTensor exists only once torch.distributed.tensor is imported (by FSDP2 or the user): not
    # importing it here saves every process 0.7 s, and builds without torch.distributed need nothing
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return tensor.to_local() if dtensor is not None and isinstance(tensor, dtensor) else tensor


WRAPPER_PARTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module"})
"""The components that FSDP1 (``FullyShardedDataParallel``) and the activation-checkpoint wrapper
(``checkpoint_wrapper``) put into every qualified name under them; not the user's model's."""


def wrapper_free(name: str) -> str:
    """``name`` without the components of :data:`WRAPPER_PARTS`: FSDP1's units and checkpoint
    wrappers inside a model keep ``named_parameters()``'s names as the model itself has them
    (as under DDP or FSDP2).

    >>> wrapper_free("_fsdp_wrapped_module.down_blocks.0._fsdp_wrapped_module._checkpoint_wrapped_module.conv.weight")
    'down_blocks.0.conv.weight'
    """
    if "_wrapped_module" not in name:  # the common case: one test
        return name
    return ".".join(part for part in name.split(".") if part not in WRAPPER_PARTS)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The model inside DDP / DataParallel / DeepSpeed engine / ``torch.compile`` / FSDP1 root
    wrappers, so names carry no ``module.``, ``_orig_mod.`` or ``_fsdp_wrapped_module.`` prefix
    (FSDP1's units inside keep theirs: :func:`wrapper_free`)."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        inner = getattr(model, "_orig_mod", None)
        if isinstance(inner, nn.Module):
            model = inner
            continue
        inner = getattr(model, "_fsdp_wrapped_module", None)  # FSDP1: no import of it here
        if isinstance(inner, nn.Module) and is_fsdp1(model):
            model = inner
            continue
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)) or is_engine(model):
            model = model.module
            continue
        break
    return model


def fsdp1_type() -> type | None:
    """FSDP1's ``FullyShardedDataParallel`` where this process imported it (no import here: a
    process without it holds no FSDP1 unit)."""
    found = getattr(sys.modules.get("torch.distributed.fsdp"), "FullyShardedDataParallel", None)
    return found if isinstance(found, type) else None


def is_fsdp1(module: Any) -> bool:
    """Whether ``module`` is an FSDP1 unit (``FullyShardedDataParallel``)."""
    fsdp = fsdp1_type()
    return fsdp is not None and isinstance(module, fsdp)


def is_compiled(model: nn.Module) -> bool:
    """Whether ``model`` runs compiled: a ``torch.compile`` wrapper (itself, or inside DDP's), or a
    module of it compiled in place (``module.compile()``)."""
    inner = unwrap_model(model)
    wrapped = inner is not model and any(hasattr(m, "_orig_mod") for m in (model, getattr(model, "module", None)))
    return wrapped or any(vars(m).get("_compiled_call_impl") is not None for m in inner.modules())
