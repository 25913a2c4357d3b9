"""Per-sample and per-timestep forensics: which samples of a step made its loss non-finite or
outlying, at which timesteps, and a loss weight that is non-finite at some timestep.

``monitor_training_step(loss, ..., timesteps=timesteps, per_sample_loss=losses,
sample_ids=ids, loss_weights=weights)``: ``per_sample_loss`` is the loss of each sample before
the batch's reduction, ``loss_weights`` the weight each sample's loss gets (min-SNR's), and
``sample_ids`` names the samples (a list of names or numbers, or an integer tensor; without
it a sample is ``#i``, its place in the step's samples). They stay on the device, added up over
the step's micro-steps, and reach the host with the step's one transfer (:class:`SampleAccumulator`).

* ``nonfinite_loss_weight`` (error): a loss weight is NaN/Inf, named with its timesteps and
  samples: min-SNR weighting divides by the SNR, 0 at the last timestep of a zero-terminal-SNR
  schedule. It is the cause of the step's NaN loss (stage 1, before the loss).
* The step's ``nonfinite_loss`` names the samples whose loss is NaN/Inf and their timesteps
  (``details["samples"]``, ``timestep`` the first one's); a non-finite per-sample loss under a
  finite step loss is a ``sample_loss_outlier`` error.
* ``sample_loss_outlier`` (warning): a finite per-sample loss above :data:`OUTLIER_RATIO` times
  the 90th percentile of this rank's last :data:`HISTORY` per-sample losses (judged once
  :data:`MIN_HISTORY` are known; the jump must also pass 1% of the run's early per-sample level,
  so the float noise of a converged loss is no outlier).

>>> history = SampleHistory()
>>> clean = [judge_samples(_columns([0.5, 0.7, 0.6, 0.4], [10, 500, 900, 999]), None, s, 0, history) for s in range(4)]
>>> [found.anomalies for found in clean]
[[], [], [], []]
>>> found = judge_samples(_columns([0.5, 40.0, 0.6, 0.4], [10, 500, 900, 999]), ["a", "b", "c", "d"], 4, 0, history)
>>> print(found.anomalies[0].message)
Sample b (t=500) has a loss of 40, 57.1x the 90th percentile of recent per-sample losses (0.7), at step 4 on rank 0:
check that sample (its image, caption, cached latents) and the loss at that timestep.

Limits: judged on each rank's own samples (another rank's outlier reaches the main process's
report only on a step whose anomalies are exchanged: one with a NaN/Inf somewhere); the history
mixes every timestep, so only a loss far above the run's usual spread is an outlier.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ...record import Anomaly, make_anomaly, rebuilt

OUTLIER_RATIO = 10.0
HISTORY = 512
MIN_HISTORY = 16
_EARLY = 32
"""The run's early per-sample level: the median of its first 32 finite per-sample losses."""
SAMPLES_NAMED = 10
"""Samples kept in an anomaly's details (the count says how many there were)."""
_COLUMNS = 4
"""loss, timestep, weight, id: one row of the fetched block each."""


class SampleAccumulator:
    """The step's per-sample values on the device (``[4, n]`` float64 blocks, one per micro-step:
    loss, timestep, weight, numeric id; NaN where not given) and the ids given as a list."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.blocks: list[torch.Tensor] = []
        self.ids: list[Any] = []
        self.given: set[str] = set()
        """The columns passed (``"loss"``, ``"weight"``): a column not passed is NaN, as is a bad value."""

    def add(
        self,
        device: torch.device,
        per_sample_loss: Any,
        timesteps: Any,
        loss_weights: Any,
        sample_ids: Any,
    ) -> None:
        if per_sample_loss is None and loss_weights is None:
            return
        first = per_sample_loss if per_sample_loss is not None else loss_weights
        n = torch.as_tensor(first).numel()
        ids_given = sample_ids is not None and not isinstance(sample_ids, torch.Tensor)
        columns = [
            _column(per_sample_loss, n, device, "per_sample_loss"),
            _column(timesteps, n, device, "timesteps"),
            _column(loss_weights, n, device, "loss_weights"),
            _column(None if ids_given else sample_ids, n, device, "sample_ids"),
        ]
        self.given |= {
            name for name, value in (("loss", per_sample_loss), ("weight", loss_weights)) if value is not None
        }
        if ids_given:
            ids = list(sample_ids)
            if len(ids) != n:
                raise ValueError(f"sample_ids has {len(ids)} values for {n} samples.")
            self.ids += ids
        else:
            self.ids += [None] * n
        self.blocks.append(torch.stack(columns))

    def device_vector(self) -> torch.Tensor | None:
        """The step's block, flat (loss row, timestep row, weight row, id row); None if none."""
        if not self.blocks:
            return None
        return torch.cat(self.blocks, dim=1).reshape(-1)


def _column(value: Any, n: int, device: torch.device, name: str) -> torch.Tensor:
    if value is None:
        return torch.full((n,), math.nan, dtype=torch.float64, device=device)
    tensor = torch.as_tensor(value).detach().reshape(-1).to(device=device, dtype=torch.float64)
    if tensor.numel() != n:
        raise ValueError(f"{name} has {tensor.numel()} values for {n} samples.")
    return tensor


@dataclass
class SampleHistory:
    """This rank's recent finite per-sample losses, and the run's early level."""

    values: deque[float] = field(default_factory=lambda: deque(maxlen=HISTORY))
    early: list[float] = field(default_factory=list)

    def add(self, losses: list[float]) -> None:
        for v in losses:
            self.values.append(v)
            if len(self.early) < _EARLY:
                self.early.append(abs(v))


@dataclass
class SampleFindings:
    anomalies: list[Anomaly]
    nonfinite: list[dict[str, Any]]
    """The samples whose loss is NaN/Inf (for the step's ``nonfinite_loss``)."""

    def add_to(self, judged: Any, rank: int, step: Any) -> None:
        """Into a judged step (``local_judging.Judgement``): this rank's own findings, and its
        ``nonfinite_loss`` naming the non-finite samples."""
        judged.anomalies = name_nonfinite_samples(judged.anomalies, self, rank, step) + self.anomalies


def judge_samples(
    values: Sequence[float],
    ids: list[Any] | None,
    step: Any,
    rank: int,
    history: SampleHistory,
    given: set[str] | frozenset[str] = frozenset({"loss"}),
) -> SampleFindings:
    """The step's fetched block (:meth:`SampleAccumulator.device_vector`), its list ids and the
    columns ``given`` in, findings out; the finite losses then join ``history``."""
    n = len(values) // _COLUMNS
    losses, timesteps, weights, numeric = (list(values[i * n : (i + 1) * n]) for i in range(_COLUMNS))
    names = [_name(i, ids, numeric) for i in range(n)]

    def sample(i: int, **value: float) -> dict[str, Any]:
        return {"sample": names[i], "timestep": _timestep(timesteps[i]), **value}

    out = []
    bad_weights = [i for i, w in enumerate(weights) if not math.isfinite(w)] if "weight" in given else []
    if bad_weights:
        details = {
            "count": len(bad_weights),
            "samples_in_step": n,
            "weight": weights[bad_weights[0]],
            "timesteps": sorted({_timestep(timesteps[i]) for i in bad_weights}, key=_order)[:20],
            "samples": [sample(i, weight=weights[i]) for i in bad_weights[:SAMPLES_NAMED]],
        }
        out.append(_anomaly("nonfinite_loss_weight", step, rank, timesteps[bad_weights[0]], details))
    bad_losses = [i for i, v in enumerate(losses) if not math.isfinite(v)] if "loss" in given else []
    nonfinite = [sample(i, loss=losses[i]) for i in bad_losses[:SAMPLES_NAMED]]
    finite = [v for v in losses if math.isfinite(v)]
    outliers = _outliers(losses, history)
    if outliers:
        high, median = outliers[0][1], outliers[0][2]
        details = {
            "reason": "outlier",
            "count": len(outliers),
            "samples_in_step": n,
            "p90": high,
            "median": median,
            "samples": [sample(i, loss=losses[i], ratio=losses[i] / high) for i, *_ in outliers[:SAMPLES_NAMED]],
        }
        out.append(_anomaly("sample_loss_outlier", step, rank, timesteps[outliers[0][0]], details))
    history.add(finite)
    return SampleFindings(out, nonfinite)


def _outliers(losses: list[float], history: SampleHistory) -> list[tuple[int, float, float]]:
    """``(index, p90, median)`` of each finite loss far above the history, largest first."""
    if len(history.values) < MIN_HISTORY:
        return []
    known = sorted(history.values)
    high = max(known[(9 * len(known)) // 10], 1e-12)
    median = known[len(known) // 2]
    early = sorted(history.early)[len(history.early) // 2] if history.early else 0.0
    found = [
        (i, high, median)
        for i, v in enumerate(losses)
        if math.isfinite(v) and v > OUTLIER_RATIO * high and v - median > 0.01 * early
    ]
    return sorted(found, key=lambda item: -losses[item[0]])


def name_nonfinite_samples(anomalies: list[Anomaly], found: SampleFindings, rank: int, step: Any) -> list[Anomaly]:
    """This rank's ``nonfinite_loss`` naming its non-finite samples (and the first one's timestep);
    with no such anomaly (a finite step loss) a ``sample_loss_outlier`` error names them."""
    if not found.nonfinite:
        return anomalies
    out, named = [], False
    for a in anomalies:
        if a.kind == "nonfinite_loss" and a.rank == rank and not named:
            named = True
            a = rebuilt(a, timestep=found.nonfinite[0]["timestep"], details={**a.details, "samples": found.nonfinite})
        out.append(a)
    if not named:
        details = {"reason": "nonfinite", "count": len(found.nonfinite), "samples": found.nonfinite}
        out.append(_anomaly("sample_loss_outlier", step, rank, found.nonfinite[0]["timestep"], details, "error"))
    return out


def _anomaly(kind: str, step: Any, rank: int, timestep: Any, details: dict, severity: str | None = None) -> Anomaly:
    t = _timestep(timestep) if timestep is not None else None
    return make_anomaly(kind, severity=severity, component="model", step=step, rank=rank, timestep=t, details=details)


def _name(i: int, ids: list[Any] | None, numeric: list[float]) -> Any:
    if ids is not None and i < len(ids) and ids[i] is not None:
        return ids[i] if isinstance(ids[i], (str, int, float)) else str(ids[i])
    if math.isfinite(numeric[i]):
        return int(numeric[i])
    return f"#{i}"


def _timestep(value: float) -> Any:
    if value is None or not math.isfinite(value):
        return None
    return int(value) if float(value).is_integer() else value


def _order(value: Any) -> float:
    return -math.inf if value is None else float(value)


def _columns(losses: list[float], timesteps: list[float]) -> list[float]:
    """A fetched block with no weights or numeric ids (for the examples)."""
    n = len(losses)
    return [*losses, *timesteps, *[math.nan] * n, *[math.nan] * n]
