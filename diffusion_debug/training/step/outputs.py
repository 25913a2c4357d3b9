"""What a monitored step leaves behind: the step counts of the summary, the ``info`` dict that
``monitor_training_step`` returns, the row the record keeps and the scalars trackers receive.
Value types in, value types out.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...record import Anomaly
from ..judges.step_checks import TOP_MODULES, StepFlags
from ..measure.step_row import StepRow


@dataclass
class StepCounts:
    """Per-step counts, judged from the gathered rows: the same on every rank."""

    total_steps: int = 0
    anomaly_steps: int = 0
    loss_anomalies: int = 0
    gradient_explosions: int = 0
    gradient_vanishing: int = 0
    skipped_steps: int = 0
    skipped_by_scaler: int = 0
    """Steps the GradScaler skipped (its own, or Accelerate's): a ``skipped_step`` of reason ``grad_scaler``."""
    skipped_by_deepspeed: int = 0
    """Steps DeepSpeed's overflow check skipped: a ``skipped_step`` of reason ``deepspeed_overflow``."""
    skipped_by_policy: int = 0
    nonfinite_steps: int = 0
    micro_steps: int = 0
    """Calls of ``monitor_training_step`` that only accumulated gradients (under gradient accumulation,
    every micro-step but the one that ends an optimizer step): 4 accumulation steps x 2 optimizer steps
    give ``total_steps`` 2 and ``micro_steps`` 6."""

    def add_step(self, anomalies: list[Anomaly], flags: StepFlags, skipped: list[Anomaly]) -> None:
        """Count a judged step (``total_steps`` is counted when the step's collective is joined).
        A rank's own failure to judge a step is not counted: the other ranks may not know it."""
        if anomalies and any(a.severity != "info" and a.details.get("where") != "judging" for a in anomalies):
            self.anomaly_steps += 1
        self.loss_anomalies += flags.loss
        explosion = anomalies and any(a.kind == "gradient_explosion" for a in anomalies)  # no generator when clean
        self.gradient_explosions += flags.explosion or bool(explosion)
        self.gradient_vanishing += flags.vanishing
        self.nonfinite_steps += flags.nonfinite or flags.nonfinite_loss
        self.add_skip(skipped)

    def add_skip(self, skipped: list[Anomaly]) -> None:
        """A step the GradScaler or DeepSpeed skipped (``skipped``: its ``skipped_step``, or none)."""
        if skipped:
            self.skipped_steps += 1
            if any(a.details.get("reason") == "deepspeed_overflow" for a in skipped):
                self.skipped_by_deepspeed += 1
            else:
                self.skipped_by_scaler += 1

    def summary(self) -> dict[str, Any]:
        """The counts with their rates over ``total_steps``."""
        total = self.total_steps

        def rate(n: int) -> float:
            return n / total if total else 0.0

        return {
            "total_steps": total,
            "anomaly_steps": self.anomaly_steps,
            "anomaly_rate": rate(self.anomaly_steps),
            "loss_anomalies": self.loss_anomalies,
            "loss_anomaly_rate": rate(self.loss_anomalies),
            "gradient_explosions": self.gradient_explosions,
            "gradient_explosion_rate": rate(self.gradient_explosions),
            "gradient_vanishing": self.gradient_vanishing,
            "gradient_vanishing_rate": rate(self.gradient_vanishing),
            "skipped_steps": self.skipped_steps,
            "skipped_step_rate": rate(self.skipped_steps),
            "skipped_by_scaler": self.skipped_by_scaler,
            "skipped_by_deepspeed": self.skipped_by_deepspeed,
            "skipped_by_policy": self.skipped_by_policy,
            "nonfinite_steps": self.nonfinite_steps,
            "accumulating_micro_steps": self.micro_steps,  # the name says what it counts
            "micro_steps": self.micro_steps,  # the same count, under the name it first had
        }

    def clear(self) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, 0)


def step_info(
    own: StepRow,
    rank: int,
    *,
    measured: bool,
    error: Exception | None,
    learning_rates: list[float],
    elapsed: float | None,
    memory: dict,
    module_norms: dict[str, float],
    update_ratio: dict[str, float],
    max_grad_norm: float | None = None,
    applied_update: dict[str, float] | None = None,
) -> dict[str, Any]:
    """What ``monitor_training_step`` returns about this rank's step (without ``step``,
    ``anomalies`` and ``policy_action``; :func:`across_ranks` adds what the exchange brought)."""
    info: dict[str, Any] = {
        "rank": rank,
        "gradients_read": measured,
        # None: no call of the step gave one (NO_LOSS); a failed row's count is NaN, its loss NaN (not read)
        "loss": own.loss if own.loss_count != 0 else None,
        "micro_steps": own.micro_steps,
        "grad_norm": own.pre_clip_norm,
        "grad_norm_clipped": own.clipped(max_grad_norm),
        "nonfinite_parameters": own.nonfinite_count,
        "learning_rates": learning_rates,
        "grad_scale": None if math.isnan(own.grad_scale) else own.grad_scale,
        "step_time_s": elapsed,
        "samples_per_s": (own.samples / elapsed) if elapsed and own.samples > 0 else None,
        "memory": memory,
    }
    if error is not None:
        info["error"] = repr(error)
    if module_norms:
        info["module_grad_norms"] = module_norms
    if update_ratio:
        info["update_to_weight_ratio"] = update_ratio
    if applied_update:
        info["applied_update_ratio"] = applied_update
    return info


def across_ranks(rows: list[StepRow], extremes: dict[str, dict[str, Any]] | None) -> dict[str, Any]:
    """What ``info`` shows of the other ranks: every rank's loss (None: no call of its step gave one)
    and gradient norm on a step whose details were exchanged (``rows``: one per rank), and on every
    step the extremes of the step's reduce with their ranks (``ranks``: per slot ``min``,
    ``min_rank``, ``max``, ``max_rank``; a rank without a loss has no loss extreme)."""
    out: dict[str, Any] = {}
    if len(rows) > 1:
        out["losses_by_rank"] = [row.loss if row.loss_count else None for row in rows]  # None: NO_LOSS
        out["grad_norms_by_rank"] = [row.pre_clip_norm for row in rows]
    if extremes:
        out["ranks"] = extremes
    return out


def record_row(info: dict[str, Any]) -> dict[str, Any]:
    """The step as the record keeps it: the per-module dicts cut to their top (and, for the
    gradient norms, their bottom: the modules that barely learn)."""
    per_module = ("module_grad_norms", "update_to_weight_ratio", "applied_update_ratio", "anomalies")
    row = {k: v for k, v in info.items() if k not in per_module}
    module_norms = info.get("module_grad_norms")
    if module_norms:
        items = list(module_norms.items())
        values = np.fromiter(module_norms.values(), dtype=np.float64, count=len(items))
        finite = np.isfinite(values)
        # the non-finite first, then the largest first; ties in module order (a stable sort, as
        # ``sorted`` was: one numpy sort where a Python key per module cost a tenth of a millisecond)
        ordered = np.where(finite, -values, -math.inf).argsort(kind="stable")
        row["top_module_grad_norms"] = dict([items[i] for i in ordered[:TOP_MODULES].tolist()])  # no generator
        smallest = ordered[finite[ordered]][: -TOP_MODULES - 1 : -1]  # the smallest, smallest first
        row["bottom_module_grad_norms"] = dict([items[i] for i in smallest.tolist()])
    if info.get("update_to_weight_ratio"):
        row["max_update_to_weight_ratio"] = max(info["update_to_weight_ratio"].values(), default=None)
    applied = info.get("applied_update_ratio") or {}
    values = np.fromiter(applied.values(), dtype=np.float64, count=len(applied))
    finite = values[np.isfinite(values)]
    if len(finite):  # the previous step's update, measured from the weights
        row["max_applied_update_ratio"] = float(np.maximum.reduce(finite))  # ndarray.max is a Python call
    return row


def tracker_values(info: dict[str, Any]) -> dict[str, float]:
    """The finite scalars logged to Accelerate's trackers (``debug/...``)."""
    values = {
        "debug/loss": info["loss"],
        "debug/grad_norm": info["grad_norm"],
        "debug/nonfinite_parameters": info["nonfinite_parameters"],
        "debug/anomalies": len(info["anomalies"]),
    }
    if info.get("grad_scale") is not None:
        values["debug/grad_scale"] = info["grad_scale"]
    for i, lr in enumerate(info["learning_rates"]):
        values[f"debug/lr_group{i}"] = lr
    return {k: v for k, v in values.items() if isinstance(v, (int, float)) and math.isfinite(v)}
