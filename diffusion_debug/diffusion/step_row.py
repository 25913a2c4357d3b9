"""One device-to-host transfer per step: tensor stats, probe readings and loose scalars together.

:func:`stats.collect` and :meth:`Probe.collect` each fetch on their own; a denoising step has
both (latent / output stats and the sentinel readings), so :func:`fetch_step` hands everything
queued to :func:`stats.to_host`, which copies each device's values at once.

:func:`merge_stats` gives the statistics of a concatenation from those of its parts (the whole
denoiser output from its classifier-free-guidance halves) without a second pass on the device.
"""

from __future__ import annotations

import math

import torch

from ..stats import PendingStats, TensorStats, dtype_max, finish, to_host


def fetch_step(pending: list[PendingStats], scalars: list[torch.Tensor]) -> tuple[list[TensorStats], list[float]]:
    """Fetch queued stats and device scalars: one transfer per device involved.  A scalar
    with no element reads as NaN."""
    vectors = [p.vector for p in pending if p.vector is not None]
    rows = to_host(vectors + list(scalars))
    measured = iter(rows[: len(vectors)])
    stats = [finish(p, next(measured) if p.vector is not None else None) for p in pending]
    values = [row[0] if row else float("nan") for row in rows[len(vectors) :]]
    return stats, values


def merge_stats(parts: list[TensorStats], shape: tuple[int, ...]) -> TensorStats:
    """The statistics of the concatenation (along dim 0, of shape ``shape``) of tensors whose
    statistics are ``parts``: counts add up, min / max / abs-max combine, the mean is the
    finite-count weighted mean, the (population) std comes from the parts' means and variances,
    the L2 norm is the root of the summed squares.  Exact up to float rounding."""
    first = parts[0]
    numel = sum(p.numel for p in parts)
    if any(p.note is not None for p in parts):
        return TensorStats(shape=tuple(shape), dtype=first.dtype, device=first.device, numel=numel, note=first.note)
    nan = sum(p.nan for p in parts)
    posinf = sum(p.posinf for p in parts)
    neginf = sum(p.neginf for p in parts)
    finite = [(p.numel - p.nonfinite, p) for p in parts if p.numel - p.nonfinite > 0 and p.mean is not None]
    zeros = sum((p.zero_fraction or 0.0) * p.numel for p in parts)
    base = dict(
        shape=tuple(shape),
        dtype=first.dtype,
        device=first.device,
        numel=numel,
        nan=nan,
        posinf=posinf,
        neginf=neginf,
        zero_fraction=(zeros / numel) if numel else 0.0,
    )
    if not finite:
        return TensorStats(**base, dtype_max_fraction=0.0 if numel == 0 else None)
    n = sum(k for k, _ in finite)
    mean = sum(k * p.mean for k, p in finite) / n
    var = sum(k * ((p.std or 0.0) ** 2 + (p.mean - mean) ** 2) for k, p in finite) / n
    absmax = max(p.absmax for _, p in finite)
    dtype = getattr(torch, first.dtype, None)
    limit = dtype_max(dtype) if isinstance(dtype, torch.dtype) else None
    return TensorStats(
        **base,
        min=min(p.min for _, p in finite),
        max=max(p.max for _, p in finite),
        mean=mean,
        std=math.sqrt(max(var, 0.0)),
        absmax=absmax,
        l2=math.sqrt(sum(p.l2**2 for _, p in finite)),
        dtype_max_fraction=(absmax / limit) if limit else None,
    )
