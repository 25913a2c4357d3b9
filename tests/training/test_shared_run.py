"""``ranks.processes.open_shared_run``: every rank joins the run directory or none does (a rank left
out would skip the step's collectives that the others run), with a stand-in for the collectives that
plays what each rank would have received."""

from __future__ import annotations

import pytest

from diffusion_debug import DiffusionDebugError
from diffusion_debug.training.ranks.processes import open_shared_run


class _Ranks:
    def __init__(self, rank: int, gathered_from_others: dict[int, str | None]):
        self.distributed, self.rank, self.is_main, self.world_size = True, rank, rank == 0, 2
        self._others = gathered_from_others
        self.broadcast: object = None

    def broadcast_object(self, obj):
        self.broadcast = obj
        return obj if self.is_main else ("run-1", None)

    def gather_objects(self, obj):
        return [obj if r == self.rank else self._others.get(r) for r in range(self.world_size)]


class _Record:
    def __init__(self, name: str):
        self.run_dir = type("Dir", (), {"name": name})()
        self.closed = False

    def close(self):
        self.closed = True


def test_a_rank_that_cannot_join_makes_every_rank_give_up_with_its_reason():
    def cannot_join(name):
        raise PermissionError(13, "Permission denied", f"/nfs/out/{name}")

    with pytest.raises(DiffusionDebugError) as raised:
        open_shared_run(_Ranks(1, {0: None}), cannot_join)
    assert str(raised.value) == (
        "rank 1 could not join the run directory 'run-1' (PermissionError: [Errno 13] Permission denied: "
        "'/nfs/out/run-1')"
    )

    opened = []
    main = _Ranks(0, {1: str(raised.value)})
    with pytest.raises(DiffusionDebugError, match="^rank 1 could not join the run directory 'run-1'"):
        open_shared_run(main, lambda name: opened.append(_Record("run-1")) or opened[-1])
    assert main.broadcast == ("run-1", None) and opened[0].closed  # the main's run is let go, not half-kept


def test_an_os_error_on_the_main_process_reaches_every_rank_instead_of_a_wait():
    def full_disk(name):
        raise OSError(28, "No space left on device")

    main = _Ranks(0, {})
    with pytest.raises(DiffusionDebugError, match=r"^OSError: \[Errno 28\] No space left on device$"):
        open_shared_run(main, full_disk)
    assert main.broadcast == (None, "OSError: [Errno 28] No space left on device")


def test_when_every_rank_joins_each_has_the_main_process_s_directory():
    joined = open_shared_run(_Ranks(1, {0: None}), _Record)
    assert joined.run_dir.name == "run-1" and not joined.closed
