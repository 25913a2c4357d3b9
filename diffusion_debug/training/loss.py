"""The loss: a robust spike detector (rolling median / MAD) and loss per timestep bucket.

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
from typing import Any

import torch

from ..stats import walk_tensors

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
        self._tail: deque[float] = deque(maxlen=_TAIL_LOSSES)
        self._tail_from = window  # a full window of losses before their tail is judged

    @property
    def early_level(self) -> float | None:
        """The median of the run's first 8 finite losses (absolute values); None before any."""
        return _median(sorted(self._early)) if self._early else None

    def converged(self, loss: float) -> bool:
        """Whether ``loss`` is below :data:`CONVERGED` x the early level (a run whose early
        level is 0 never converged: its loss never depended on anything)."""
        early = self.early_level
        return early is not None and early > 0 and math.isfinite(loss) and abs(loss) <= CONVERGED * early

    def update(self, loss: float) -> SpikeCheck:
        if not math.isfinite(loss):
            return SpikeCheck(False, None, None, None)
        check = SpikeCheck(False, None, None, None)
        n = len(self.history)
        if n >= self._needed:
            values = sorted(self.history)
            median = _median(values)
            mad = _median(sorted(abs(v - median) for v in values))
            scale = max(_MAD_TO_STD * mad, 1e-3 * abs(median), 1e-12)
            score = (loss - median) / scale
            threshold = self.threshold * math.sqrt(max(1.0, _FULL_TRUST / n))
            high = values[min(n - 1, (9 * n) // 10)]  # the window's 90th percentile
            above_floor = loss > (1.0 + self.min_ratio) * max(abs(high), abs(median))
            matters = loss - median > self.min_jump * (self.early_level or 0.0)
            beyond_tail = len(self._tail) < self._tail_from or loss > (1.0 + self.min_ratio) * abs(self._p99())
            check = SpikeCheck(score > threshold and above_floor and matters and beyond_tail, median, scale, score)
        self.history.append(loss)
        self._tail.append(loss)
        if len(self._early) < _EARLY_LOSSES:
            self._early.append(abs(loss))
        return check

    def _p99(self) -> float:
        values = sorted(self._tail)
        return values[min(len(values) - 1, (99 * len(values)) // 100)]


def _median(values: list[float]) -> float:
    n = len(values)
    return values[n // 2] if n % 2 else 0.5 * (values[n // 2 - 1] + values[n // 2])


class TimestepBuckets:
    """Loss per timestep bucket (``buckets`` equal bins over ``[0, num_train_timesteps)``).

    Sums stay on the device: :meth:`device_vector` gives ``[sum, count, nonfinite]`` per bucket
    for one step (3 x buckets values) to ride in the step's single transfer; :meth:`add`
    accumulates the fetched values on the host.

    With only a scalar loss, the batch loss is attributed to the bucket of every sample's
    timestep (each sample counts once, with the batch's loss): a practical curve when batches
    mix timesteps, exact when ``per_sample_loss`` is given.
    """

    def __init__(self, buckets: int, num_train_timesteps: int):
        self.buckets = buckets
        self.num_train_timesteps = max(1, int(num_train_timesteps))
        self.sum = [0.0] * buckets
        self.count = [0] * buckets
        self.nonfinite = [0] * buckets

    def device_vector(
        self, timesteps: torch.Tensor, loss: torch.Tensor, per_sample_loss: torch.Tensor | None, device: torch.device
    ) -> torch.Tensor:
        t = timesteps.detach().reshape(-1).to(device=device, dtype=torch.float64)
        index = (t * self.buckets / self.num_train_timesteps).floor().clamp(0, self.buckets - 1).long()
        if per_sample_loss is not None:
            values = per_sample_loss.detach().reshape(-1).to(device=device, dtype=torch.float64)
            if values.numel() != t.numel():
                raise ValueError(f"per_sample_loss has {values.numel()} values for {t.numel()} timesteps.")
        else:
            values = loss.detach().to(device=device, dtype=torch.float64).reshape(1).expand(t.numel())
        finite = torch.isfinite(values)
        out = torch.zeros(3, self.buckets, dtype=torch.float64, device=device)
        out[0].index_add_(0, index, torch.where(finite, values, 0.0))
        out[1].index_add_(0, index, finite.double())
        out[2].index_add_(0, index, (~finite).double())
        return out.reshape(-1)

    def add(self, row: list[float]) -> None:
        b = self.buckets
        for i in range(b):
            self.sum[i] += row[i]
            self.count[i] += int(row[b + i])
            self.nonfinite[i] += int(row[2 * b + i])

    def summary(self) -> list[dict]:
        width = self.num_train_timesteps / self.buckets
        return [
            {
                "bucket": i,
                "timesteps": [round(i * width), round((i + 1) * width)],
                "count": self.count[i],
                "mean_loss": self.sum[i] / self.count[i] if self.count[i] else None,
                "nonfinite": self.nonfinite[i],
            }
            for i in range(self.buckets)
        ]


class LossAccumulator:
    """The loss (and timestep-bucket sums) of the optimizer step in progress, added up over its
    micro-steps on the device: nothing reaches the host until the step's one transfer."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.loss_sum: torch.Tensor | None = None
        self.count = 0
        self.bucket_sum: torch.Tensor | None = None
        self.samples = 0
        self.input_nonfinite: torch.Tensor | None = None
        """Non-finite values in the ``inputs=`` batches of the step (None: none passed)."""
        self.input_counts: dict[str, torch.Tensor] = {}

    def add(
        self,
        loss: torch.Tensor | float,
        device: torch.device,
        buckets: TimestepBuckets,
        timesteps: torch.Tensor | None = None,
        per_sample_loss: torch.Tensor | None = None,
        batch_size: int | None = None,
        inputs: Any = None,
    ) -> None:
        if isinstance(loss, torch.Tensor):
            value = loss.detach().to(device=device, dtype=torch.float64).reshape(-1).mean()
        else:
            value = torch.tensor(float(loss), dtype=torch.float64, device=device)
        self.loss_sum = value if self.loss_sum is None else self.loss_sum + value
        self.count += 1
        if timesteps is not None:
            timesteps = torch.as_tensor(timesteps)
            vec = buckets.device_vector(timesteps, value, per_sample_loss, device)
            self.bucket_sum = vec if self.bucket_sum is None else self.bucket_sum + vec
            self.samples += timesteps.numel()
        elif per_sample_loss is not None:
            self.samples += per_sample_loss.numel()
        elif batch_size is not None:
            self.samples += int(batch_size)
        if inputs is not None:
            counts = nonfinite_counts(inputs, device)
            total = torch.stack(list(counts.values())).sum() if counts else torch.zeros((), device=device)
            total = total.double()
            self.input_nonfinite = total if self.input_nonfinite is None else self.input_nonfinite + total
            for name, count in counts.items():
                previous = self.input_counts.get(name)
                self.input_counts[name] = count if previous is None else previous + count

    def mean(self) -> torch.Tensor:
        """The step's mean loss (float64, on the device)."""
        return self.loss_sum / self.count


def nonfinite_counts(inputs: Any, device: torch.device, name: str = "inputs") -> dict[str, torch.Tensor]:
    """NaN/Inf count (a device scalar: no sync) of every floating-point tensor in ``inputs``, a
    tensor or a nested value of them (:func:`stats.walk_tensors`), by path (``inputs["pixel_values"]``).
    Integer tensors (token ids) and other values are skipped.

    >>> counts = nonfinite_counts({"pixels": torch.tensor([1.0, float("nan")]), "ids": torch.tensor([1])}, "cpu")
    >>> {k: int(v) for k, v in counts.items()}
    {'inputs["pixels"]': 1}
    """
    out: dict[str, torch.Tensor] = {}
    for keys, tensor in walk_tensors(inputs):
        if tensor.is_floating_point() or tensor.is_complex():
            path = name + "".join(f"[{key!r}]".replace("'", '"') for key in keys)
            out[path] = (~torch.isfinite(tensor.detach())).sum().to(device)
    return out


def num_train_timesteps(noise_scheduler: Any) -> int:
    """The scheduler's ``num_train_timesteps`` (config object or dict); 1000 when unknown."""
    config = getattr(noise_scheduler, "config", None)
    value = getattr(config, "num_train_timesteps", None) if config is not None else None
    if value is None and isinstance(config, dict):
        value = config.get("num_train_timesteps")
    return int(value) if value else 1000
