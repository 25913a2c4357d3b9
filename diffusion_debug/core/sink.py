"""The one anomaly sink of a run (:class:`AnomalySink`) and the layout of a ``debugger_error``."""

from __future__ import annotations

import logging
import traceback
import warnings
from typing import Any, Hashable

from ..config import DebugConfig
from ..errors import DiffusionDebugError
from ..record import KINDS, Anomaly, RunRecord, distinct_details, make_anomaly, severity_rank

_LOG_LEVELS = {"info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
RAISED = "_diffusion_debug_raised"
"""The attribute set (to its ``where``) on an error of the debugger's own that a guard re-raised
with ``strict=True``, once recorded: an outer guard passes it on without recording it again, and
the OOM watch does not take it for the user's (:func:`raised_by_debugger`). On the error, not held
by the sink: an OOM's frames hold the failed call's tensors."""


class AnomalySink:
    """Folds, records, logs, warns and queues every anomaly of one run.

    Folding: an anomaly whose key matches one still *open* is not recorded again; the first one's
    ``details["count"]`` and ``details["last_step"]`` follow the repeats (``last_run`` too, a repeat in a
    later run of the window: its step counts from 0 again), and ``events.jsonl``
    gets a one-line ``anomaly_repeated`` event. What keeps a key open is the front-end's window:
    :meth:`end_step` closes the keys not seen since the last call (training: repeats on
    consecutive steps fold), :meth:`new_window` closes all of them (inference: one pipeline run).
    ``once=True`` keys (static checks) stay closed for the debugger's life, until :meth:`clear`.
    """

    def __init__(self, record: RunRecord, config: DebugConfig, logger: logging.Logger):
        self.record = record
        self.config = config
        self.logger = logger
        self.errors: list[Anomaly] = []
        """Error-severity anomalies (repeats included) the policy has not acted on yet."""
        self._open: dict[Hashable, Anomaly] = {}
        self._touched: set[Hashable] = set()
        self._once: set[Hashable] = set()
        record.on_stream_lost = self.stream_lost
        if record.stream_cause is not None:  # lost already while the record was opened
            self.stream_lost(record.stream_cause)

    def emit(self, anomaly: Anomaly, key: Hashable | None = None, *, once: bool = False, log: bool = True) -> bool:
        """Take ``anomaly``; True when it was recorded as a new one (not folded). ``log=False``:
        recorded but not logged (another process logs it: one line per anomaly). ``key``: the kind's
        fold key unless given."""
        kind = KINDS.get(anomaly.kind)
        if kind is None:  # a typo would otherwise reach the record with a generic guide entry
            raise DiffusionDebugError(
                f"Unknown anomaly kind {anomaly.kind!r}; register it with register_kind() first."
            )
        key = kind.fold_key(anomaly) if key is None else key
        if once:
            if key in self._once:
                return False
            self._once.add(key)
        self._touched.add(key)
        first = self._open.get(key)
        if first is not None:
            first.details["count"] = first.details.get("count", 1) + 1
            if anomaly.step is not None:
                first.details["last_step"] = anomaly.step
            run = anomaly.details.get("run")
            later_run = run is not None and run != first.details.get("run")  # (FreeInit's next pass: its steps anew)
            if later_run:
                first.details["last_run"] = run
            self.record.add_event(
                "anomaly_repeated",
                kind=first.kind,
                rank=first.rank,
                component=first.component,
                module=first.module,
                parameter=first.parameter,
                step=anomaly.step,
                count=first.details["count"],
                **({"run": run} if later_run else {}),
                **({"details": distinct_details(kind.name, first.details)} if kind.distinct_by else {}),
            )
            if anomaly.severity == "error":
                self.errors.append(first)
            return False
        anomaly.details.setdefault("count", 1)
        self._open[key] = anomaly
        self.record.add_anomaly(anomaly)
        if log:
            self._log(anomaly)
        if self.config.policy == "warn" and severity_rank(anomaly.severity) >= severity_rank(
            self.config.warn_severity
        ):
            warnings.warn(
                f"diffusion-debug {anomaly.kind} at {anomaly.where() or 'the run'}: {anomaly.message}",
                RuntimeWarning,
                stacklevel=4,
            )
        if anomaly.severity == "error":
            self.errors.append(anomaly)
        return True

    def _log(self, anomaly: Anomaly) -> None:
        level = _LOG_LEVELS[anomaly.severity]
        if level >= _LOG_LEVELS[self.config.log_level]:
            where, also = anomaly.where() or "the run", anomaly.details.get("also_on_ranks")
            if also:  # the same anomaly on other ranks of the step: one line for all (training)
                ranks = f"{len(also)} rank" + ("s" if len(also) > 1 else "")
                where += f" (first on rank {anomaly.rank} at step {anomaly.step}, then {ranks})"
            self.logger.log(level, "%s at %s: %s", anomaly.kind, where, anomaly.message)

    def take_errors(self) -> list[Anomaly]:
        """The queued error anomalies, oldest first; the queue is emptied."""
        errors, self.errors = self.errors, []
        return errors

    def end_step(self) -> None:
        """Close the keys not emitted since the last call."""
        if self._open:  # none open (a clean run's steps): no comprehension, a Python call a step
            self._open = {k: a for k, a in self._open.items() if k in self._touched}
        self._touched = set()

    def new_window(self) -> None:
        """Close every key (a new pipeline run)."""
        self._open.clear()
        self._touched.clear()

    def clear(self) -> None:
        """Forget every key and queued error (``clear_debug_history``)."""
        self.new_window()
        self._once.clear()
        self.errors.clear()

    # -- the debugger's own failures ---------------------------------------------------------------
    def debugger_error(self, where: str, error: BaseException, *, step: int | None = None, rank: int = 0) -> Anomaly:
        """Record that the debugger's ``where`` failed with ``error`` and the run went on."""
        anomaly = debugger_failure(where, error, step=step, rank=rank)
        self.emit(anomaly, ("debugger_error", where, rank))
        return anomaly

    def raised(self, where: str, error: BaseException, *, step: int | None = None, rank: int = 0) -> None:
        """``strict=True``: the debugger's own ``error`` goes on to the caller. Recorded once, by the
        innermost guard it leaves (a ``debugger_error`` that says it was raised, on disk at once:
        the run may end there), and marked (:data:`RAISED`) so that no one records it again."""
        if raised_by_debugger(error):
            return
        mark_raised(error, where)
        self.emit(debugger_failure(where, error, step=step, rank=rank, raised=True), ("debugger_error", where, rank))
        self.record.flush_to_disk()

    def stream_lost(self, error: BaseException) -> None:
        """``events.jsonl`` could not be written: a ``debugger_error`` and one RuntimeWarning
        (whatever the policy); the run goes on, the record is kept in memory for ``save()``."""
        anomaly = self.debugger_error("events.jsonl", error, rank=self.record.rank)
        warned = self.config.policy == "warn" and severity_rank(anomaly.severity) >= severity_rank(
            self.config.warn_severity
        )
        if not warned:  # the sink did not warn already: the one warning
            warnings.warn(f"diffusion-debug debugger_error: {anomaly.message}", RuntimeWarning, stacklevel=2)

    def guard(self, where: str, *, step: int | None = None, rank: int = 0) -> "_Guard":
        """Run a measurement: its failure is recorded (on ``rank``) and the run goes on (unless ``strict``)."""
        return _Guard(self, where, step, rank)


class _Guard:
    """:meth:`AnomalySink.guard`'s context manager: a class, not a generator's (a watched call enters
    some thirty guards; a generator's costs twice the Python calls)."""

    __slots__ = ("sink", "where", "step", "rank")

    def __init__(self, sink: AnomalySink, where: str, step: int | None, rank: int):
        self.sink, self.where, self.step, self.rank = sink, where, step, rank

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, error: BaseException | None, traceback: Any) -> bool:
        if error is None or isinstance(error, DiffusionDebugError) or not isinstance(error, Exception):
            return False
        if self.sink.config.strict:
            self.sink.raised(self.where, error, step=self.step, rank=self.rank)
            return False
        self.sink.debugger_error(self.where, error, step=self.step, rank=self.rank)
        return True


def debugger_failure(
    where: str,
    error: BaseException | None,
    *,
    step: Any = None,
    rank: int = 0,
    component: str = "",
    raised: bool = False,
) -> Anomaly:
    """The one ``debugger_error`` anomaly for a failure of the debugger's own ``where`` (the sink
    emits it at once; the training debugger gathers it with the step's rows first); its sentence
    is the kind's, from ``where``, the error and the component. ``raised``: re-raised to the
    caller (``strict=True``), not gone on from (``details["raised"]``, only then)."""
    details = debugger_error_details(where, error)
    if raised:
        details["raised"] = True
    return make_anomaly("debugger_error", component=component, step=step, rank=rank, details=details)


def mark_raised(error: BaseException, where: str) -> None:
    """Mark ``error`` (:data:`RAISED`) as the debugger's own, recorded once at ``where`` and re-raised
    with ``strict=True``, where its ``debugger_error`` is recorded by other means than
    :meth:`AnomalySink.raised` (the training step gathers its anomalies before recording them)."""
    try:
        setattr(error, RAISED, where)
    except Exception:  # pragma: no cover - an exception class without __dict__
        pass


def raised_by_debugger(error: BaseException) -> bool:
    """Whether ``error`` is the debugger's own, re-raised with ``strict=True`` (recorded already)."""
    return getattr(error, RAISED, None) is not None


def debugger_error_details(where: str, error: BaseException | None) -> dict[str, Any]:
    """The one ``details`` layout of a ``debugger_error``: where, the error, a short traceback."""
    if error is None:
        return {"where": where, "error": None, "traceback": None}
    trace = "".join(traceback.format_exception(type(error), error, error.__traceback__, limit=4))
    return {"where": where, "error": f"{type(error).__name__}: {error}", "traceback": trace[-2000:]}
