"""``buffers_kept(module)``: a one-off call (a replay, an inspection) leaves the module's buffers as
they were. A module in training mode may change its buffers in place when called (BatchNorm's
running statistics and ``num_batches_tracked``); those of modules in training mode are copied
before the call and written back after it (the batch-norm kernel changes its statistics without
bumping their version counter, so every one is written back).

>>> import torch
>>> model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
>>> with buffers_kept(model):
...     _ = model(torch.randn(8, 3))
>>> torch.equal(model[1].running_mean, torch.zeros(3)), int(model[1].num_batches_tracked)
(True, 0)

Limits: modules in eval mode are not copied (their buffers stay put in every torch module, and a
large pipeline in eval mode costs nothing); a buffer replaced by another tensor (not changed in
place) is not put back; inference tensors cannot change outside ``inference_mode`` and are skipped.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn


@contextlib.contextmanager
def buffers_kept(module: nn.Module) -> Iterator[None]:
    saved = [
        (buffer, buffer.detach().clone())
        for m in module.modules()
        if m.training
        for buffer in m.buffers(recurse=False)
        if buffer is not None and not buffer.is_inference()
    ]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, copy in saved:
                buffer.copy_(copy)
