"""Where this rank is, for naming a hang before the process group's watchdog fires.

The training thread only writes this rank's :class:`~.patterns.Position` (attribute writes, no I/O):
a training forward and its backward (``probes.apply_phase_marks`` on the model), a forward that
raised (``raised``, with the error: the rank left it while the others may wait in its collectives), the
monitor's exchange (``monitor``), what follows it (``optimizer``) until the optimizer's step is done
(``before_forward``, of the next step: a step post-hook on the optimizer given to the monitor), an
optimizer step that holds collectives (``step``: DeepSpeed ZeRO's, wrapped on its optimizer), and the
user's own phases (``with tdbg.phase("validation"):``, left as it was before it; an error leaving it is read
in that phase while the rank handles it); an error that left the step elsewhere is read by the watcher
(``unwinding``), not marked. The watcher thread (``watcher``)
publishes it through the store and names a stall; its verdict reaches this rank's record through
:meth:`RankLiveness.record`.

One wait on the store in the training thread, once: before the monitor's first exchange a rank
waits until every rank has arrived there (``SideChannel.arrive``), so that a monitor called on some
ranks only is named by the watcher while nobody sits in a collective paired with another one
(gloo would pair this all_gather with the others' gradient all-reduce), and ends the job with a
DiffusionDebugError on the ranks that called it.

Limits: on one process (or ``stall_timeout=0``) nothing is published and no hook is added. After
the first exchange a monitor skipped on some ranks is named while the others sit in the exchange
(where gloo may already have failed on the mismatch). A rank blocked in a call that holds the GIL
(DDP's bucket rebuild does, for a moment) cannot publish or dump its stack meanwhile: the others
name it from its last position. On GPUs collectives are asynchronous: a rank's phase is where its
Python is, which runs ahead of a stuck kernel until the next host sync. A debugger constructed on
some ranks only waits in the constructor's broadcast, before this channel exists. A rank whose
channel failed at set-up runs unwatched; the others wait for it at the first step at most twice the
stall time (plus 10 s), then go on without the check. A step the GradScaler skips calls no optimizer
step and so no step hook: the rank stays "between step k's monitor and step k+1's forward" (which
names the optimizer step among the places) until its next forward.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
import weakref
from typing import Any, Callable, Iterable, Iterator

from torch import nn

from ...config import DebugConfig
from ...core import AnomalySink
from ...core.instance_methods import StackedOnInstance
from ...core.out_of_memory import raised_at
from ...errors import DiffusionDebugError
from ...probes import ProbeHandle, apply_phase_marks
from ...record import Anomaly, make_anomaly
from .patterns import Position, Stall, error_text
from .side_channel import SideChannel
from .watcher import StallWatcher

logger = logging.getLogger("diffusion_debug.training")

_KEPT_SKIPS = 8  # the last steps a rank's monitor calls jumped over, kept to name a skipped step
_ARRIVAL_MARGIN_S = 10.0  # beyond twice the stall time, the most the first step waits for every rank
_opened = 0  # debuggers this process opened with a side channel


class RankLiveness:
    """This rank's position and, with several processes, its stall watcher. ``save()`` writes the
    report (the main process, before a verdict ends the job)."""

    def __init__(self, position: Position, step_offset: int = 0, watcher: StallWatcher | None = None):
        self.position = position
        self.step_offset = step_offset
        self.watcher = watcher
        self.sink: AnomalySink | None = None
        self.is_main = position.rank == 0
        self.save: Callable[[], Any] = lambda: None
        self._marks = ProbeHandle()
        self._last_step: Any = None
        self._stepped: dict[int, Any] = {}  # id(optimizer) -> its step post-hook's handle
        self._step_marks: list[_StepMark] = []  # on the optimizers whose step holds collectives

    @classmethod
    def open(cls, ctx: Any, config: DebugConfig, sink: AnomalySink, owner: Any, engine: str = "") -> "RankLiveness":
        """``owner``: the debugger, whose ``report().save()`` runs before a verdict ends the job
        (held weakly: the owner's finalizer holds this); ``engine``: whose collectives backward
        waits in (``Position.engine``)."""
        position = Position(rank=ctx.rank, host=socket.gethostname(), engine=engine)
        if not ctx.distributed or not config.stall_timeout:
            return cls(position, config.step_offset)
        run_dir = sink.record.run_dir
        global _opened
        _opened += 1  # every rank opens its debuggers in the same order: one key space per debugger
        try:
            channel = SideChannel.open(f"{run_dir.name}/{_opened}", ctx.rank, ctx.world_size)
            channel.publish(position)
        except Exception as error:  # a store without what the channel needs: the run goes on unwatched
            logger.warning("The training debugger cannot watch for stalls (no usable store): %r", error)
            return cls(position, config.step_offset)
        liveness = cls(position, config.step_offset)
        liveness.sink, liveness.is_main, liveness.save = sink, ctx.is_main, _weak_save(owner)
        liveness.watcher = StallWatcher(
            channel,
            position,
            stall_timeout=config.stall_timeout,
            end_job=config.stall_action == "exit",
            run_dir=run_dir,
            record=liveness.record,
        )
        liveness.watcher.start()
        return liveness

    # -- marks (the training thread) -------------------------------------------------------------
    def mark(self, phase: str, step: Any = None, error: str = "") -> None:
        """``error``: what a forward raised, in phase ``raised`` (cleared by any other mark: no stale text)."""
        self.position.phase, self.position.step, self.position.error = phase, step, error
        self.position.counter += 1

    def _next_step(self) -> Any:
        return self._last_step + 1 if isinstance(self._last_step, int) else None

    def _forward(self) -> None:
        self.position.forwards += 1
        self.mark("forward", self._next_step())
        if self.watcher is not None:  # (the training thread: an error it handles now is around the step)
            self.watcher.unwinding.forward_began()

    def _backward(self) -> None:
        self.mark("backward", self._next_step())

    def _raised(self, error: Exception) -> None:
        """The watched model's training forward raised: this rank left it, where the others may wait in its
        collectives (FSDP2's, ZeRO-3's all-gathers) until the next forward begins (a retry)."""
        self.mark("raised", self._next_step(), error_text(error))

    @contextlib.contextmanager
    def phase(self, name: str, step: Any = None) -> Iterator[None]:
        if not isinstance(name, str) or not name:
            raise DiffusionDebugError(f"A phase is a name such as 'validation' or 'save', not {name!r}.")
        before = (self.position.phase, self.position.step, self.position.error)
        self.mark(name, self._last_step if step is None else step)
        try:
            yield
        except BaseException as error:  # where the rank was when it raised, while it handles it (``unwinding``)
            self.position.left = (name, self.position.step, raised_at(error))
            raise
        finally:
            self.mark(*before)

    def _after_optimizer(self, *_: Any) -> None:
        if self.position.phase == "optimizer":  # the monitored step's update is done: on to the next forward
            self.mark("before_forward", self._next_step())

    def _watch_optimizer(self, optimizer: Any) -> None:
        """A step post-hook on ``optimizer`` (the one inside Accelerate's wrapper), once: a rank
        stalled after its update (data loading, a save) is named before the next step's forward."""
        inner = getattr(optimizer, "optimizer", optimizer)
        if self.watcher is None or id(inner) in self._stepped or not hasattr(inner, "register_step_post_hook"):
            return
        self._stepped[id(inner)] = inner.register_step_post_hook(self._after_optimizer)

    @contextlib.contextmanager
    def monitoring(self, step: Any, exchange: bool, optimizer: Any = None) -> Iterator[None]:
        """Around one ``monitor_training_step`` call; ``exchange``: the call enters the collective."""
        if not exchange:
            yield
            return
        if optimizer is not None:
            self._watch_optimizer(optimizer)
        position = self.position
        index = position.exchanges + self.step_offset if step is None else _plus(step, self.step_offset)
        if isinstance(index, int) and isinstance(self._last_step, int) and index > self._last_step + 1:
            position.skipped = [*position.skipped, *range(self._last_step + 1, index)][-_KEPT_SKIPS:]
            position.skipped_total += index - self._last_step - 1
        position.exchanges += 1
        self._last_step = index
        self.mark("monitor", index)
        if position.exchanges == 1 and self.watcher is not None:
            self._await_first_exchange()
        try:
            yield
        finally:
            self.mark("optimizer", index)

    def _await_first_exchange(self) -> None:
        """Every rank at the monitor's first exchange before this one enters it, or the verdict of
        the watcher (a monitor called on some ranks only) raised here."""
        watcher = self.watcher
        assert watcher is not None
        watcher.keep_process.set()  # a verdict ends this process by raising here, not by os._exit
        channel = watcher.channel
        # a rank whose channel failed at set-up runs unwatched: it never arrives nor publishes, so no
        # verdict comes either; past twice the stall time (and a margin) this rank goes on unwatched
        deadline = time.monotonic() + 2 * watcher.stall_timeout + _ARRIVAL_MARGIN_S
        try:
            channel.arrive(1)
            while channel.arrived(1) < channel.world_size:
                if watcher.handled.wait(0.02):
                    raise DiffusionDebugError(self._ended_message, anomaly=self._ended, run_dir=watcher.run_dir)
                if time.monotonic() > deadline:
                    logger.warning(
                        "The training debugger's stall watch saw %d of %d ranks reach their first step in %.0f s "
                        "(a rank without a usable store is not watched); going on without the check.",
                        channel.arrived(1),
                        channel.world_size,
                        2 * watcher.stall_timeout + _ARRIVAL_MARGIN_S,
                    )
                    break
        except DiffusionDebugError:
            raise
        except Exception as error:  # the store failed: enter the exchange as without the channel
            logger.warning("The training debugger could not check that every rank reached its first step: %r", error)
        watcher.keep_process.clear()

    # -- a verdict (the watcher thread) ------------------------------------------------------------
    _ended: Anomaly | None = None
    _ended_message = ""

    def record(self, stall: Stall, verdict: dict[str, Any]) -> None:
        """Record the named stall on this rank: the main process logs it (and saves the report when
        the job ends), every other rank keeps it in its own events file."""
        anomaly = stall_anomaly(stall, verdict)
        self._ended, self._ended_message = anomaly, anomaly.message  # what the first exchange raises
        assert self.sink is not None
        self.sink.emit(anomaly, log=self.is_main)
        self.sink.record.add_event("stall", **verdict)
        if verdict["end"] and self.is_main:
            try:
                self.save()
            except Exception as error:  # the report is best effort: the job ends either way
                logger.warning("Could not save the report before ending the stalled job: %r", error)
        self.sink.record.flush_to_disk()

    # -- lifecycle ----------------------------------------------------------------------------------
    def attach(self, models: nn.Module | Iterable[nn.Module], collective_steps: Iterable[Any] = ()) -> None:
        """The phase marks on ``models``; ``collective_steps``: optimizers whose ``step`` holds collectives
        (DeepSpeed ZeRO's: its gradient norm, overflow check and parameter all-gather), marked ``step``
        while a monitored step's update runs in them."""
        if self.watcher is not None and not self._marks.attached:
            self._marks = apply_phase_marks(models, self._forward, self._backward, on_error=self._raised)
            self._step_marks = [_StepMark(optimizer, "step", self) for optimizer in collective_steps]

    def detach(self) -> None:
        self._marks.remove()
        marks, self._step_marks = self._step_marks, []
        for mark in marks:
            mark.remove()
        stepped, self._stepped = self._stepped, {}
        for handle in stepped.values():
            handle.remove()

    def close(self) -> None:
        """This rank left the loop: published once more, then the watcher stops. Closed at the process's exit
        after an uncaught error (the debugger's finalizer), it is published as ``raised`` with it."""
        self.detach()
        watcher, self.watcher = self.watcher, None
        if watcher is not None:
            watcher.stop()
            ended = watcher.unwinding.position(self.position, watcher.thread)
            self.position = watcher.position = ended if ended.uncaught else self.position
        if not self.position.uncaught:
            self.mark("closed", self._last_step)
        if watcher is not None:
            with contextlib.suppress(Exception):
                watcher.channel.publish(self.position)


class _StepMark(StackedOnInstance):
    """An optimizer's ``step`` that holds collectives, marked: a rank inside the update of a monitored step
    is in phase ``step`` (where the others wait for a rank that has not entered it), then before the next
    forward. A step called elsewhere (inside backward, under Accelerate's DeepSpeed plugin) is not marked."""

    def __init__(self, owner: Any, name: str, liveness: RankLiveness):
        self.liveness = liveness
        super().__init__(owner, name)

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        liveness = self.liveness
        if not self.active or liveness.position.phase != "optimizer":
            return self.original(*args, **kwargs)
        liveness.mark("step", liveness.position.step)
        try:
            return self.original(*args, **kwargs)
        finally:
            liveness.mark("before_forward", liveness._next_step())


def stall_anomaly(stall: Stall, verdict: dict[str, Any]) -> Anomaly:
    """``rank_desync`` on the first rank to look at, its message built from the stall. An error that left that
    rank's watched forward is its cause (``follows`` its ``step_error``, which names the block): the headline."""
    rank = stall.ranks[0] if stall.ranks else 0
    details = {
        "stall": stall.to_dict(),
        "pattern": stall.pattern,
        "ranks": stall.ranks,
        "waiting": stall.waiting,
        "ended_job": bool(verdict["end"]),
        "named_by": verdict["by"],
        "stacks": "stacks-rank*.txt",
        "at": time.time(),
    }
    if stall.pattern == "raised" and stall.raised_in == "":
        details["follows"] = {"kind": "step_error", "rank": rank}
    step = stall.step if isinstance(stall.step, int) else None
    return make_anomaly("rank_desync", component="model", step=step, rank=rank, details=details)


def _weak_save(owner: Any) -> Callable[[], Any]:
    ref = weakref.ref(owner)
    return lambda: (lambda alive: alive and alive.report().save())(ref())


def _plus(step: Any, offset: int) -> Any:
    try:
        return int(step) + offset
    except (TypeError, ValueError):
        return step
