"""Tensor statistics, measured on the tensor's own device and brought to the host in one transfer.

:mod:`.tensors`: one tensor's statistics (:func:`measure` / :func:`collect`, :func:`tensor_stats`),
the dtype helpers and the one abs-max (:func:`absmax`). :mod:`.nested`: the walk over nested
values (:func:`walk_tensors`, :func:`map_tensors`, on ``torch.utils._pytree``; the two that stay
apart say why there). :mod:`.batched`: many tensors measured
together in a few ops and brought to the host with the step's other device values in one copy
(:func:`queue_tensors`), and the statistics of a concatenation from its parts (:func:`merge_stats`).
:mod:`.host`: :class:`HostCopy`, how a step's values leave the device, :func:`read_now`, the call
that reads a tensor's values into Python (a ``float()``/``bool()`` of one scalar, such as a call's
first timestep, is read where it is used), and :class:`count_host_transfers`, how reads are counted.
"""

from .batched import (
    PendingSummaries,
    QueuedTensors,
    can_summarize,
    finish_summary,
    merge_stats,
    queue_tensors,
    summarize,
)
from .host import (
    ANY_AUTOCAST,
    HostCopy,
    autocast_off,
    count_host_transfers,
    detached,
    outside_autocast,
    read_now,
    to_device,
)
from .nested import absmax_on_device, call_tensors, cuda_devices, iter_tensors, map_tensors, tensors_in, walk_tensors
from .tensors import (
    PendingStats,
    TensorStats,
    absmax,
    collect,
    dtype_max,
    dtype_name,
    finish,
    finite_signal,
    is_low_precision,
    measurable,
    measure,
    plain_tensor,
    scalars_to_host,
    tensor_stats,
    to_host,
)

__all__ = [
    "ANY_AUTOCAST",
    "HostCopy",
    "autocast_off",
    "outside_autocast",
    "count_host_transfers",
    "detached",
    "PendingStats",
    "PendingSummaries",
    "QueuedTensors",
    "TensorStats",
    "absmax",
    "absmax_on_device",
    "call_tensors",
    "can_summarize",
    "collect",
    "cuda_devices",
    "dtype_max",
    "dtype_name",
    "finish",
    "finish_summary",
    "finite_signal",
    "is_low_precision",
    "iter_tensors",
    "map_tensors",
    "measurable",
    "measure",
    "plain_tensor",
    "merge_stats",
    "queue_tensors",
    "read_now",
    "to_device",
    "summarize",
    "tensor_stats",
    "tensors_in",
    "scalars_to_host",
    "to_host",
    "walk_tensors",
]
