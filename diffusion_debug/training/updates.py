"""The update the optimizer applied, read from the weights themselves: which weights went
non-finite (read only on a step whose loss or gradients already are).

Limits: reads every trainable weight (one reduction each and one transfer), so it runs only on
steps that are special already.
"""

from __future__ import annotations

import torch

from .gradients import TrainableParameters


@torch.no_grad()
def nonfinite_weights(params: TrainableParameters) -> list[bool]:
    """Exactly which trainable weights hold a NaN/Inf (one transfer)."""
    device = params.params[0].device
    return torch.stack([(~torch.isfinite(p.detach())).any().to(device) for p in params.params]).tolist()
