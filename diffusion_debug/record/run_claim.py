"""A live run's hold on its directory, so that two live runs never share one.

A record holds an exclusive ``flock`` on its run directory from the moment it opens it until it
closes (or its process ends, however it ends: the kernel drops the lock). A second live run
asking for a name that is held, in this process or another, gets ``NAME-2`` (``NAME-3`` ...)
instead of writing into the first one's files; a finished run's directory is taken again as
before. A distinct directory rather than an error, because the common way to meet this is a
notebook cell run twice, where the first debugger is still alive until the second one replaces it.

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

MAX_SUFFIX = 100
"""How many ``NAME-N`` are tried before a held name is an error."""


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
    ``run_name-2``, ``run_name-3`` ... when a live run holds it; one DiffusionDebugError when the
    first :data:`MAX_SUFFIX` names are all held."""
    for number in range(1, MAX_SUFFIX + 1):
        name = run_name if number == 1 else f"{run_name}-{number}"
        run_dir = prepare_run_dir(output_dir, name, exclusive=exclusive)
        lock = RunLock.hold(run_dir)
        if lock is not None:
            return run_dir, lock
    raise DiffusionDebugError(
        f"The run name {run_name!r} and {run_name}-2 to {run_name}-{MAX_SUFFIX} are all in use by live runs; "
        "close some of them, or set another run_name."
    )
