"""The commands' progress bars: tqdm on stderr, shown only to a person at a terminal.

A command decides once (:func:`shows_progress`) whether a bar is wanted: not with ``--quiet``,
not when stderr is a pipe or a file (a log stays free of carriage returns). A library user is
left alone: nothing here changes a pipeline unless a command asks for it, and
:func:`denoising_bar_config` is what ``run`` hands to the pipeline's own
``set_progress_bar_config`` (diffusers draws the bar of its denoising loop itself).

>>> denoising_bar_config(False, "run")
{'disable': True}

Limits: one bar at a time; under ``accelerate launch`` only the main process draws one; the
postfix of ``train`` shows what the debugger already read to the host (no added sync).
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any, TextIO


def shows_progress(quiet: bool = False, stream: TextIO | None = None) -> bool:
    """Whether a bar is wanted: not ``quiet`` and ``stream`` (stderr) is a terminal."""
    stream = sys.stderr if stream is None else stream
    if quiet:
        return False
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # a replaced stream without isatty, or a closed one
        return False


def denoising_bar_config(enabled: bool, label: str) -> dict[str, Any]:
    """The keyword arguments for ``pipe.set_progress_bar_config``: a bar of denoising steps on
    stderr labelled ``label``, or none."""
    if not enabled:
        return {"disable": True}
    return {"disable": False, "desc": label, "unit": "step", "file": sys.stderr, **_width()}


def progress_bar(total: int, label: str, unit: str, enabled: bool) -> Any:
    """A tqdm bar on stderr (a disabled one, which draws nothing, when not ``enabled``)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=label, unit=unit, file=sys.stderr, disable=not enabled, **_width())


def _width() -> dict[str, Any]:
    """tqdm's size: the terminal's, followed as it is resized; 80x24 where the terminal says it has
    none (a pseudo-terminal of size 0x0, as ``script`` opens without a terminal: tqdm then takes
    -1 rows and draws nothing)."""
    try:
        columns = os.get_terminal_size(sys.stderr.fileno()).columns
    except (AttributeError, ValueError, OSError):
        columns = 0
    return {"dynamic_ncols": True} if columns > 0 else {"ncols": 80, "nrows": 24}


class DoctorProgress:
    """The progress of ``doctor``: called with each run's label as it starts (``run_doctor``'s
    ``progress``). At a terminal a bar over the runs (dtype, and compiled); elsewhere one line per
    run on stderr, so a log says what is running; with ``quiet`` nothing."""

    def __init__(self, dtypes: tuple[str, ...], compiled: bool, quiet: bool = False):
        runs = (1 + sum(d != "float32" for d in dtypes)) * (2 if compiled else 1)  # float32 always runs
        self.lines = not quiet and not shows_progress(quiet)
        self.bar = progress_bar(runs, "doctor", "run", shows_progress(quiet))
        self.started = 0

    def __call__(self, line: str) -> None:
        if self.lines:
            print(line, file=sys.stderr, flush=True)
        if self.started:
            self.bar.update(1)  # the run before this one is done
        self.started += 1
        self.bar.set_postfix_str(line.removeprefix("doctor: "))

    def close(self) -> None:
        if self.started:
            self.bar.update(1)
        self.bar.close()


class TrainingProgress:
    """The bar of ``train``: one tick per optimizer step, the step's loss and the anomalies so far
    in its postfix (both from what ``monitor_training_step`` returned: values already on the host)."""

    def __init__(self, total: int, enabled: bool):
        self.bar = progress_bar(total, "train", "step", enabled)
        self.anomalies = 0
        self.loss: float | None = None
        self.steps = 0

    def saw(self, info: dict[str, Any]) -> None:
        """Take in one call's result of ``monitor_training_step`` (micro-steps included)."""
        self.anomalies += len(info.get("anomalies") or ())
        loss = info.get("loss")
        if isinstance(loss, (int, float)):
            self.loss = float(loss)

    def step_done(self) -> None:
        """One optimizer step is over: tick, with the loss and anomaly count."""
        loss = "n/a" if self.loss is None else ("nan" if math.isnan(self.loss) else f"{self.loss:.4g}")
        self.bar.set_postfix_str(f"loss {loss}, anomalies {self.anomalies}", refresh=False)
        self.bar.update(1)
        self.steps += 1

    def close(self) -> None:
        self.bar.close()
