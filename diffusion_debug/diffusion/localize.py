"""Name the module that made a NaN/Inf (or a near-overflow): replay one call with full probes.

The replay runs the same module on the same arguments under ``torch.no_grad()`` with every
module probed, with the torch RNG state saved and restored around it, and returns the readings.

Limits: a module with hidden state that changes per call (a diffusers cache hook, a stateful
attention processor) sees one extra call; a replay only happens after something went wrong.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..probes import ModuleReading, Probe
from ..stats import cuda_devices


def replay_readings(module: nn.Module, args: tuple, kwargs: dict, prefix: str = "") -> list[ModuleReading]:
    """Run ``module(*args, **kwargs)`` once with full probes; readings named inside the component
    (``prefix`` + name inside ``module``)."""
    devices = cuda_devices((args, kwargs, list(module.parameters())[:1]))
    probe = Probe(module, "full")
    with torch.random.fork_rng(devices=devices), torch.no_grad(), probe.attach():
        module(*args, **kwargs)
    readings = probe.collect()
    if not prefix:
        return readings
    return [dataclasses.replace(r, module=f"{prefix}.{r.module}" if r.module else prefix) for r in readings]
