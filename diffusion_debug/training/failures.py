"""The training debugger's own failures, each a ``debugger_error`` anomaly
(``core.debugger_failure``) whose sentence names the rank and the step: measuring, judging or
recording a step, replaying its ``closure=``, or the monitoring call itself, failed, and training
went on (``strict=True`` raises instead: then the anomaly says it was raised, ``raised=True``, and
the error is marked as recorded, ``core.mark_raised``, so that no outer guard records it again). A
failed measurement is known on every rank (its row's failure slot), its error only on its own. The
sentence is the kind's (``record/messages.py``), from ``where`` and the component ``model``.
"""

from __future__ import annotations

from typing import Any

from ..core import debugger_failure, mark_raised
from ..record import Anomaly, rebuilt


def measurement_failed(rank: int, step: Any, error: Exception | None, *, raised: bool = False) -> Anomaly:
    """A rank's measurement failed (``error`` is known on that rank only)."""
    return _debugger_error("measurement", rank, step, error, raised)


def judging_failed(rank: int, step: Any, error: Exception, *, raised: bool = False, kept: bool = False) -> Anomaly:
    """``kept``: with ``strict=True``, recorded and not raised (it happened inside the step's
    exchange, which every rank must finish): its sentence does not advise ``strict=True``."""
    anomaly = _debugger_error("judging", rank, step, error, raised)
    return rebuilt(anomaly, details={**anomaly.details, "kept_under_strict": True}) if kept else anomaly


def recording_failed(rank: int, step: Any, error: Exception, *, raised: bool = False) -> Anomaly:
    return _debugger_error("recording", rank, step, error, raised)


def replay_failed(rank: int, step: Any, error: BaseException, *, raised: bool = False) -> Anomaly:
    """The ``closure=`` replay under anomaly mode failed (an OOM in it, a closure that raises)."""
    return _debugger_error("replay", rank, step, error, raised)


def forward_replay_failed(rank: int, step: Any, error: BaseException) -> Anomaly:
    """Launch's replay of a NaN step's kept forward failed (an OOM in it, a forward that needs grad)."""
    return _debugger_error("forward replay", rank, step, error, False)


def monitoring_failed(rank: int, step: Any, error: Exception) -> Anomaly:
    return _debugger_error("monitoring", rank, step, error, False)


def _debugger_error(where: str, rank: int, step: Any, error: BaseException | None, raised: bool) -> Anomaly:
    """``raised``: the error goes on to the caller (``strict=True``); it is marked as recorded here."""
    if raised and error is not None:
        mark_raised(error, where)
    return debugger_failure(where, error, step=step, rank=rank, component="model", raised=raised)
