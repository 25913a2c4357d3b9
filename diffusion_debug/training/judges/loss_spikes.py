"""Loss spikes: a robust detector (rolling median / MAD, with a heavy-tail rule).

>>> detector = LossSpikeDetector(window=20, threshold=6.0, min_ratio=2.0)
>>> [detector.update(v).spike for v in [1.0, 1.1, 0.9, 1.0, 1.05, 0.95, 1.0, 1.02, 0.98, 1.0]]
[False, False, False, False, False, False, False, False, False, False]
>>> detector.update(9.0).spike
True
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

# MAD of a normal distribution times this is its standard deviation.
_MAD_TO_STD = 1.4826
_MIN_HISTORY = 2
_FULL_TRUST = 8
"""Below this many losses the MAD is a poor estimate: the threshold is raised by sqrt(8 / n)."""
_EARLY_LOSSES = 8
_TAIL_LOSSES = 250
"""Finite losses in the long reservoir whose 99th percentile a spike must also clear (a heavy tail)."""
"""The run's early loss level: the median of its first 8 finite losses (by absolute value)."""
CONVERGED = 1e-6
"""A loss below this share of the early level has converged: its float noise is no spike, and its
tiny gradients are the optimum's, not vanishing ones."""


@dataclass(frozen=True)
class SpikeCheck:
    spike: bool
    median: float | None
    scale: float | None
    """Robust standard deviation: 1.4826 x MAD (floored at 1e-3 x |median|)."""
    score: float | None
    """(loss - median) / scale."""


_NOT_JUDGED = SpikeCheck(False, None, None, None)
"""A loss not judged (non-finite, or too few before it): one frozen instance, made once."""


class LossSpikeDetector:
    """Flags a loss that is both more than ``threshold`` robust deviations (1.4826 x MAD) above
    the rolling median of the last ``window`` finite losses and more than ``1 + min_ratio`` times
    the window's 90th percentile (the relative floor: a converged loss of 6e-10 +- 1e-10 has a
    tiny MAD, and 0.8e-9 is no spike; a diffusion loss whose batches at small timesteps are
    often 5x the median sets a high 90th percentile). Judges from the third loss on; while fewer
    than 8 losses are known the threshold is raised by ``sqrt(8 / n)`` (the MAD of two or three
    noisy early losses says little). A spike joins the window (a lasting jump becomes the new normal instead of
    flagging forever).

    What matters for training is judged against the run's own scale: a jump (loss - median) must
    also pass ``min_jump`` x the run's early loss level (:attr:`early_level`, the median of its
    first 8 finite losses). Once converged, a loss that goes from 5.7e-10 to 3.8e-9, or from 1e-4
    to 5e-4 in a run that began at 0.1, is float noise or a wobble of the optimizer, not a spike;
    a run that sits at 1e-9 from its start is judged at its own scale.

    A heavy-tailed loss (one extreme sample in a small batch makes the batch loss 30x its median,
    about once in a hundred steps) is judged against its own tail: once a full ``window`` of
    finite losses is known, a spike must also pass ``1 + min_ratio`` times the 99th percentile of
    the last :data:`_TAIL_LOSSES`, so a clean run's rare batch outliers stay quiet while a loss far above anything
    the run has shown is still a spike.

    Limits: the relative floor and the early level are taken on absolute values, so a loss that
    can be negative is judged as if positive. A run that converges within its last
    :data:`_TAIL_LOSSES` steps keeps pre-convergence losses in that tail until they leave it."""

    def __init__(self, window: int, threshold: float, min_ratio: float = 2.0, min_jump: float = 0.01):
        self.threshold = threshold
        self.min_ratio = min_ratio
        self.min_jump = min_jump
        self.history: deque[float] = deque(maxlen=window)
        self._needed = min(window, _MIN_HISTORY)
        self._early: list[float] = []
        self._early_level: float | None = None  # their median, taken when one is added
        self._tail: deque[float] = deque(maxlen=_TAIL_LOSSES)
        self._tail_from = window  # a full window of losses before their tail is judged

    @property
    def early_level(self) -> float | None:
        """The median of the run's first 8 finite losses (absolute values); None before any."""
        return self._early_level

    def converged(self, loss: float) -> bool:
        """Whether ``loss`` is below :data:`CONVERGED` x the early level (a run whose early
        level is 0 never converged: its loss never depended on anything)."""
        early = self._early_level  # not the property: a call a step
        return early is not None and early > 0 and math.isfinite(loss) and abs(loss) <= CONVERGED * early

    def update(self, loss: float) -> SpikeCheck:
        if not math.isfinite(loss):
            return _NOT_JUDGED
        check = _NOT_JUDGED
        n = len(self.history)
        if n >= self._needed:
            values = sorted(self.history)
            median = _median(values)
            mad = _median(sorted([abs(v - median) for v in values]))  # a list: a generator is a call a value
            scale = max(_MAD_TO_STD * mad, 1e-3 * abs(median), 1e-12)
            score = (loss - median) / scale
            threshold = self.threshold * math.sqrt(max(1.0, _FULL_TRUST / n))
            high = values[min(n - 1, (9 * n) // 10)]  # the window's 90th percentile
            above_floor = loss > (1.0 + self.min_ratio) * max(abs(high), abs(median))
            matters = loss - median > self.min_jump * (self._early_level or 0.0)  # not the property: a call
            # the tail (a sort of up to 250 losses) is looked at only for a loss that is a spike otherwise
            spike = (
                score > threshold
                and above_floor
                and matters
                and (len(self._tail) < self._tail_from or loss > (1.0 + self.min_ratio) * abs(self._p99()))
            )
            check = SpikeCheck(spike, median, scale, score)
        self.history.append(loss)
        self._tail.append(loss)
        if len(self._early) < _EARLY_LOSSES:
            self._early.append(abs(loss))
            self._early_level = _median(sorted(self._early))
        return check

    def _p99(self) -> float:
        values = sorted(self._tail)
        return values[min(len(values) - 1, (99 * len(values)) // 100)]


def _median(values: list[float]) -> float:
    n = len(values)
    return values[n // 2] if n % 2 else 0.5 * (values[n // 2 - 1] + values[n // 2])
