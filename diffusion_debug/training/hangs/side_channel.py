"""The liveness side channel: each rank's position, the verdict on a stall and its acknowledgements,
through the process group's key-value store (never a collective, so it cannot hang with them).

Keys live under ``diffusion_debug/<run name>/`` of the default group's store (``TCPStore`` under
torchrun and ``accelerate launch``), on a connection of its own (``clone()``) whose timeout is a
few seconds; the default group's store and its 30-minute timeout are left as they are.
Every call is one round trip that does not wait for another rank: ``set``, ``check``, ``add``,
``compare_set``, and ``get``/``multi_get`` only of keys known to exist.

Limits: a store without ``clone()`` is used as it is (its own timeout); a store that stops
answering raises ``DistStoreError`` (or blocks for its timeout) in the watcher thread, never in
the training loop's collectives.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

import torch.distributed as dist

from .patterns import Position, Stall

TIMEOUT_SECONDS = 5.0
"""Store round trips of the side channel give up after this."""


class SideChannel:
    """One rank's view of the store: publish its position, read everyone's, agree on verdicts."""

    def __init__(self, store: Any, rank: int, world_size: int):
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self._keys = [f"rank/{r}" for r in range(world_size)]
        self._all_published = False

    @classmethod
    def open(cls, run_name: str, rank: int, world_size: int) -> "SideChannel":
        """On the default process group's store (``torch.distributed`` initialised)."""
        store = dist.distributed_c10d._get_default_store()
        if hasattr(store, "clone"):
            store = store.clone()  # a connection of its own: its timeout, and no lock shared with torch
            store.set_timeout(datetime.timedelta(seconds=TIMEOUT_SECONDS))
        return cls(dist.PrefixStore(f"diffusion_debug/{run_name}/", store), rank, world_size)

    def publish(self, position: Position) -> None:
        self.store.set(self._keys[self.rank], json.dumps(position.to_dict(), default=str))

    def read(self) -> list[Position | None]:
        """Every rank's last published position (None: not published yet)."""
        if not self._all_published:
            present = [self.store.check([key]) for key in self._keys]
            self._all_published = all(present)
            if not self._all_published:
                return [self._get(key) if there else None for key, there in zip(self._keys, present)]
        return [Position.from_dict(json.loads(raw)) for raw in self.store.multi_get(self._keys)]

    def _get(self, key: str) -> Position:
        return Position.from_dict(json.loads(self.store.get(key)))

    # -- verdicts: the first rank to propose one names the stall for all -----------------------------
    def propose(self, number: int, verdict: dict[str, Any]) -> dict[str, Any]:
        """Verdict ``number`` as agreed: ``verdict`` if no rank proposed one before, else theirs."""
        raw = self.store.compare_set(f"verdict/{number}", "", json.dumps(verdict, default=str))
        return json.loads(raw)

    def verdict(self, number: int) -> dict[str, Any] | None:
        key = f"verdict/{number}"
        return json.loads(self.store.get(key)) if self.store.check([key]) else None

    def acknowledge(self, number: int) -> int:
        """This rank has dumped its stack and recorded verdict ``number``: how many ranks have."""
        return self.store.add(f"ack/{number}", 1)

    def acknowledged(self, number: int) -> int:
        return self.store.add(f"ack/{number}", 0)

    # -- the first exchange: is every rank coming? ------------------------------------------------
    def arrive(self, exchange: int) -> int:
        return self.store.add(f"exchange/{exchange}", 1)

    def arrived(self, exchange: int) -> int:
        return self.store.add(f"exchange/{exchange}", 0)


def verdict_of(stall: Stall, *, end: bool, by: int) -> dict[str, Any]:
    """What goes in the store: the stall, whether every rank ends the job, who named it."""
    return {"stall": stall.to_dict(), "end": end, "by": by}
