"""The anomalies section of report.html (``templates/anomalies.html``): the verdict line, then one
group per kind (what it means, what to do) with a card per place where the kind happened, most
severe and earliest first. The headline's kind and card come first; what follows from an anomaly
(``record.folded``) is listed inside that anomaly's card, not in a group of its own.

Limits: a kind shows at most :data:`ANOMALY_CARDS_PER_KIND` cards and, folded away, at most
:data:`ANOMALY_ROWS_PER_KIND` rows one by one (summary.json holds them all).
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

from ..record import Anomaly, RunData, diagnosis_severity, folded, kind_info, severity_rank
from .html_env import format_value
from .plots_common import kind_color, number
from .rank_groups import OnRanks, rank_span, same_on_ranks
from .text import HTML_MESSAGE_CHARS, cut, follow_label

ANOMALY_CARDS_PER_KIND = 6
ANOMALY_ROWS_PER_KIND = 300


def _verdict(anomalies: list[Anomaly], first: Anomaly, under: list[Anomaly], show_rank: bool) -> dict[str, Any] | None:
    """The worst severity, a count per severity and the most important anomaly (``first``, the
    headline, with the ``under`` that follow from it); None for none."""
    if not anomalies:
        return None
    counts: dict[str, int] = {}
    for a in anomalies:
        counts[a.severity] = counts.get(a.severity, 0) + 1
    kinds = len({a.kind for a in anomalies})
    text = f"{len(anomalies)} anomal{'y' if len(anomalies) == 1 else 'ies'} of {kinds} kind(s). "
    text += f"Most important: {first.kind}"
    where = first.where(show_rank)
    if where:
        text += f" at {where}"
    if under:
        text += f"; {len(under)} of the others follow from it"
    return {
        "worst": min(counts, key=lambda s: -severity_rank(s)),
        "chips": [(s, counts[s]) for s in sorted(counts, key=lambda s: -severity_rank(s))],
        "text": text,
    }


def _where(a: Anomaly, show_rank: bool) -> list[tuple[str, Any, str]]:
    """Where an anomaly happened, as (label, value, "code" for a name or "b" for a number)."""
    parts: list[tuple[str, Any, str]] = []
    if a.component:
        parts.append(("component", a.component, "code"))
    if a.module:
        parts.append(("module", a.module, "code"))
    if a.parameter:
        parts.append(("parameter", a.parameter, "code"))
    if a.step is not None:
        parts.append(("step", a.step, "b"))
    if a.timestep is not None:
        parts.append(("timestep", format_value(number(a.timestep)), "b"))
    if isinstance(a, OnRanks):  # several ranks found it alike
        parts.append(("ranks", rank_span(a.ranks), "b"))
    elif show_rank or a.rank:
        parts.append(("rank", a.rank, "b"))
    return parts


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
    """What the debugger itself folded into one anomaly (``details.count``, ``last_step``, ``last_run``)."""
    count = number(a.details.get("count")) if isinstance(a.details, dict) else math.nan
    if not math.isfinite(count) or count <= 1:
        return ""
    last, run = a.details.get("last_step"), a.details.get("last_run")
    of_run = f" of run {run}" if run is not None else ""  # a later run's step (FreeInit's next pass)
    return f" · seen {int(count)} times" + (f", last at step {last}{of_run}" if last is not None else "")


def _card(cluster: Sequence[Anomaly], show_rank: bool, under: Sequence[Anomaly] = ()) -> dict[str, Any]:
    """One card for anomalies that repeat at the same place: the first one's message, the steps
    where it came back, and the anomalies that follow from them, folded; its severity is the
    diagnosis's (``record.diagnosis_severity``), summary.json's headline keeps the anomaly's own."""
    a = cluster[0]
    again = ""
    if len(cluster) > 1:
        steps = [b.step for b in cluster if b.step is not None]
        runs = {b.details.get("run") for b in cluster if isinstance(b.details, dict)} - {None}
        again = f"repeated {len(cluster)} times"
        if len(runs) > 1:
            again += f", in pipeline runs {step_ranges(runs)}"
        if steps:
            again += f", at step{'s' if len(set(steps)) > 1 else ''} {step_ranges(steps)}"
    return {
        "severity": diagnosis_severity(a, under),
        "message": cut(a.message, HTML_MESSAGE_CHARS),
        "where": _where(a, show_rank),
        "repeats": _repeats(a),
        "again": again,
        "details": list(a.details.items()) if a.details else [],
        "consequences": _rows(under[:ANOMALY_ROWS_PER_KIND], show_rank, kind=True),
        "consequences_label": follow_label(under),
        "consequences_more": max(0, len(under) - ANOMALY_ROWS_PER_KIND),
    }


def _rows(members: Sequence[Anomaly], show_rank: bool, kind: bool = False) -> list[dict[str, Any]]:
    """Anomalies one by one (``kind``: with their kind, for a list of several kinds)."""
    return [
        {
            "severity": a.severity,
            "kind": a.kind if kind else "",
            "where": _where(a, show_rank),
            "message": cut(a.message, HTML_MESSAGE_CHARS),
        }
        for a in members
    ]


def _clusters(members: Sequence[Anomaly]) -> list[list[Anomaly]]:
    """Anomalies of one kind grouped by where they happened, most severe and earliest first."""
    clusters: dict[tuple[Any, ...], list[Anomaly]] = {}
    for a in members:
        ranks = a.ranks if isinstance(a, OnRanks) else (a.rank,)
        clusters.setdefault((a.severity, a.component, a.module, a.parameter, ranks), []).append(a)
    return sorted(
        clusters.values(),
        key=lambda c: (-severity_rank(c[0].severity), c[0].step if c[0].step is not None else -1),
    )


def _group(
    kind: str,
    members: list[Anomaly],
    show_rank: bool,
    training: bool,
    head: Anomaly | None,
    under_of: dict[int, list[Anomaly]],
) -> dict[str, Any]:
    """One kind: its guide, its cards (``head``, the headline, first), each with what follows from its
    anomalies (``under_of``, by ``id``) folded in, and, when cards do not show every anomaly, all its rows.
    Its split counts each anomaly at its diagnosis's severity (with what follows from it), as its card's chip
    shows it; the verdict's chips count the record's own severities, as summary.json and the terminal do."""
    severities: dict[str, int] = {}
    for a in members:
        severity = diagnosis_severity(a, under_of.get(id(a), ()))
        severities[severity] = severities.get(severity, 0) + 1
    guide = kind_info(kind)
    clusters = _clusters(members)
    if head is not None:  # the headline's card first
        clusters.sort(key=lambda c: not any(a is head for a in c))
    group: dict[str, Any] = {
        "kind": kind,
        "color": kind_color(kind),
        "count": len(members),
        "split": ", ".join(f"{n} {s}" for s, n in sorted(severities.items(), key=lambda i: -severity_rank(i[0]))),
        "meaning": guide.meaning,
        "action": guide.training_action if training and guide.training_action else guide.action,
        "cards": [
            _card(c, show_rank, [b for a in c for b in under_of.get(id(a), ())])
            for c in clusters[:ANOMALY_CARDS_PER_KIND]
        ],
        "rows": [],
        "rows_label": "",
        "rows_more": 0,
    }
    if len(clusters) > ANOMALY_CARDS_PER_KIND or len(clusters) < len(members):
        hidden = len(clusters) - ANOMALY_CARDS_PER_KIND
        shown = members[:ANOMALY_ROWS_PER_KIND]
        group["rows_label"] = f"all {len(members)} one by one" + (
            f" ({hidden} places not shown above)" if hidden > 0 else ""
        )
        group["rows"] = _rows(shown, show_rank)
        group["rows_more"] = len(members) - len(shown)
    return group


def anomalies_context(run: RunData) -> dict[str, Any]:
    """What the anomalies section shows: the verdict, then one group per kind, most severe first."""
    s = run.summary
    anomalies = run.anomalies
    show_rank = isinstance(s.get("world_size"), int) and s["world_size"] > 1
    training = s.get("kind") == "training"
    shown = folded(anomalies)  # what follows from another anomaly is listed under the one that started it
    first, first_under = shown[0] if shown else (None, [])  # the headline: its rank named, as summary.json's
    if show_rank:  # what several ranks found alike: one card naming the ranks
        shown = same_on_ranks(shown)
    head = shown[0][0] if shown else None
    under_of = {id(a): under for a, under in shown}
    groups: dict[str, list[Anomaly]] = {}
    for a, _ in shown:
        groups.setdefault(a.kind, []).append(a)

    def order(kind: str) -> tuple[bool, int, int]:  # the headline's kind first, then the most severe
        members = groups[kind]
        first = min(i for i, (a, _) in enumerate(shown) if a.kind == kind)
        return kind != head.kind, min(-severity_rank(a.severity) for a in members), first

    dropped = number(s.get("dropped_anomalies"))
    return {
        "verdict": _verdict(anomalies, first, first_under, show_rank) if first is not None else None,
        "dropped": int(dropped) if math.isfinite(dropped) and dropped > 0 else 0,
        "groups": [
            _group(
                kind,
                sorted(groups[kind], key=lambda a: (a.step if a.step is not None else -1, a.rank)),
                show_rank,
                training,
                head if kind == head.kind else None,
                under_of,
            )
            for kind in sorted(groups, key=order)
        ],
    }
