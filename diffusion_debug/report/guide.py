"""What each anomaly kind means and what to do about it, read from the kind registry
(:mod:`diffusion_debug.record.anomaly`): the HTML report shows it next to each group of anomalies
and the README's table is made from it.

>>> print(guide_markdown(["loss_spike"]).splitlines()[0])
| kind | what it means | what to do |
"""

from __future__ import annotations

from typing import Iterable

from ..record import KINDS, kind_info


def guide_markdown(kinds: Iterable[str] | None = None) -> str:
    """The guide as a Markdown table (for the README)."""
    rows = ["| kind | what it means | what to do |", "| --- | --- | --- |"]
    for kind in KINDS if kinds is None else kinds:
        g = kind_info(kind)
        rows.append(f"| `{kind}` | {g.meaning} | {g.action} |")
    return "\n".join(rows)
