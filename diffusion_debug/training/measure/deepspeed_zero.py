"""DeepSpeed ZeRO (stages 1, 2 and 3): where the engine keeps each watched parameter's gradient and
weight on this rank. After ``engine.backward`` ZeRO holds the reduced gradients in its own
partitioned buffers and leaves ``.grad`` None: stages 1 and 2 keep, on the rank whose flat
partition holds it, a fragment of each parameter's averaged gradient (``param._hp_mapping``);
stage 3 a partition of every parameter (``param.ds_id``; its weight too, ``param.ds_tensor``).
These fragments are this rank's shards, read like FSDP2's: ``shards.ShardNorms`` sums the squares
of their norms over the ranks (a fragment is empty where another rank holds the whole parameter).

DeepSpeed is never imported here: a parameter ZeRO set up says so by its attributes, and an engine
or ZeRO optimizer is recognised by its class once ``deepspeed`` is in ``sys.modules``.

Limits: construct the debugger after ``deepspeed.initialize`` (it finds the partitions on the
parameters); the fragments exist between ``engine.backward`` and ``engine.step`` at a gradient
accumulation boundary (where the monitor is called); with ZeRO's CPU offload they are read on the
host, where they are; stage 3 reads a float32 copy of each partition (``zero_gradients`` then
reaches stages 1 and 2 only). Tested on stage 2.
"""

from __future__ import annotations

import sys
from typing import Any, Iterable

import torch


def _deepspeed_class(path: str) -> type | None:
    """A DeepSpeed class by ``module:name``, only when DeepSpeed was imported (by the user)."""
    module_name, _, name = path.partition(":")
    if "deepspeed" not in sys.modules:
        return None
    module = sys.modules.get(module_name)
    return getattr(module, name, None) if module is not None else None


def is_engine(obj: Any) -> bool:
    """``obj`` is a ``deepspeed.DeepSpeedEngine`` (what ``deepspeed.initialize`` and Accelerate's
    DeepSpeed plugin return as the model)."""
    engine = _deepspeed_class("deepspeed.runtime.engine:DeepSpeedEngine")
    return engine is not None and isinstance(obj, engine)


def zero_optimizer(obj: Any) -> Any:
    """The ZeRO optimizer inside ``obj`` (an engine, Accelerate's wrapper, the ZeRO optimizer
    itself), or None."""
    base = _deepspeed_class("deepspeed.runtime.base_optimizer:ZeROOptimizer")
    seen: set[int] = set()
    while obj is not None and id(obj) not in seen and base is not None:
        seen.add(id(obj))
        if isinstance(obj, base):
            return obj
        obj = getattr(obj, "optimizer", None)
    return None


def _stage3(param: torch.Tensor) -> bool:
    return hasattr(param, "ds_id") and hasattr(param, "_z3_optimizer")


def _partitioned(param: torch.Tensor) -> bool:
    return _stage3(param) or hasattr(param, "_hp_mapping")


class ZeroPartitions:
    """This rank's fragments of the watched parameters' gradients and weights under ZeRO."""

    def __init__(self, params: list[torch.Tensor], engines: list[Any]):
        self.params = params
        self.optimizers = [o for o in (zero_optimizer(e) for e in engines) if o is not None]
        """The ZeRO optimizers of the engines found (to read their overflow skip)."""
        self._empty = torch.zeros(0, dtype=params[0].dtype, device=params[0].device)

    @classmethod
    def find(cls, params: list[torch.Tensor], models: Iterable[Any], accelerator: Any = None) -> ZeroPartitions | None:
        """The partitions when ZeRO set up every trainable parameter (after ``deepspeed.initialize``),
        else None. ``models``: the watched models (an engine among them gives its optimizer)."""
        if "deepspeed" not in sys.modules or not params or not all(_partitioned(p) for p in params):
            return None
        candidates = [*models, *(getattr(accelerator, "_models", None) or [])]
        return cls(params, [m for m in candidates if is_engine(m)])

    def gradients(self) -> list[torch.Tensor]:
        """Each parameter's gradient fragment on this rank (empty where another rank holds it)."""
        return [self._gradient(p) for p in self.params]

    def _gradient(self, param: torch.Tensor) -> torch.Tensor:
        if _stage3(param):
            grad = param._z3_optimizer.get_local_fp32_grad_for_param(param)
            return self._empty if grad is None else grad
        mapping = param._hp_mapping
        if mapping is None:
            return self._empty
        return mapping.get_lp_grad_fragment(param._index_in_param_group)

    def weights(self) -> list[torch.Tensor]:
        """Each parameter's weight fragment on this rank, matching :meth:`gradients` (stages 1 and 2
        keep whole weights on every rank: the fragment of the same elements)."""
        out = []
        for p in self.params:
            if _stage3(p):
                out.append(p.ds_tensor.detach())
            elif p._hp_mapping is None:
                out.append(self._empty)
            else:
                address = p._hp_mapping.lp_fragment_address
                out.append(p.detach().reshape(-1).narrow(0, address.start, address.numel))
        return out

    def step_skipped(self, optimizer: Any) -> bool | None:
        """Whether ZeRO's last ``step()`` skipped the update for non-finite gradients (its overflow
        check: "OVERFLOW! Skipping step"): of the optimizer passed, else of the engine's."""
        found = zero_optimizer(optimizer)
        for candidate in [found] if found is not None else self.optimizers:
            flag = getattr(candidate, "overflow", None)
            if isinstance(flag, bool):
                return flag
        return None

    def trained(self, optimizers: Iterable[Any]) -> tuple[set[int], list[torch.Tensor]]:
        """The flat partitions (by ``id``) the ZeRO optimizers among ``optimizers`` (and the
        engines') hand to their torch optimizer, and the model parameters they partition."""
        flat: set[int] = set()
        trained: list[torch.Tensor] = []
        for zero in [*(zero_optimizer(o) for o in optimizers), *self.optimizers]:
            if zero is None:
                continue
            for flats, groups in (
                ("single_partition_of_fp32_groups", "bit16_groups"),
                ("fp32_partitioned_groups_flat", "fp16_groups"),
            ):
                flat.update(id(t) for t in getattr(zero, flats, None) or [])
                trained += [p for group in getattr(zero, groups, None) or [] for p in group]
        return flat, trained
