"""The job behind ``diffusion-debug export``: a saved run's tables as CSV or parquet files.

``steps``, ``anomalies`` and (for a training run) ``ranks`` (see
:mod:`diffusion_debug.record.tables`) go to ``steps.csv``, ``anomalies.csv``, ``ranks.csv``
(or ``.parquet``) in the run directory or ``out``. A table with no rows is not written, except
``steps``, which is always written (a header-only file says the run recorded no step).

Limits: parquet needs pyarrow (an optional dependency); without it the command says so in one
line and writes nothing. CSV cells hold the saved JSON values as text: non-finite floats are
``nan``, ``inf`` and ``-inf``, lists and per-module dicts are JSON text.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any, Sequence

from ..errors import DiffusionDebugError
from ..record import load_run, write_atomic
from ..record.tables import TABLES, tables, typed_columns

EXPORT_FORMATS = ("csv", "parquet")


def export_run(run_dir: str | Path, format: str = "csv", out: str | Path | None = None) -> list[Path]:
    """Write the run's tables as ``format`` files into ``out`` (default: the run directory); the paths written."""
    if format not in EXPORT_FORMATS:
        raise DiffusionDebugError(f"--format {format!r} is not one of {', '.join(EXPORT_FORMATS)}.")
    write = _csv_bytes if format == "csv" else _parquet_writer()  # a missing pyarrow is said before anything
    run = load_run(run_dir)
    target = Path(run_dir if out is None else out)
    found = tables(run.steps, run.anomalies)
    written = []
    for name in TABLES:
        rows = found[name]
        if rows or name == "steps":
            written.append(write_atomic(target / f"{name}.{format}", write(rows)))
    return written


def _csv_bytes(rows: Sequence[dict[str, Any]]) -> bytes:
    text = io.StringIO()
    columns = list(dict.fromkeys(key for row in rows for key in row)) or ["step"]
    writer = csv.DictWriter(text, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)  # floats as repr: they read back to the same value
    return text.getvalue().encode("utf-8")


def _parquet_writer() -> Any:
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise DiffusionDebugError(
            "--format parquet needs pyarrow, which is not installed here: pip install pyarrow (or use --format csv)."
        ) from None

    def parquet_bytes(rows: Sequence[dict[str, Any]]) -> bytes:
        columns = typed_columns(rows) or {"step": []}
        sink = pyarrow.BufferOutputStream()
        pyarrow.parquet.write_table(pyarrow.table(columns), sink)
        return sink.getvalue().to_pybytes()

    return parquet_bytes
