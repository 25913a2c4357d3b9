"""Device-to-host reads: :class:`HostCopy`, how a step's values leave the device (deferred, or
read now), :func:`read_now`, the call that turns a tensor's values into Python values (every
``tolist`` of the package; a ``float()``/``bool()`` of one scalar is read where it is used), and
:class:`count_host_transfers`, how the budget of reads is checked.

>>> import torch
>>> with count_host_transfers() as reads:
...     _ = torch.ones(3).sum().item()
>>> reads.count, reads.calls
(1, ['item'])

Counts the tensor methods that bring values to the host (``item``, ``tolist``, ``cpu``,
``numpy``, ``__float__``, ``__int__``, ``__bool__``, and ``to``/``copy_`` towards the CPU from
another device) through a ``TorchFunctionMode``, so it works on CPU too, where no real copy
happens.  On CPU, ``cpu()`` and ``to("cpu")`` of a CPU tensor are not counted.  A read of a
:class:`HostCopy`'s host buffer is counted apart (``deferred``), not as ``blocking``: on a GPU
that buffer was filled by a non-blocking copy long before.  Limits: reads made by C++ code that
never passes through Python (none in this package) are not seen.

>>> copy = HostCopy([torch.tensor([1.0, 2.0]), torch.tensor(3)])
>>> with count_host_transfers() as reads:
...     copy.wait()
[[1.0, 2.0], [3.0]]
>>> reads.blocking, reads.deferred
([], ['tolist'])
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_READS = {"item", "tolist", "numpy", "__float__", "__int__", "__bool__", "__index__"}
_HOST_BUFFERS: dict[int, weakref.ref] = {}  # id -> the host buffer a HostCopy filled
_EMPTY_FLOAT64: dict[torch.device, torch.Tensor] = {}
ANY_AUTOCAST: Callable[[], bool] = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)
"""Whether any autocast is on (one C call; True before torch has the call: the autocast paths then always)."""


def detached(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when autograd does not track it (inference, ``no_grad``), else ``t.detach()``:
    a reduction of it then records no graph. ``detach`` is an op of its own: a full probe reduces
    about 500 tensors a UNet call, and saves 500 dispatches so."""
    return t.detach() if t.requires_grad else t


class HostCopy:
    """Device values on their way to the host: the tensors of each device concatenated (as
    float64, so that an fp16 value next to an int64 count keeps both) and copied out once. On a
    GPU the copy goes into pinned memory without blocking, with a CUDA event recorded on the
    tensors' own device; :meth:`wait` waits for that event (long done when read a step later)
    and returns each tensor's values as a list of floats. On CPU the buffer is the
    concatenation itself. ``deferred=False``: a read now (one blocking ``tolist`` per device)."""

    def __init__(self, tensors: Sequence[torch.Tensor], *, deferred: bool = True):
        self.size = len(tensors)
        self.parts: list[tuple[list[int], torch.Tensor, Any, list[tuple[int, bool]]]] = []
        by_device: dict[torch.device, list[int]] = {}
        for i, t in enumerate(tensors):
            by_device.setdefault(t.device, []).append(i)
        for device, indices in by_device.items():
            own = tensors if len(by_device) == 1 else [tensors[i] for i in indices]
            tracked = False
            for t in own:  # a loop, not any() over a generator: no frame a value
                if t.requires_grad:
                    tracked = True
                    break
            if ANY_AUTOCAST():  # (one C call) a user's ``with torch.autocast(...)`` around the pipeline
                host, layout = _joined(device, own)
            elif tracked:
                with torch.no_grad():  # no graph for the copy (a detach each would be an op per value)
                    pieces, layout = _flat_parts(device, own)
                    host = torch.cat(pieces)
            else:  # nothing autograd tracks (a denoising step's values): no grad-mode context to enter
                pieces, layout = _flat_parts(device, own)
                host = torch.cat(pieces)
            event = None
            if deferred and device.type == "cuda":
                flat, host = host, torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
                host.copy_(flat, non_blocking=True)
                with torch.cuda.device(device):
                    event = torch.cuda.Event()
                    event.record()
            if deferred and host.device.type == "cpu":
                key = id(host)  # forgotten when the buffer dies (a C weak reference, not a finalize object)
                _HOST_BUFFERS[key] = weakref.ref(host, partial(_forget_buffer, key))
            self.parts.append((indices, host, event, layout))

    def ready(self) -> bool:
        """Whether :meth:`wait` would return without waiting."""
        return all(event is None or event.query() for _, _, event, _ in self.parts)

    def wait(self) -> list[list[float]]:
        if len(self.parts) == 1:  # one device (the usual case): its rows are the answer, in order
            return _rows(*self.parts[0])
        out: list[list[float]] = [[] for _ in range(self.size)]
        for part in self.parts:
            for i, row in zip(part[0], _rows(*part)):
                out[i] = row
        return out


def _joined(device: torch.device, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[tuple[int, bool]]]:
    """The float64 buffer and layout of ``tensors`` joined outside autocast (and autograd): under it,
    ``stack`` and ``cat`` cast each piece not of the widest dtype first (an op each: a step's fp16
    abs-maxes beside its float32 statistics, at every step of a user's ``with torch.autocast(...)``)
    and refuse fp16 beside bf16 (``Unexpected floating ScalarType``); outside, ``cat`` promotes
    them itself into the float64 buffer, exactly."""
    with autocast_off(device.type), torch.no_grad():
        pieces, layout = _flat_parts(device, tensors)
        return torch.cat(pieces), layout


@contextlib.contextmanager
def autocast_off(device_type: str) -> Iterator[None]:
    """Autocast off for ``device_type`` within the block, its cache of cast weights kept: leaving a
    ``torch.autocast`` region whose nesting count falls to 0 clears that cache, which a user who turned
    autocast on with ``torch.set_autocast_enabled`` (no region, count 0) would then refill, a cast a
    weight at the next call; one count more around the region keeps it (2 C calls)."""
    torch.autocast_increment_nesting()
    try:
        with torch.autocast(device_type, enabled=False):
            yield
    finally:
        torch.autocast_decrement_nesting()


_NO_CONTEXT = contextlib.nullcontext()
_PRIVATEUSE1: Callable[[], str] = getattr(torch._C, "_get_privateuse1_backend_name", lambda: "privateuseone")
_AUTOCAST_DEVICE_TYPES = ("cuda", "cpu", "xpu", "mps", "hpu", "xla", "mtia", "ipu")
"""With a third-party backend's (:data:`_PRIVATEUSE1`, its name as registered: ``torch.autocast`` takes no other),
every device type whose autocast :data:`ANY_AUTOCAST` sees (one left on: the monitor measured under it)."""


def outside_autocast() -> contextlib.ExitStack | contextlib.nullcontext:
    """:func:`autocast_off` for every device type whose autocast is on (a user's ``with torch.autocast(...)``
    around a training step's monitor: its casts are no part of a measurement, and its ``stack``/``cat`` raise for
    the half dtype not its own), entered as it is made: the block of a ``with``, or until its ``close()``; a
    context that does nothing where none is on (one C call).

    >>> with torch.autocast("cpu", dtype=torch.bfloat16):
    ...     with outside_autocast():
    ...         off = torch.is_autocast_enabled("cpu")
    ...     off, torch.is_autocast_enabled("cpu")
    (False, True)
    """
    if not ANY_AUTOCAST():
        return _NO_CONTEXT
    with contextlib.ExitStack() as stack:  # a failure at a later device type puts the earlier ones back
        for device_type in (*_AUTOCAST_DEVICE_TYPES, _PRIVATEUSE1()):
            try:
                on = torch.is_autocast_enabled(device_type)
            except (RuntimeError, TypeError, ValueError):  # a device type this build does not know
                continue
            if on:
                stack.enter_context(autocast_off(device_type))
        return stack.pop_all()


def _rows(indices: list[int], host: torch.Tensor, event: Any, layout: list[tuple[int, bool]]) -> list[list[float]]:
    """The values of one device's tensors, a list each, from their host buffer (read in one
    ``tolist``): ``layout`` is :func:`_flat_parts`'s, a run of 0-d tensors made a list a value
    in one comprehension rather than a slice each."""
    if event is not None:
        event.synchronize()
    flat = read_now(host)
    rows: list[list[float]] = []
    start = 0
    for size, run in layout:
        if run:
            rows += [[v] for v in flat[start : start + size]]
        else:
            rows.append(flat[start : start + size])
        start += size
    return rows


def read_now(values: Any) -> Any:
    """``values.tolist()`` of a tensor (or a numpy array): its values as Python numbers, read now
    (one blocking transfer for a device tensor). Every read of the package passes here, so that a
    search for ``tolist``/``item`` finds the reads in ``stats`` alone; batch values first
    (:class:`HostCopy`, :func:`~diffusion_debug.stats.tensors.to_host`) rather than calling it
    in a loop.

    >>> read_now(torch.tensor([1, 2])), read_now(torch.tensor(True))
    ([1, 2], True)
    """
    return values.tolist()


def to_device(values: Sequence[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Python numbers as a tensor of ``dtype`` on ``device``, without blocking the host: a tensor
    made from numbers on a GPU is a blocking copy from pageable memory, so on CUDA the numbers go
    through pinned memory with ``non_blocking`` (torch's pinned allocator keeps the buffer until
    the copy has run).

    >>> to_device([1, 2], torch.long, torch.device("cpu"))
    tensor([1, 2])
    """
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _empty_float64(device: torch.device) -> torch.Tensor:
    empty = _EMPTY_FLOAT64.get(device)
    if empty is None:
        empty = _EMPTY_FLOAT64[device] = torch.empty(0, dtype=torch.float64, device=device)
    return empty


def _forget_buffer(key: int, ref: weakref.ref) -> None:
    if _HOST_BUFFERS.get(key) is ref:
        del _HOST_BUFFERS[key]


def is_host_buffer(tensor: Any) -> bool:
    """Whether ``tensor`` is the host buffer of a :class:`HostCopy` (reading it blocks nothing)."""
    ref = _HOST_BUFFERS.get(id(tensor))
    return ref is not None and ref() is tensor


class count_host_transfers(TorchFunctionMode):
    """Context manager; ``count`` and ``calls`` (method names, in order) after it, split into
    ``blocking`` (reads of device values) and ``deferred`` (reads of a :class:`HostCopy`'s host
    buffer)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []
        self.blocking: list[str] = []
        self.deferred: list[str] = []

    @property
    def count(self) -> int:
        return len(self.calls)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        read = name in _READS
        if not read and name in ("cpu", "to") and args and isinstance(args[0], torch.Tensor):
            read = args[0].device.type != "cpu" and _targets_cpu(name, args[1:], kwargs)
        if read:
            self.calls.append(name)
            (self.deferred if args and is_host_buffer(args[0]) else self.blocking).append(name)
        return func(*args, **kwargs)


def _targets_cpu(name: str, args: tuple, kwargs: dict) -> bool:
    if name == "cpu":
        return True
    target = kwargs.get("device", args[0] if args else None)
    if isinstance(target, (str, torch.device)):
        return torch.device(target).type == "cpu"
    return False


def _flat_parts(
    device: torch.device, tensors: Sequence[torch.Tensor]
) -> tuple[list[torch.Tensor], list[tuple[int, bool]]]:
    """The pieces ``torch.cat`` joins into one float64 buffer, in order, and their layout: ``(number
    of values, whether a run of 0-d tensors)`` a piece. A run of 0-d floating tensors of one dtype
    (a probe's values, hundreds a call) is stacked in one op rather than reshaped one op each; a
    dtype change ends the run (a stack of mixed dtypes promotes each tensor on its own, 5 times
    slower: 1.5 against 0.3 ms for 700 fp16 values with one fp32 among them), and a run of one is
    reshaped, as before (so no more ops than tensors); an integer count keeps its own piece
    (stacked with floats it would round to float32). Called under ``no_grad``: a tensor autograd
    tracks needs no detach."""
    empty = _EMPTY_FLOAT64.get(device)
    parts, layout, run, kind = [empty if empty is not None else _empty_float64(device)], [], [], None

    def close(run: list[torch.Tensor]) -> None:
        if len(run) == 1:
            parts.append(run[0].reshape(-1))
            layout.append((1, False))
        else:
            parts.append(torch.stack(run))
            layout.append((len(run), True))

    for t in tensors:
        dtype = t.dtype
        if t.ndim == 0 and (dtype is kind or dtype.is_floating_point):
            if dtype is not kind:
                if run:
                    close(run)
                    run = []
                kind = dtype
            run.append(t)
            continue
        if run:
            close(run)
            run, kind = [], None
        piece = t if t.ndim == 1 else t.reshape(-1)  # a vector (a step's) joins as it is: no view op
        parts.append(piece)
        layout.append((piece.numel(), False))
    if run:
        close(run)
    return parts, layout
