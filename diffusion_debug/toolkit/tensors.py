"""``analyze_tensor``: one tensor at a glance, in the spirit of lovely-tensors.

>>> import torch
>>> a = analyze_tensor(torch.tensor([1.0, -3.0, float("inf"), 0.0]), "x")
>>> a
x: tensor[4] float32 cpu min=-3 max=1 mean=-0.6667 std=1.7 +Inf=1 zero=1 range=8.8e-39
>>> a.inf, a.zeros, a.has_nan, a.range_fraction == 3.0 / torch.finfo(torch.float32).max
(1, 1, False, True)

The statistics are :func:`~diffusion_debug.stats.tensor_stats`: one pass of fused reductions on
the tensor's own device and ONE transfer to the host, whatever the tensor's size.

Limits: min / max / mean / std are over the finite elements (std with ``correction=0``); the NaN
and Inf counts say how many were left out. ``range`` is the largest |value| as a share of the
dtype's largest finite value (near 1: the next op may overflow). Meta, complex, sparse and
quantized tensors are not measured (the repr says why).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..stats import TensorStats, tensor_stats


@dataclass(frozen=True)
class TensorAnalysis:
    """What :func:`analyze_tensor` found; ``repr`` is one line, ``to_dict()`` plain values."""

    name: str | None
    stats: TensorStats

    @property
    def shape(self) -> tuple[int, ...]:
        return self.stats.shape

    @property
    def dtype(self) -> str:
        return self.stats.dtype

    @property
    def device(self) -> str:
        return self.stats.device

    @property
    def nan(self) -> int:
        return self.stats.nan

    @property
    def inf(self) -> int:
        """+Inf and -Inf together."""
        return self.stats.posinf + self.stats.neginf

    @property
    def zeros(self) -> int:
        fraction = self.stats.zero_fraction
        return round(fraction * self.stats.numel) if fraction is not None else 0

    @property
    def has_nan(self) -> bool:
        return self.nan > 0

    @property
    def has_inf(self) -> bool:
        return self.inf > 0

    @property
    def is_finite(self) -> bool:
        return self.stats.is_finite

    @property
    def min(self) -> float | None:
        return self.stats.min

    @property
    def max(self) -> float | None:
        return self.stats.max

    @property
    def mean(self) -> float | None:
        return self.stats.mean

    @property
    def std(self) -> float | None:
        return self.stats.std

    @property
    def range_fraction(self) -> float | None:
        """Largest finite |value| / the dtype's largest finite value."""
        return self.stats.dtype_max_fraction

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, **self.stats.to_dict(), "inf": self.inf, "zeros": self.zeros}

    def __repr__(self) -> str:
        s = self.stats
        shape = ", ".join(map(str, s.shape))
        head = f"{self.name}: " if self.name else ""
        parts = [f"{head}tensor[{shape}] {s.dtype} {s.device}"]
        if s.note is not None:
            return f"{parts[0]} ({s.note})"
        if s.min is not None:
            parts.append(f"min={_g(s.min)} max={_g(s.max)} mean={_g(s.mean)} std={_g(s.std)}")
        elif s.numel == 0:
            parts.append("empty")
        for label, count in (("NaN", s.nan), ("+Inf", s.posinf), ("-Inf", s.neginf), ("zero", self.zeros)):
            if count:
                parts.append(f"{label}={count}")
        if s.dtype_max_fraction is not None and s.numel:
            parts.append(f"range={s.dtype_max_fraction:.2g}")
        return " ".join(parts)


def _g(value: float | None) -> str:
    return "None" if value is None else f"{value:.4g}"


def analyze_tensor(t: torch.Tensor, name: str | None = None) -> TensorAnalysis:
    """Shape, dtype, device, NaN / Inf / zero counts, finite min / max / mean / std and the share of
    the dtype's range used, for ``t`` (one pass on its device, one transfer)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"analyze_tensor takes a torch.Tensor, not {type(t).__name__}.")
    return TensorAnalysis(name, tensor_stats(t))
