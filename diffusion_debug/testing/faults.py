"""Planted faults: forward hooks that make a module misbehave on purpose, for tests and the demo.

Each planter registers one forward hook with torch's own ``register_forward_hook`` and returns its
handle: ``handle.remove()`` ends the fault, and the handle works as a context manager.

Limits:

* Only a module whose output is a single tensor is changed; a tuple or ``ModelOutput`` output
  passes through untouched.
* The call count belongs to the hook: planting again on the same module starts counting from 0.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["plant_nonfinite", "plant_overflow"]


def _after_calls(module: torch.nn.Module, from_call: int, change) -> Any:
    calls = {"n": 0}

    def hook(_module, _args, output):
        calls["n"] += 1
        if calls["n"] > from_call and isinstance(output, torch.Tensor):
            return change(output)
        return None

    return module.register_forward_hook(hook)


def plant_nonfinite(module: torch.nn.Module, *, from_call: int = 0, value: float = float("inf")):
    """Make ``module`` return ``value`` (Inf by default) in one element of its output, from its
    ``from_call``-th call on (0: every call).  A denoiser's inner module is called once per
    step, so ``from_call=3`` starts the fault at denoising step 3.  Returns the hook's handle:
    ``handle.remove()`` ends the fault.

    >>> import torch
    >>> layer = torch.nn.Linear(2, 2)
    >>> with plant_nonfinite(layer, from_call=1):
    ...     first, second = layer(torch.ones(1, 2)), layer(torch.ones(1, 2))
    >>> bool(first.isfinite().all()), bool(second.isfinite().all())
    (True, False)
    """

    def change(output: torch.Tensor) -> torch.Tensor:
        output = output.clone()  # keeps the output's memory format (e.g. channels-last)
        # Index the first element rather than ``view(-1)``, which needs a contiguous tensor.
        output[(0,) * output.dim()] = value
        return output

    return _after_calls(module, from_call, change)


def plant_overflow(module: torch.nn.Module, *, fraction: float = 0.8, from_call: int = 0):
    """Scale ``module``'s output so that its abs-max is ``fraction`` of its dtype's largest
    value (an fp16 activation heading for overflow; above 1.0 it overflows to Inf).  Returns
    the hook's handle."""

    def change(output: torch.Tensor) -> torch.Tensor:
        limit = torch.finfo(output.dtype).max
        peak = output.detach().abs().amax().float().clamp(min=1e-6)
        return (output.float() * (fraction * limit / peak)).to(output.dtype)

    return _after_calls(module, from_call, change)
