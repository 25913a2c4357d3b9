"""Interleaved timing: A B C A B C ..., warm-up first, median of the repetitions.

Running the cases in turn inside one process means drift (thermal, other load, allocator
state) hits every case alike; the median ignores the odd slow repetition.
"""

from __future__ import annotations

import platform
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass
class Comparison:
    """Median seconds per case, and each case's ratio to the baseline (the first case)."""

    title: str
    times: dict[str, list[float]] = field(default_factory=dict)

    @property
    def baseline(self) -> str:
        return next(iter(self.times))

    def median(self, case: str) -> float:
        return statistics.median(self.times[case])

    def ratio(self, case: str) -> float:
        return self.median(case) / self.median(self.baseline)

    def rows(self) -> list[tuple[str, float, float]]:
        return [(case, self.median(case), self.ratio(case)) for case in self.times]

    def markdown(self) -> str:
        lines = [f"| {self.title} | median s | ratio |", "| --- | ---: | ---: |"]
        lines += [f"| {case} | {seconds:.4f} | {ratio:.3f}x |" for case, seconds, ratio in self.rows()]
        return "\n".join(lines)


def interleaved(title: str, cases: dict[str, Callable[[], object]], *, repeats: int, warmup: int = 1) -> Comparison:
    """Time every case ``repeats`` times, in turn; the first case is the baseline."""
    for _ in range(warmup):
        for run in cases.values():
            run()
    result = Comparison(title, {name: [] for name in cases})
    for _ in range(repeats):
        for name, run in cases.items():
            start = time.perf_counter()
            run()
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()
            result.times[name].append(time.perf_counter() - start)
    return result


def machine() -> str:
    import os

    import diffusers
    import transformers

    cpu = platform.processor() or platform.machine()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return (
        f"{cpu}, {os.cpu_count()} cores, {gpu}; torch {torch.__version__} ({torch.get_num_threads()} threads), "
        f"diffusers {diffusers.__version__}, transformers {transformers.__version__}, "
        f"Python {platform.python_version()}"
    )
