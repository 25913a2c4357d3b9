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

from ...record import Anomaly, followed_key, follows_key, loads
from ...record.run_dir import FirstAnomalies, anomaly_problem, fold_repeat
from .origin import copy_key

ONE_RANK_KINDS = ("debugger_error", "step_error")
"""The kinds a rank records for itself alone, outside the step's exchange: the main process's record lacks them."""

_WANTED = (*(f'"{kind}"'.encode() for kind in ONE_RANK_KINDS), b'"step_amended"', b'"step_skipped"')
_CHUNK = 1 << 20  # bytes read at a time: a long file costs no more memory than this and its kept rows


class RankFiles:
    """The other ranks' events files, each read as far as its last whole line, once: a later :meth:`read` reads
    what was written since (an offset per file; a file replaced, by a rank that writes its events whole at the
    end, is read anew), ``_CHUNK`` bytes at a time. Keeps each rank's own anomalies of :data:`ONE_RANK_KINDS`
    (``rank`` its own), with the repeats its ``anomaly_repeated`` rows fold into them, at most ``limit`` a rank; a
    line that names none of those kinds nor ``step_amended`` (a step row: nearly every line) is not parsed. A file
    gone or unreadable (a killed rank's disk, NFS) is left out, and read again at the next :meth:`read`."""

    def __init__(self, run_dir: Path, rank: int, limit: int = 10_000):
        self.run_dir, self.rank, self.limit = Path(run_dir), rank, limit
        self.lines_read = 0
        """Whole lines read from every file so far: each once (unless its file was replaced); a line still being
        written is read again, whole, at a later read."""
        self._at: dict[int, tuple[Any, int]] = {}  # per rank: its file's identity and offset
        self._theirs: dict[int, list[Anomaly]] = {}
        self._open: dict[int, FirstAnomalies] = {}  # per rank: its anomalies, as its repeats' rows name them
        self.amended: dict[tuple[int, Any, Any], dict[str, Any]] = {}
        """Per (rank, step, joined): the values that rank read its own row of the step, taken at monitored step
        ``joined``, anew with (its ``step_amended``, ``RunRecord.amend_step``; its ``step_skipped``, as
        ``skipped``), at most ``limit`` rows: what the main process's copy of that one row takes
        (``RunRecord.amend_rank_step``), not its later rows of a step number the loop repeated."""

    def read(self, ranks: Iterable[int]) -> list[Anomaly]:
        """Each rank of ``ranks`` (not this one)'s own anomalies, read so far, by rank then as written."""
        wanted = sorted({r for r in ranks if r != self.rank})
        for other in wanted:
            self._read_one(other)
        return [a for other in wanted for a in self._theirs.get(other, [])]

    def clear(self) -> None:
        """Forget the anomalies and amended rows read (``clear_debug_history``); what is read from now on is what is
        written later."""
        self._theirs.clear()
        self._open.clear()
        self.amended.clear()

    def _read_one(self, other: int) -> None:
        path = self.run_dir / f"events-rank{other}.jsonl"
        try:
            with open(path, "rb") as handle:
                stat = os.fstat(handle.fileno())
                identity, offset = self._at.get(other, (None, 0))
                if identity != (stat.st_dev, stat.st_ino) or stat.st_size < offset:  # replaced: read anew
                    offset = 0
                    self._theirs.pop(other, None)
                    self._open.pop(other, None)
                handle.seek(offset)
                rest = b""
                while chunk := handle.read(_CHUNK):
                    rest += chunk
                    whole = rest.rfind(b"\n") + 1  # a line still being written waits for the next read
                    self._at[other] = ((stat.st_dev, stat.st_ino), offset + whole)
                    offset, lines, rest = offset + whole, rest[:whole], rest[whole:]
                    self.lines_read += lines.count(b"\n")
                    for line in _wanted_lines(lines):
                        self._take(other, _row(line))
        except OSError:  # the cause stays unknown, the report goes on (what was read whole is kept)
            return

    def _take(self, other: int, row: dict | None) -> None:
        if row is None or row.get("rank") != other:
            return
        kind = row.get("type")
        if kind in ("step_amended", "step_skipped"):  # a skip found after its row: the copy says so too
            values = row.get("values") if kind == "step_amended" else {"skipped": row.get("reason")}
            key = (other, row.get("step"), row.get("joined"))
            if isinstance(values, dict) and (key in self.amended or len(self.amended) < self.limit):
                self.amended.setdefault(key, {}).update(values)
        elif kind == "anomaly_repeated" and row.get("kind") in ONE_RANK_KINDS:  # as rebuild_summary folds it
            first = self._open[other].named(row) if other in self._open else None
            if first is not None:
                fold_repeat(first.details, row)
        elif kind == "anomaly" and row.get("kind") in ONE_RANK_KINDS:
            kept = self._theirs.setdefault(other, [])
            data = {k: v for k, v in row.items() if k not in ("type", "time")}
            if len(kept) < self.limit and anomaly_problem(data) is None:
                anomaly = Anomaly.from_dict(data)
                kept.append(anomaly)
                self._open.setdefault(other, FirstAnomalies()).add(data, anomaly)


def _wanted_lines(lines: bytes) -> list[bytes]:
    """The lines of ``lines`` (whole ones) that name a token of ``_WANTED``, in order: found by ``bytes.find`` over
    the whole text, where a check a line cost a Python call for each step row."""
    starts = set()
    for token in _WANTED:
        at = lines.find(token)
        while at >= 0:
            start = lines.rfind(b"\n", 0, at) + 1
            starts.add(start)
            end = lines.find(b"\n", at)
            at = lines.find(token, end) if end >= 0 else -1
    return [lines[start : lines.find(b"\n", start)] for start in sorted(starts)]


def _row(line: bytes) -> dict | None:
    try:
        row = loads(line.decode("utf-8", errors="replace"))
    except (ValueError, RecursionError):  # a damaged line: left out, as read_jsonl does
        return None
    return row if isinstance(row, dict) else None


def kept_elsewhere(anomalies: Sequence[Anomaly], files: RankFiles, rank: int, world_size: int) -> list[Anomaly]:
    """The other ranks' own anomalies of a kind only one rank records (:data:`ONE_RANK_KINDS`: its
    ``debugger_error``, its forward's ``step_error``, recorded outside the step's exchange) that ``anomalies`` (the
    main process's record) lacks: each as its rank recorded it (its severity, details and repeat count), once. Every
    other kind is in the main record already, or recorded by every rank alike for itself (``unwatched_parameters``,
    ``gradient_sync_off``): a copy of each would repeat the main's own, once a rank. A copy already in the record
    (a report before) takes the repeat count its rank has folded since."""

    def same(anomaly: Anomaly) -> tuple:
        """What the main record's copy of it is found by: its rank and ``copy_key``, not its severity nor its
        other details (the exchange may grade it anew and add to them: the rank that made a NaN, what follows)."""
        return (anomaly.rank, *copy_key(anomaly, severity=False))

    have = {same(a): a for a in anomalies}
    out = []
    for a in files.read(range(world_size)):
        key = same(a)
        held = have.get(key)
        if held is None:
            have[key] = copy = Anomaly.from_dict(a.to_dict())
            out.append(copy)
        elif a.details.get("count", 1) > held.details.get("count", 1):  # repeats its rank folded since
            for name in ("count", "last_step", "last_run"):
                if name in a.details:
                    held.details[name] = a.details[name]
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
            found.append(Anomaly.from_dict(anomaly.to_dict()))  # the record's own (RankFiles' folds repeats in)
    return found
