"""Text and times read from a saved run, made safe to show: a saved file may hold anything, so
a message is cut to a bounded length before it is laid out, and a timestamp outside what the
platform's clock can show reads "unknown" instead of raising.

>>> cut("a" * 12, 5)
'aaaaa… 7 more characters'
>>> local_time(1e300)
'unknown'

Limits: :func:`cut` counts characters, not terminal columns (a wide character counts as one).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from typing import Any, Sequence

TERMINAL_MESSAGE_CHARS = 2000
"""The most of one message the terminal table wraps (a 50 MB message would take minutes)."""

HTML_MESSAGE_CHARS = 100_000
"""The most of one message report.html shows, in a scrolling box (summary.json holds it all)."""


def cut(text: str, limit: int) -> str:
    """``text`` up to ``limit`` characters, then how many were left out; linear in ``limit``."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… {len(text) - limit} more characters"


def local_time(seconds: Any) -> str:
    """A Unix time as ``YYYY-MM-DD HH:MM:SS ZONE`` in local time, or ``"unknown"`` when it is not
    a number the platform's clock can show (``1e300``, NaN, a string)."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds):
        return "unknown"
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(seconds))
    except (OverflowError, OSError, ValueError):  # beyond time_t, or before what the C library takes
        return "unknown"


def follow_label(under: Sequence[Any]) -> str:
    """What follows from an anomaly (``record.folded``), counted by kind, most first: the terminal's row
    and report.html's headline say it alike.

    >>> from diffusion_debug.record import Anomaly
    >>> b = Anomaly("loss_spike", "warning", "The loss jumped.", "model", step=11)
    >>> follow_label([b, b]), follow_label([])
    ('2 anomalies follow from it (2 loss_spike)', '')
    """
    if not under:
        return ""
    listed = ", ".join(f"{n} {kind}" for kind, n in Counter(b.kind for b in under).most_common())
    return f"{len(under)} {'anomaly follows' if len(under) == 1 else 'anomalies follow'} from it ({listed})"
