"""Many tensors' statistics measured together: a few ops on the device whatever their number, and
one transfer to the host for all of them (with any other device values that ride along).

:func:`summarize` queues the sum, L2 norm and abs-max of tensors of one shape, dtype and device in
four ops (five on a CPU); :func:`queue_tensors` groups named tensors into as few such calls as their shapes
allow and starts their copy to the host (:class:`~diffusion_debug.stats.host.HostCopy`),
and :meth:`QueuedTensors.wait` turns the copy into :class:`TensorStats`. The per-step statistics
of a denoising step (latents, the two guidance halves of the model output, the predicted x0) are
measured this way: at real size on a GPU every op is a kernel launch, and a step has room for
few of them. :func:`merge_stats` gives the statistics of a concatenation from those of its parts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from .host import ANY_AUTOCAST, HostCopy, autocast_off, detached
from .tensors import PendingStats, TensorStats, dtype_max, dtype_name, finish, measure, tensor_stats

_INF = math.inf


@dataclass
class PendingSummaries:
    """The sums, L2 norms and abs-maxes of several tensors, queued on their device as three
    vectors (to the host with the step's other values; see :func:`summarize`)."""

    tensors: list[torch.Tensor]
    vectors: list[torch.Tensor]

    def finish(self, host: Sequence[Sequence[float]]) -> list[TensorStats | None]:
        """The stats of each tensor from the host copies of :attr:`vectors` (``None`` for a tensor
        with a NaN/Inf: see :func:`finish_summary`)."""
        sums, l2, absmax = host
        first = self.tensors[0]  # the tensors share their shape, dtype and device: each read once
        kind = (tuple(first.shape), first.numel(), dtype_name(first.dtype), dtype_max(first.dtype), str(first.device))
        out = []
        for i in range(len(self.tensors)):  # a loop, not a comprehension: no frame of its own (every step)
            out.append(_summary((sums[i], l2[i], absmax[i]), *kind))
        return out


def summarize(tensors: Sequence[torch.Tensor]) -> PendingSummaries:
    """Queue the sum, L2 norm and abs-max of ``tensors`` (non-empty, floating, strided, all of
    one shape, dtype and device: :func:`can_summarize`) in four ops whatever their number: one
    stack, three reductions along it (on a CPU five: the abs-max is ``abs`` then ``amax``, NaN
    first as the norm gives it, since the CPU's inf-norm along dims loops per element). The
    per-step statistics of a denoising step (latents, the two guidance halves of the model
    output, the predicted x0) are measured this way: at real size on a GPU every op is a kernel
    launch, and a step has room for few of them.

    Limits: mean and std come from the sum and the L2 norm (``std**2 = l2**2 / n - mean**2``),
    which loses precision when |mean| is much larger than std; min and max are not measured; a
    non-finite element makes the values non-finite, and :func:`finish_summary` then says the
    tensor needs a full :func:`measure` (its NaN/Inf counts are not known from these)."""
    # the parts detached where autograd tracks them: no graph is recorded (and no no_grad context is
    # entered at every step); a step's tensors under inference need no detach, an op each
    if len(tensors) > 1:
        parts = [t.detach() if t.requires_grad else t for t in tensors]
        try:
            x = torch.stack(parts)
        except RuntimeError:  # autocast's stack raised for the half dtype not its own (asked only then: no call
            if not ANY_AUTOCAST():  # at every step where no autocast is on)
                raise
            with autocast_off(tensors[0].device.type):
                x = torch.stack(parts)
    else:
        x = detached(tensors[0]).unsqueeze(0)
    dims = tuple(range(1, x.dim()))
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32  # a norm may not narrow float64
    sums = x.sum(dim=dims, dtype=acc)
    l2 = torch.linalg.vector_norm(x, 2, dim=dims, dtype=acc)
    if x.device.type == "cpu":  # the CPU's inf-norm along dims takes up to 15 times abs then amax
        absmax = x.abs().amax(dim=dims)  # (0.28 against 0.03 ms for a 4-tensor SD1.5 step in fp16)
    else:
        absmax = torch.linalg.vector_norm(x, math.inf, dim=dims)
    return PendingSummaries(list(tensors), [sums, l2, absmax])


def can_summarize(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether :func:`summarize` can take ``tensors`` together (floating, non-empty, one shape,
    dtype and device)."""
    if not tensors:
        return False
    first = tensors[0]
    for t in tensors:  # a loop, not a generator: asked for every measured call (a frame a tensor)
        if not (t.is_floating_point() and t.layout is torch.strided and not t.is_meta and t.numel() > 0):
            return False
    for t in tensors:
        if not (t.shape == first.shape and t.dtype == first.dtype and t.device == first.device):
            return False
    return True


def finish_summary(t: torch.Tensor, values: Sequence[float]) -> TensorStats | None:
    """The :class:`TensorStats` of ``t`` from its host copy of sum, L2 norm and abs-max; ``None`` when
    a value is non-finite (the tensor holds a NaN/Inf: measure it fully to count them)."""
    return _summary(values, tuple(t.shape), t.numel(), dtype_name(t.dtype), dtype_max(t.dtype), str(t.device))


def _summary(
    values: Sequence[float], shape: tuple[int, ...], n: int, dtype: str, limit: float | None, device: str
) -> TensorStats | None:
    """:func:`finish_summary` from what it reads of the tensor (a group's tensors share it)."""
    total, l2, absmax = values
    if not (-_INF < total < _INF and -_INF < l2 < _INF and -_INF < absmax < _INF):  # NaN compares False
        return None
    mean = total / n
    return TensorStats(
        shape=shape,
        dtype=dtype,
        device=device,
        numel=n,
        mean=mean,
        std=math.sqrt(max(l2 * l2 / n - mean * mean, 0.0)),
        absmax=absmax,
        l2=l2,
        dtype_max_fraction=(absmax / limit) if limit else None,
    )


def merge_stats(parts: list[TensorStats], shape: tuple[int, ...]) -> TensorStats:
    """The statistics of the concatenation (along dim 0, of shape ``shape``) of tensors whose
    statistics are ``parts``: counts add up, min / max / abs-max combine (min / max only where
    every part has them: :func:`stats.summarize` does not measure them), the mean is the
    finite-count weighted mean, the (population) std comes from the parts' means and variances,
    the L2 norm is the root of the summed squares.  Exact up to float rounding."""
    first = parts[0]
    if len(parts) == 2 and _summarized(first) and _summarized(parts[1]):
        return _merge_two(first, parts[1], shape)
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
    limit = _limit_of(first.dtype)
    return TensorStats(
        **base,
        min=None if any(p.min is None for _, p in finite) else min(p.min for _, p in finite),
        max=None if any(p.max is None for _, p in finite) else max(p.max for _, p in finite),
        mean=mean,
        std=math.sqrt(max(var, 0.0)),
        absmax=absmax,
        l2=math.sqrt(sum(p.l2**2 for _, p in finite)),
        dtype_max_fraction=(absmax / limit) if limit else None,
    )


def _summarized(p: TensorStats) -> bool:
    """Finite, measured, non-empty, without min/max or zero counts: :func:`finish_summary`'s stats
    (a step's two guidance halves, nearly always)."""
    return (
        p.note is None
        and p.nan == 0
        and p.posinf == 0
        and p.neginf == 0
        and p.numel > 0
        and p.mean is not None
        and p.min is None
        and p.zero_fraction is None
    )


def _merge_two(a: TensorStats, b: TensorStats, shape: tuple[int, ...]) -> TensorStats:
    """:func:`merge_stats` of two :func:`_summarized` parts (a step's guidance halves), without
    the general case's generators: the same values, bit for bit."""
    na, nb = a.numel, b.numel
    n = na + nb
    mean = (na * a.mean + nb * b.mean) / n
    da, db, sa, sb = a.mean - mean, b.mean - mean, a.std or 0.0, b.std or 0.0
    var = (na * (sa**2 + da**2) + nb * (sb**2 + db**2)) / n
    absmax = a.absmax if a.absmax >= b.absmax else b.absmax
    limit = _limit_of(a.dtype)
    return TensorStats(
        shape=tuple(shape),
        dtype=a.dtype,
        device=a.device,
        numel=n,
        zero_fraction=0.0,
        mean=mean,
        std=math.sqrt(max(var, 0.0)),
        absmax=absmax,
        l2=math.sqrt(a.l2**2 + b.l2**2),
        dtype_max_fraction=(absmax / limit) if limit else None,
    )


def _limit_of(name: str) -> float | None:
    """The largest value of the dtype named ``name`` (:func:`dtype_max`, which keeps it), None
    for a name that is no dtype."""
    dtype = getattr(torch, name, None)
    return dtype_max(dtype) if isinstance(dtype, torch.dtype) else None


# -- named tensors, queued together and brought to the host in one copy -------------------------------------


@dataclass
class QueuedTensors:
    """Named tensors' statistics queued on their devices and on their way to the host, with other
    device values riding along in the same copy (see :func:`queue_tensors`)."""

    tensors: dict[str, torch.Tensor]
    groups: list[tuple[list[str], PendingSummaries]]
    singles: list[tuple[str, PendingStats]]
    merged: dict[str, tuple[tuple[str, ...], tuple[int, ...]]]
    copy: HostCopy

    def wait(self) -> tuple[dict[str, TensorStats], list[list[float]]]:
        """The statistics by name (a tensor holding a NaN/Inf is measured again, fully, for its
        counts; a merged name from its parts) and the host values of the ``extra`` tensors."""
        rows = self.copy.wait()
        at = 0
        by_name: dict[str, TensorStats] = {}
        for names, pending in self.groups:  # slices and loops, not comprehensions: this runs every step
            size = len(pending.vectors)
            for name, stats in zip(names, pending.finish(rows[at : at + size])):
                by_name[name] = stats if stats is not None else tensor_stats(self.tensors[name])
            at += size
        for name, pending in self.singles:
            if pending.vector is not None:
                by_name[name] = finish(pending, rows[at])
                at += 1
            else:
                by_name[name] = finish(pending, None)
        for name, (parts, shape) in self.merged.items():
            by_name[name] = merge_stats(list(map(by_name.__getitem__, parts)), shape)
        return by_name, rows[at:]


def queue_tensors(
    tensors: dict[str, torch.Tensor],
    extra: Sequence[torch.Tensor] = (),
    *,
    merged: dict[str, tuple[tuple[str, ...], tuple[int, ...]]] | None = None,
    deferred: bool = False,
) -> QueuedTensors:
    """Queue the statistics of ``tensors`` in as few :func:`summarize` calls as their shapes,
    dtypes and devices allow (one, for the usual step) and start their copy to the host together
    with ``extra`` (any device values: one transfer per device for all of them). A tensor that
    cannot be summarised (empty, meta, not floating point) is queued on its own with
    :func:`measure`, which says what it is. ``merged``: names whose statistics are merged from
    their parts' (:func:`merge_stats`), with the whole's shape. ``deferred``: see
    :class:`~diffusion_debug.stats.host.HostCopy`."""
    by_kind: dict[tuple, list[str]] = {}
    singles = []
    for name, t in tensors.items():  # can_summarize([t]), inline: asked for every tensor of every step
        if t.is_floating_point() and t.layout is torch.strided and not t.is_meta and t.numel() > 0:
            by_kind.setdefault((t.shape, t.dtype, t.device), []).append(name)
        else:
            singles.append((name, measure(t)))
    groups, vectors = [], []
    for names in by_kind.values():  # loops, not comprehensions: no frame each, at every step
        pending = summarize(list(map(tensors.__getitem__, names)))
        groups.append((names, pending))
        vectors += pending.vectors
    for _, single in singles:
        if single.vector is not None:
            vectors.append(single.vector)
    copy = HostCopy(vectors + list(extra), deferred=deferred)
    return QueuedTensors(tensors, groups, singles, dict(merged or {}), copy)
