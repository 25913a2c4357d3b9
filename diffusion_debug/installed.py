"""What the installed torch offers above the declared floor (``pyproject.toml``), detected once.

The debugger runs on every declared version: where an API is newer than the floor, the code asks
here and takes the older path, so a user's run is never broken by a missing API.

>>> isinstance(GLOBAL_HOOKS_TAKE_KWARGS, bool) and isinstance(HAS_SET_STANCE, bool)
True
"""

from __future__ import annotations

import inspect

import torch
from torch.nn.modules.module import register_module_forward_hook


def _takes(function, name: str) -> bool:
    try:
        return name in inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False


#: ``register_module_forward_hook(hook, with_kwargs=True)`` (torch 2.6): a process-wide forward hook
#: that sees a call's keyword arguments. Without it, a probe hooks each module it reads.
GLOBAL_HOOKS_TAKE_KWARGS = _takes(register_module_forward_hook, "with_kwargs")

#: ``torch.compiler.set_stance`` (torch 2.6): run compiled code eagerly within a block.
HAS_SET_STANCE = hasattr(torch.compiler, "set_stance")
