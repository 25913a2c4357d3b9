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
_PROCESS = psutil.Process(os.getpid())
_STATM: tuple[int, int] | None = None
"""``(pid, descriptor)`` of this process's ``/proc/<pid>/statm`` (descriptor -1: not readable)."""
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") and sys.platform.startswith("linux") else 0
_TOTAL_MEMORY: list[int] = []
"""The machine's physical memory, read once (psutil caches it the same way for ``memory_percent``)."""


def memory_sample(device: torch.device | str | None = None) -> dict[str, Any]:
    """RSS / VMS / percent of this process, plus CUDA allocated / reserved / peak (MB) when
    ``device`` is a CUDA device (or None and CUDA is initialised). One read of ``/proc``: the
    percent is psutil's ``memory_percent()`` (RSS over physical memory) from the same read."""
    rss, vms = _rss_vms()
    if not _TOTAL_MEMORY:
        _TOTAL_MEMORY.append(psutil.virtual_memory().total)
    out: dict[str, Any] = {"rss_mb": rss / _MB, "vms_mb": vms / _MB, "percent": rss / float(_TOTAL_MEMORY[0]) * 100}
    cuda = _cuda_device(device)
    if cuda is not None:
        allocated, reserved = _cuda_stats(cuda, "allocated_bytes", "reserved_bytes")
        out["cuda_allocated_mb"] = allocated["current"] / _MB
        out["cuda_reserved_mb"] = reserved["current"] / _MB
        out["cuda_peak_mb"] = allocated["peak"] / _MB
    return out


def _rss_vms() -> tuple[int, int]:
    """This process's resident and virtual size in bytes: on Linux one ``pread`` of
    ``/proc/<pid>/statm`` through a descriptor kept open (what psutil reads, without its ~10 us of
    Python; a watched call samples memory at every component call), elsewhere psutil."""
    global _PROCESS, _STATM
    pid = os.getpid()
    if _PROCESS.pid != pid:  # forked (e.g. a DataLoader worker or a launcher)
        _PROCESS, _STATM = psutil.Process(pid), None
    if _STATM is None and _PAGE > 0:
        try:
            _STATM = (pid, os.open(f"/proc/{pid}/statm", os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)))
        except OSError:
            _STATM = (pid, -1)
    if _STATM is not None and _STATM[1] >= 0:
        try:
            vms, rss = os.pread(_STATM[1], 64, 0).split()[:2]
            return int(rss) * _PAGE, int(vms) * _PAGE
        except (OSError, ValueError):
            pass
    info = _PROCESS.memory_info()
    return info.rss, info.vms


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
