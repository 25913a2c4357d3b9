"""What the other ranks recorded in their own events files alone, read by the main process for its report.

Every rank streams its own anomalies to ``events-rank<r>.jsonl``; the main process's record holds every rank's
that a step's exchange carried. What a rank found outside the exchange (its ``debugger_error`` recording a step,
a forward's ``step_error``) is in its own file only: :func:`kept_elsewhere` names those the main record lacks,
and :class:`RankFiles` reads each file once, from where its last read stopped (a report mid-run, then the last
one, read each line once).

>>> import tempfile
>>> from diffusion_debug.record import dumps, make_anomaly
>>> error = make_anomaly("debugger_error", step=3, rank=1, details={"where": "recording", "error": "OSError: x"})
>>> folder = Path(tempfile.mkdtemp())
>>> _ = (folder / "events-rank1.jsonl").write_text(dumps({"type": "anomaly", **error.to_dict()}) + "\\n")
>>> files = RankFiles(folder, rank=0)
>>> [(a.kind, a.rank, a.step) for a in kept_elsewhere([], files, 0, world_size=2)]
[('debugger_error', 1, 3)]
>>> kept_elsewhere([error], files, 0, world_size=2), files.lines_read  # its one line, read once
([], 1)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from ...record import Anomaly, distinct_details, followed_key, follows_key, loads
from ...record.run_dir import anomaly_problem
from .exchange import shared_by_ranks


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
        self.amended: dict[tuple[int, Any], dict[str, Any]] = {}
        """Per (rank, step): the values that rank read its own row of the step anew with (its ``step_amended``,
        ``RunRecord.amend_step``), at most ``limit`` steps: what the main process's copy of the row takes."""

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
            if row is None or row.get("rank") != other:
                continue
            if row.get("type") == "step_amended" and isinstance(row.get("values"), dict):
                key = (other, row.get("step"))
                if key in self.amended or len(self.amended) < self.limit:
                    self.amended.setdefault(key, {}).update(row["values"])
            if row.get("type") != "anomaly" or len(kept) >= self.limit:
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


def same_key(anomaly: Anomaly) -> tuple:
    """What makes an anomaly of another rank's file the one the main record holds (the exchange carried it): its
    kind, rank, step and place, and the details that tell its kind apart at one place (not its severity nor its
    other details, which the exchange may add to: the rank that made a NaN, what follows what)."""
    place = (anomaly.kind, anomaly.rank, anomaly.step, anomaly.component, anomaly.module, anomaly.parameter)
    return (*place, *distinct_details(anomaly.kind, anomaly.details).values())


def kept_elsewhere(anomalies: Sequence[Anomaly], files: RankFiles, rank: int, world_size: int) -> list[Anomaly]:
    """The other ranks' own anomalies that ``anomalies`` (the main process's record) lacks: each as its rank
    recorded it (its severity and details), once. A kind the ranks share one a step (the GradScaler's
    ``skipped_step``, a learning-rate jump: the exchange keeps the first rank's) is left out where the record
    has it at that step on any rank."""
    have = {same_key(a) for a in anomalies}
    shared = {(a.kind, a.step) for a in anomalies if shared_by_ranks(a)}
    out = []
    for a in files.read(range(world_size)):
        key = same_key(a)
        if key in have or (shared_by_ranks(a) and (a.kind, a.step) in shared):
            continue
        have.add(key)
        out.append(a)
    return out


def causes_kept_elsewhere(anomalies: Sequence[Anomaly], files: RankFiles, rank: int) -> list[Anomaly]:
    """What another rank recorded in its own events file (``events-rank<r>.jsonl``) alone and one of
    ``anomalies`` (this process's record) follows (``details["follows"]``): a rank's forward error
    (``step_error``, found outside the step's exchange) that left the others in a collective, which the
    ``rank_desync`` every rank records names. Added to the main process's record, it is the headline, at its
    block and rank, over the stall it caused. A file is read only for such a cause, through ``files``
    (:class:`RankFiles`: each line once, however many reports ask while the cause stays missing).

    Limits: the other rank's file is read as far as that rank flushed it (every anomaly is flushed as it is
    written); a cause that rank never wrote (it was killed first) stays unknown, and the stall heads itself.
    """
    have = {follows_key(a) for a in anomalies}
    wanted: dict[int, set[tuple]] = {}
    for a in anomalies:
        follows = a.details.get("follows") if isinstance(a.details, dict) else None
        if not isinstance(follows, Mapping) or not isinstance(follows.get("rank"), int) or follows["rank"] == rank:
            continue
        key = followed_key(follows, a.step, a.rank)
        if key not in have:
            wanted.setdefault(follows["rank"], set()).add(key)
    found = []
    for anomaly in files.read(wanted) if wanted else ():
        keys = wanted[anomaly.rank]
        if follows_key(anomaly) in keys:
            keys.discard(follows_key(anomaly))
            found.append(anomaly)
    return found
