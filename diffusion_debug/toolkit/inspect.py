"""``inspect_model``: one forward pass with every module probed, and what each one returned.

>>> import torch
>>> from diffusion_debug.testing import plant_nonfinite
>>> _ = torch.manual_seed(0)
>>> model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
>>> with plant_nonfinite(model[1]):
...     found = inspect_model(model, torch.ones(1, 2))
>>> found.first_nonfinite, found.first_near_overflow
('1', None)
>>> print(found.table())
module   type        shape   dtype    min      max      mean      std     nonfinite  range
-------  ----------  ------  -------  -------  -------  --------  ------  ---------  -------
0        Linear      [1, 3]  float32  -0.5417  0.36     -0.1091   0.369              1.6e-39
1        Linear      [1, 3]  float32  -0.2082  0.04336  -0.08244  0.1258  1          6.1e-40
2        Linear      [1, 1]  float32                                      1
(model)  Sequential  [1, 1]  float32                                      1
>>> found.to_dict()["first_nonfinite"]
'1'

The call runs under ``torch.no_grad()`` with the torch RNG state (CPU and the CUDA devices the
call draws on) and the buffers a module in training mode changes (BatchNorm's running statistics)
saved and restored around it, so inspecting changes no later result; every hook is removed
afterwards. The producer of a NaN/Inf is the first module, in the order modules finish,
whose output is non-finite while its inputs were finite (the full probe of
:mod:`~diffusion_debug.probes.readings`), not its parents, which finish later.

Limits: the statistics are of each module's first floating output tensor; ``first_near_overflow``
is the first output whose largest |value| reaches :data:`OVERFLOW_FRACTION` of its dtype's largest
finite value (fp16: 32752); values computed by functional code between two child modules are
attributed to their parent. One forward: the cost is a dozen reductions per module output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..probes import ModuleOutput, ProbeConfig, apply_output_stats, apply_probes, buffers_kept, find_producer
from ..record import dumps
from ..report.terminal import table
from ..stats import cuda_devices

OVERFLOW_FRACTION = 0.5
"""Share of the dtype's largest value at which an output counts as near overflow (the default of
``DebugConfig.overflow_fraction``)."""


@dataclass
class ModelInspection:
    """What :func:`inspect_model` saw: one row per module call, in the order calls finished."""

    model: str
    rows: list[ModuleOutput]
    first_nonfinite: str | None
    """The module that produced the first NaN/Inf from finite inputs (None: every output finite)."""
    first_near_overflow: str | None
    """The first module whose output reached :data:`OVERFLOW_FRACTION` of its dtype's maximum."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "first_nonfinite": self.first_nonfinite,
            "first_near_overflow": self.first_near_overflow,
            "modules": [
                {
                    "module": r.module,
                    "call": r.call,
                    "type": r.type,
                    "tensors": r.tensors,
                    "stats": None if r.stats is None else r.stats.to_dict(),
                }
                for r in self.rows
            ],
        }

    def to_json(self, indent: int | None = 1) -> str:
        """Strict JSON (non-finite numbers as the strings ``"nan"``, ``"inf"``, ``"-inf"``)."""
        return dumps(self.to_dict(), indent=indent)

    def table(self) -> str:
        """One line per module call: shape, dtype, finite min / max / mean / std, NaN+Inf count,
        share of the dtype's range."""
        lines = []
        for r in self.rows:
            s = r.stats
            name = (r.module or "(model)") + (f" (call {r.call})" if r.call else "")
            if s is None:
                lines.append((name, r.type, "", "", "", "", "", "", "", ""))
                continue
            values = [_g(v) for v in (s.min, s.max, s.mean, s.std)]
            shape = "[" + ", ".join(map(str, s.shape)) + "]"
            fraction = "" if s.dtype_max_fraction is None else f"{s.dtype_max_fraction:.2g}"
            lines.append((name, r.type, shape, s.dtype, *values, s.nonfinite or "", fraction))
        headers = ["module", "type", "shape", "dtype", "min", "max", "mean", "std", "nonfinite", "range"]
        return table(headers, lines)

    def __str__(self) -> str:
        head = f"{self.model}: {len(self.rows)} module calls"
        if self.first_nonfinite is not None:
            head += f"; first NaN/Inf produced by {self.first_nonfinite or '(the model itself)'}"
        if self.first_near_overflow is not None:
            head += f"; first near its dtype's maximum: {self.first_near_overflow or '(the model itself)'}"
        return f"{head}\n{self.table()}"


def _g(value: float | None) -> str:
    return "" if value is None else f"{value:.4g}"


def inspect_model(model: nn.Module, /, *args: Any, **kwargs: Any) -> ModelInspection:
    """Run ``model(*args, **kwargs)`` once with every module probed; per-module output shapes,
    dtypes and statistics, and the first module whose output is non-finite or near overflow."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"inspect_model takes a torch.nn.Module first, not {type(model).__name__}.")
    devices = cuda_devices((args, kwargs, list(model.parameters())[:1]))
    with torch.random.fork_rng(devices=devices), torch.no_grad(), buffers_kept(model):
        with apply_probes(model, ProbeConfig("full")) as readings, apply_output_stats(model) as outputs:
            model(*args, **kwargs)
    producer = getattr(find_producer(readings.state.collect()), "module", None)
    rows = outputs.state.collect()
    near = next(
        (
            r.module
            for r in rows
            if r.stats is not None
            and r.stats.dtype_max_fraction is not None
            and r.stats.dtype_max_fraction >= OVERFLOW_FRACTION
        ),
        None,
    )
    return ModelInspection(type(model).__name__, rows, producer, near)
