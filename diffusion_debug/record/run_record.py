"""The run's record: per-step rows, anomalies and events, bounded in memory, streamed to disk.

A :class:`RunRecord` owns one run directory::

    <output_dir>/<run-name>/
        events.jsonl    one JSON object per line, on disk as it happens (flushed per entry,
                        but for a pipeline call's opening events, which go with its first
                        step's row, and its VAE decode's, which goes with its detach), so a
                        killed run leaves every finished line readable
        modules.jsonl   level ``extreme`` (full probes) only: each component call's module
                        readings, one line a call (:meth:`RunRecord.add_readings`), on disk only
        summary.json    written atomically by DebugReport.save()
        report.html     built from the two files above by diffusion_debug.report
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
import time
from collections import Counter, deque
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from ..config import DebugConfig
from .anomaly import Anomaly
from .jsonio import dumps, dumps_plain, encode_chunks, to_jsonable, write_atomic
from .run_claim import RunLock, claim_run_dir
from .run_dir import new_run_name, step_key

READINGS_FILE = "modules.jsonl"


def versions() -> dict[str, str]:
    """Versions of the libraries a run depends on, for the summary: from the loaded module where
    it is loaded, else from the installed package's metadata (importing diffusers and
    transformers only to read a version costs seconds of CPU in every process of a job)."""
    out = {"python": platform.python_version(), "platform": platform.platform(), "torch": torch.__version__}
    for name in ("diffusers", "transformers", "accelerate", "diffusion_debug"):
        module = sys.modules.get(name)
        if module is not None:
            out[name] = getattr(module, "__version__", "unknown")
            continue
        try:
            out[name] = importlib.metadata.version(name.replace("_", "-"))
        except importlib.metadata.PackageNotFoundError:  # pragma: no cover - missing optional library
            continue
    out["cuda"] = torch.version.cuda or "none"
    return out


class RunRecord:
    """Per-step rows, anomalies and events of one run, with bounded memory.

    ``history_size`` steps and events stay in memory (ring buffers; the other ranks' step rows
    the main process records have a ring of their own, :attr:`rank_steps`, so they never push
    its own rows out); anomalies keep their
    first ``10 * history_size`` entries plus a count per kind, so the summary is exact even when
    the list is not.  With ``stream=True`` every entry is also appended to ``events.jsonl``
    as it happens.

    Without ``run_dir`` the record opens ``config.run_name`` (a new unique name when unset) and
    holds it until :meth:`close`: a name another live run holds is taken as ``NAME-2`` ... (see
    :mod:`.run_claim`). Given ``run_dir`` (another rank joining the main process's directory),
    it holds nothing.
    """

    def __init__(
        self,
        config: DebugConfig,
        *,
        kind: str,
        run_dir: Path | None = None,
        rank: int = 0,
        stream: bool | None = None,
        events_name: str = "events.jsonl",
    ):
        self.config = config
        self.kind = kind
        self.rank = rank
        self.lock: RunLock | None = None
        if run_dir is None:
            wanted = config.run_name or new_run_name(config.debug_file_prefix)
            run_dir, self.lock = claim_run_dir(config.output_dir, wanted, exclusive=config.run_name is None)
        self.run_dir = run_dir
        self.started = time.time()
        self.steps: deque[dict[str, Any]] = deque(maxlen=config.history_size)
        self.rank_steps: deque[dict[str, Any]] = deque(maxlen=config.history_size)
        self._rank_joined: deque[int | None] = deque(maxlen=config.history_size)  # each one's (add_rank_step)
        self._joined: deque[tuple[int, dict[str, Any]]] = deque(maxlen=config.history_size)  # (add_step)
        self.events: deque[dict[str, Any]] = deque(maxlen=config.history_size)
        self.anomalies: list[Anomaly] = []
        self.max_anomalies = 10 * config.history_size
        self.anomaly_counts: Counter[str] = Counter()
        self.severity_counts: Counter[str] = Counter()
        self.dropped_anomalies = 0
        self.events_path = self.run_dir / events_name
        self.stream_error: str | None = None
        """The first cause of a lost event stream (the stream stops; the ring buffer goes on)."""
        self.stream_cause: BaseException | None = None
        """That first cause as the exception itself (for the debugger's ``debugger_error``)."""
        self.on_stream_lost: Callable[[BaseException], None] | None = None
        """Called once, with the first cause, when the stream is lost (the sink records it)."""
        self._stream = None
        self._readings: Any = None
        self.readings_error: str | None = None
        """Why ``modules.jsonl`` stopped (a failing disk stops that stream only)."""
        self._streamed = bool(config.stream_events if stream is None else stream)
        if self._streamed:
            try:
                self._stream = _open_stream(self.events_path)
            except OSError as error:
                self._lose_stream(error)
        self._write(to_jsonable({"type": "start", "kind": kind, "config": config.to_dict(), "versions": versions()}))

    def _write(self, entry: dict[str, Any], flush: bool = True) -> None:
        """Keep ``entry`` (already plain JSON data) and stream it, on disk when this returns unless
        ``flush=False`` (then with the next entry that is: a write is one system call, ~60 us on
        this CI's disk). A failing disk never breaks the run: streaming stops, ``stream_error``
        says why, the ring buffer goes on."""
        entry = {"time": round(time.time(), 6), "rank": self.rank, **entry}
        self.events.append(entry)
        if self._stream is not None:
            try:
                self._stream.write("".join(encode_chunks(entry, 0)) + "\n")
                if flush:
                    self._stream.flush()
            except (OSError, ValueError, TypeError, RecursionError) as error:  # a cycle: no check made
                self._lose_stream(error)

    def _lose_stream(self, error: BaseException) -> None:
        first = self.stream_error is None
        if first:  # the first cause, not "I/O operation on closed file" after it
            self.stream_error = f"{type(error).__name__}: {error}"
            self.stream_cause = error
        stream, self._stream = self._stream, None
        if stream is not None:
            try:
                stream.close()  # flushes: may fail again on the same disk
            except (OSError, ValueError):
                pass
        if first and self.on_stream_lost is not None:
            try:
                self.on_stream_lost(error)
            except Exception:  # pragma: no cover - reporting the loss must not break the run either
                pass

    def add_step(self, row: dict[str, Any], *, joined: int | None = None) -> None:
        """This process's row; ``joined``: its monitored step on the clock every rank shares (``History.joined``, a
        training run's), kept beside it and in its streamed entry (not in the row): what names this one row where
        the loop repeats a step number (:meth:`amend_step`, :meth:`mark_skipped`)."""
        row = to_jsonable(row)
        self.steps.append(row)
        if joined is None:  # (a pipeline's: no call more per step)
            self._write({"type": "step", **row})
        else:
            self._joined.append((joined, row))
            self._write({"type": "step", **row, "joined": joined})

    def step_row(self, step: Any, joined: int | None = None) -> dict[str, Any] | None:
        """This process's kept row of ``step`` (as :meth:`add_step` wrote it) taken at monitored step ``joined``;
        ``joined`` None: its last row of ``step``. None where none is kept."""
        step = to_jsonable(step)
        rows = reversed(self.steps) if joined is None else (row for at, row in reversed(self._joined) if at == joined)
        return next((row for row in rows if row.get("step") == step), None)

    def mark_skipped(self, step: Any, reason: str, *, joined: int | None = None) -> None:
        """This process's row of ``step`` says that its optimizer step was skipped (``reason``:
        ``grad_scaler``, ``deepspeed_overflow``, ``policy``), learnt after the row was written (a
        GradScaler's skip shows at the next step): the kept row gets ``skipped``, and the stream a
        ``step_skipped`` entry that :func:`~.run_dir.every_rank_steps` puts into the streamed row. Both are the row
        taken at monitored step ``joined`` (:meth:`step_row`), else the last row of ``step`` recorded (marked
        before a later row is added: a loop that repeats step numbers with one optimizer)."""
        step = to_jsonable(step)
        row = self.step_row(step, joined)
        if row is not None:
            row["skipped"] = reason
        named = {} if joined is None else {"joined": joined}
        self._write({"type": "step_skipped", "step": step, **named, "reason": reason})

    def amend_step(self, step: Any, values: dict[str, Any], *, joined: int | None = None) -> None:
        """This process's row of ``step`` read anew (``values`` replace its fields), learnt after the row was
        written (a GradScaler not passed, confirmed a step later: the row unscaled): the row taken at monitored
        step ``joined`` (:meth:`step_row`: not another optimizer's row of the same step number, a GAN's; None: the
        last of that step) takes them, and the stream a ``step_amended`` entry naming it that
        :func:`~.run_dir.every_rank_steps` puts into the streamed row; ``joined`` also names the main process's
        copy of this very row (:meth:`amend_rank_step`)."""
        step, values = to_jsonable(step), to_jsonable(values)
        row = self.step_row(step, joined)
        if row is not None:
            row.update(values)
        named = {} if joined is None else {"joined": joined}
        self._write({"type": "step_amended", "step": step, **named, "values": values})

    def amend_rank_step(self, rank: int, step: Any, values: dict[str, Any], *, joined: int | None = None) -> bool:
        """Another rank's row of ``step``, kept here as a copy, read anew as that rank read its own
        (:meth:`amend_step` there, its ``step_amended`` in its own events file): the one copy of it, that rank's
        row of ``step`` (``3`` and ``3.0`` alike) taken at its monitored step ``joined`` (:meth:`add_rank_step`;
        the last such copy), takes ``values``, not its later rows of a step number the loop repeated, as
        :func:`~.run_dir.every_rank_steps` amends that rank's own row; and the stream a ``step_amended`` entry of
        that rank naming it (a summary rebuilt from this file reads it so). False, nothing written, when no such
        copy is kept or it holds ``values`` already."""
        values = to_jsonable(values)
        key = step_key({"step": step})
        row = next(
            (
                row
                for row, at in zip(reversed(self.rank_steps), reversed(self._rank_joined))
                if row.get("rank") == rank and at == joined and step_key(row) == key
            ),
            None,
        )
        if row is None or all(k in row and row[k] == v for k, v in values.items()):
            return False
        row.update(values)
        named = {} if joined is None else {"joined": joined}
        self._write({"type": "step_amended", "step": step, "rank": rank, **named, "values": values})
        return True

    def add_rank_step(self, row: dict[str, Any], *, joined: int | None = None) -> None:
        """Another rank's step row (it carries its ``rank``), kept apart from this process's own; ``joined``: the
        monitored step it was taken at (the clock every rank shares), which that rank's :meth:`amend_step` names:
        kept beside it, and in its streamed entry (not in the row)."""
        row = to_jsonable(row)
        self.rank_steps.append(row)
        self._rank_joined.append(joined)
        self._write({"type": "step", **row} if joined is None else {"type": "step", **row, "joined": joined})

    def all_steps(self) -> list[dict[str, Any]]:
        """This process's rows and the other ranks' rows, by step then rank where steps are numbers
        (else in the order recorded, this process's first)."""
        rows = list(self.steps) + list(self.rank_steps)
        if not self.rank_steps:
            return rows

        def order(row: dict[str, Any]) -> tuple:
            step = row.get("step")
            number = isinstance(step, (int, float)) and not isinstance(step, bool)
            return (0, step, row.get("rank", 0)) if number else (1, 0, 0)

        return sorted(rows, key=order)

    def add_anomaly(self, anomaly: Anomaly) -> None:
        self.anomaly_counts[anomaly.kind] += 1
        self.severity_counts[anomaly.severity] += 1
        if len(self.anomalies) < self.max_anomalies:
            self.anomalies.append(anomaly)
        else:
            self.dropped_anomalies += 1
        self._write({"type": "anomaly", **anomaly.to_dict()})

    def add_event(self, type: str, *, flush: bool = True, **data: Any) -> None:
        """``flush=False``: an event that an entry written soon after (a step row) brings to disk
        (a watched pipeline call's ``attach``, ``run_start``, ``set_timesteps``)."""
        self._write({"type": type, **to_jsonable(data)}, flush)

    def add_readings(self, entry: dict[str, Any]) -> None:
        """One component call's module readings, appended to ``modules.jsonl`` and kept nowhere in
        memory (hundreds of modules a call would crowd the event ring out). Only while events are
        streamed; a failing disk stops this file, never the run. ``entry``: plain data, as
        :func:`~.jsonio.dumps_plain` takes it."""
        if not self._streamed or self.readings_error is not None:
            return
        try:
            if self._readings is None:
                self._readings = _open_stream(self.run_dir / READINGS_FILE)
            self._readings.write(dumps_plain(entry) + "\n")
            self._readings.flush()
        except (OSError, ValueError, TypeError) as error:
            self.readings_error = f"{type(error).__name__}: {error}"
            self._close_readings()

    def _close_readings(self) -> None:
        readings, self._readings = self._readings, None
        if readings is not None:
            try:
                readings.close()
            except (OSError, ValueError):
                pass

    def clear(self) -> None:
        self.steps.clear()
        self.rank_steps.clear()
        self._rank_joined.clear()
        self._joined.clear()
        self.events.clear()
        self.anomalies.clear()
        self.anomaly_counts.clear()
        self.severity_counts.clear()
        self.dropped_anomalies = 0

    def summary(self) -> dict[str, Any]:
        """The record's part of summary.json."""
        return {
            "kind": self.kind,
            "run_dir": str(self.run_dir),
            "started": self.started,
            "duration_s": time.time() - self.started,
            "anomaly_counts": dict(self.anomaly_counts),
            "severity_counts": dict(self.severity_counts),
            "dropped_anomalies": self.dropped_anomalies,
            "stream_error": self.stream_error,
            "config": self.config.to_dict(),
            "versions": versions(),
        }

    def flush_to_disk(self) -> None:
        """Make events.jsonl complete: flush the stream; without one (not streaming, or the
        stream was closed), write the buffered events unless the streamed file holds more."""
        if self._stream is not None:
            try:
                self._stream.flush()
            except (OSError, ValueError) as error:
                self._lose_stream(error)
        elif not self._streamed:
            write_atomic(self.events_path, "".join(dumps(e) + "\n" for e in self.events))

    def close(self) -> None:
        """Close ``events.jsonl`` (and ``modules.jsonl``) and let go of the run directory; never
        raises (a failing disk is kept in ``stream_error``)."""
        self._close_readings()
        stream, self._stream = self._stream, None
        if stream is not None:
            try:
                stream.close()
            except (OSError, ValueError) as error:
                if self.stream_error is None:
                    self.stream_error = f"{type(error).__name__}: {error}"
        if self.lock is not None:
            self.lock.release()

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.steps)


def _open_stream(path: Path) -> Any:
    """``path`` opened to append, buffered (the writer flushes), never through a symbolic link (``O_NOFOLLOW``: a
    link planted in a reused run directory is refused). A file that ends in a line cut by a
    killed writer gets a newline first, so the next entry starts on a line of its own."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size:
            with open(path, "rb") as existing:
                existing.seek(size - 1)
                if existing.read(1) != b"\n":
                    os.write(fd, b"\n")
        return os.fdopen(fd, "a", encoding="utf-8")  # flushed per entry by the writer, or with the next
    except BaseException:
        os.close(fd)
        raise
