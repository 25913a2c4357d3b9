"""Count the aten ops that reach the kernels: how the per-step cost budget is checked on any machine.

At real size on a GPU a diffusion pipeline is launch-bound, so what the debugger costs is the
number of ops it adds, not the arithmetic in them; the count is deterministic on CPU and tracks
the GPU cost.

>>> import torch
>>> with count_aten_ops() as ops:
...     _ = (torch.ones(3) * 2).sum()
>>> ops.total, sorted(ops.counts)
(3, ['aten.mul.Tensor', 'aten.ones.default', 'aten.sum.default'])

Views (``view``, ``expand``, ``select``, ``detach``, ... — no kernel, no launch) are not counted.
Limits: ops run by code that does not dispatch through torch (a custom CUDA extension called
directly) are not seen; ops inside ``torch.compile``'d graphs count as the graph's ops.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

# view-like ops that have no kernel of their own (the schema-based test misses a few of them)
_NO_KERNEL = {"aten.detach.default", "aten.alias.default", "aten.lift_fresh.default"}


class count_aten_ops(TorchDispatchMode):
    """Context manager; ``counts`` (a Counter of op names) and ``total`` after it."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = str(func)
        if not (getattr(func, "is_view", False) or name in _NO_KERNEL):
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def added_ops(with_debugger: Counter[str], without: Counter[str]) -> Counter[str]:
    """The ops one run made more than another (ops it made fewer of are left out)."""
    return Counter({op: n - without.get(op, 0) for op, n in with_debugger.items() if n > without.get(op, 0)})
