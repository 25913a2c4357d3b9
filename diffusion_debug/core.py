"""What both debuggers share above the record and the report.

For now: :class:`DebugReport`, the live view of a run that ``save()`` turns into a run directory
(it sits above ``report`` because saving builds ``report.html``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .record import Anomaly, RunRecord, dumps, to_jsonable, write_atomic
from .report import write_html


@dataclass
class DebugReport:
    """What a debugger saw: anomalies, steps and components, ready to save.

    ``save()`` writes ``summary.json`` (atomically), completes ``events.jsonl``, writes the
    extra files (previews, plots), then builds ``report.html`` from the saved files alone.
    """

    run_dir: Path
    summary: dict[str, Any]
    anomalies: list[Anomaly]
    steps: list[dict[str, Any]]
    components: dict[str, Any] = field(default_factory=dict)
    files: dict[str, bytes] = field(default_factory=dict)
    """Extra files to write, by path relative to the run directory."""
    record: RunRecord | None = field(default=None, repr=False)
    is_main: bool = True
    """False on a non-main rank: ``save()`` then only completes that rank's events file, and
    the main process writes summary.json and report.html."""

    def to_dict(self) -> dict[str, Any]:
        return to_jsonable(
            {
                **self.summary,
                "anomalies": [a.to_dict() for a in self.anomalies],
                "components": self.components,
                "steps": self.steps,
            }
        )

    def save(self, html: bool = True) -> Path:
        """Write the run directory and return its path."""
        if self.record is not None:
            self.record.flush_to_disk()
        if not self.is_main:
            return self.run_dir
        for relative, data in self.files.items():
            write_atomic(self.run_dir / relative, data)
        write_atomic(self.run_dir / "summary.json", dumps(self.to_dict(), indent=1))
        if html:
            write_html(self.run_dir)
        return self.run_dir
