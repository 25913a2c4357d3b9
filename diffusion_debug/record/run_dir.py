"""The run directory: its name, its creation, and reading a saved one back.

A run directory holds ``events.jsonl`` (streamed), ``summary.json`` (atomic) and ``report.html``;
it is never shared by two runs.
"""

from __future__ import annotations

import os
import re
import secrets
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from operator import is_not
from pathlib import Path
from typing import Any

from ..errors import DiffusionDebugError
from .anomaly import Anomaly, distinct_details
from .jsonio import load_json, read_jsonl


@dataclass
class RunData:
    """What a run directory holds. ``summary["incomplete"]`` is set when summary.json was missing
    and the summary was rebuilt from the event files (a killed run, or one that never saved)."""

    run_dir: Path
    summary: dict[str, Any]
    events: list[dict[str, Any]]

    @property
    def anomalies(self) -> list[Anomaly]:
        """summary.json's anomalies, built once: the same objects at every read, so what finds one by identity
        (:func:`~.anomaly.consequences`, a report's cause and its folded copies) finds it across two reads. Built
        anew only when ``summary["anomalies"]`` is another list or holds other entries than when they were built
        (appended, removed or replaced: compared by identity, entry by entry, not by value; a caller editing an
        entry in place assigns the list or the entry anew, as no library code edits one)."""
        rows = self.summary.get("anomalies", [])
        held = self._anomalies
        if held is None or held[0] is not rows or len(held[1]) != len(rows) or any(map(is_not, held[1], rows)):
            self._anomalies = (rows, list(rows), [Anomaly.from_dict(a) for a in rows])
        return self._anomalies[2]

    @property
    def steps(self) -> list[dict[str, Any]]:
        """The step rows: a diffusion run's, or a training run's main process's own (rank 0's,
        ``summary["rank"]``), one per step, whatever the number of ranks; :attr:`rank_steps` has
        every rank's. (summary.json also keeps a bounded share of the other ranks' rows: not here.)"""
        return main_process_steps(self.summary, self.summary.get("steps", []))

    @property
    def rank_steps(self) -> list[dict[str, Any]]:
        """A training run's step rows, one per step and rank, by step then rank, read from every
        rank's event file (:func:`every_rank_steps`; summary.json's rows where the run has none);
        :attr:`steps` for any other run. Read once."""
        if self.summary.get("kind") != "training":
            return self.steps
        if self._rank_steps is None:
            self._rank_steps = every_rank_steps(self.run_dir, self.summary.get("steps", []))
        return self._rank_steps

    _rank_steps: list[dict[str, Any]] | None = field(default=None, repr=False, compare=False)
    _anomalies: tuple[list, list, list[Anomaly]] | None = field(default=None, repr=False, compare=False)


def load_run(run_dir: str | os.PathLike) -> RunData:
    """Load a run directory: ``summary.json`` (checked field by field) and ``events.jsonl``.

    Without summary.json the summary is rebuilt from ``events*.jsonl`` and marked incomplete.
    Anything unreadable is one DiffusionDebugError naming the file and the field."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise DiffusionDebugError(f"{str(run_dir)!r} is not a run directory: no such directory.")
    summary_path, events_path = run_dir / "summary.json", run_dir / "events.jsonl"
    for path in [summary_path, *run_dir.glob("events*.jsonl")]:
        _refuse_outside(run_dir, path)
    events = _read_events(events_path) if events_path.is_file() else []
    if summary_path.is_file():
        summary = _read_summary(summary_path)
    elif events:
        summary = rebuild_summary(run_dir)
    else:
        raise DiffusionDebugError(
            f"{str(run_dir)!r} is not a run directory: it has no summary.json and no events.jsonl."
        )
    return RunData(run_dir, summary, events)


def _refuse_outside(run_dir: Path, path: Path) -> None:
    """A run directory is self-contained: a file of it that is a symbolic link out of it (to a
    file of another run, or anywhere else) is refused, whichever file it is."""
    if not path.is_symlink():
        return
    try:
        inside = path.resolve().is_relative_to(run_dir.resolve())
    except (OSError, RuntimeError):  # a loop of links
        inside = False
    if not inside:
        raise DiffusionDebugError(
            f"{str(path)!r} is a symbolic link out of the run directory; a run directory holds its own files."
        )


def _read_events(path: Path) -> list[dict[str, Any]]:
    try:
        return read_jsonl(path)
    except (OSError, UnicodeDecodeError) as error:
        raise DiffusionDebugError(f"{str(path)!r} cannot be read: {error.__class__.__name__}: {error}.") from None


# summary.json fields the report reads, and the type each must have when present
_SUMMARY_FIELDS: dict[str, type | tuple[type, ...]] = {
    "kind": str,
    "anomalies": list,
    "steps": list,
    "components": dict,
    "anomaly_counts": dict,
    "severity_counts": dict,
    "config": dict,
    "versions": dict,
    "previews": list,
    "bundles": list,
    "end": dict,
}


def _read_summary(path: Path) -> dict[str, Any]:
    where = repr(str(path))
    if path.stat().st_size > 512 * 1024 * 1024:
        raise DiffusionDebugError(f"{where} is over 512 MB; it is not a summary this package wrote.")
    try:
        summary = load_json(path)
    except (OSError, UnicodeDecodeError) as error:
        raise DiffusionDebugError(f"{where} cannot be read: {error.__class__.__name__}: {error}.") from None
    except RecursionError:
        raise DiffusionDebugError(f"{where} is nested too deeply to be a summary.") from None
    except ValueError as error:
        raise DiffusionDebugError(f"{where} is not valid strict JSON: {str(error)[:200]}.") from None
    if not isinstance(summary, dict):
        raise DiffusionDebugError(f"{where} must hold a JSON object, not {type(summary).__name__}.")
    for key, kind in _SUMMARY_FIELDS.items():
        if key in summary and not isinstance(summary[key], kind):
            raise DiffusionDebugError(
                f"{where}: field {key!r} must be {_type_name(kind)}, not {type(summary[key]).__name__}."
            )
    for index, step in enumerate(summary.get("steps", [])):
        if not isinstance(step, dict):
            raise DiffusionDebugError(f"{where}: steps[{index}] must be an object, not {type(step).__name__}.")
    for index, anomaly in enumerate(summary.get("anomalies", [])):
        problem = anomaly_problem(anomaly)
        if problem:
            raise DiffusionDebugError(f"{where}: anomalies[{index}] {problem}.")
    return summary


def anomaly_problem(data: Any) -> str | None:
    """Why ``data`` cannot be read as an Anomaly (None when it can)."""
    if not isinstance(data, dict):
        return f"must be an object, not {type(data).__name__}"
    for key in ("kind", "severity", "message"):
        if not isinstance(data.get(key), str):
            return f"field {key!r} must be text, not {type(data.get(key)).__name__}"
    for key, kind in (("component", str), ("module", str), ("details", dict), ("rank", int)):
        if key in data and data[key] is not None and not isinstance(data[key], kind):
            return f"field {key!r} must be {_type_name(kind)}, not {type(data[key]).__name__}"
    if (
        "step" in data
        and data["step"] is not None
        and (isinstance(data["step"], bool) or not isinstance(data["step"], int))
    ):
        return f"field 'step' must be an integer, not {type(data['step']).__name__}"
    try:
        Anomaly.from_dict(data)
    except (TypeError, ValueError) as error:
        return str(error).rstrip(".")
    return None


def _type_name(kind: type | tuple[type, ...]) -> str:
    """What a value of ``kind`` is called in an error, with its article.

    >>> _type_name(dict), _type_name(int), _type_name(str), _type_name((list, float))
    ('an object', 'an integer', 'text', 'a list or a float')
    """
    names = {str: "text", list: "a list", dict: "an object", int: "an integer"}
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(names.get(k) or f"a{'n' if k.__name__[0] in 'aeiou' else ''} {k.__name__}" for k in kinds)


def main_process_steps(summary: dict[str, Any], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Of a run's step ``rows``, what its ``steps`` are (:attr:`RunData.steps`, the live
    ``DebugReport.steps``): a training run's main process's own (``summary["rank"]``), one a step;
    any other run's, all of them."""
    if summary.get("kind") != "training":
        return list(rows)
    main = summary.get("rank", 0)
    return [row for row in rows if row.get("rank", main) == main]


def every_rank_steps(run_dir: Path, fallback: list[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """One row per step and rank, ordered by step then rank: each rank's rows from its own event
    file (``events.jsonl`` is the main process's, ``events-rank<r>.jsonl`` rank r's); a rank with no
    file of its own keeps the copies another file holds (the main's, of the steps it exchanged).
    ``fallback`` (the summary's rows) where the run has no event file. A row read anew or found skipped after it
    was written (``step_amended``, ``step_skipped``) is the one its entry names, taken at the monitored step it
    names (``joined``; a rank's own row in a file without it: the last of that step its file holds before the
    entry): never another row of a step number the loop repeated (a later one, another optimizer's)."""
    files = sorted(Path(run_dir).glob("events*.jsonl"), key=lambda p: (p.name != "events.jsonl", p.name))
    own: dict[int, list[dict[str, Any]]] = {}
    copies: dict[int, dict[Any, dict[str, Any]]] = {}
    amended: dict[tuple, dict] = {}  # RunRecord.amend_rank_step: the copy of another rank's row read anew
    for path in files:
        try:
            rows = _read_events(path)
        except DiffusionDebugError:
            continue  # an unreadable file: the other ranks' rows still count
        match = re.fullmatch(r"events-rank(\d+)\.jsonl", path.name)
        start = next((r for r in rows if r.get("type") == "start"), {})
        owner = int(match.group(1)) if match else start.get("rank", 0)
        latest: dict[Any, dict[str, Any]] = {}  # this file's own rows as written so far: _named's, and its last
        for row in rows:
            kind = row.get("type")
            if kind == "step_skipped" and row.get("rank", owner) == owner:  # RunRecord.mark_skipped: the row it
                latest.get(_named(row, owner), {})["skipped"] = row.get("reason")  # names
            elif kind == "step_amended" and isinstance(row.get("values"), dict):
                if row.get("rank", owner) == owner:  # RunRecord.amend_step: the row it names
                    latest.get(_named(row, owner), {}).update(row["values"])
                else:  # RunRecord.amend_rank_step: the copy it names
                    amended.setdefault(_named(row, owner), {}).update(row["values"])
            if kind != "step":
                continue
            step = {k: v for k, v in row.items() if k not in ("type", "time", "joined")}
            rank = step.get("rank", owner)
            if rank == owner:
                own.setdefault(owner, []).append(step)
                latest[(owner, step_key(step), None)] = latest[_named(row, owner)] = step
            else:
                copies.setdefault(rank, {}).setdefault(_named(row, owner), step)
    if not own and not copies:
        return list(fallback)
    for rank, kept in copies.items():  # a copy read anew (RunRecord.amend_rank_step), where its rank has no file
        for key, row in kept.items():
            row.update(amended.get(key, {}))
    out = [row for rows in own.values() for row in rows]
    out += [row for rank, rows in copies.items() if rank not in own for row in rows.values()]
    return sorted(out, key=lambda row: (step_key(row), _order(row.get("rank", 0))))


def _named(row: dict[str, Any], owner: int) -> tuple:
    """What names a step row in the stream of rank ``owner``, and what a ``step_amended`` or ``step_skipped`` entry
    names: its rank and step, and the monitored step it was taken at (``joined``; None in a file written before
    rows named it, or an entry naming none: for ``owner``'s own rows, its last row of that step)."""
    return (row.get("rank", owner), step_key(row), row.get("joined"))


def step_key(row: dict[str, Any]) -> tuple[int, Any]:
    """What a step row is matched by: its step number (``3`` and ``3.0`` alike), else its step's text."""
    return _order(row.get("step"))


def _order(value: Any) -> tuple[int, Any]:
    """Numbers first, in their order, then anything else by its text (steps the user named)."""
    return (0, value) if isinstance(value, (int, float)) and not isinstance(value, bool) else (1, str(value))


def _fold_key(row: dict[str, Any]) -> tuple:
    # the first anomaly's place, which its anomaly_repeated events name, read back from JSON; a
    # consequence at the place of its cause has a fold key of its own (``default_key``), but the
    # two are never open together (one a kind, rank and step): a repeat is the latest one's. Two
    # at one place that their kind tells apart (each optimizer's own stall) may be: the details
    # that do (a repeat's event carries them) are part of the key
    return (*_place(row), tuple(distinct_details(str(row.get("kind")), row.get("details")).values()))


def _place(row: dict[str, Any]) -> tuple:
    # a row with no details (an anomaly_bundle event; an anomaly_repeated one written before repeats
    # carried them) names the place alone: the latest anomaly there
    return (
        row.get("kind"),
        row.get("rank", 0),
        row.get("component") or "",
        row.get("module") or "",
        row.get("parameter"),
    )


class FirstAnomalies:
    """The anomalies of a run's events, as the rows that repeat them or save their bundle after them name them
    (``anomaly_repeated``, ``anomaly_bundle``): by fold key, and by place for a row with no details."""

    def __init__(self) -> None:
        self._by_key: dict[tuple, Any] = {}
        self._by_place: dict[tuple, Any] = {}

    def add(self, row: dict[str, Any], anomaly: Any) -> None:
        """``anomaly`` (anything: a dict, an Anomaly) is the one named at ``row``'s place from now on."""
        self._by_key[_fold_key(row)] = self._by_place[_place(row)] = anomaly

    def named(self, row: dict[str, Any]) -> Any:
        """The anomaly ``row`` names (None: none)."""
        return self._by_key.get(_fold_key(row)) if "details" in row else self._by_place.get(_place(row))


def fold_repeat(details: dict[str, Any], row: dict[str, Any]) -> None:
    """An ``anomaly_repeated`` row folded into the ``details`` of the anomaly it repeats: its count, its last step,
    and a later run's name (the sink's ``last_run``)."""
    details["count"] = row.get("count", details.get("count", 1))
    details["last_step"] = row.get("step")
    if row.get("run") is not None:
        details["last_run"] = row["run"]


def rebuild_summary(run_dir: Path) -> dict[str, Any]:
    """The summary of a run that never wrote summary.json, from its event files (every rank's):
    the start event's kind and config, every step row of the main events file, every anomaly
    (with the counts of its folded repeats and the repro bundle saved after it), marked ``incomplete``. A row
    read anew or found skipped after it was written (``step_amended``, ``step_skipped``) is read so, the one row its
    entry names, as :func:`every_rank_steps` reads it."""
    files = sorted(run_dir.glob("events*.jsonl"), key=lambda p: (p.name != "events.jsonl", p.name))
    summary: dict[str, Any] = {"kind": "unknown", "run_dir": str(run_dir), "incomplete": True}
    anomalies: list[dict[str, Any]] = []
    steps: list[dict[str, Any]] = []
    bad: dict[str, list[int]] = {}
    first_anomalies = FirstAnomalies()
    named: dict[tuple, dict[str, Any]] = {}
    owner = 0  # the main events file's process (its start event's rank)
    for path in files:
        rows = _read_events(path)
        if rows.bad_lines:
            bad[path.name] = rows.bad_lines[:20]
        for row in rows:
            kind = row.get("type")
            if kind == "start":
                owner = row.get("rank", 0) if path.name == "events.jsonl" else owner
                summary.setdefault("started", row.get("time"))
                for key in ("kind", "config", "versions"):
                    if key in row:
                        summary[key] = row[key]
            elif kind == "step" and path.name == "events.jsonl":
                steps.append({k: v for k, v in row.items() if k not in ("type", "time", "joined")})
                named[_named(row, owner)] = steps[-1]  # each row by its joined (a copy's, its own's)
                if row.get("rank", owner) == owner:  # and its own last row of each step
                    named[(owner, step_key(row), None)] = steps[-1]
            elif kind in ("step_amended", "step_skipped") and path.name == "events.jsonl":
                named_row = named.get(_named(row, owner))  # as every_rank_steps reads them: the row it names
                if named_row is not None and isinstance(row.get("values"), dict):
                    named_row.update(row["values"])
                elif named_row is not None and kind == "step_skipped":
                    named_row["skipped"] = row.get("reason")
            elif kind == "anomaly" and anomaly_problem({k: v for k, v in row.items() if k != "type"}) is None:
                anomaly = {k: v for k, v in row.items() if k not in ("type", "time")}
                anomalies.append(anomaly)
                first_anomalies.add(anomaly, anomaly)
            elif kind == "anomaly_repeated":
                first = first_anomalies.named(row)
                if first is not None and isinstance(first.get("details"), dict):
                    fold_repeat(first["details"], row)
            elif kind == "anomaly_bundle":  # saved after the anomaly's event (why checks the path)
                first = first_anomalies.named(row)
                if first is not None and isinstance(first.get("details"), dict) and isinstance(row.get("bundle"), str):
                    first["details"]["bundle"] = row["bundle"]
    summary.update(
        anomalies=anomalies,
        steps=steps,
        anomaly_counts=dict(Counter(a["kind"] for a in anomalies)),
        severity_counts=dict(Counter(a["severity"] for a in anomalies)),
        incomplete_reason="summary.json is missing (the run was killed or stopped before it saved); "
        "this summary was rebuilt from the event files",
    )
    if bad:
        summary["unreadable_event_lines"] = bad
    named = (re.fullmatch(r"events-rank(\d{1,6})\.jsonl", path.name) for path in files)
    ranks = [int(match.group(1)) for match in named if match]
    if any(rank > 0 for rank in ranks):  # each rank writes its own file: the report names every rank
        summary["world_size"] = max(ranks) + 1
    return summary


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
    except FileExistsError as error:
        if not run_dir.is_dir():  # a file where output_dir or the run directory should be
            raise DiffusionDebugError(
                f"Cannot write the run directory {str(run_dir)!r} (output_dir={str(output_dir)!r}): "
                f"{error.strerror or error}."
            ) from None
        raise DiffusionDebugError(
            f"The run directory {str(run_dir)!r} exists already; runs never share one."
        ) from None
    except OSError as error:
        reason = error.strerror or str(error)
        raise DiffusionDebugError(
            f"Cannot write the run directory {str(run_dir)!r} (output_dir={str(output_dir)!r}): {reason}."
        ) from None
    return run_dir
