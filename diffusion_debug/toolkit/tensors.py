"""``analyze_tensor``: one tensor at a glance, in the spirit of lovely-tensors.

>>> import torch
>>> a = analyze_tensor(torch.tensor([1.0, -3.0, float("inf"), 0.0]), "x")
>>> a
x: tensor[4] float32 cpu min=-3 max=1 mean=-0.6667 std=1.7 +Inf=1 zero=1 range=8.8e-39
>>> a.inf, a.zeros, a.has_nan, a.range_fraction == 3.0 / torch.finfo(torch.float32).max
(1, 1, False, True)

The statistics are :func:`~diffusion_debug.stats.tensor_stats`: one pass of fused reductions on
the tensor's own device and ONE transfer to the host, whatever the tensor's size.

A view that repeats its values (``expand``, a stride of 0) is measured on the values it holds,
without the copy a reduction over it would make, and a nested tensor over all its components:

>>> analyze_tensor(torch.zeros(1).expand(10**6, 10**6))
tensor[1000000, 1000000] float32 cpu min=0 max=0 mean=0 std=0 zero=1000000000000 range=0
>>> parts = [torch.ones(2), torch.tensor([float("nan"), 3.0, 0.0])]
>>> analyze_tensor(torch.nested.nested_tensor(parts, layout=torch.jagged))
nested tensor of 2: [2], [3] float32 cpu min=0 max=3 mean=1.25 std=1.09 NaN=1 zero=1 range=8.8e-39

Limits: min / max / mean / std are over the finite elements (std with ``correction=0``); the NaN
and Inf counts say how many were left out. ``range`` is the largest |value| as a share of the
dtype's largest finite value (near 1: the next op may overflow). A quantized weight (torchao,
GGUF, bitsandbytes, quanto) is measured in the values its layer computes with, dequantized, and
the repr names its class (an 8-bit bitsandbytes weight whose scales its layer holds, after its
first forward, is measured as stored). Meta, complex, sparse and torch's own quantized tensors
are not measured (the repr says why). A nested tensor's ``shape`` is its
number of values (its components' shapes are ``nested_shapes``); measuring one copies its
values once unless it is jagged and whole (its values are then one buffer, read in place).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from ..stats import TensorStats, tensor_stats
from ..stats.quantized import dequantized, is_quantized


@dataclass(frozen=True)
class TensorAnalysis:
    """What :func:`analyze_tensor` found; ``repr`` is one line, ``to_dict()`` plain values."""

    name: str | None
    stats: TensorStats
    nested_shapes: tuple[tuple[int, ...], ...] | None = None
    """The shape of each component of a nested tensor (None for any other tensor)."""
    quantized: str | None = None
    """A quantized weight's class (torchao, GGUF, bitsandbytes, quanto) and how it was read:
    ``"Int8Tensor, dequantized"``, or ``"Int8Params, as stored"`` (its scales not at hand)."""

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
        if self.nested_shapes is not None:
            shown = ", ".join(f"[{', '.join(map(str, part))}]" for part in self.nested_shapes[:4])
            more = f", ... ({len(self.nested_shapes) - 4} more)" if len(self.nested_shapes) > 4 else ""
            parts = [f"{head}nested tensor of {len(self.nested_shapes)}: {shown}{more} {s.dtype} {s.device}"]
        else:
            parts = [f"{head}tensor[{shape}] {s.dtype} {s.device}"]
        if self.quantized is not None:
            parts.append(f"({self.quantized})")
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
    if t.is_nested:
        return _analyze_nested(t, name)
    if is_quantized(t):
        values = dequantized(t)
        read = "dequantized" if values is not t else "as stored"
        return TensorAnalysis(name, tensor_stats(values), quantized=f"{type(t).__name__}, {read}")
    return TensorAnalysis(name, _repeated_stats(t))


def _repeated_stats(t: torch.Tensor) -> TensorStats:
    """:func:`tensor_stats` of ``t``, measured on one slice of each dimension of stride 0: such a
    dimension repeats every value the same number of times, so min, max, mean, std, |max| and the
    zero share are the slice's, and the counts and the L2 norm scale by the repeat."""
    held = t
    if t.layout is torch.strided and t.numel():
        for dim, (size, stride) in enumerate(zip(t.shape, t.stride())):
            if stride == 0 and size > 1:
                held = held.narrow(dim, 0, 1)
    if held is t:
        return tensor_stats(t)
    stats = tensor_stats(held)
    repeat = t.numel() // held.numel()
    return dataclasses.replace(
        stats,
        shape=tuple(t.shape),
        numel=t.numel(),
        nan=stats.nan * repeat,
        posinf=stats.posinf * repeat,
        neginf=stats.neginf * repeat,
        l2=None if stats.l2 is None else stats.l2 * math.sqrt(repeat),
    )


def _analyze_nested(t: torch.Tensor, name: str | None) -> TensorAnalysis:
    """A nested tensor: its components' values measured as one flat tensor (torch's reductions
    refuse nested tensors)."""
    components = t.unbind()
    shapes = tuple(tuple(c.shape) for c in components)
    if t.layout is torch.jagged and getattr(t, "_lengths", None) is None:
        values = t.values().reshape(-1)  # the one buffer the components are, end to end
    elif components:
        values = torch.cat([c.reshape(-1) for c in components])
    else:
        values = torch.empty(0, dtype=t.dtype, device=t.device)
    return TensorAnalysis(name, tensor_stats(values), shapes)
