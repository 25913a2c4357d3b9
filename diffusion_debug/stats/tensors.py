"""Tensor statistics, measured on the tensor's own device and brought to the host in one transfer.

``measure(t)`` queues a handful of fused reductions on ``t``'s device and returns a
:class:`PendingStats`; nothing reaches the host until :func:`collect` stacks every pending
vector of a device and copies it in ONE transfer.  :func:`tensor_stats` does both for a
single tensor.

>>> import torch
>>> s = tensor_stats(torch.tensor([1.0, -3.0, float("inf"), 0.0]))
>>> (s.numel, s.nan, s.posinf, s.min, s.max, s.absmax, s.zero_fraction)
(4, 0, 1, -3.0, 1.0, 3.0, 0.25)

Limits: min / max / mean / std / abs-max / L2 norm are over the *finite* elements only (the
non-finite ones are counted instead); std is the population std (``correction=0``).  Meta
tensors have no data; complex, sparse and quantized tensors are not measured: their
:class:`TensorStats` has ``note`` saying so and ``None`` for the values.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .host import ANY_AUTOCAST, HostCopy, autocast_off, detached, read_now

# Order of the values in a device vector (see _device_vector).
_FIELDS = ("finite", "nan", "posinf", "neginf", "zeros", "min", "max", "mean", "std", "absmax", "l2")
_NAN = float("nan")


@dataclass(frozen=True)
class TensorStats:
    """Statistics of one tensor. Values over finite elements; ``None`` where undefined."""

    shape: tuple[int, ...]
    dtype: str
    device: str
    numel: int
    nan: int = 0
    posinf: int = 0
    neginf: int = 0
    min: float | None = None
    max: float | None = None
    mean: float | None = None
    std: float | None = None
    absmax: float | None = None
    l2: float | None = None
    zero_fraction: float | None = None
    dtype_max_fraction: float | None = None
    """abs-max / the dtype's largest finite value: near 1.0 the next op may overflow."""
    note: str | None = None
    """Set when the tensor could not be measured (meta, complex, sparse, quantized)."""

    @property
    def nonfinite(self) -> int:
        return self.nan + self.posinf + self.neginf

    @property
    def is_finite(self) -> bool:
        # the counts compared here, not through ``nonfinite``: asked of every tensor of every step
        return self.nan == 0 and self.posinf == 0 and self.neginf == 0

    def to_dict(self) -> dict[str, Any]:
        # what dataclasses.asdict gives (every other field is a number, text or None), without its
        # deep copy of each value: a step row converts several of these
        d = {name: getattr(self, name) for name in _STATS_FIELDS}
        d["shape"] = list(self.shape)
        return d


_STATS_FIELDS = tuple(f.name for f in dataclasses.fields(TensorStats))


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def dtype_name(dtype: torch.dtype) -> str:
    """``"float16"`` for ``torch.float16`` (cached: probes call it per module call)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


_DTYPE_MAX: dict[torch.dtype, float | None] = {}


def dtype_max(dtype: torch.dtype) -> float | None:
    """Largest finite value of ``dtype`` (``None`` for bool and complex; cached: every step's
    statistics ask for it)."""
    if dtype in _DTYPE_MAX:
        return _DTYPE_MAX[dtype]
    if dtype is torch.bool or dtype.is_complex:
        limit = None
    elif dtype.is_floating_point:
        limit = float(torch.finfo(dtype).max)
    else:
        limit = float(torch.iinfo(dtype).max)
    _DTYPE_MAX[dtype] = limit
    return limit


def plain_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` seen as a ``torch.Tensor`` (no copy) where it is a subclass with a ``__torch_function__`` of
    its own (diffusers' ``GGUFParameter``, which a compiled GGUF transformer returns as its output, and
    whose every op then raises, ``KeyError: None``): a measurement of its values is no op of that
    subclass, so it adds no error of ours to the one the user's code meets. Any other tensor (a
    parameter, a wrapper subclass such as ``DTensor``) as it is; so is a subclass with a
    ``__torch_dispatch__`` of its own (a jagged nested tensor, torchao's, ``MaskedTensor``): its data is
    not its storage (its ``alias`` raised, or made one of its own kind). Called where a type is not
    ``torch.Tensor`` (checked inline: no Python call for a plain tensor)."""
    kind = type(t)
    own = getattr(kind, "__torch_function__", None)
    if getattr(own, "__func__", own) in _PLAIN_TORCH_FUNCTIONS or kind.__torch_dispatch__ is not _PLAIN_DISPATCH:
        return t
    with torch._C.DisableTorchFunctionSubclass():
        return t.as_subclass(torch.Tensor)


_PLAIN_TORCH_FUNCTIONS = (
    torch.Tensor.__torch_function__.__func__,
    torch._C._disabled_torch_function_impl,
)
_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__


def _unmeasurable(t: torch.Tensor) -> str | None:
    if t.is_meta:
        return "meta tensor: no data to measure"
    if t.is_complex():
        return "complex tensor: not measured"
    if t.layout is not torch.strided:
        return f"{t.layout} tensor: not measured"
    if t.is_quantized:
        return "quantized tensor: not measured"
    return None


def _device_vector(t: torch.Tensor) -> torch.Tensor:
    """All of _FIELDS for a non-empty strided real tensor, as one float64 vector on its device
    (float32 on MPS)."""
    # Everything accumulates in float64: integers (and bool) are exact there, sums of fp16 / bf16 /
    # fp8 in their own dtype would lose precision, and the squares of float32 or bf16 values above
    # ~1.8e19 overflow float32 (std and L2 of a finite near-overflow tensor would read inf).
    x = t.detach().to(wide_float(t.device))
    finite = torch.isfinite(x)
    n_finite = finite.sum()
    xf = torch.where(finite, x, 0.0)
    mean = xf.sum() / n_finite.clamp(min=1)
    centred = torch.where(finite, x - mean, 0.0)
    var = (centred * centred).sum() / n_finite.clamp(min=1)
    values = torch.stack(
        [
            n_finite.to(x.dtype),
            torch.isnan(x).sum().to(x.dtype),
            (x == math.inf).sum().to(x.dtype),
            (x == -math.inf).sum().to(x.dtype),
            (x == 0).sum().to(x.dtype),
            torch.where(finite, x, math.inf).amin(),
            torch.where(finite, x, -math.inf).amax(),
            mean,
            var.sqrt(),
            absmax(xf),
            torch.linalg.vector_norm(xf),
        ]
    )
    return values


@dataclass
class PendingStats:
    """Stats queued on a device, not yet on the host: pass to :func:`collect`."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    numel: int
    vector: torch.Tensor | None  # None when empty or not measurable
    note: str | None = None


def measure(t: torch.Tensor) -> PendingStats:
    """Queue the statistics of ``t`` on its device; no host synchronisation."""
    shape = tuple(t.shape)
    note = _unmeasurable(t)
    numel = t.numel()
    if note is not None or numel == 0:
        return PendingStats(shape, t.dtype, t.device, numel, None, note)
    with torch.no_grad():
        return PendingStats(shape, t.dtype, t.device, numel, _device_vector(t))


def to_host(tensors: Sequence[torch.Tensor]) -> list[list[float]]:
    """Host copies of device tensors, each flattened to a list of floats, in ONE transfer per
    device, read now (:class:`~diffusion_debug.stats.host.HostCopy` for one read later)."""
    return HostCopy(tensors, deferred=False).wait()


def scalars_to_host(scalars: Sequence[torch.Tensor]) -> list[float]:
    """The first value of each of ``scalars`` (NaN for an empty one), read now: :func:`to_host`'s,
    in fewer ops where they allow it (a component call's abs-max, or a decoded image's extremes,
    at every call). 0-d floating tensors of one dtype and device that autograd does not track are
    read as they are (one alone) or stacked (one op; :func:`to_host` joins a float64 buffer to
    the stack): the same values, in one transfer either way."""
    if not scalars:
        return []
    first = scalars[0]
    dtype, device = first.dtype, first.device
    alike = dtype.is_floating_point
    for t in scalars:  # a loop, not all() over a generator: no frame a value (hundreds a probed call)
        if t.ndim or t.dtype is not dtype or t.requires_grad or t.device != device:
            alike = False
            break
    if alike:
        if len(scalars) == 1:
            return [read_now(first)]
        try:
            stacked = torch.stack(scalars)
        except RuntimeError:  # autocast's stack takes float32 and its own dtype only: the other half dtype raised
            if not ANY_AUTOCAST():  # (asked only then: no call at every read where no autocast is on)
                raise
            with autocast_off(device.type):
                stacked = torch.stack(scalars)
        return read_now(stacked)
    values = []
    for row in to_host(scalars):
        values.append(row[0] if row else math.nan)
    return values


def collect(pending: list[PendingStats]) -> list[TensorStats]:
    """Fetch every pending vector to the host: one transfer per device involved."""
    measured = [p for p in pending if p.vector is not None]
    rows = iter(to_host([p.vector for p in measured]))
    return [finish(p, next(rows) if p.vector is not None else None) for p in pending]


def finish(p: PendingStats, row: list[float] | None) -> TensorStats:
    """The :class:`TensorStats` for a pending measurement, given its values on the host (``row``:
    the host copy of ``p.vector``, or ``None`` when it had none)."""
    base = dict(shape=p.shape, dtype=dtype_name(p.dtype), device=str(p.device), numel=p.numel)
    if row is None:
        if p.note is None:  # empty tensor: counts are all zero, values undefined
            return TensorStats(**base, zero_fraction=0.0, dtype_max_fraction=0.0)
        return TensorStats(**base, note=p.note)
    v = dict(zip(_FIELDS, row))
    finite = int(v["finite"])
    has = finite > 0
    limit = dtype_max(p.dtype)
    absmax = v["absmax"] if has else None
    return TensorStats(
        **base,
        nan=int(v["nan"]),
        posinf=int(v["posinf"]),
        neginf=int(v["neginf"]),
        min=v["min"] if has else None,
        max=v["max"] if has else None,
        mean=v["mean"] if has else None,
        std=v["std"] if has else None,
        absmax=absmax,
        l2=v["l2"] if has else None,
        zero_fraction=v["zeros"] / p.numel,
        dtype_max_fraction=(absmax / limit) if (absmax is not None and limit) else None,
    )


def is_low_precision(dtype: torch.dtype) -> bool:
    """fp16, bf16 and fp8: the dtypes whose largest value an activation can reach."""
    return dtype.is_floating_point and dtype.itemsize <= 2


def measurable(t: torch.Tensor) -> bool:
    """Floating, non-empty, strided and holding data: a tensor that :func:`absmax` and
    :func:`finite_signal` can reduce."""
    return t.is_floating_point() and bool(t.numel()) and not t.is_meta and t.layout is torch.strided


def absmax(t: torch.Tensor) -> torch.Tensor:
    """The largest |value| of a :func:`measurable` ``t``, as a 0-d tensor in its dtype (float32
    for fp8) on its device, with no host synchronisation; NaN if any element is NaN, inf if any is
    infinite (and none is NaN).

    >>> absmax(torch.tensor([1.0, -3.0])).item(), absmax(torch.tensor([float("inf"), float("nan")])).item()
    (3.0, nan)
    """
    x = detached(t)
    if x.dtype.itemsize == 1:  # fp8 has no reduction kernels
        x = x.float()
    # One aten op (count_aten_ops), no temporary, NaN-propagating: abs().amax() is two ops and a
    # full-size copy, aminmax with its neg/maximum three to five, and a GPU step pays per launch.
    return torch.linalg.vector_norm(x, math.inf)


def finite_signal(t: torch.Tensor) -> torch.Tensor | None:
    """One cheap reduction of ``t`` that is non-finite exactly when ``t`` has a NaN or Inf, as
    a 0-d tensor on ``t``'s device (no host synchronisation).

    For fp16, bf16 and fp8 it is the :func:`absmax` (the overflow signal), in the tensor's dtype:
    an Inf there means the tensor overflowed.  For wider dtypes it is the float32 sum: only its
    finiteness means anything, and on CPU it costs a fifth of a min/max pass.  One op either way.
    Limit: a float32/float64 tensor whose finite sum exceeds float32's range (about 3e38) reads
    as non-finite, so a finite float32 activation near its dtype's maximum is named as a NaN/Inf's
    producer (it is the module that drove the values there). A float64 sum would tell them apart,
    but costs 2 to 8 times a float32 sum on a CPU (the full-probe overhead went from 1.13x to
    1.19x, over its budget). ``None`` for tensors that are not :func:`measurable`.
    """
    if not measurable(t):
        return None
    if is_low_precision(t.dtype):
        return absmax(t)
    return detached(t).sum(dtype=torch.float32)


def wide_float(device: torch.device) -> torch.dtype:
    """The dtype sums accumulate in: float64, but float32 on MPS (which has no float64)."""
    return torch.float32 if device.type == "mps" else torch.float64


def tensor_stats(t: torch.Tensor) -> TensorStats:
    """Measure one tensor and bring its stats to the host."""
    return collect([measure(t)])[0]
