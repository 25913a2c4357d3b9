"""The small pieces every section of report.html is made of: escaping, one value as table text,
a table cell (numbers right-aligned, NaN/Inf marked red), a name/value table and a message box."""

from __future__ import annotations

import html
import json
import math
from typing import Any, Iterable, Sequence

from .text import HTML_MESSAGE_CHARS, cut


def escape(value: Any) -> str:
    """Any value as HTML text, quotes escaped too (safe in attributes)."""
    return html.escape(str(value), quote=True)


def message_box(text: str) -> str:
    """An anomaly's message in a box that scrolls when it is long (a saved message can be
    megabytes; the box holds its first :data:`~.text.HTML_MESSAGE_CHARS` characters)."""
    return f"<div class='message'>{escape(cut(text, HTML_MESSAGE_CHARS))}</div>"


def is_nonfinite(value: Any) -> bool:
    """NaN/Inf, as a float or as strict JSON stores it (``"nan"``, ``"inf"``, ``"-inf"``)."""
    return (
        isinstance(value, str)
        and value in ("nan", "inf", "-inf")
        or (isinstance(value, float) and not math.isfinite(value))
    )


def format_value(value: Any) -> str:
    """One stored value as short table text (4 significant digits, long JSON cut)."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}" if abs(value) >= 10_000 else str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.4g}"
    if isinstance(value, (dict, list)):
        text = json.dumps(value, ensure_ascii=False)
        return text if len(text) <= 300 else text[:299] + "…"
    return str(value)


def cell(value: Any) -> str:
    """A ``<td>``: numbers right-aligned, NaN/Inf marked red."""
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool) or is_nonfinite(value)
    classes = " ".join(c for c in ("num" if numeric else "", "bad" if is_nonfinite(value) else "") if c)
    return (
        f"<td class='{classes}'>{escape(format_value(value))}</td>"
        if classes
        else f"<td>{escape(format_value(value))}</td>"
    )


def kv_table(pairs: Iterable[tuple[str, Any]], per_row: int = 1) -> str:
    """Name/value pairs, ``per_row`` pairs side by side (long lists stay short)."""
    pairs = list(pairs)
    rows = []
    for i in range(0, len(pairs), per_row):
        rows.append("<tr>" + "".join(f"<td>{escape(k)}</td>{cell(v)}" for k, v in pairs[i : i + per_row]) + "</tr>")
    return f"<table class='kv'>{''.join(rows)}</table>" if rows else ""


def named_rows_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A scrolling table whose first column is a name in ``<code>`` (a module, an operator) and
    whose other columns are :func:`cell` values; "" for no rows."""
    body = "".join(
        f"<tr><td><code>{escape(r[0])}</code></td>" + "".join(cell(v) for v in r[1:]) + "</tr>" for r in rows
    )
    if not body:
        return ""
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    return f"<div class='scroll'><table><tr>{head}</tr>{body}</table></div>"
