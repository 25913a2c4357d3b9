"""The columns of a run's per-step table, shared by report.html and the terminal summary.

A column is ``(header, getter)``; a getter reads one saved step row and returns ``None`` where
the row has no such value (a column that is ``None`` on every row is left out).

>>> row = {"step": 3, "latents": {"std": 1.5, "nan": 2, "posinf": 0, "neginf": 1}}
>>> [(h, get(row)) for h, get in pick(INFERENCE_STEP_COLUMNS, ("step", "latent std", "NaN/Inf values"))]
[('step', 3), ('latent std', 1.5), ('NaN/Inf values', 3)]
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from .text import cut

Column = tuple[str, Callable[[dict[str, Any]], Any]]


def field(row: Any, *path: str) -> Any:
    """``row[path[0]][path[1]]...``, or ``None`` where any level is missing."""
    for key in path:
        if not isinstance(row, dict):
            return None
        row = row.get(key)
    return row


def path(*keys: str) -> Callable[[dict[str, Any]], Any]:
    return lambda row: field(row, *keys)


def nonfinite_values(*names: str) -> Callable[[dict[str, Any]], Any]:
    """NaN + Inf counts summed over the named tensor statistics of a row."""

    def count(row: dict[str, Any]) -> int | None:
        seen, total = False, 0
        for name in names:
            for key in ("nan", "posinf", "neginf"):
                value = field(row, name, key)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    seen, total = True, total + int(value)
        return total if seen else None

    return count


def first_lr(row: dict[str, Any]) -> Any:
    rates = row.get("learning_rates")
    return rates[0] if isinstance(rates, list) and rates else row.get("lr")


INFERENCE_STEP_COLUMNS: list[Column] = [
    ("step", path("step")),
    ("run", path("run")),
    ("timestep", path("timestep")),
    ("sigma", path("sigma")),
    ("denoiser", path("denoiser")),  # the expert that ran the step (Wan 2.2); absent with one denoiser
    ("latent std", path("latents", "std")),
    ("latent |max|", path("latents", "absmax")),
    ("latent mean", path("latents", "mean")),
    ("output L2", path("model_output", "l2")),
    ("guidance gap", path("guidance_gap")),
    ("NaN/Inf values", nonfinite_values("latents", "model_output")),
    ("time s", path("time_s")),
    ("RSS MB", path("memory", "rss_mb")),
]
TRAINING_STEP_COLUMNS: list[Column] = [
    ("step", path("step")),
    ("rank", path("rank")),
    ("loss", path("loss")),
    ("grad norm", path("grad_norm")),
    ("clipped", path("grad_norm_clipped")),
    ("NaN/Inf grads", path("nonfinite_parameters")),
    ("lr", first_lr),
    ("grad scale", path("grad_scale")),
    # lr x gradient / weight: recorded only for an optimizer that steps by its gradient (SGD), where it
    # foretells the step's update; an adaptive one's (AdamW's, Muon's) would mislead, and has none
    ("lr x grad/weight", path("max_update_to_weight_ratio")),
    # every optimizer's update as it moved the weights: the previous step's, measured from them
    ("update/weight (measured, prev. step)", path("max_applied_update_ratio")),
    ("skipped", path("skipped")),
    ("step time s", path("step_time_s")),
    ("samples/s", path("samples_per_s")),
    ("RSS MB", path("memory", "rss_mb")),
    ("CUDA MB", path("memory", "cuda_allocated_mb")),
]


def pick(columns: list[Column], headers: Sequence[str]) -> list[Column]:
    """The named columns, in the order given (a narrower table, e.g. for a terminal)."""
    by_header = dict(columns)
    return [(h, by_header[h]) for h in headers]


def end_label(end: Any) -> str | None:
    """How a launched script ended, in a few words (``raised RuntimeError``), or None when unknown."""
    if not isinstance(end, dict) or not isinstance(end.get("status"), str):
        return None
    status = cut(end["status"], 40)
    if status == "raised":
        return f"raised {cut(str(end.get('exception', 'an exception')), 200)}"
    if status == "interrupted":
        return f"interrupted by {cut(str(end.get('signal', 'a signal')), 40)}"
    if status == "finished" and isinstance(end.get("exit_code"), int) and end["exit_code"] != 0:
        return f"finished with exit code {end['exit_code']}"
    return status


def end_line(end: Any) -> str | None:
    """The line a run that did not finish cleanly opens with: where it raised, or the signal."""
    label = end_label(end)
    if label is None or label == "finished":
        return None
    if end["status"] == "raised":
        message = cut(" ".join(str(end.get("message", "")).split()), 300)
        where = f" at {cut(str(end['where']), 300)}" if end.get("where") else ""
        return f"The script {label}{': ' + message if message else ''}{where}; the figures stop there."
    if end["status"] == "interrupted":
        return f"The run was {label} before the script finished; the figures stop there."
    return f"The script {label}."


def run_warnings(summary: dict[str, Any]) -> list[str]:
    """What a reader must know before trusting the run's figures: how a script that did not finish
    ended, the summary was rebuilt from the event files (the run was killed), event lines were
    unreadable, the event stream was lost."""
    out = []
    ended = end_line(summary.get("end"))
    if ended:
        out.append(ended)
    if summary.get("incomplete"):
        out.append(f"Incomplete run: {summary.get('incomplete_reason') or 'summary.json is missing'}.")
    bad = summary.get("unreadable_event_lines")
    if isinstance(bad, dict) and bad:
        files = ", ".join(f"{name} line(s) {', '.join(map(str, lines))}" for name, lines in bad.items())
        out.append(f"Unreadable event lines were left out: {files}.")
    if summary.get("stream_error"):
        out.append(f"The event stream was lost during the run ({summary['stream_error']}); events.jsonl ends there.")
    return out
