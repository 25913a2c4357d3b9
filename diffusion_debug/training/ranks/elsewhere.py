"""The other ranks' events files, read by the main process for its report.

Every rank streams its own anomalies to ``events-rank<r>.jsonl``; what a rank found outside the step's exchange
(a forward's ``step_error``) is in its own file only. :class:`RankFiles` reads each file once, from where its last
read stopped (a report mid-run, then the last one, read each line once).

>>> import tempfile
>>> from diffusion_debug.record import dumps, make_anomaly
>>> error = make_anomaly("debugger_error", step=3, rank=1, details={"where": "recording", "error": "OSError: x"})
>>> folder = Path(tempfile.mkdtemp())
>>> _ = (folder / "events-rank1.jsonl").write_text(dumps({"type": "anomaly", **error.to_dict()}) + "\\n")
>>> files = RankFiles(folder, rank=0)
>>> [(a.kind, a.rank, a.step) for a in files.read([0, 1])], files.lines_read
([('debugger_error', 1, 3)], 1)
>>> len(files.read([1])), files.lines_read  # its one line, read once
(1, 1)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable

from ...record import Anomaly, loads
from ...record.run_dir import anomaly_problem


class RankFiles:
    """The other ranks' events files, each read as far as its last whole line, once: a later :meth:`read` reads
    what was written since (an offset per file; a file replaced, by a rank that writes its events whole at the
    end, is read anew). Keeps each rank's own anomalies (``rank`` its own), at most ``limit`` a rank. A file
    gone or unreadable (a killed rank's disk, NFS) is left out, and read again at the next :meth:`read`."""

    def __init__(self, run_dir: Path, rank: int, limit: int = 10_000):
        self.run_dir, self.rank, self.limit = Path(run_dir), rank, limit
        self.lines_read = 0
        """Whole lines read from every file so far: each once (unless its file was replaced); a line still being
        written is read again, whole, at a later read."""
        self._at: dict[int, tuple[Any, int]] = {}  # per rank: its file's identity and offset
        self._theirs: dict[int, list[Anomaly]] = {}

    def read(self, ranks: Iterable[int]) -> list[Anomaly]:
        """Each rank of ``ranks`` (not this one)'s own anomalies, read so far, by rank then as written."""
        wanted = sorted({r for r in ranks if r != self.rank})
        for other in wanted:
            self._read_one(other)
        return [a for other in wanted for a in self._theirs.get(other, [])]

    def clear(self) -> None:
        """Forget the anomalies read (``clear_debug_history``); what is read from now on is what is written later."""
        self._theirs.clear()

    def _read_one(self, other: int) -> None:
        path = self.run_dir / f"events-rank{other}.jsonl"
        try:
            with open(path, "rb") as handle:
                stat = os.fstat(handle.fileno())
                identity, offset = self._at.get(other, (None, 0))
                if identity != (stat.st_dev, stat.st_ino) or stat.st_size < offset:  # replaced: read anew
                    offset = 0
                    self._theirs.pop(other, None)
                handle.seek(offset)
                chunk = handle.read()
        except OSError:  # the cause stays unknown, the report goes on
            return
        whole = chunk.rfind(b"\n") + 1  # a line still being written waits for the next read
        self._at[other] = ((stat.st_dev, stat.st_ino), offset + whole)
        kept = self._theirs.setdefault(other, [])
        for line in chunk[:whole].splitlines():
            self.lines_read += 1
            row = _row(line)
            if row is None or row.get("type") != "anomaly" or row.get("rank") != other or len(kept) >= self.limit:
                continue
            data = {k: v for k, v in row.items() if k not in ("type", "time")}
            if anomaly_problem(data) is None:
                kept.append(Anomaly.from_dict(data))


def _row(line: bytes) -> dict | None:
    try:
        row = loads(line.decode("utf-8", errors="replace"))
    except (ValueError, RecursionError):  # a damaged line: left out, as read_jsonl does
        return None
    return row if isinstance(row, dict) else None
