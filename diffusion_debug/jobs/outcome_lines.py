"""What a command says after its work, besides the terminal summary: the verdict of ``run
--repeat``, where policy ``stop`` ended the denoising loop or the training, the replay command of
each repro bundle; and, over ``--repeat``'s calls, each warning once.

>>> print(repeat_verdict([], 2, 0))
determinism: the 2 calls with seed 0 agree: the same image (pixel for pixel), the same latent statistics at each step.

Limits: these lines read the saved run directory (as ``diffusion-debug report`` does), so what
they say is what the report says.
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Any, Iterator


def repeat_verdict(found: list[Any], repeat: int, seed: int) -> str:
    """One line, either way: the repeated calls agreed, or the first that did not and where."""
    if not found:
        return (
            f"determinism: the {repeat} calls with seed {seed} agree: the same image (pixel for pixel), the same "
            "latent statistics at each step."
        )
    first = found[0]
    runs = first.details.get("runs") or [1, 2]
    return f"determinism: NOT deterministic: call {runs[1]} differs from call {runs[0]}: {first.message}"


def stop_line(run_dir: str | Path) -> str | None:
    """Where policy ``stop`` ended the denoising loop and why (None when it did not)."""
    from ..record import load_run

    run = load_run(run_dir)
    event = next((e for e in run.events if e.get("type") == "policy_stop"), None)
    if event is None:
        return None
    cause = next((a for a in run.anomalies if a.kind == event.get("kind") and a.step == event.get("step")), None)
    why = f"{cause.kind} at {cause.where()}" if cause is not None else str(event.get("kind"))
    return (
        f"stopped: policy 'stop' ended the denoising loop after step {event.get('step')} ({why}); the image "
        "is decoded from the latents of that step."
    )


def training_stop_line(summary: dict[str, Any]) -> str:
    """Where policy ``stop`` ended ``train`` and why, from the job's summary."""
    steps = summary.get("total_steps")
    reason = summary.get("stop_reason") or "an error-severity anomaly"
    return (
        f"stopped: policy 'stop' ended the training loop after {steps} monitored step(s), before the last one's "
        f"optimizer step, because of {reason}"
    )


def replay_commands(run_dir: str | Path) -> list[str]:
    """The report's replay command for each repro bundle of the run, cause first."""
    from ..record import by_cause, load_run
    from ..report.html import replay_command

    run = load_run(run_dir)
    bundles = [a.details["bundle"] for a in by_cause(run.anomalies) if isinstance(a.details.get("bundle"), str)]
    return [replay_command(run, bundle) for bundle in dict.fromkeys(bundles)]


def print_replay_commands(run_dir: str | Path) -> None:
    for command in replay_commands(run_dir):
        print(f"replay: {command}")


@contextlib.contextmanager
def each_warning_once() -> Iterator[None]:
    """Show each warning (by category and text) once while the block runs: ``--repeat`` makes
    the same call several times and its warnings are the same each time."""
    seen: set[tuple[type, str]] = set()
    show = warnings.showwarning

    def once(message: Any, category: type, *args: Any, **kwargs: Any) -> None:
        key = (category, str(message))
        if key not in seen:
            seen.add(key)
            show(message, category, *args, **kwargs)

    warnings.showwarning = once
    try:
        yield
    finally:
        warnings.showwarning = show
