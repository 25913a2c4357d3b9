"""The training debugger's own failures, each a ``debugger_error`` anomaly
(``core.debugger_failure``) whose sentence names the rank and the step: measuring, judging or
recording a step, or the monitoring call itself, failed, and training went on (``strict=True``
raises instead). A failed measurement is known on every rank (its row's failure slot), its error
only on its own.
"""

from __future__ import annotations

from typing import Any

from ..core import debugger_failure
from ..record import Anomaly


def measurement_failed(rank: int, step: Any, error: Exception | None) -> Anomaly:
    """A rank's measurement failed (``error`` is known on that rank only)."""
    text = f" ({type(error).__name__}: {error})" if error is not None else ""
    message = (
        f"Rank {rank} failed to measure step {step}{text} and training went on; set strict=True to see the traceback."
    )
    return _debugger_error("measurement", rank, step, error, message)


def judging_failed(rank: int, step: Any, error: Exception) -> Anomaly:
    return _debugger_error("judging", rank, step, error, _failed_to("judge", rank, step, error))


def recording_failed(rank: int, step: Any, error: Exception) -> Anomaly:
    return _debugger_error("recording", rank, step, error, _failed_to("record", rank, step, error))


def monitoring_failed(rank: int, step: Any, error: Exception) -> Anomaly:
    message = (
        f"The training debugger failed to measure this step ({type(error).__name__}: {error}); training goes on, "
        "set strict=True to see the traceback."
    )
    return _debugger_error("monitoring", rank, step, error, message)


def _failed_to(verb: str, rank: int, step: Any, error: Exception) -> str:
    return (
        f"Rank {rank} failed to {verb} step {step} ({type(error).__name__}: {error}) and training went on; "
        "set strict=True to see the traceback."
    )


def _debugger_error(where: str, rank: int, step: Any, error: Exception | None, message: str) -> Anomaly:
    return debugger_failure(where, error, step=step, rank=rank, message=message, component="model")
