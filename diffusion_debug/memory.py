"""Process and CUDA memory, sampled cheaply (no device synchronisation).

>>> sample = memory_sample()
>>> sample["rss_mb"] > 0
True
"""

from __future__ import annotations

import os
import sys
from typing import Any

import psutil
import torch

_MB = 1024.0 * 1024.0
_PROCESS: list[psutil.Process] = []
_STATM: list[int] = []
"""The descriptor of this process's ``/proc/<pid>/statm`` (-1: not readable), once opened;
emptied in a forked child (``os.register_at_fork``), so that no sample asks for the pid."""
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") and sys.platform.startswith("linux") else 0
_TOTAL_MEMORY: list[int] = []
"""The machine's physical memory, read once (psutil caches it the same way for ``memory_percent``)."""


def memory_sample(device: torch.device | str | None = None) -> dict[str, Any]:
    """RSS / VMS / percent of this process, plus CUDA allocated / reserved / peak (MB) when
    ``device`` is a CUDA device (or None and CUDA is initialised). One read of ``/proc``: the
    percent is psutil's ``memory_percent()`` (RSS over physical memory) from the same read.
    A watched call samples at every component call and every step: without CUDA it makes no
    Python call."""
    statm = _STATM[0] if _STATM else _open_statm()
    rss = vms = -1
    if statm >= 0:
        try:
            vms, rss = os.pread(statm, 64, 0).split()[:2]
            rss, vms = int(rss) * _PAGE, int(vms) * _PAGE
        except (OSError, ValueError):
            rss = -1
    if rss < 0:
        info = _process().memory_info()
        rss, vms = info.rss, info.vms
    if not _TOTAL_MEMORY:
        _TOTAL_MEMORY.append(psutil.virtual_memory().total)
    out: dict[str, Any] = {"rss_mb": rss / _MB, "vms_mb": vms / _MB, "percent": rss / float(_TOTAL_MEMORY[0]) * 100}
    # CUDA's flag read first: without CUDA no Python call (is_initialized() adds the forked-child check)
    initialized = getattr(torch.cuda, "_initialized", True) and torch.cuda.is_initialized()
    cuda = _cuda_device(device) if initialized else None  # ~0.1 us, is_available() ~1.4 us
    if cuda is not None:
        allocated, reserved = _cuda_stats(cuda, "allocated_bytes", "reserved_bytes")
        out["cuda_allocated_mb"] = allocated["current"] / _MB
        out["cuda_reserved_mb"] = reserved["current"] / _MB
        out["cuda_peak_mb"] = allocated["peak"] / _MB
    return out


def _process() -> psutil.Process:
    """psutil's handle on this process (made again in a forked child)."""
    if not _PROCESS or _PROCESS[0].pid != os.getpid():
        _PROCESS[:] = [psutil.Process(os.getpid())]
    return _PROCESS[0]


def _open_statm() -> int:
    """A descriptor of this process's ``/proc/<pid>/statm``, kept open (-1: none, not Linux or not
    readable): one ``pread`` of it is what psutil reads, without its ~10 us of Python."""
    fd = -1
    if _PAGE > 0:
        try:
            fd = os.open(f"/proc/{os.getpid()}/statm", os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            fd = -1
    _STATM[:] = [fd]
    return fd


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker, a launcher) reads its own ``statm``: the parent's
    descriptor names the parent."""
    if _STATM and _STATM[0] >= 0:
        try:
            os.close(_STATM[0])
        except OSError:
            pass
    _STATM.clear()
    _PROCESS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _cuda_stats(device: torch.device, *names: str) -> list[dict[str, int]]:
    """The caching allocator's ``all`` figures of each of ``names``, from one read of its nested
    statistics: ``torch.cuda.memory_allocated`` and its kind each flatten every statistic into a
    dict (~0.5 ms apiece on an H200), and a watched call samples memory at every step."""
    stats = torch.cuda.memory_stats_as_nested_dict(device)  # {} before the allocator's first use
    return [{"current": 0, "peak": 0, **stats.get(name, {}).get("all", {})} for name in names]


def _cuda_device(device: torch.device | str | None) -> torch.device | None:
    if not torch.cuda.is_initialized():  # ~0.1 us, where is_available() takes ~1.4 us (initialised implies available)
        return None
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    return device if device.type == "cuda" else None


def call_peak_mb(sample: dict[str, Any], peak_before: float | None) -> float:
    """A call's peak memory in MB, from :func:`memory_sample` after it and :func:`cuda_peak_mb` when
    it began: the CUDA peak when the call set a new high (exact), else what is allocated after it (a
    lower bound: the peak counter is never reset, so a call under an earlier high cannot be told
    apart); without CUDA the process RSS.

    >>> call_peak_mb({"rss_mb": 900.0, "cuda_allocated_mb": 2000.0, "cuda_peak_mb": 5000.0}, 4000.0)
    5000.0
    >>> call_peak_mb({"rss_mb": 900.0, "cuda_allocated_mb": 2000.0, "cuda_peak_mb": 5000.0}, 5000.0)
    2000.0
    >>> call_peak_mb({"rss_mb": 900.0}, None)
    900.0
    """
    if "cuda_peak_mb" not in sample:
        return sample["rss_mb"]
    if peak_before is not None and sample["cuda_peak_mb"] <= peak_before:
        return sample["cuda_allocated_mb"]
    return sample["cuda_peak_mb"]


def cuda_peak_mb(device: torch.device | str | None = None) -> float | None:
    """The CUDA peak allocated since the last reset, in MB (None without CUDA). Read only: the
    counter is the user's (``torch.cuda.reset_peak_memory_stats``), never reset here."""
    cuda = _cuda_device(device)
    return _cuda_stats(cuda, "allocated_bytes")[0]["peak"] / _MB if cuda is not None else None


def growth_mb(values: list[float]) -> float:
    """Growth over a series as a robust trend: the median of the last quarter minus the median
    of the first quarter (one-off spikes do not count as growth)."""
    if len(values) < 8:
        return 0.0
    quarter = len(values) // 4
    head, tail = sorted(values[:quarter]), sorted(values[-quarter:])
    return tail[len(tail) // 2] - head[len(head) // 2]
