"""Count device-to-host reads: how the one-transfer-per-step budget is checked.

>>> import torch
>>> with count_host_transfers() as reads:
...     _ = torch.ones(3).sum().item()
>>> reads.count, reads.calls
(1, ['item'])

Counts the tensor methods that bring values to the host (``item``, ``tolist``, ``cpu``,
``numpy``, ``__float__``, ``__int__``, ``__bool__``, and ``to``/``copy_`` towards the CPU from
another device) through a ``TorchFunctionMode``, so it works on CPU too, where no real copy
happens.  On CPU, ``cpu()`` and ``to("cpu")`` of a CPU tensor are not counted.  Limits: reads
made by C++ code that never passes through Python (none in this package) are not seen.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_READS = {"item", "tolist", "numpy", "__float__", "__int__", "__bool__", "__index__"}


class count_host_transfers(TorchFunctionMode):
    """Context manager; ``count`` and ``calls`` (method names, in order) after it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    @property
    def count(self) -> int:
        return len(self.calls)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _READS:
            self.calls.append(name)
        elif name in ("cpu", "to") and args and isinstance(args[0], torch.Tensor):
            if args[0].device.type != "cpu" and _targets_cpu(name, args[1:], kwargs):
                self.calls.append(name)
        return func(*args, **kwargs)


def _targets_cpu(name: str, args: tuple, kwargs: dict) -> bool:
    if name == "cpu":
        return True
    target = kwargs.get("device", args[0] if args else None)
    if isinstance(target, (str, torch.device)):
        return torch.device(target).type == "cpu"
    return False
