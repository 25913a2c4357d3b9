"""The run directory: its name, its creation, and reading a saved one back.

A run directory holds ``events.jsonl`` (streamed), ``summary.json`` (atomic) and ``report.html``;
it is never shared by two runs.
"""

from __future__ import annotations

import os
import secrets
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import DiffusionDebugError
from .anomaly import Anomaly
from .jsonio import load_json, read_jsonl


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


def new_run_name(prefix: str) -> str:
    """``<prefix>-<date>-<time>-<pid>-<6 hex>``: the random tail keeps two runs started in one
    process within one second apart."""
    return f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{secrets.token_hex(3)}"


def prepare_run_dir(output_dir: str | os.PathLike, run_name: str, *, exclusive: bool = False) -> Path:
    """Create ``output_dir/run_name`` and prove it writable, or raise one clear error.

    ``exclusive``: the directory must not exist yet (a generated name), so no two runs share it.
    """
    run_dir = Path(output_dir) / run_name
    try:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        run_dir.mkdir(exist_ok=not exclusive)
        with tempfile.TemporaryFile(dir=run_dir):
            pass
    except FileExistsError:
        raise DiffusionDebugError(
            f"The run directory {str(run_dir)!r} exists already; runs never share one."
        ) from None
    except OSError as error:
        reason = error.strerror or str(error)
        raise DiffusionDebugError(
            f"Cannot write the run directory {str(run_dir)!r} (output_dir={str(output_dir)!r}): {reason}."
        ) from None
    return run_dir
