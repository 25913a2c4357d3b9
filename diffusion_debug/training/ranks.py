"""What the training debugger knows about processes: rank, world size, the one small collective
per monitored step, and the run directory's name shared by every rank.

Every rank calls :meth:`RankContext.gather` in the same monitored step with a vector of the
same length; every rank receives every rank's vector, so decisions taken from the gathered
matrix (raise, skip) are the same on all ranks and no rank is left waiting in a collective.
Uses ``torch.distributed`` directly on the default group (gloo or nccl, as Accelerate set it up).
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..errors import DiffusionDebugError
from ..record import Anomaly, RunRecord


class RankContext:
    """Rank, world size, device and main-process flag, from an Accelerator or torch.distributed."""

    def __init__(self, accelerator: Any = None, device: torch.device | None = None):
        self.accelerator = accelerator
        if accelerator is not None:
            self.rank = int(accelerator.process_index)
            self.world_size = int(accelerator.num_processes)
            self.is_main = bool(accelerator.is_main_process)
            self.device = torch.device(accelerator.device)
        else:
            initialised = dist.is_available() and dist.is_initialized()
            self.rank = dist.get_rank() if initialised else 0
            self.world_size = dist.get_world_size() if initialised else 1
            self.is_main = self.rank == 0
            self.device = device or torch.device("cpu")
        if self.world_size > 1 and not (dist.is_available() and dist.is_initialized()):
            self.world_size = 1  # e.g. a launcher without a process group: nothing to exchange
        self._collective_device = self.device
        if self.world_size > 1 and dist.get_backend() == "gloo":
            self._collective_device = torch.device("cpu")

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def gather(self, vector: torch.Tensor) -> torch.Tensor:
        """``[world_size, n]``: every rank's ``vector`` (1-d float64), on every rank."""
        if not self.distributed:
            return vector.unsqueeze(0)
        local = vector.to(self._collective_device).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local)
        return torch.stack(parts).to(vector.device)

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` on every rank (only in steps all ranks know are special)."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: Any) -> Any:
        """Main's ``obj`` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()


def environment_world_size() -> int:
    """``WORLD_SIZE`` as the launcher (torchrun, accelerate launch) set it; 1 when unset or unreadable."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def open_shared_run(ctx: RankContext, open_record: Callable[[str | None], RunRecord]) -> RunRecord:
    """The run's record on this rank, every rank in one directory: the main process opens the run
    first (``open_record(None)``: it chooses the directory and holds it, ``NAME-2`` when a live run
    holds ``run_name``), then broadcasts the directory's name, which the others join
    (``open_record(name)``).

    A failure to open it on the main process is broadcast too, so every rank raises it and
    none waits in the broadcast."""
    if not ctx.distributed:
        return open_record(None)
    record, name, error = None, None, None
    if ctx.is_main:
        try:
            record = open_record(None)
            name = record.run_dir.name
        except DiffusionDebugError as failure:
            error = str(failure)
    name, error = ctx.broadcast_object((name, error))
    if error is not None:
        raise DiffusionDebugError(error)
    return record if record is not None else open_record(name)


def exchange_anomalies(
    ctx: RankContext, anomalies: list[Anomaly], failed: Callable[[Exception], Anomaly]
) -> list[Anomaly]:
    """In a step every rank knows is special: gather each rank's own anomalies with their local
    details, so the main process records them as that rank saw them. A rank that cannot
    serialise its own still joins, with ``failed(error)`` instead."""
    try:
        mine = [a.to_dict() for a in anomalies if a.rank == ctx.rank]
    except Exception as error:
        mine = [failed(error).to_dict()]
    return [Anomaly.from_dict(d) for per_rank in ctx.gather_objects(mine) for d in per_rank]
