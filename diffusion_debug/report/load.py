"""Read a run directory back."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import DiffusionDebugError
from ..record import Anomaly, load_json, read_jsonl


@dataclass
class RunData:
    """What a run directory holds."""

    run_dir: Path
    summary: dict[str, Any]
    events: list[dict[str, Any]]

    @property
    def anomalies(self) -> list[Anomaly]:
        return [Anomaly.from_dict(a) for a in self.summary.get("anomalies", [])]

    @property
    def steps(self) -> list[dict[str, Any]]:
        return self.summary.get("steps", [])


def load_run(run_dir: str | os.PathLike) -> RunData:
    """Load ``summary.json`` and ``events.jsonl`` of a run directory."""
    run_dir = Path(run_dir)
    summary_path = run_dir / "summary.json"
    if not summary_path.is_file():
        raise DiffusionDebugError(f"{str(run_dir)!r} is not a run directory: it has no summary.json.")
    events_path = run_dir / "events.jsonl"
    events = read_jsonl(events_path) if events_path.is_file() else []
    return RunData(run_dir, load_json(summary_path), events)
