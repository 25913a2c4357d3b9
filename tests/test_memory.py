"""diffusion_debug.memory: a sample says what psutil says, from one read of /proc."""

from __future__ import annotations

import os
import sys

import psutil
import torch

from diffusion_debug.memory import cuda_peak_mb, memory_sample


def test_a_memory_sample_has_psutils_fields_and_values_from_one_read(monkeypatch):
    process = psutil.Process(os.getpid())
    reads, preads = [], []
    real, real_pread = psutil.Process.memory_info, os.pread

    def counted(self):
        reads.append(1)
        return real(self)

    def counted_pread(*args):
        preads.append(1)
        return real_pread(*args)

    monkeypatch.setattr(psutil.Process, "memory_info", counted)
    monkeypatch.setattr(os, "pread", counted_pread)
    sample = memory_sample("cpu")
    assert sorted(sample) == ["percent", "rss_mb", "vms_mb"]  # no CUDA fields on a CPU device
    # one read of /proc: on Linux a pread of /proc/<pid>/statm (psutil's own source), else psutil
    assert (len(preads), len(reads)) == ((1, 0) if sys.platform.startswith("linux") else (0, 1))
    info = real(process)
    assert abs(sample["rss_mb"] - info.rss / 2**20) < 64  # the same process, a moment apart
    assert abs(sample["vms_mb"] - info.vms / 2**20) < 256
    # psutil's own percent: RSS over the machine's physical memory
    assert abs(sample["percent"] - sample["rss_mb"] * 2**20 / psutil.virtual_memory().total * 100) < 1e-9
    assert abs(sample["percent"] - process.memory_percent()) < 0.5


def test_a_forked_process_samples_its_own_memory_not_its_parents(tmp_path):
    """The kept /proc descriptor is the parent's after a fork: the child opens its own, so its
    samples follow its own growth (the parent's would not move) and agree with psutil's."""
    if not hasattr(os, "fork"):
        return
    memory_sample("cpu")  # the parent's descriptor is open
    out = tmp_path / "child.txt"
    pid = os.fork()
    if pid == 0:  # the child: sample, grow by 512 MB, sample again
        try:
            before = memory_sample("cpu")["rss_mb"]
            grown = bytearray(512 * 2**20)
            grown[::4096] = b"x" * len(grown[::4096])
            after = memory_sample("cpu")["rss_mb"]
            out.write_text(f"{before} {after} {psutil.Process().memory_info().rss / 2**20}")
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    before, after, actual = map(float, out.read_text().split())
    assert after - before > 400, (before, after)  # the child's own growth
    assert abs(after - actual) < 64, (after, actual)


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
    monkeypatch.setattr(torch.cuda, "_initialized", True)  # the flag a sample reads before asking is_initialized()
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", lambda device: reads.append(device) or nested)
    sample = memory_sample("cuda:0")
    assert (sample["cuda_allocated_mb"], sample["cuda_reserved_mb"], sample["cuda_peak_mb"]) == (3.0, 8.0, 5.0)
    assert reads == [torch.device("cuda:0")]
    assert cuda_peak_mb("cuda:0") == 5.0
    nested = {}
    assert memory_sample("cuda:0")["cuda_allocated_mb"] == 0.0 and cuda_peak_mb("cuda:0") == 0.0
