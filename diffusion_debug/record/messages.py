"""What both debuggers' messages share: the one phrase that sends the reader to a cause, and the
builders of the kinds both debuggers emit about themselves and the device (``debugger_error``,
``out_of_memory``). Pure; registered in ``record/kinds.py``.

>>> follows("the first NaN/Inf", "unet conv_in, step 0")
'; it follows the first NaN/Inf at unet conv_in, step 0: fix that first'
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .anomaly import Anomaly


def follows(what: str, where: str) -> str:
    """The tail of a message whose cause is another anomaly, named ``what`` at ``where``."""
    return f"; it follows {what} at {where}: fix that first"


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and ``noun``, plural unless ``n`` is 1.

    >>> counted(1, "step"), counted(0, "step"), counted(2, "anomaly", "anomalies")
    ('1 step', '0 steps', '2 anomalies')
    """
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def memory_source(source: str) -> str:
    """What a ``memory_growth``'s ``details["source"]`` measured, as its sentence names it."""
    return "Process memory" if source == "rss" else "CUDA allocated memory"


_TRAINING_VERBS = {
    "measurement": "measure",
    "judging": "judge",
    "recording": "record",
    "replay": "replay closure= for",
    "forward replay": "replay the trained model's forward of",  # launch's (judges.forward_replay)
}


def debugger_error(anomaly: Anomaly) -> str:
    d = anomaly.details
    where, error = d["where"], d.get("error")
    text = error if error is not None else "no error"
    if d.get("raised"):  # strict=True
        return f"The debugger's {where} failed ({text[:200]}) and was raised (strict=True)."
    if anomaly.component == "model" and where in _TRAINING_VERBS:  # the training step's own failures
        caught = f" ({error})" if error is not None else ""  # another rank's error is not known here
        if d.get("kept_under_strict"):  # strict is on already: no advice to set it
            return (
                f"Rank {anomaly.rank} failed to {_TRAINING_VERBS[where]} step {anomaly.step}{caught} and training "
                "went on (not raised with strict=True: every rank must finish the step's exchange)."
            )
        return (
            f"Rank {anomaly.rank} failed to {_TRAINING_VERBS[where]} step {anomaly.step}{caught} and training went "
            "on; set strict=True to see the traceback."
        )
    if anomaly.component == "model" and where == "monitoring":
        return (
            f"The training debugger failed to measure this step ({text}); training goes on, set strict=True to see "
            "the traceback."
        )
    if where == "events.jsonl":
        return (
            f"events.jsonl could not be written ({text[:200]}); the run went on and its record is kept in memory for "
            "save()."
        )
    return f"The debugger's {where} failed ({text[:200]}); the run went on without it."


def out_of_memory(anomaly: Anomaly) -> str:
    d = anomaly.details
    place = " ".join(p for p in (anomaly.component, anomaly.module) if p) or "the watched call"
    phase = d.get("phase")
    at = f" at step {anomaly.step}" if anomaly.step is not None else (f" ({phase})" if phase else "")
    allocated, reserved = d.get("cuda_allocated_mb"), d.get("cuda_reserved_mb")
    figures = f" with {allocated:.0f} MB allocated and {reserved:.0f} MB reserved" if allocated is not None else ""
    return f"Out of memory in {place}{at}{figures}; try: {'; '.join(d['remedies'])}."
