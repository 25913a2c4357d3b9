"""Planted faults: forward hooks that make a module misbehave on purpose, for tests and the demo.

Each planter registers one forward hook with torch's own ``register_forward_hook`` and returns its
handle: ``handle.remove()`` ends the fault, and the handle works as a context manager.

Limits:

* A module whose output is not a single tensor has its first tensor changed: a tuple's (a UNet
  down block's hidden states, not its residuals), a diffusers or transformers output's ``sample``
  (else its first tensor field). The output keeps its type and its other items; one with no tensor
  (None, a tuple of Nones) raises a ``TypeError`` at the call rather than plant nothing.
* The call count belongs to the hook: planting again on the same module starts counting from 0.
* Plant before the debugger attaches: torch runs forward hooks in the order they were registered,
  so a fault planted after the debugger's probes changes the output after they read it; full probes
  then name the module's parent (the first to see it), or no module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["plant_leak", "plant_nonfinite", "plant_oom", "plant_overflow"]


def _after_calls(module: torch.nn.Module, from_call: int, change) -> Any:
    calls = {"n": 0}

    def hook(_module, _args, output):
        calls["n"] += 1
        if calls["n"] <= from_call:
            return None
        if isinstance(output, torch.Tensor):
            return change(output)
        return _change_first_tensor(module, output, change)

    return module.register_forward_hook(hook)


def _change_first_tensor(module: torch.nn.Module, output: Any, change) -> Any:
    """``output`` with its first tensor (a mapping's ``sample``, else its first tensor value) put
    through ``change``, as a new output of the same type; None when ``change`` returns None."""
    if isinstance(output, (tuple, list)):
        keys = list(range(len(output)))
    elif isinstance(output, Mapping):  # diffusers' BaseOutput, transformers' ModelOutput, a dict
        keys = sorted(output.keys(), key=lambda k: k != "sample")  # ``sample`` first, else their order
    else:
        keys = []
    key = next((k for k in keys if isinstance(output[k], torch.Tensor)), None)
    if key is None:
        raise TypeError(
            f"cannot plant a fault in {type(module).__name__}: its output, a {type(output).__name__}, holds no tensor"
        )
    changed = change(output[key])
    if changed is None:
        return None
    if isinstance(output, (tuple, list)):
        items = [changed if i == key else item for i, item in enumerate(output)]
        if hasattr(output, "_fields"):  # a named tuple
            return type(output)(*items)
        return type(output)(items)
    if dataclasses.is_dataclass(output) and key in {f.name for f in dataclasses.fields(output)}:
        return dataclasses.replace(output, **{key: changed})
    return type(output)({**output, key: changed})


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


def plant_oom(module: torch.nn.Module, *, from_call: int = 0):
    """Make ``module`` raise ``torch.OutOfMemoryError`` (the CUDA caching allocator's message) when it
    is called, from its ``from_call``-th call on: an out-of-memory error testable on CPU. Returns
    the pre-hook's handle.

    >>> layer = torch.nn.Linear(2, 2)
    >>> with plant_oom(layer):
    ...     layer(torch.ones(1, 2))
    Traceback (most recent call last):
    ...
    torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB (planted by diffusion_debug.testing)
    """
    calls = {"n": 0}

    def hook(_module, _args):
        calls["n"] += 1
        if calls["n"] > from_call:
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 2.00 GiB (planted by diffusion_debug.testing)"
            )

    return module.register_forward_pre_hook(hook)


def plant_leak(module: torch.nn.Module, *, megabytes: float = 8.0, from_call: int = 0):
    """Make ``module`` keep ``megabytes`` of new memory (a tensor on its output's device, filled so
    that the pages are touched) at every call from its ``from_call``-th on, as code that appends
    each call's result to a list does. ``handle.remove()`` ends the fault and lets the memory go."""
    kept: list[torch.Tensor] = []

    def change(output: torch.Tensor) -> None:
        kept.append(torch.ones(int(megabytes * 1024 * 1024 / 4), device=output.device))

    return _after_calls(module, from_call, change)
