"""Stability actions: what the training debugger may do about a step, when the config asks (each
one off by default, each recorded as an anomaly saying what was done, each decided from the step's
gathered anomalies so that every rank does the same):

* ``clip_grad_on_explosion``: on ``gradient_explosion``, the gradients are scaled so that their
  global norm is the given value (``gradients_clipped``, with the factor). Scaling by the ratio of
  norms works on scaled fp16 gradients and on shards alike; not when ``grad_norm=`` says the
  script clipped before monitoring.
* ``lr_reduce_after_spikes``: after that many steps with a ``loss_spike`` or ``gradient_explosion``
  within ``loss_spike_window`` monitored steps, every param group's ``lr`` is multiplied by
  ``lr_reduce_factor``, and so are the ``base_lrs`` of the schedulers the Accelerator prepared
  (a LambdaLR would set the old rate back at its next step) (``lr_reduced``).
* ``restore_finite_weights_mb``: the trainable weights are copied to host memory at every monitored
  step whose loss and gradients are finite, when they take at most that many MB; on a step with a
  non-finite loss or gradient whose weights are non-finite, the copy is put back, the gradients are
  zeroed (the following ``optimizer.step()`` adds nothing from the batch) and the optimizer state
  of parameters whose state went non-finite is dropped (Adam starts their moments afresh)
  (``weights_restored``). Memory: one host copy of the trainable weights, in their dtype.

Policy ``skip`` keeps its one meaning (zero the step's gradients on an error); these actions are
separate options. Limits: a scheduler not prepared by an Accelerator keeps its own ``base_lrs``
(reduce it there); the host copy is taken before ``optimizer.step()`` (the weights that gave the
finite loss), a copy per step, so it is meant for small models; weights that differ across ranks
are checked on each rank alone.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import torch

from ...config import DebugConfig
from ...core import AnomalySink
from ...record import Anomaly, make_anomaly
from ..measure.gradients import TrainableParameters, zero_gradients
from ..measure.optimizer_state import learning_rates

_MB = 1024.0 * 1024.0
_SPIKES = ("loss_spike", "gradient_explosion")
_NONFINITE = ("nonfinite_loss", "nonfinite")


class StabilityActions:
    """The actions of one training debugger; :meth:`act` runs once per monitored step."""

    def __init__(self, params: TrainableParameters, config: DebugConfig, sink: AnomalySink, rank: int):
        self.params = params
        self.config = config
        """The monitor's config (``act`` is handed the current one)."""
        self.sink = sink
        self.rank = rank
        self._spikes: deque[int] = deque()  # joined-step numbers of the steps with a spike
        self._copy: list[torch.Tensor] | None = None
        self._copied_step: Any = None
        self._too_large_noted = False
        self.nbytes = sum(p.numel() * p.element_size() for p in params.params)

    def joined(self) -> None:
        """Parameters joined the watch: their bytes counted, and no copy of the old list restored over the new."""
        self.nbytes = sum(p.numel() * p.element_size() for p in self.params.params)
        self._copy, self._copied_step = None, None

    def act(
        self, config: DebugConfig, anomalies: list[Anomaly], step: Any, joined: int, call: Any, accelerator: Any
    ) -> None:
        """Take the actions this step's anomalies call for, and record each (a failure of ours is a
        ``debugger_error``; the step goes on). ``call``: the monitor's call (optimizer, grad_norm)."""
        self.config = config
        if not (config.clip_grad_on_explosion or config.lr_reduce_after_spikes or config.restore_finite_weights_mb):
            return
        with self.sink.guard("stability_actions", step=step, rank=self.rank):
            self._act(anomalies, step, joined, call, accelerator)

    def _act(self, anomalies: list[Anomaly], step: Any, joined: int, call: Any, accelerator: Any) -> None:
        kinds, optimizer = {a.kind for a in anomalies}, call.optimizer
        done: list[Anomaly] = []
        if self.config.restore_finite_weights_mb:
            done += self._restore_or_keep(kinds, step, optimizer)
        # grad_norm= given: the user clipped before monitoring, the gradients are within their max norm
        clipped_already = call.grad_norm is not None
        if self.config.clip_grad_on_explosion and "gradient_explosion" in kinds and not done and not clipped_already:
            done += self._clip(anomalies, step)
        if self.config.lr_reduce_after_spikes and kinds & set(_SPIKES):
            done += self._reduce_lr(step, joined, optimizer, accelerator)
        for anomaly in done:
            self.sink.emit(anomaly)

    # -- clip -----------------------------------------------------------------------------------
    def _clip(self, anomalies: list[Anomaly], step: Any) -> list[Anomaly]:
        explosions = [a for a in anomalies if a.kind == "gradient_explosion"]
        own = next((a for a in explosions if a.rank == self.rank), explosions[0])
        norm, target = own.details.get("grad_norm"), self.config.clip_grad_on_explosion
        if not isinstance(norm, (int, float)) or not math.isfinite(norm) or norm <= target:
            return []  # an overflowed norm is the policy's (skip), not a scale
        factor = target / norm
        grads = [p.grad for p in self.params.params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, factor)
        return [
            self._anomaly(
                "gradients_clipped",
                step,
                {"grad_norm": norm, "max_norm": target, "factor": factor},
            )
        ]

    # -- reduce the learning rate ------------------------------------------------------------------
    def _reduce_lr(self, step: Any, joined: int, optimizer: Any, accelerator: Any) -> list[Anomaly]:
        window, spikes = self.config.loss_spike_window, self._spikes
        spikes.append(joined)
        while spikes and spikes[0] <= joined - window:
            spikes.popleft()
        if len(spikes) < self.config.lr_reduce_after_spikes or optimizer is None:
            return []
        spikes.clear()
        factor = self.config.lr_reduce_factor
        before = learning_rates(optimizer)
        for group in optimizer.param_groups:
            if group.get("lr") is not None:  # Adafactor's relative_step (lr None) sets its own
                group["lr"] = group["lr"] * factor
        schedulers = 0
        for prepared in getattr(accelerator, "_schedulers", None) or []:
            inner = getattr(prepared, "scheduler", prepared)
            if isinstance(getattr(inner, "base_lrs", None), list):
                inner.base_lrs = [lr * factor for lr in inner.base_lrs]
                schedulers += 1
        after = learning_rates(optimizer)
        count = self.config.lr_reduce_after_spikes
        return [
            self._anomaly(
                "lr_reduced",
                step,
                {
                    "factor": factor,
                    "lr_before": before,
                    "lr": after,
                    "spikes": count,
                    "window": window,
                    "schedulers": schedulers,
                },
            )
        ]

    # -- keep and restore the last finite weights ---------------------------------------------------
    def _restore_or_keep(self, kinds: set[str], step: Any, optimizer: Any) -> list[Anomaly]:
        limit_mb = self.config.restore_finite_weights_mb
        if self.nbytes / _MB > limit_mb:
            if not self._too_large_noted:
                self._too_large_noted = True
                self.sink.record.add_event(
                    "restore_finite_weights_off",
                    note=f"the trainable weights take {self.nbytes / _MB:.1f} MB, over restore_finite_weights_mb "
                    f"({limit_mb:g}): no copy is kept",
                )
            return []
        if not kinds & set(_NONFINITE) and "nonfinite_input" not in kinds:
            if "debugger_error" not in kinds:  # a step whose measurement failed says nothing of the weights
                self._keep(step)
            return []
        if self._copy is None or _weights_finite(self.params):
            return []
        if not self._copy_finite():  # weights went NaN where the loss did not look yet: the copy holds it too
            copied, self._copy, self._copied_step = self._copied_step, None, None
            return [
                self._anomaly(
                    "weights_restored",
                    step,
                    {"from_step": copied, "restored": False},
                )
            ]
        with torch.no_grad():
            torch._foreach_copy_([p.data for p in self.params.params], self._copy)
        zero_gradients(self.params)
        dropped = _drop_nonfinite_state(optimizer, self.params)
        return [
            self._anomaly(
                "weights_restored",
                step,
                {
                    "from_step": self._copied_step,
                    "restored": True,
                    "mb": self.nbytes / _MB,
                    "optimizer_state_dropped": dropped,
                },
            )
        ]

    def _copy_finite(self) -> bool:
        """Whether the kept copy is finite (a read of host memory, on a step with NaN weights only)."""
        assert self._copy is not None
        if any(t.is_pinned() for t in self._copy):
            torch.cuda.synchronize()  # the copy into pinned memory was not blocking
        return all(bool(torch.isfinite(t).all()) for t in self._copy if t.is_floating_point())

    def _keep(self, step: Any) -> None:
        params = [p.detach() for p in self.params.params]
        if self._copy is None:
            pin = torch.cuda.is_available() and any(p.is_cuda for p in params)
            self._copy = [torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=pin) for p in params]
        torch._foreach_copy_(self._copy, params, non_blocking=True)
        self._copied_step = step

    def _anomaly(self, kind: str, step: Any, details: dict[str, Any]) -> Anomaly:
        return make_anomaly(kind, component="model", step=step, rank=self.rank, details=details)


def _weights_finite(params: TrainableParameters) -> bool:
    norms = torch._foreach_norm([p.detach() for p in params.params], math.inf)
    return bool(torch.isfinite(torch.stack([n.float() for n in norms])).all())  # one read, on such steps only


def _drop_nonfinite_state(optimizer: Any, params: TrainableParameters) -> int:
    """Forget the optimizer state of each parameter whose state holds NaN/Inf; how many."""
    state = getattr(getattr(optimizer, "optimizer", optimizer), "state", None)  # under an AcceleratedOptimizer
    if state is None:
        return 0
    dropped = 0
    for p in params.params:
        entry = state.get(p)
        if entry and any(isinstance(v, torch.Tensor) and not torch.isfinite(v).all() for v in entry.values()):
            del state[p]
            dropped += 1
    return dropped
