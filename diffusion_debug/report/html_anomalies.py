"""The anomalies section of report.html: the verdict line, then one group per kind (what it means,
what to do) with a card per place where the kind happened, most severe and earliest first.

Limits: a kind shows at most :data:`ANOMALY_CARDS_PER_KIND` cards and, folded away, at most
:data:`ANOMALY_ROWS_PER_KIND` rows one by one (summary.json holds them all).
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

from ..record import Anomaly, RunData, by_cause, kind_info, severity_rank
from .html_cells import escape, format_value, kv_table, message_box
from .plots_common import kind_color, number

ANOMALY_CARDS_PER_KIND = 6
ANOMALY_ROWS_PER_KIND = 300


def _verdict(anomalies: list[Anomaly], summary: dict[str, Any]) -> str:
    counts: dict[str, int] = {}
    for a in anomalies:
        counts[a.severity] = counts.get(a.severity, 0) + 1
    if not anomalies:
        return "<p class='verdict ok'>No anomalies: the debugger found nothing wrong in this run.</p>"
    worst = min(counts, key=lambda s: -severity_rank(s))
    chips = "".join(
        f"<span class='chip {escape(s)}'>{counts[s]} {escape(s)}</span>"
        for s in sorted(counts, key=lambda s: -severity_rank(s))
    )
    first = by_cause(anomalies)[0]  # cause before consequence: input, loss, gradients, update; lowest rank
    kinds = len({a.kind for a in anomalies})
    text = f"{len(anomalies)} anomal{'y' if len(anomalies) == 1 else 'ies'} of {kinds} kind(s). "
    text += f"Most important: {first.kind}"
    where = first.where()
    if where:
        text += f" at {where}"
    return f"<p class='verdict {escape(worst)}'>{chips}{escape(text)}.</p>"


def _where(a: Anomaly, show_rank: bool) -> str:
    parts = []
    if a.component:
        parts.append(f"component <code>{escape(a.component)}</code>")
    if a.module:
        parts.append(f"module <code>{escape(a.module)}</code>")
    if a.parameter:
        parts.append(f"parameter <code>{escape(a.parameter)}</code>")
    if a.step is not None:
        parts.append(f"step <b>{escape(a.step)}</b>")
    if a.timestep is not None:
        parts.append(f"timestep <b>{escape(format_value(number(a.timestep)))}</b>")
    if show_rank or a.rank:
        parts.append(f"rank <b>{escape(a.rank)}</b>")
    return " · ".join(parts) if parts else "the whole run"


def step_ranges(steps: Iterable[int]) -> str:
    """Steps as short ranges.

    >>> step_ranges([9, 10, 11, 3, 14, 15])
    '3, 9–11, 14–15'
    """
    ordered = sorted(set(steps))
    spans: list[list[int]] = []
    for step in ordered:
        if spans and step == spans[-1][1] + 1:
            spans[-1][1] = step
        else:
            spans.append([step, step])
    return ", ".join(str(a) if a == b else f"{a}–{b}" for a, b in spans)


def _repeats(a: Anomaly) -> str:
    """What the debugger itself folded into one anomaly (``details.count``, ``last_step``)."""
    count = number(a.details.get("count")) if isinstance(a.details, dict) else math.nan
    if not math.isfinite(count) or count <= 1:
        return ""
    last = a.details.get("last_step")
    return f" · seen {int(count)} times" + (f", last at step {escape(last)}" if last is not None else "")


def _anomaly_card(cluster: Sequence[Anomaly], show_rank: bool) -> str:
    """One card for anomalies that repeat at the same place: the first one's message, and the
    steps where it came back."""
    a = cluster[0]
    details = ""
    if a.details:
        details = f"<details><summary>details</summary>{kv_table(a.details.items())}</details>"
    again = ""
    if len(cluster) > 1:
        steps = [b.step for b in cluster if b.step is not None]
        again = (
            f"<div class='where'>repeated {len(cluster)} times"
            + (f", at steps {escape(step_ranges(steps))}" if steps else "")
            + "</div>"
        )
    return (
        f"<li class='anomaly {escape(a.severity)}'><span class='chip {escape(a.severity)}'>{escape(a.severity)}</span>"
        f"{message_box(a.message)}"
        f"<div class='where'>where: {_where(a, show_rank)}{_repeats(a)}</div>{again}{details}</li>"
    )


def _clusters(members: Sequence[Anomaly]) -> list[list[Anomaly]]:
    """Anomalies of one kind grouped by where they happened, most severe and earliest first."""
    clusters: dict[tuple[Any, ...], list[Anomaly]] = {}
    for a in members:
        clusters.setdefault((a.severity, a.component, a.module, a.parameter, a.rank), []).append(a)
    return sorted(
        clusters.values(),
        key=lambda c: (-severity_rank(c[0].severity), c[0].step if c[0].step is not None else -1),
    )


def _anomaly_rows(anomalies: Sequence[Anomaly], show_rank: bool) -> str:
    shown = anomalies[:ANOMALY_ROWS_PER_KIND]
    head = "<tr><th>severity</th><th>where</th><th>message</th></tr>"
    rows = "".join(
        f"<tr><td>{escape(a.severity)}</td><td>{_where(a, show_rank)}</td><td>{message_box(a.message)}</td></tr>"
        for a in shown
    )
    more = len(anomalies) - len(shown)
    tail = f"<p class='note'>… and {more} more in summary.json.</p>" if more else ""
    return f"<div class='scroll'><table>{head}{rows}</table></div>{tail}"


def anomalies_section(run: RunData) -> str:
    """The anomalies section: the verdict, then one group per kind, most severe first."""
    s = run.summary
    anomalies = run.anomalies
    parts = ["<section id='anomalies'><h2>Anomalies</h2>", _verdict(anomalies, s)]
    dropped = number(s.get("dropped_anomalies"))
    if math.isfinite(dropped) and dropped > 0:
        parts.append(
            f"<p class='note'>{int(dropped)} further anomalies were dropped when the record's buffer "
            "was full; the counts below include only those kept.</p>"
        )
    show_rank = isinstance(s.get("world_size"), int) and s["world_size"] > 1
    groups: dict[str, list[Anomaly]] = {}
    for a in anomalies:
        groups.setdefault(a.kind, []).append(a)

    def order(kind: str) -> tuple[int, int]:
        members = groups[kind]
        return min(-severity_rank(a.severity) for a in members), anomalies.index(members[0])

    for kind in sorted(groups, key=order):
        members = sorted(groups[kind], key=lambda a: (a.step if a.step is not None else -1, a.rank))
        severities: dict[str, int] = {}
        for a in members:
            severities[a.severity] = severities.get(a.severity, 0) + 1
        split = ", ".join(f"{n} {sev}" for sev, n in sorted(severities.items(), key=lambda i: -severity_rank(i[0])))
        guide = kind_info(kind)
        clusters = _clusters(members)
        cards = "".join(_anomaly_card(c, show_rank) for c in clusters[:ANOMALY_CARDS_PER_KIND])
        more = ""
        if len(clusters) > ANOMALY_CARDS_PER_KIND or len(clusters) < len(members):
            hidden = len(clusters) - ANOMALY_CARDS_PER_KIND
            label = f"all {len(members)} one by one" + (f" ({hidden} places not shown above)" if hidden > 0 else "")
            more = f"<details><summary>{escape(label)}</summary>{_anomaly_rows(members, show_rank)}</details>"
        parts.append(
            f"<section class='group' id='kind-{escape(kind)}' style='border-left-color:{kind_color(kind)}'>"
            f"<h3>{escape(kind)} <span class='count'>× {len(members)} ({escape(split)})</span></h3>"
            f"<p class='guide'><b>What it means:</b> {escape(guide.meaning)} "
            f"<b>What to do:</b> {escape(guide.action)}</p>"
            f"<ol class='anomalies'>{cards}</ol>{more}</section>"
        )
    parts.append("</section>")
    return "".join(parts)
