"""The training debugger's own failures, each a ``debugger_error`` anomaly
(``core.debugger_failure``) whose sentence names the rank and the step: measuring, judging or
recording a step, replaying its ``closure=``, or the monitoring call itself, failed, and training
went on (``strict=True`` raises instead). A failed measurement is known on every rank (its row's
failure slot), its error only on its own. The sentence is the kind's (``record/messages.py``), from
``where`` and the component ``model``.
"""

from __future__ import annotations

from typing import Any

from ..core import debugger_failure
from ..record import Anomaly


def measurement_failed(rank: int, step: Any, error: Exception | None) -> Anomaly:
    """A rank's measurement failed (``error`` is known on that rank only)."""
    return _debugger_error("measurement", rank, step, error)


def judging_failed(rank: int, step: Any, error: Exception) -> Anomaly:
    return _debugger_error("judging", rank, step, error)


def recording_failed(rank: int, step: Any, error: Exception) -> Anomaly:
    return _debugger_error("recording", rank, step, error)


def replay_failed(rank: int, step: Any, error: BaseException) -> Anomaly:
    """The ``closure=`` replay under anomaly mode failed (an OOM in it, a closure that raises)."""
    return _debugger_error("replay", rank, step, error)


def monitoring_failed(rank: int, step: Any, error: Exception) -> Anomaly:
    return _debugger_error("monitoring", rank, step, error)


def _debugger_error(where: str, rank: int, step: Any, error: BaseException | None) -> Anomaly:
    return debugger_failure(where, error, step=step, rank=rank, component="model")
