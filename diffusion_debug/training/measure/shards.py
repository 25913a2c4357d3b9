"""Sharded parameters (FSDP2 ``fully_shard``: ``DTensor`` parameters and gradients; FSDP1
``FullyShardedDataParallel(use_orig_params=True)``: each parameter a view of this rank's part of a
flat parameter, empty where it holds none): a rank holds one shard of each parameter, so the norms
it measures are its shards' (``wrappers.local_part``);
a whole parameter's norm is the square root of its shards' squares summed over the ranks (in
float64: finite shards never sum to inf here, while clip_grad_norm_'s float32 sum may). That
sum is one ``all_reduce(SUM)`` of one value per parameter (two on the steps that read the
weights) per monitored step, whatever the world size, before the step's reduce.

Every rank joins it in every monitored step, also one whose measurement failed before it
(:meth:`ShardNorms.join_failed` sends zeros: that step's norms then miss its shards), so no
rank waits in it.

Limits: construct the debugger after ``fully_shard`` (it watches the parameters it finds); the
update sketch samples each rank's own shard (a stall is judged across the ranks:
``judges.not_learning``); the replica checksum is not run (the shards differ by design), nor a
``closure=`` replay (the sharded forward would run on one rank only); a NaN/Inf gradient is counted
on the rank whose shard holds it, and named by registration order (FSDP2 sets the gradients group
by group after each reduce-scatter, not in backward's order).
"""

from __future__ import annotations

from typing import Callable

import torch


class ShardNorms:
    """Whole-parameter norms from this rank's shard norms, through ``sum_over_ranks``."""

    def __init__(self, sum_over_ranks: Callable[[torch.Tensor], torch.Tensor], count: int):
        self.sum_over_ranks = sum_over_ranks
        self.count = count
        self.joined = False
        """This rank joined the current step's sum."""

    def begin(self) -> None:
        self.joined = False

    def whole(self, norms: torch.Tensor, weights: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The whole parameters' gradient (and weight) norms, in float64: finite shards' norms give
        a finite whole even beyond float32's largest value, which a float32 sum reads as inf
        (``step_checks.judge_gradients`` names that sum's overflow)."""
        parts = [norms.double().square()] + ([weights.double().square()] if weights is not None else [])
        self.joined = True  # before the call: a failure inside it must not join twice
        summed = self.sum_over_ranks(torch.cat(parts)).sqrt()
        return summed[: self.count], (summed[self.count :] if weights is not None else None)

    def join_failed(self, refresh_weights: bool, device: torch.device) -> None:
        """A rank whose measurement failed before :meth:`whole` still joins the step's sum."""
        if not self.joined:
            self.joined = True
            size = self.count * (2 if refresh_weights else 1)
            self.sum_over_ranks(torch.zeros(size, dtype=torch.float64, device=device))
