"""A run's record as flat tables (one dict a row, the same columns on every row) for a
spreadsheet, parquet or pandas: ``steps``, ``anomalies`` and ``ranks``.

* ``steps``: one row per recorded step. Nested statistics become dotted columns
  (``latents.std``, ``memory.rss_mb``); a list, and the per-module dicts of
  :data:`JSON_TEXT_FIELDS`, become JSON text (one cell, not a column per module).
* ``anomalies``: one row per anomaly, its stable fields, ``details`` as JSON text.
* ``ranks``: one row per training step and rank (``loss``, ``grad_norm``): the rows every rank
  recorded, and the per-rank lists a step row carries; empty for an inference run.

>>> flatten({"step": 3, "latents": {"std": 1.5, "shape": [1, 4]}, "loss": "nan"})
{'step': 3, 'latents.std': 1.5, 'latents.shape': '[1, 4]', 'loss': 'nan'}
>>> typed_columns([{"loss": 1.0}, {"loss": "nan"}, {"loss": None}])
{'loss': [1.0, nan, None]}

Limits: values are those of the saved JSON record: non-finite floats are the strings ``"nan"``,
``"inf"`` and ``"-inf"`` in :func:`flatten`'s rows (and in CSV), floats again in
:func:`typed_columns` (parquet, pandas) where the rest of the column is numbers.
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Mapping, Sequence

from .anomaly import Anomaly

TABLES = ("steps", "anomalies", "ranks")
"""The tables of a run, in the order they are written."""

JSON_TEXT_FIELDS = frozenset(
    {
        "module_grad_norms",
        "top_module_grad_norms",
        "bottom_module_grad_norms",
        "update_to_weight_ratio",
        "applied_update_ratio",
        "details",
    }
)
"""Dict fields kept as one JSON cell: their keys are module names, different from step to step
(so is any other field named ``*_module_grad_norms``)."""


def is_json_text_field(key: str) -> bool:
    """Whether a dict under ``key`` is one JSON cell (:data:`JSON_TEXT_FIELDS`), not a column per key."""
    return key in JSON_TEXT_FIELDS or str(key).endswith("_module_grad_norms")


ANOMALY_COLUMNS = ("kind", "severity", "component", "module", "parameter", "step", "timestep", "rank", "message")

EMPTY_COLUMNS = {
    "steps": ("step",),
    "anomalies": (*ANOMALY_COLUMNS, "details"),
    "ranks": ("step", "rank", "loss", "grad_norm"),
}
"""The columns a table with no rows is written with (a header-only CSV reads as an empty DataFrame)."""

_NON_FINITE = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


def _json_text(value: Any) -> str:
    return json.dumps(value, allow_nan=False, default=str)


def flatten(row: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """One saved row with nested dicts as dotted columns, lists (and :data:`JSON_TEXT_FIELDS`) as JSON text."""
    flat: dict[str, Any] = {}
    for key, value in row.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and not is_json_text_field(key):
            flat.update(flatten(value, f"{name}."))
        elif isinstance(value, (Mapping, list, tuple)):
            flat[name] = _json_text(value)
        else:
            flat[name] = value
    return flat


def _same_columns(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every row with every column (None where a row has none), in first-seen order."""
    rows = list(rows)
    columns = list(dict.fromkeys(key for row in rows for key in row))
    return [{column: row.get(column) for column in columns} for row in rows]


def step_rows(steps: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The ``steps`` table."""
    return _same_columns(flatten(row) for row in steps if isinstance(row, Mapping))


def anomaly_rows(anomalies: Sequence[Anomaly]) -> list[dict[str, Any]]:
    """The ``anomalies`` table."""
    rows = []
    for anomaly in anomalies:
        data = anomaly.to_dict()
        row = {column: data.get(column) for column in ANOMALY_COLUMNS}
        row["details"] = _json_text(data.get("details") or {})
        rows.append(row)
    return rows


def rank_rows(steps: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The ``ranks`` table: ``step``, ``rank``, ``loss``, ``grad_norm`` for each training step and
    rank, sorted by step then rank (a row a rank recorded itself wins over a step's per-rank list)."""
    found: dict[tuple[Any, Any], dict[str, Any]] = {}
    training = [row for row in steps if isinstance(row, Mapping) and ("rank" in row or "losses_by_rank" in row)]
    for row in training:
        step = row.get("step")
        found[(step, row.get("rank", 0))] = {
            "step": step,
            "rank": row.get("rank", 0),
            "loss": row.get("loss"),
            "grad_norm": row.get("grad_norm"),
        }
    for row in training:
        losses, norms = row.get("losses_by_rank") or [], row.get("grad_norms_by_rank") or []
        for rank, (loss, norm) in enumerate(zip(losses, norms)):
            found.setdefault(
                (row.get("step"), rank), {"step": row.get("step"), "rank": rank, "loss": loss, "grad_norm": norm}
            )
    return sorted(found.values(), key=lambda r: (_order(r["step"]), _order(r["rank"])))


def _order(value: Any) -> tuple[int, Any]:
    return (0, value) if isinstance(value, (int, float)) and not isinstance(value, bool) else (1, str(value))


def tables(steps: Sequence[Mapping[str, Any]], anomalies: Sequence[Anomaly]) -> dict[str, list[dict[str, Any]]]:
    """The three tables of a run, by name (:data:`TABLES`)."""
    return {"steps": step_rows(steps), "anomalies": anomaly_rows(anomalies), "ranks": rank_rows(steps)}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def typed_columns(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[Any]]:
    """The rows as columns with one type each, for parquet and pandas: a column of numbers gets
    its ``"nan"``/``"inf"``/``"-inf"`` back as floats; a column of mixed values becomes text."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    out: dict[str, list[Any]] = {}
    for column in columns:
        values = [row.get(column) for row in rows]
        present = [v for v in values if v is not None]
        if all(_is_number(v) or v in _NON_FINITE for v in present) and any(_is_number(v) for v in present):
            out[column] = [_NON_FINITE.get(v, v) if isinstance(v, str) else v for v in values]
        elif all(isinstance(v, bool) for v in present) or all(isinstance(v, str) for v in present):
            out[column] = values
        else:
            out[column] = [None if v is None else (v if isinstance(v, str) else _json_text(v)) for v in values]
    return out


def to_dataframe(rows: Sequence[Mapping[str, Any]], empty_columns: Sequence[str] = ()) -> Any:
    """A pandas DataFrame of a table's rows (:func:`typed_columns`); with no rows, an empty one
    with ``empty_columns`` (as export's header-only files read back). Needs pandas."""
    try:
        import pandas
    except ImportError:
        raise ImportError(
            "to_pandas() needs pandas, which is not installed here: pip install pandas "
            "(or read the run's steps.csv from `diffusion-debug export RUN_DIR`)."
        ) from None
    return pandas.DataFrame(typed_columns(rows) or {name: [] for name in empty_columns})
