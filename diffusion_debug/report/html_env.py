"""The jinja2 environment of the report's pages (``templates/``) and the value filters its
templates use: one stored value as short table text, a table cell's classes, a data URI.

Templates are written one element a line, indented; their lines are joined without the line
breaks and the indentation, so a page is one line of HTML as the report has always been (tests
read rows as ``<tr><td class='num'>``). A space that matters at a line's end is written inside the
line, never at its edge. Every ``{{ value }}`` is escaped as :func:`html.escape` escapes it, quotes
included, so text and attributes are safe and the page spells entities as it always did.
"""

from __future__ import annotations

import base64
import html
import json
import math
from typing import Any

import jinja2
from jinja2.ext import Extension
from markupsafe import Markup

__all__ = ["cell_class", "data_uri", "format_value", "is_nonfinite", "render"]


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


def cell_class(value: Any) -> str:
    """A table cell's classes: ``num`` for numbers (right-aligned), ``bad`` for NaN/Inf (red)."""
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool) or is_nonfinite(value)
    return " ".join(c for c in ("num" if numeric else "", "bad" if is_nonfinite(value) else "") if c)


def data_uri(data: bytes, mime: str = "image/png") -> str:
    """Bytes embedded in the page, ``data:<mime>;base64,...``."""
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


class _JoinLines(Extension):
    """Joins an HTML template's lines, without their indentation (see the module docstring)."""

    def preprocess(self, source: str, name: str | None, filename: str | None = None) -> str:
        if not (name or "").endswith(".html"):
            return source
        return "".join(line.strip() for line in source.splitlines())


def _escape(value: Any) -> Any:
    # html.escape's spelling (&quot; &#x27;), not markupsafe's (&#34; &#39;): the same page as before
    return value if hasattr(value, "__html__") else Markup(html.escape(str(value), quote=True))


_ENV = jinja2.Environment(
    loader=jinja2.PackageLoader("diffusion_debug.report", "templates"),
    autoescape=True,
    finalize=_escape,
    extensions=[_JoinLines],
    undefined=jinja2.StrictUndefined,
)
_ENV.filters.update(fmt=format_value, cell_class=cell_class)


def render(template: str, **context: Any) -> str:
    """A template of ``templates/`` rendered with ``context``."""
    return _ENV.get_template(template).render(**context)
