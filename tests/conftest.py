"""Settings for the whole suite: torch runs one intra-op thread, here and in the processes the tests
start, unless whoever runs the suite set ``OMP_NUM_THREADS`` themselves.

The tiny pipelines' kernels are too small to gain from a second thread, and on a small shared CPU
torch's worker threads spin against other processes: a step of a tiny pipeline then takes seconds
instead of milliseconds (a fine-tuning job test: 14 s with two threads, 6 s with one, under load).
Results do not depend on it: every test compares runs made in one process, or with a tolerance.
"""

import os

import torch


def pytest_configure(config):
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"  # inherited by subprocesses (accelerate launch, the CLI)
        torch.set_num_threads(1)
