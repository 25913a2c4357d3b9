"""The job behind ``diffusion-debug export``: a saved run's tables as CSV or parquet files.

``steps``, ``anomalies`` and ``ranks`` (see :mod:`diffusion_debug.record.tables`) go to
``steps.csv``, ``anomalies.csv``, ``ranks.csv`` (or ``.parquet``) in the run directory or ``out``.
A training run's steps and ranks are read from every rank's event file: one row per step and rank,
however few of them summary.json keeps.
Every table is written, one with no rows as its header alone (an inference run's ``ranks``, a
clean run's ``anomalies``): ``pandas.read_csv`` of any of the three then works for any run and
gives an empty DataFrame where there was nothing, and an ``out`` that held another run's tables
keeps none of them beside the new ones. An ``out`` that cannot hold the tables is one error
before the run is read; nothing is created before then.

Limits: parquet needs pyarrow (an optional dependency); without it the command says so in one
line and writes nothing. CSV cells hold the saved JSON values as text: non-finite floats are
``nan``, ``inf`` and ``-inf``, lists and per-module dicts are JSON text. A CSV is made to be opened in
a spreadsheet, so a text cell (or column name) that starts with ``=``, ``+``, ``-``, ``@``, a tab or a
carriage return gets a leading ``'`` (OWASP's advice against formula injection: a module a user named
``=HYPERLINK(...)``, a crafted ``summary.json``); a number, ``-inf`` included, is written as it is.
Parquet cells are typed, never formulas, and are written unchanged.
"""

from __future__ import annotations

import csv
import io
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Sequence

from ..errors import DiffusionDebugError

# the record (and torch with it) loads when a run is exported: ``diffusion-debug launch`` imports
# this module with the command line and must not pay for it

EXPORT_FORMATS = ("csv", "parquet")


def export_run(run_dir: str | Path, format: str = "csv", out: str | Path | None = None) -> list[Path]:
    """Write the run's tables as ``format`` files into ``out`` (default: the run directory); the paths written."""
    from ..record import load_run, write_atomic
    from ..record.tables import EMPTY_COLUMNS, TABLES, tables

    if format not in EXPORT_FORMATS:
        raise DiffusionDebugError(f"--format {format!r} is not one of {', '.join(EXPORT_FORMATS)}.")
    write = _csv_bytes if format == "csv" else _parquet_writer()  # a missing pyarrow is said before anything
    if out is not None:
        check_out(Path(out))
    run = load_run(run_dir)
    target = Path(run_dir if out is None else out)
    found = tables(run.rank_steps, run.anomalies)  # a training run: every rank's every step, from its event file
    return [write_atomic(target / f"{name}.{format}", write(found[name], EMPTY_COLUMNS[name])) for name in TABLES]


def check_out(out: Path) -> None:
    """An ``--out`` that cannot hold the tables is one clear error; it creates nothing (a missing
    folder is made when the tables are written, under its nearest existing folder, checked here)."""
    existing = out
    while not os.path.lexists(existing) and existing.parent != existing:
        existing = existing.parent
    if not existing.is_dir():
        if existing == out:
            raise DiffusionDebugError(f"--out {str(out)!r} is not a folder: a file of that name exists.")
        raise DiffusionDebugError(f"--out {str(out)!r} cannot be made: {str(existing)!r} is a file.")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise DiffusionDebugError(f"--out {str(out)!r} cannot be written: {reason}.") from None


_FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")
_NUMBER_TEXT = re.compile(r"[+-]?(?:(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?|inf|nan)")


def spreadsheet_cell(value: Any) -> Any:
    """``value`` as a CSV cell a spreadsheet will not run: text starting like a formula gets a leading ``'``.

    >>> [spreadsheet_cell(v) for v in ("=HYPERLINK(1)", "@SUM(A1)", "-2+3", -1.5, "-inf", "up_blocks.0", None)]
    ["'=HYPERLINK(1)", "'@SUM(A1)", "'-2+3", -1.5, '-inf', 'up_blocks.0', None]
    """
    if isinstance(value, str) and value.startswith(_FORMULA_STARTS) and not _NUMBER_TEXT.fullmatch(value):
        return "'" + value
    return value


def _csv_bytes(rows: Sequence[dict[str, Any]], empty_columns: Sequence[str]) -> bytes:
    text = io.StringIO()
    columns = list(dict.fromkeys(key for row in rows for key in row)) or list(empty_columns)
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow([spreadsheet_cell(column) for column in columns])
    # floats as repr: they read back to the same value
    writer.writerows([spreadsheet_cell(row.get(column)) for column in columns] for row in rows)
    return text.getvalue().encode("utf-8")


def _parquet_writer() -> Any:
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise DiffusionDebugError(
            "--format parquet needs pyarrow, which is not installed here: pip install pyarrow (or use --format csv)."
        ) from None

    from ..record.tables import typed_columns

    def parquet_bytes(rows: Sequence[dict[str, Any]], empty_columns: Sequence[str]) -> bytes:
        columns = typed_columns(rows) or {name: [] for name in empty_columns}
        sink = pyarrow.BufferOutputStream()
        pyarrow.parquet.write_table(pyarrow.table(columns), sink)
        return sink.getvalue().to_pybytes()

    return parquet_bytes
