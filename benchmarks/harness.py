"""Interleaved timing: A B C A B C ..., warm-up first, median of the repetitions.

Running the cases in turn inside one process means drift (thermal, other load, allocator
state) hits every case alike; the median ignores the odd slow repetition.  A noisy machine has
slow phases (everything 20-30% slower for a second or more) that can cover a case's runs in a
few rounds and not the baseline's, so the ratio budgets are checked against is the median of
per-round paired ratios (each round runs every case once; the case over that round's baseline):
a slow phase then moves both sides of a ratio together.
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
    clock: str = "wall"
    """``"wall"`` (``time.perf_counter``) or ``"cpu"`` (``time.process_time``: this process's CPU
    time, which other processes' load on a shared machine does not enter)."""

    @property
    def baseline(self) -> str:
        return next(iter(self.times))

    def median(self, case: str) -> float:
        return statistics.median(self.times[case])

    def ratio_of_medians(self, case: str) -> float:
        return self.median(case) / self.median(self.baseline)

    def ratio(self, case: str) -> float:
        """The median of the per-round ratios (case / that round's baseline): the figure budgets
        are checked against."""
        return statistics.median(t / b for t, b in zip(self.times[case], self.times[self.baseline]))

    def ratio_spread(self, case: str) -> tuple[float, float]:
        """The first and third quartiles of the per-round ratios: where the middle half of the
        rounds fell. On a noisy machine a budget verdict means something only when this range
        stays on one side of the budget."""
        ratios = [t / b for t, b in zip(self.times[case], self.times[self.baseline])]
        if len(ratios) < 2:
            return ratios[0], ratios[0]
        first, _, third = statistics.quantiles(ratios, n=4)
        return first, third

    def added_ms(self, case: str) -> float:
        """The median of the per-round differences to the baseline, in milliseconds."""
        return 1e3 * statistics.median(t - b for t, b in zip(self.times[case], self.times[self.baseline]))

    def rows(self) -> list[tuple[str, float, float, float]]:
        return [(case, self.median(case), self.ratio_of_medians(case), self.ratio(case)) for case in self.times]

    def markdown(self) -> str:
        lines = [
            f"| {self.title} | median {'CPU ' if self.clock == 'cpu' else ''}s | ratio of medians "
            "| paired ratio (median per round) | middle half of rounds |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        for case, seconds, of_medians, paired in self.rows():
            first, third = self.ratio_spread(case)
            lines.append(f"| {case} | {seconds:.4f} | {of_medians:.3f}x | {paired:.3f}x | {first:.3f}-{third:.3f}x |")
        return "\n".join(lines)


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def interleaved(
    title: str, cases: dict[str, Callable[[], object]], *, repeats: int, warmup: int = 1, clock: str = "wall"
) -> Comparison:
    """Time every case ``repeats`` times, in turn, by ``clock`` (a key of :data:`CLOCKS`); the first
    case is the baseline."""
    now = CLOCKS[clock]
    for _ in range(warmup):
        for run in cases.values():
            run()
    result = Comparison(title, {name: [] for name in cases}, clock)
    for _ in range(repeats):
        for name, run in cases.items():
            start = now()
            run()
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()
            result.times[name].append(now() - start)
    return result


def machine() -> str:
    import os

    import diffusers
    import transformers

    cpu = cpu_model()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return (
        f"{cpu}, {os.cpu_count()} cores, {gpu}; torch {torch.__version__} ({torch.get_num_threads()} threads), "
        f"diffusers {diffusers.__version__}, transformers {transformers.__version__}, "
        f"Python {platform.python_version()}"
    )


def cpu_model() -> str:
    """The CPU's model name: ``platform.processor()`` is empty (or just the architecture) on
    Linux, so /proc/cpuinfo's "model name" first."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if not line.strip():
                    break  # the first processor's block is enough
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name") or fields.get("Model") or platform.processor() or platform.machine()
    if "cpu family" in fields and "model" in fields:  # "Intel(R) Xeon(R) Processor" alone names no generation
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return name
