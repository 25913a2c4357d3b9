"""A live run's hold on its directory, so that two live runs never share one.

A record holds an exclusive ``flock`` on its run directory from the moment it opens it until it
closes (or its process ends, however it ends: the kernel drops the lock). A run asking for a name
that is held by a live run, in this process or another, or whose directory holds an earlier run
(its ``events.jsonl`` or ``summary.json``), gets ``NAME-2`` (``NAME-3`` ...) instead of writing
into the other one's files: a run directory holds one run, so a killed run's events are never read
against an earlier run's summary, and nothing of the earlier run is lost. A distinct directory
rather than an error, because the common way to meet this is a script or a notebook cell run
again with the same ``run_name``.

Limits: where ``flock`` is missing (Windows) or refused (some network filesystems) the directory
is used without a hold, as before. A process forked while the run is live (a DataLoader worker)
keeps the hold with it until that process ends.
"""

from __future__ import annotations

import os
import weakref
from pathlib import Path

from ..errors import DiffusionDebugError
from .run_dir import prepare_run_dir

MAX_SUFFIX = 10_000
"""How many ``NAME-N`` are tried before a taken name is an error."""
RUN_FILES = ("events.jsonl", "summary.json")
"""What an earlier run left in its directory."""


class RunLock:
    """An exclusive ``flock`` on a run directory; :meth:`release` is idempotent, and a lock that is
    garbage-collected is released too."""

    def __init__(self, fd: int | None):
        self._release = weakref.finalize(self, os.close, fd) if fd is not None else None

    @classmethod
    def hold(cls, run_dir: Path) -> RunLock | None:
        """The lock on ``run_dir``, or None when another live run holds it."""
        try:
            import fcntl
        except ImportError:  # pragma: no cover - Windows: no flock, no hold
            return cls(None)
        flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
        fd = os.open(run_dir, flags)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except OSError:  # a filesystem without locks: used without a hold
            os.close(fd)
            return cls(None)
        return cls(fd)

    @property
    def held(self) -> bool:
        return self._release is not None and self._release.alive

    def release(self) -> None:
        if self._release is not None:
            self._release()


def claim_run_dir(output_dir: str | os.PathLike, run_name: str, *, exclusive: bool = False) -> tuple[Path, RunLock]:
    """``output_dir/run_name`` created (as :func:`~.run_dir.prepare_run_dir`) and held, or
    ``run_name-2``, ``run_name-3`` ... when a live run holds it or it holds an earlier run; one
    DiffusionDebugError when the first :data:`MAX_SUFFIX` names are all taken."""
    for number in range(1, MAX_SUFFIX + 1):
        name = run_name if number == 1 else f"{run_name}-{number}"
        if holds_run(Path(output_dir) / name):
            continue
        run_dir = prepare_run_dir(output_dir, name, exclusive=exclusive)
        lock = RunLock.hold(run_dir)
        if lock is None:
            continue
        if holds_run(run_dir):  # an earlier run finished between the look and the lock
            lock.release()
            continue
        return run_dir, lock
    raise DiffusionDebugError(
        f"The run name {run_name!r} and {run_name}-2 to {run_name}-{MAX_SUFFIX} are all taken by live or earlier "
        "runs; set another run_name."
    )


def holds_run(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds an earlier run's record (:data:`RUN_FILES`)."""
    return any(os.path.lexists(run_dir / name) for name in RUN_FILES)  # a link counts, wherever it points
