"""A tensor's fingerprint (a few float64 reductions and a strided sample) and the relative error
between two fingerprints: what a comparison keeps of each output instead of the tensor.

>>> import torch
>>> a = fingerprint(torch.ones(4, 4))
>>> a.total, a.l2, a.abs_max
(16.0, 4.0, 1.0)
>>> relative_error(a, fingerprint(torch.ones(4, 4) * 1.01)) > 0.009
True
>>> relative_error(a, a)
0.0

Limits: two tensors with the same reductions and the same sampled elements read as equal (a
change confined to unsampled elements shows only through the sums and the norm).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

SAMPLES = 16
"""Elements kept per tensor, evenly spaced over its flattened storage."""

TOLERANCES = {"float32": 1e-5, "float64": 1e-9, "float16": 1e-2, "bfloat16": 8e-2}
"""Relative error allowed per dtype: about ten units of the dtype's rounding (fp16's eps is 9.8e-4,
bf16's 7.8e-3), what a component call of tens of layers accumulates; fp32 allows for reordered
sums (a compiled graph, another kernel). A comparison of two dtypes uses the looser of the two."""
FP8_TOLERANCE = 1e-1
"""fp8 (float8_e4m3fn, float8_e5m2) and any other dtype narrower than 16 bits."""


class Fingerprint(NamedTuple):
    """A few float64 reductions of one tensor."""

    shape: tuple[int, ...]
    total: float
    l1: float
    l2: float
    abs_max: float
    sample: tuple[float, ...]


def fingerprint(tensor: torch.Tensor) -> Fingerprint:
    """The fingerprint of ``tensor`` (one transfer to the host)."""
    t = tensor.detach().reshape(-1).to(torch.float64)
    n = t.numel()
    if n == 0:
        return Fingerprint(tuple(tensor.shape), 0.0, 0.0, 0.0, 0.0, ())
    index = torch.linspace(0, n - 1, min(SAMPLES, n), device=t.device).round().long()
    absolute = t.abs()
    values = torch.cat([torch.stack([t.sum(), absolute.sum(), t.norm(), absolute.max()]), t[index]]).tolist()
    return Fingerprint(tuple(tensor.shape), *values[:4], tuple(values[4:]))


def _scale(*values: float) -> float:
    finite = [abs(v) for v in values if math.isfinite(v)]
    return max([*finite, 1e-30])


def _gap(a: float, b: float, scale: float) -> float:
    if a == b or (math.isnan(a) and math.isnan(b)):
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / scale


def relative_error(a: Fingerprint, b: Fingerprint) -> float:
    """The largest relative gap between two fingerprints' reductions and samples (inf when their
    shapes differ, or one is finite where the other is not; 0.0 when equal)."""
    if a.shape != b.shape or len(a.sample) != len(b.sample):
        return math.inf
    gaps = [
        _gap(a.total, b.total, _scale(a.l1, b.l1)),
        _gap(a.l2, b.l2, _scale(a.l2, b.l2)),
        _gap(a.abs_max, b.abs_max, _scale(a.abs_max, b.abs_max)),
    ]
    if any(x != y for x, y in zip(a.sample, b.sample)):
        if not all(math.isfinite(v) for v in (*a.sample, *b.sample)):
            gaps.append(max(_gap(x, y, 1.0) for x, y in zip(a.sample, b.sample)))
        else:
            diff = math.sqrt(sum((x - y) ** 2 for x, y in zip(a.sample, b.sample)))
            norm = _scale(math.sqrt(sum(x * x for x in a.sample)), math.sqrt(sum(y * y for y in b.sample)))
            gaps.append(diff / norm)
    return max(gaps)


def errors_of(a: tuple[Fingerprint, ...], b: tuple[Fingerprint, ...]) -> float:
    """The largest :func:`relative_error` over two lists of fingerprints (inf when their lengths differ)."""
    if len(a) != len(b):
        return math.inf
    return max((relative_error(x, y) for x, y in zip(a, b)), default=0.0)


def tolerance_for(*dtypes: torch.dtype | None) -> float:
    """The relative error allowed when comparing outputs computed in ``dtypes`` (the loosest).

    >>> tolerance_for(torch.float32, torch.float16)
    0.01
    """
    found = []
    for dtype in dtypes:
        if dtype is None:
            continue
        name = str(dtype).removeprefix("torch.")
        if name in TOLERANCES:
            found.append(TOLERANCES[name])
        elif dtype.is_floating_point and torch.finfo(dtype).bits < 16:
            found.append(FP8_TOLERANCE)
    return max(found, default=TOLERANCES["float32"])
