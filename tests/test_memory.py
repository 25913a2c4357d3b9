"""diffusion_debug.memory: a sample says what psutil says, from one read of /proc."""

from __future__ import annotations

import os

import psutil

from diffusion_debug.memory import memory_sample


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
