"""One device-to-host transfer per step: tensor stats, probe readings and loose scalars together.

:func:`stats.collect` and :meth:`Probe.collect` each fetch on their own; a denoising step has
both (latent / output stats and the sentinel readings), so :func:`fetch_step` concatenates
everything queued on a device into one vector and copies it once.
"""

from __future__ import annotations

import torch

from ..stats import PendingStats, TensorStats, finish


def fetch_step(
    pending: list[PendingStats], scalars: list[torch.Tensor]
) -> tuple[list[TensorStats], list[float]]:
    """Fetch queued stats and device scalars: one transfer per device involved."""
    parts: list[torch.Tensor] = []
    for p in pending:
        if p.vector is not None:
            parts.append(p.vector.reshape(-1))
    parts.extend(s.detach().reshape(-1) for s in scalars)
    host: dict[int, list[float]] = {}
    by_device: dict[torch.device, list[int]] = {}
    for i, part in enumerate(parts):
        by_device.setdefault(part.device, []).append(i)
    for indices in by_device.values():
        flat = torch.cat([parts[i].to(torch.float64) for i in indices]).tolist()  # the one transfer
        offset = 0
        for i in indices:
            n = parts[i].numel()
            host[i] = flat[offset : offset + n]
            offset += n
    stats, k = [], 0
    for p in pending:
        if p.vector is not None:
            stats.append(finish(p, host[k]))
            k += 1
        else:
            stats.append(finish(p, None))
    values = [host[k + j][0] if host[k + j] else float("nan") for j in range(len(scalars))]
    return stats, values
