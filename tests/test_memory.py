"""diffusion_debug.memory: a sample says what psutil says, from one read of /proc."""

from __future__ import annotations

import os

import psutil
import torch

from diffusion_debug.memory import cuda_peak_mb, memory_sample


def test_a_memory_sample_has_psutils_fields_and_values_from_one_read(monkeypatch):
    process = psutil.Process(os.getpid())
    reads = []
    real = psutil.Process.memory_info

    def counted(self):
        reads.append(1)
        return real(self)

    monkeypatch.setattr(psutil.Process, "memory_info", counted)
    sample = memory_sample("cpu")
    assert sorted(sample) == ["percent", "rss_mb", "vms_mb"]  # no CUDA fields on a CPU device
    assert len(reads) == 1  # was 2: memory_percent() read /proc again
    info = real(process)
    assert abs(sample["rss_mb"] - info.rss / 2**20) < 64  # the same process, a moment apart
    assert abs(sample["vms_mb"] - info.vms / 2**20) < 256
    # psutil's own percent: RSS over the machine's physical memory
    assert abs(sample["percent"] - sample["rss_mb"] * 2**20 / psutil.virtual_memory().total * 100) < 1e-9
    assert abs(sample["percent"] - process.memory_percent()) < 0.5


def test_cuda_figures_come_from_one_read_of_the_allocators_nested_statistics(monkeypatch):
    # the shape torch.cuda.memory_stats_as_nested_dict returns (torch.cuda.memory_allocated reads
    # "allocated_bytes.all.current" of the same statistics); {} before the allocator's first use
    mb = 2**20
    nested = {
        "allocated_bytes": {"all": {"current": 3 * mb, "peak": 5 * mb, "allocated": 9 * mb, "freed": 6 * mb}},
        "reserved_bytes": {"all": {"current": 8 * mb, "peak": 8 * mb}},
    }
    reads = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", lambda device: reads.append(device) or nested)
    sample = memory_sample("cuda:0")
    assert (sample["cuda_allocated_mb"], sample["cuda_reserved_mb"], sample["cuda_peak_mb"]) == (3.0, 8.0, 5.0)
    assert reads == [torch.device("cuda:0")]
    assert cuda_peak_mb("cuda:0") == 5.0
    nested = {}
    assert memory_sample("cuda:0")["cuda_allocated_mb"] == 0.0 and cuda_peak_mb("cuda:0") == 0.0
