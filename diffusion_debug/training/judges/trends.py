"""Slow divergence: a loss whose robust trend rises over a window, with no single spike to flag.

:class:`LossTrend` keeps the last :data:`TREND_WINDOW` finite losses of one rank and compares the
median of the window's later half with the median of its earlier half (the median-of-halves
slope), judged against the loss's own noise with distribution-free bounds (order statistics, so
the heavy tail of a diffusion loss's batches needs no model): the run diverges when the later
median is at least :data:`RISE_RATIO` times the earlier one, the later half's lower bound (its
median's order statistic ``RISE_SCORE x sqrt(n) / 2`` places down) lies above the earlier half's
upper bound, and the rise matters for training (more than 1% of the run's early loss level, as
for spikes: a converged loss wobbling at 1e-9 is no divergence).

>>> import math
>>> trend = LossTrend()
>>> rising = [3 ** (i / 50) * (1 + 0.1 * math.sin(2.3 * i)) for i in range(60)]  # x3 over 50 steps, +-10%
>>> [i for i, v in enumerate(rising) if trend.update(i, v, early_level=1.0)]
[32]
>>> flat = LossTrend()
>>> [i for i, v in enumerate([1.0, 1.2, 0.8, 1.1, 0.9] * 40) if flat.update(i, v, early_level=1.0)]
[]

Limits: the window is short by design (a tripling over 50 steps is seen at steps 30-40 with
+-10% noise, by step 40-60 with +-30%); a loss whose batches scatter by more than about a factor
of two (lognormal sigma 0.6) hides a tripling over 50 steps. Losses are taken one per monitored
step; a window whose earlier median is not positive is not judged; once flagged, a rank is
judged again only after its trend has fallen back (the later half's median at or below the
earlier half's).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

from ...record import Anomaly, make_anomaly

TREND_WINDOW = 50
"""Losses (monitored steps) the trend is read over."""
MIN_LOSSES = 20
"""Losses needed before the trend is judged."""
RISE_RATIO = 1.5
"""The later half's median must be at least this many times the earlier half's."""
RISE_SCORE = 3.0
"""... and its median's distribution-free bound this many standard errors down above the earlier
half's bound as many up (about a 3-sigma interval each, whatever the noise's distribution)."""
MIN_RISE = 0.01
"""... and rise by more than this share of the run's early loss level."""


@dataclass(frozen=True)
class TrendCheck:
    """The evidence of a rising trend over the window ``first_step`` .. ``last_step``."""

    first_step: Any
    last_step: Any
    losses: int
    median_before: float
    median_after: float
    slope: float
    """Median-of-halves slope: the rise of the medians per step between the halves' centres."""
    bound_before: float
    """The upper bound of the earlier half's median (an order statistic above it)."""
    bound_after: float
    """The lower bound of the later half's median: above ``bound_before``."""

    def details(self) -> dict[str, Any]:
        return {
            "slope_per_step": self.slope,
            "window_steps": self.losses,
            "from_step": self.first_step,
            "to_step": self.last_step,
            "median_before": self.median_before,
            "median_after": self.median_after,
            "rise_ratio": self.median_after / self.median_before,
            "bound_before": self.bound_before,
            "bound_after": self.bound_after,
        }


class LossTrend:
    """One rank's recent losses and whether their trend rises (see the module's docstring)."""

    def __init__(self, window: int = TREND_WINDOW, minimum: int = MIN_LOSSES):
        self.losses: deque[tuple[Any, float]] = deque(maxlen=window)
        self.minimum = minimum
        self.flagged = False

    def update(self, step: Any, loss: float, early_level: float | None) -> TrendCheck | None:
        """Take this step's loss; the evidence when the trend becomes clear at this step."""
        if not math.isfinite(loss):
            return None
        self.losses.append((step, loss))
        n = len(self.losses)
        if n < self.minimum:
            return None
        values = [v for _, v in self.losses]
        half = n // 2
        before, after = _median(values[:half]), _median(values[n - half :])
        if self.flagged:
            self.flagged = after > before  # judged again once the trend has fallen back
            return None
        if not before > 0:
            return None
        # distribution-free bounds of each half's median: the order statistics Z sqrt(half) / 2 from it
        reach = math.ceil(RISE_SCORE * math.sqrt(half) / 2)
        lowest_after = sorted(values[n - half :])[max(0, (half - 1) // 2 - reach)]
        highest_before = sorted(values[:half])[min(half - 1, half // 2 + reach)]
        rise = after - before
        if after < RISE_RATIO * before or lowest_after <= highest_before or rise <= MIN_RISE * (early_level or 0.0):
            return None
        self.flagged = True
        steps = [s for s, _ in self.losses]
        return TrendCheck(steps[0], steps[-1], n, before, after, rise / (n - half), highest_before, lowest_after)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    return ordered[n // 2] if n % 2 else 0.5 * (ordered[n // 2 - 1] + ordered[n // 2])


def judge_trend(rank: int, loss: float, step: Any, trend: LossTrend, early_level: float | None) -> list[Anomaly]:
    """``loss_divergence`` at the step the rank's rising loss trend became clear."""
    found = trend.update(step, loss, early_level)
    if found is None:
        return []
    return [
        make_anomaly(
            kind="loss_divergence",
            severity="warning",
            component="model",
            step=step,
            rank=rank,
            details=found.details(),
        )
    ]
