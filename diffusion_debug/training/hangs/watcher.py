"""The watcher thread of the liveness side channel: on every rank, every ``interval`` seconds it
publishes this rank's position, reads every rank's, and when no rank has moved for
``stall_timeout`` seconds in a phase that holds a collective (forward, backward, the monitor's
exchange) while the ranks disagree, proposes a verdict naming the stall
(:func:`patterns.name_stall`). Whoever proposes first names it for all: every rank's watcher then
dumps its process's Python stacks (``faulthandler``, all threads) to ``stacks-rank<r>.txt`` in
the run directory, records the anomaly (``record``), acknowledges, and when the verdict ends the
job, waits for every rank's acknowledgement (a few seconds at most) and ends its process with
``os._exit(EXIT_CODE)`` after flushing the logs: the launcher sees every rank fail at once. While the
training thread unwinds with an error (``unwinding``) this rank's position is published as ``raised``.

Every rank watches (not only the main one), so a rank whose Python is stuck holding the GIL
cannot keep the others from naming it. "Not moved" is judged on this rank's clock from when a
rank's counter last changed, never from another host's timestamps.

A stall is named once it has held for two looks: the same ranks named, every other rank unmoved. A
position is published up to a look late, so a snapshot read while ranks leave a long wait would blame the
first to move; the others' moves reach the store within those looks and end that candidate. The ranks
named may keep moving meanwhile (a rank running training forwards of its own, one after the other, while
the others wait in a collective): that is the stall, not a snapshot going stale.

Limits: a rank whose watcher is kept from publishing for more than a look (the GIL held) may still leave
a half-moved snapshot. The anomaly is recorded from the watcher thread: a waiting rank is frozen by
definition (not moved for ``stall_timeout``), but one that resumes at that very moment, or a rank named
that keeps moving, may write to its record concurrently. A stall named under the ``wait`` action is
named once; once a rank that waited in it moves, the next one needs a full ``stall_timeout`` of waiting
again. A rank that closed its debugger has no watcher: it is named (``left_early``) but dumps no stack.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from .patterns import WAITING_PHASES, Position, Stall, name_stall
from .side_channel import SideChannel, verdict_of
from .unwinding import Unwinding

logger = logging.getLogger("diffusion_debug.training")

EXIT_CODE = 75
"""What a process ended by a stall verdict exits with (``EX_TEMPFAIL``)."""


def dump_stacks(run_dir: Path, rank: int, header: str) -> Path:
    """Every thread's Python stack of this process, appended to ``stacks-rank<rank>.txt``."""
    path = Path(run_dir) / f"stacks-rank{rank}.txt"
    with open(path, "a", encoding="utf-8") as out:
        out.write(f"# {header}\n")
        out.flush()
        faulthandler.dump_traceback(file=out, all_threads=True)
        out.write("\n")
    return path


class StallWatcher:
    """The daemon thread; :meth:`start` once, :meth:`stop` at close (idempotent).

    ``position`` is this rank's (written by the training thread); ``record(stall, verdict)`` records
    a named stall on this rank; ``end_allowed()`` is False while the training thread will end the
    job itself (it raises in the monitor's first exchange)."""

    def __init__(
        self,
        channel: SideChannel,
        position: Position,
        *,
        stall_timeout: float,
        end_job: bool,
        run_dir: Path,
        record: Callable[[Stall, dict[str, Any]], None],
        clock: Callable[[], float] = time.monotonic,
        thread: threading.Thread | None = None,
    ):
        self.channel = channel
        self.position = position
        self.thread = threading.current_thread() if thread is None else thread
        """The training thread (the one that built the watcher): an error it unwinds with is published."""
        self.unwinding = Unwinding(self.thread)
        self.stall_timeout = stall_timeout
        self.end_job = end_job
        self.run_dir = run_dir
        self.record = record
        self.clock = clock
        self.interval = min(1.0, stall_timeout / 6)
        self.handled = threading.Event()
        """Set once a verdict that ends the job has been handled on this rank."""
        self.keep_process = threading.Event()
        """Set by the training thread while it ends the job itself (raising): no os._exit then."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._seen: dict[int, tuple[int, float]] = {}
        self.next_verdict = 0  # the number of the next verdict to look for or propose
        self._named: dict[int, int] = {}  # the waiting ranks of the last stall named, and their counters
        self._held_since: tuple[Any, float] | None = None  # the stall seen at the last looks, and since when
        self._failed = False

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="diffusion-debug-stall-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self.interval + TIMEOUT_JOIN)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.tick()
            except Exception as error:  # the channel failed: the run goes on unwatched
                if not self._failed:
                    self._failed = True
                    logger.warning("The training debugger's stall watch lost its side channel: %r", error)

    # -- one look ------------------------------------------------------------------------------------
    def tick(self) -> None:
        self.channel.publish(self.unwinding.position(self.position, self.thread))  # an error left the step?
        positions = self.channel.read()
        if self._named and any(p is None or self._named.get(p.rank, p.counter) != p.counter for p in positions):
            # the stall named last resolves: every rank's wait counts from now (the positions published
            # meanwhile are up to an interval old, and would name a stall out of a half-moved snapshot)
            self._named, self._seen, self._held_since = {}, {}, None
        waiting = self._waiting(positions)
        stall = None if any(p is None for p in positions) else name_stall(positions)  # type: ignore[arg-type]
        held = self._held(stall, positions)  # type: ignore[arg-type]  # a stall: every rank published
        number = self.next_verdict
        verdict = self.channel.verdict(number)
        if verdict is None and waiting and not self._named and stall is not None and held:
            end = self.end_job or stall.definite
            verdict = self.channel.propose(number, verdict_of(stall, end=end, by=self.position.rank))
        if verdict is not None:
            self._named = dict(waiting) or {p.rank: p.counter for p in positions if p is not None}
            # a closed rank's watcher is gone, and so is one exiting with an uncaught error (closed at the exit)
            live = sum(p is None or (p.phase != "closed" and not p.uncaught) for p in positions)
            self.handle(number, verdict, expected=live)

    def _waiting(self, positions: list[Position | None]) -> tuple[tuple[int, int], ...]:
        """The ranks (and their counters) frozen for ``stall_timeout`` (this clock) in a phase that
        holds a collective; empty until every rank has published."""
        now = self.clock()
        for p in positions:
            if p is not None and self._seen.get(p.rank, (None,))[0] != p.counter:
                self._seen[p.rank] = (p.counter, now)
        if any(p is None for p in positions):
            return ()
        return tuple(
            (p.rank, p.counter)
            for p in positions
            if p is not None and p.phase in WAITING_PHASES and now - self._seen[p.rank][1] >= self.stall_timeout
        )

    def _held(self, stall: Stall | None, positions: list[Position]) -> bool:
        """``stall`` has held for :data:`SETTLED_LOOKS` looks (this clock): the same ranks named, and every
        other rank at the same counter. A rank publishes its position up to a look late, so a snapshot read
        while the ranks leave a wait that named nothing (all in one place: a rank slow inside the forward whose
        all-gather the others wait in) holds a rank that went on and the others' old places, which would name
        the rank that went on as holding them up; the others' moves, published meanwhile, end it. The ranks
        named may move (their own training forwards, one after the other): they are what holds the others."""
        if stall is None:
            self._held_since = None
            return False
        key = (tuple(stall.ranks), tuple((p.rank, p.counter) for p in positions if p.rank not in stall.ranks))
        now = self.clock()
        if self._held_since is None or self._held_since[0] != key:
            self._held_since = (key, now)
        return now - self._held_since[1] >= SETTLED_LOOKS * self.interval

    # -- a verdict: every rank's part --------------------------------------------------------------
    def handle(self, number: int, verdict: dict[str, Any], expected: int | None = None) -> None:
        """Dump, record, acknowledge; end the process when the verdict ends the job (after the
        ``expected`` ranks acknowledged, every rank by default)."""
        self.next_verdict = number + 1
        stall = Stall.from_dict(verdict["stall"])
        try:
            dump_stacks(self.run_dir, self.position.rank, f"stall {number}: {stall.text}")
        except OSError as error:
            logger.warning("Could not write this rank's stacks for the stall: %r", error)
        try:
            self.record(stall, verdict)
        except Exception as error:  # the record failing must not keep a stalled job alive
            logger.warning("Could not record the stall on this rank: %r", error)
        self.channel.acknowledge(number)
        if not verdict["end"]:
            return
        self.wait_for_acknowledgements(number, self.channel.world_size if expected is None else expected)
        self.handled.set()
        if not self.keep_process.is_set():
            end_process(stall)

    def wait_for_acknowledgements(self, number: int, expected: int) -> None:
        """Until ``expected`` ranks recorded the verdict (their stacks are on disk), a few seconds at most."""
        deadline = time.monotonic() + max(5.0, 2 * self.interval)
        while self.channel.acknowledged(number) < expected and time.monotonic() < deadline:
            time.sleep(0.05)


SETTLED_LOOKS = 2
"""The looks (of ``interval`` s) a stall must have held (the same ranks named, the others unmoved) to be named."""
TIMEOUT_JOIN = 6.0  # the watcher may be in a store round trip (side_channel.TIMEOUT_SECONDS) when stopped


def end_process(stall: Stall) -> None:
    """Say why on stderr, flush what the logs hold, and end this process now (no cleanup that
    could wait in a collective)."""
    for handler in logging.getLogger().handlers + logger.handlers:
        try:
            handler.flush()
        except Exception:  # pragma: no cover - a broken handler must not keep the process alive
            pass
    try:
        sys.stdout.flush()
        sys.stderr.write(f"diffusion-debug: ending this process (exit {EXIT_CODE}), the job stalled: {stall.text}\n")
        sys.stderr.flush()
    finally:
        os._exit(EXIT_CODE)
