"""Interleaved timing: A B C, then C B A, ..., warm-up first, median of paired ratios.

Running the cases in turn inside one process means drift (thermal, other load, allocator
state) hits every case alike; the median ignores the odd slow repetition.  A noisy machine has
slow phases (everything 20-30% slower for a second or more) that can cover a case's runs in a
few rounds and not the baseline's, so the ratio budgets are checked against is the median of
paired ratios (a slow phase then moves both sides of a ratio together).

What keeps the ratios steady on a shared machine (measured by an A/A comparison, the same call
against itself, which must read 1.00x: benchmarks/RESULTS.md, 2026-11-28 16:30):

- **Mirrored rounds (ABBA).** Every other round runs the cases in reverse order, and a pair is
  two consecutive rounds (A B C C B A): each case's two runs are centred on the same moment, so a
  drift that is linear over the pair cancels, and no case always follows the same other case
  (the call after a debugger's call no longer pays for its garbage in every round). The paired
  ratio is the median over pairs of (the case's two runs) / (the baseline's two runs).
- **The collector outside the timed calls.** ``gc.collect()`` then ``gc.freeze()`` after the
  warm-up (the pipelines' millions of objects leave the generations a collection walks), and a
  ``gc.collect()`` before every timed call: each call starts from the same empty young generation,
  so the collections it triggers itself (its real cost, kept) fall at the same points every time.
- **A warm-up to steady state**: at least ``warmup`` rounds (two), up to 3 more while some
  case's latest run is still 5% off its previous one (first calls read components fully, allocate).
- **The precision of the figure, not only the spread of the rounds**: the middle half of the
  pairs (how the machine scattered them) and a bootstrap 95% interval of the paired median (how
  well the figure is known; it narrows with more rounds, the middle half does not).
"""

from __future__ import annotations

import contextlib
import gc
import math
import platform
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch


@dataclass
class Comparison:
    """Median seconds per case, and each case's ratio to the baseline (the first case)."""

    title: str
    times: dict[str, list[float]] = field(default_factory=dict)
    clock: str = "wall"
    """``"wall"`` (``time.perf_counter``) or ``"cpu"`` (``time.process_time``: this process's CPU
    time, which other processes' load on a shared machine does not enter)."""
    mirrored: bool = False
    """Whether odd rounds ran the cases in reverse order (:func:`interleaved`): the paired ratios
    are then taken over pairs of consecutive rounds, not single rounds."""

    @property
    def baseline(self) -> str:
        return next(iter(self.times))

    def median(self, case: str) -> float:
        return statistics.median(self.times[case])

    def ratio_of_medians(self, case: str) -> float:
        return self.median(case) / self.median(self.baseline)

    def ratios(self, case: str) -> list[float]:
        """The paired ratios: per round (case / that round's baseline), or, for mirrored rounds, per
        pair of consecutive rounds (the case's two runs over the baseline's two; an odd last round
        alone)."""
        case_times, base_times = self.times[case], self.times[self.baseline]
        width = 2 if self.mirrored else 1
        return [
            sum(case_times[i : i + width]) / sum(base_times[i : i + width]) for i in range(0, len(case_times), width)
        ]

    def ratio(self, case: str) -> float:
        """The median of the paired ratios (:meth:`ratios`): the figure budgets are checked against."""
        return statistics.median(self.ratios(case))

    def ratio_spread(self, case: str) -> tuple[float, float]:
        """The first and third quartiles of the paired ratios: where the middle half of the rounds
        (pairs of rounds, when mirrored) fell. On a noisy machine a budget verdict means something
        only when this range stays on one side of the budget."""
        ratios = self.ratios(case)
        if len(ratios) < 2:
            return ratios[0], ratios[0]
        first, _, third = statistics.quantiles(ratios, n=4)
        return first, third

    def ratio_interval(self, case: str, *, resamples: int = 2000, level: float = 0.95) -> tuple[float, float]:
        """A percentile-bootstrap interval (``level``, a fixed seed: the same times give the same
        interval) of the paired median :meth:`ratio`: how well the figure is known, where
        :meth:`ratio_spread` says how scattered the rounds were."""
        ratios = self.ratios(case)
        if len(ratios) < 2:
            return ratios[0], ratios[0]
        draw = random.Random(0)
        medians = sorted(statistics.median(draw.choices(ratios, k=len(ratios))) for _ in range(resamples))
        tail = (1.0 - level) / 2
        return medians[int(tail * (resamples - 1))], medians[round((1.0 - tail) * (resamples - 1))]

    def added_ms(self, case: str) -> float:
        """The median of the per-round differences to the baseline, in milliseconds."""
        return 1e3 * statistics.median(t - b for t, b in zip(self.times[case], self.times[self.baseline]))

    def added_ms_interval(self, case: str, *, level: float = 0.95) -> tuple[float, float]:
        """A distribution-free interval (at least ``level``) of the median per-round difference
        :meth:`added_ms`, in milliseconds: the order statistics ``d(k)`` and ``d(n+1-k)`` of the
        ``n`` sorted differences, ``k`` the largest with ``P(Binomial(n, 1/2) < k) <= (1 - level) / 2``
        (the median lies below ``d(k)`` only if fewer than ``k`` differences fall below it). No
        resampling: the same times give the same interval. Below 6 rounds no such ``k`` exists
        at 95%, and the interval is the whole range of the differences (less sure than ``level``)."""
        differences = sorted(1e3 * (t - b) for t, b in zip(self.times[case], self.times[self.baseline]))
        n, tail = len(differences), (1.0 - level) / 2
        k, below = 0, 0.0
        while k < n and below + math.comb(n, k) / 2**n <= tail:
            below += math.comb(n, k) / 2**n
            k += 1
        if k == 0:
            return differences[0], differences[-1]
        return differences[k - 1], differences[n - k]

    def rows(self) -> list[tuple[str, float, float, float]]:
        return [(case, self.median(case), self.ratio_of_medians(case), self.ratio(case)) for case in self.times]

    def markdown(self) -> str:
        unit = "pairs of rounds" if self.mirrored else "rounds"
        lines = [
            f"| {self.title} | median {'CPU ' if self.clock == 'cpu' else ''}s | ratio of medians "
            f"| paired ratio (median) | middle half of {unit} | 95% interval of the paired ratio |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for case, seconds, of_medians, paired in self.rows():
            first, third = self.ratio_spread(case)
            low, high = self.ratio_interval(case)
            lines.append(
                f"| {case} | {seconds:.4f} | {of_medians:.3f}x | {paired:.3f}x | {first:.3f}-{third:.3f}x "
                f"| {low:.3f}-{high:.3f}x |"
            )
        return "\n".join(lines)


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def interleaved(
    title: str,
    cases: dict[str, Callable[[], object]],
    *,
    repeats: int,
    warmup: int = 1,
    clock: str = "wall",
    mirrored: bool = True,
) -> Comparison:
    """Time every case ``repeats`` times (rounds), in turn, by ``clock`` (a key of :data:`CLOCKS`);
    the first case is the baseline. ``mirrored``: odd rounds run the cases in reverse order, and the
    collector runs outside the timed calls (the module's docstring says why)."""
    now = CLOCKS[clock]
    synced = torch.cuda.is_available() and torch.cuda.is_initialized()
    names = list(cases)
    warm(cases, warmup, clock=clock)
    result = Comparison(title, {name: [] for name in cases}, clock, mirrored)
    frozen = mirrored and gc.isenabled()
    if frozen:
        gc.collect()
        gc.freeze()
    try:
        for round_ in range(repeats):
            for name in reversed(names) if mirrored and round_ % 2 else names:
                if frozen:
                    gc.collect()
                start = now()
                cases[name]()
                if synced:
                    torch.cuda.synchronize()
                result.times[name].append(now() - start)
    finally:
        if frozen:
            gc.unfreeze()
    return result


_EXTRA_ROUNDS = [3]
"""The rounds :func:`warm` may add to reach a steady state (none under :func:`smoke_warm_ups`)."""
_SMOKE = [False]
"""Whether :func:`smoke_warm_ups` is in force: every warm-up is then one round."""


@contextlib.contextmanager
def smoke_warm_ups() -> Iterator[None]:
    """Within: every warm-up runs one round (:func:`warm_up_rounds`) and none more to reach a
    steady state. For ``--smoke`` (checks, not figures): on a loaded machine the runs never settle,
    and every warm-up ran 3 rounds more for nothing; one round still runs each case once before
    it is timed (what a case makes on its first call, a reused debugger, is made there)."""
    before = _EXTRA_ROUNDS[0], _SMOKE[0]
    _EXTRA_ROUNDS[0], _SMOKE[0] = 0, True
    try:
        yield
    finally:
        _EXTRA_ROUNDS[0], _SMOKE[0] = before


def warm_up_rounds(rounds: int) -> int:
    """The warm-up rounds to run for the ``rounds`` asked: one under :func:`smoke_warm_ups`."""
    return min(rounds, 1) if _SMOKE[0] else rounds


def warm(
    cases: dict[str, Callable[[], object]],
    rounds: int,
    *,
    clock: str = "wall",
    settle: float = 0.05,
    extra: int | None = None,
) -> int:
    """Run every case ``rounds`` times (at least twice; once under :func:`smoke_warm_ups`), then up
    to ``extra`` more rounds (3; none under :func:`smoke_warm_ups`) while some case's latest run took
    ``settle`` more or less than its run before, by ``clock``: first calls read components fully,
    allocate, fill caches. Returns the rounds run."""
    extra = _EXTRA_ROUNDS[0] if extra is None else extra
    least = warm_up_rounds(max(2, rounds))
    now = CLOCKS[clock]
    synced = torch.cuda.is_available() and torch.cuda.is_initialized()
    last: dict[str, float] = {}
    done = 0
    while done < least + extra:
        steady = done + 1 >= least
        for name, run in cases.items():
            start = now()
            run()
            if synced:
                torch.cuda.synchronize()
            took = now() - start
            steady = steady and name in last and abs(took - last[name]) <= settle * last[name]
            last[name] = took
        done += 1
        if steady:
            break
    return done


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
