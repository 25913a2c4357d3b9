"""Gradient norms of the trainable parameters: per parameter, per module and global, with fused
``torch._foreach_norm`` reductions that stay on the device until the step's one transfer.

>>> import torch
>>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
>>> model(torch.ones(1, 2)).sum().backward()
>>> params = TrainableParameters.of(model)
>>> params.names
['0.weight', '0.bias', '1.weight', '1.bias']
>>> params.module_names
['0', '1']

Limits: norms are of ``.grad`` as it is when read (the caller reads them before
``optimizer.step()`` and before any clipping: the *pre-clipping* norm); a gradient that is
``None`` counts as zero; per-parameter norms are accumulated in float32 (a gradient holding
values above ~1e19 overflows to inf: the exact non-finite check, :func:`nonfinite_mask`, is
then run to tell overflow from a real NaN/Inf).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
from torch import nn


def unwrap_model(model: nn.Module) -> nn.Module:
    """The model inside DDP / DataParallel / ``torch.compile`` wrappers, so names carry no
    ``module.`` or ``_orig_mod.`` prefix."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        inner = getattr(model, "_orig_mod", None)
        if isinstance(inner, nn.Module):
            model = inner
            continue
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
            continue
        break
    return model


@dataclass
class TrainableParameters:
    """The parameters with ``requires_grad``, in registration order, with their module."""

    names: list[str]
    params: list[nn.Parameter]
    module_of: list[int]
    """Index into :attr:`module_names` of each parameter's module."""
    module_names: list[str]
    _module_index: torch.Tensor = field(repr=False, default=None)

    @classmethod
    def of(cls, model: nn.Module) -> "TrainableParameters":
        names, params, module_of, module_names, index = [], [], [], [], {}
        for name, param in unwrap_model(model).named_parameters():
            if not param.requires_grad:
                continue
            module = name.rpartition(".")[0]
            if module not in index:
                index[module] = len(module_names)
                module_names.append(module)
            names.append(name)
            params.append(param)
            module_of.append(index[module])
        return cls(names, params, module_of, module_names, torch.tensor(module_of, dtype=torch.long))

    def __len__(self) -> int:
        return len(self.params)

    def module_norms(self, param_norms: torch.Tensor) -> torch.Tensor:
        """Per-module L2 norms from per-parameter L2 norms (host or device float tensor)."""
        index = self._module_index.to(param_norms.device)
        squares = torch.zeros(len(self.module_names), dtype=torch.float64, device=param_norms.device)
        return squares.index_add_(0, index, param_norms.double().square()).sqrt()


@torch.no_grad()
def _grouped_norms(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """L2 norm of each tensor, as float32 on ``device``, one fused kernel per (device, dtype)."""
    first = tensors[0]
    if all(t.device == first.device and t.dtype == first.dtype for t in tensors):
        return torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32)).to(device)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    out = torch.empty(len(tensors), dtype=torch.float32, device=device)
    for indices in groups.values():
        norms = torch.stack(torch._foreach_norm([tensors[i] for i in indices], 2, dtype=torch.float32))
        out[torch.tensor(indices, device=device)] = norms.to(device)
    return out


def grad_norms(params: TrainableParameters, device: torch.device) -> torch.Tensor:
    """Per-parameter gradient L2 norms (float32, on ``device``); ``None`` gradients give 0."""
    zero = torch.zeros((), device=device)
    return _grouped_norms([p.grad if p.grad is not None else zero for p in params.params], device)


def weight_norms(params: TrainableParameters, device: torch.device) -> torch.Tensor:
    """Per-parameter weight L2 norms (float32, on ``device``)."""
    return _grouped_norms(params.params, device)


def nonfinite_mask(params: TrainableParameters) -> list[bool]:
    """Exactly which gradients hold a NaN/Inf (one transfer; run only when a norm is not finite)."""
    device = params.params[0].device
    flags = [
        (~torch.isfinite(p.grad.detach())).any().to(device)
        if p.grad is not None
        else torch.zeros((), dtype=torch.bool, device=device)
        for p in params.params
    ]
    return torch.stack(flags).tolist()


def parameter_checksums(params: TrainableParameters, device: torch.device) -> torch.Tensor:
    """Sum of each parameter in float64: equal across ranks when the replicas agree."""
    return torch.stack([p.detach().sum(dtype=torch.float64).to(device) for p in params.params])


def zero_gradients(params: TrainableParameters) -> None:
    """Set every existing gradient to zero in place (not to None: a GradScaler or DDP that
    expects the gradient tensors keeps working)."""
    grads = [p.grad for p in params.params if p.grad is not None]
    if grads:
        torch._foreach_zero_(grads)


class BackwardOrder:
    """Records the order in which gradients are accumulated in backward, with one
    post-accumulate-grad hook per trainable parameter (a list append: no tensor work).

    ``remove()`` takes the hooks off; the order of the last backward is :attr:`order`.
    """

    def __init__(self, params: TrainableParameters):
        # The last backward's order: a bounded deque, so nothing grows if no monitor call clears it.
        self.order: deque[int] = deque(maxlen=max(1, len(params)))
        self._handles = []
        append = self.order.append
        for i, p in enumerate(params.params):
            self._handles.append(p.register_post_accumulate_grad_hook(lambda _p, i=i: append(i)))

    def first(self, flagged: list[int]) -> int | None:
        """The flagged parameter whose gradient was accumulated first in the last backward
        (registration order, reversed, when no backward was recorded)."""
        wanted = set(flagged)
        for i in self.order:
            if i in wanted:
                return i
        return max(flagged) if flagged else None

    def remove(self) -> None:
        handles, self._handles = self._handles, []
        for h in handles:
            h.remove()
