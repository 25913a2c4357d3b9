"""What the training debugger knows about processes: rank, local rank, host, world size, the
collectives of a monitored step, and the run directory's name shared by every rank.

Every rank calls the same collective in the same monitored step with a tensor of the same
length (the step's :meth:`RankContext.all_reduce_max`; :meth:`RankContext.gather` on steps every
rank knows are special), so decisions taken from what comes back (raise, skip) are the same on
all ranks and no rank is left waiting in a collective. Uses ``torch.distributed`` directly on the
default group (gloo or nccl, as Accelerate set it up).
"""

from __future__ import annotations

import os
import socket
from typing import Any, Callable

import torch
import torch.distributed as dist

from ...errors import DiffusionDebugError
from ...record import RunRecord
from ...stats import read_now


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
        self.local_rank = _local_rank(accelerator, self.rank)
        self.host = socket.gethostname()
        if self.world_size > 1 and not (dist.is_available() and dist.is_initialized()):
            self.world_size = 1  # e.g. a launcher without a process group: nothing to exchange
        self._collective_device = self.device
        if self.world_size > 1 and dist.get_backend() == "gloo":
            self._collective_device = torch.device("cpu")
        self.distributed = self.world_size > 1
        """Several processes: read six times a step, an attribute (a property was a call each)."""

    def gather(self, vector: torch.Tensor) -> torch.Tensor:
        """``[world_size, n]``: every rank's ``vector`` (1-d float64), on every rank."""
        if not self.distributed:
            return vector.unsqueeze(0)
        local = vector.to(self._collective_device).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local)
        return torch.stack(parts).to(vector.device)

    def all_reduce_max(self, values: list[int]) -> list[int]:
        """The element-wise maximum of every rank's ``values`` (int64, the same length on every
        rank), on every rank: one collective whose size does not grow with the world."""
        if not self.distributed:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.int64, device=self._collective_device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return read_now(tensor)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The element-wise sum of every rank's ``tensor`` (float64, the same length on every rank)."""
        if not self.distributed:
            return tensor
        local = tensor.to(self._collective_device).contiguous()
        dist.all_reduce(local, op=dist.ReduceOp.SUM)
        return local.to(tensor.device)

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


def _local_rank(accelerator: Any, rank: int) -> int:
    """The process's index on its machine (Accelerate's, else the launcher's ``LOCAL_RANK``)."""
    if accelerator is not None and hasattr(accelerator, "local_process_index"):
        return int(accelerator.local_process_index)
    try:
        return int(os.environ.get("LOCAL_RANK", rank))
    except ValueError:
        return rank


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
    none waits in the broadcast; so is one on another rank (a node where the directory is not
    there): every rank joins the run or none does, since a rank left out would skip the step's
    collectives that the others run."""
    if not ctx.distributed:
        return open_record(None)
    record, name, error = None, None, None
    if ctx.is_main:
        try:
            record = open_record(None)
            name = record.run_dir.name
        except Exception as failure:  # an OSError too: the other ranks must not wait in the broadcast
            error = f"{type(failure).__name__}: {failure}"
            error = str(failure) if isinstance(failure, DiffusionDebugError) else error
    name, error = ctx.broadcast_object((name, error))
    if error is not None:
        raise DiffusionDebugError(error)
    own = None
    if record is None:
        try:
            record = open_record(name)
        except Exception as failure:
            own = f"rank {ctx.rank} could not join the run directory {name!r} ({type(failure).__name__}: {failure})"
    errors = [e for e in ctx.gather_objects(own) if e is not None]
    if errors:
        if record is not None:
            record.close()
        raise DiffusionDebugError(errors[0])
    return record
