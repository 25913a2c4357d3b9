"""Findings that every rank made alike, shown once: a row naming the ranks (``ranks 0-7``) instead of
one row per rank, in the terminal's tables and report.html's cards.

Ranks made a finding alike when its severity, kind, step, timestep and place are the same and so are
its message and details once each rank's own number in it (``on rank 3``) is set aside: an oversized update
that DDP applies alike on every rank, a NaN loss every rank computes from the same NaN weights. A
finding of one rank (a NaN rank 5 made; the copies the others received say "from rank 5", so they
differ) keeps its own row, and what follows from each member is listed under the one row. The
headline and summary.json are not changed: this is how the saved anomalies are shown, not what is
recorded.

>>> from diffusion_debug.record import Anomaly
>>> rows = [Anomaly("lr_spike", "warning", f"lr x1e4 on rank {r}.", "optimizer", step=10, rank=r) for r in range(8)]
>>> rows.append(Anomaly("nonfinite", "error", "NaN made here.", "model", step=3, rank=5))
>>> [(a.where(True), a.message) for a, _ in same_on_ranks([(a, []) for a in rows])]
[('optimizer, step 10, ranks 0-7', 'lr x1e4 on ranks 0-7.'), ('model, step 3, rank 5', 'NaN made here.')]
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Sequence

from ..record import Anomaly


@dataclasses.dataclass
class OnRanks(Anomaly):
    """One row for a finding several ranks made alike: the lowest rank's, standing for ``ranks``."""

    ranks: tuple[int, ...] = ()

    def where(self, show_rank: bool = False) -> str:
        place = Anomaly.where(dataclasses.replace(self, rank=0))  # the place and step, no rank
        return ", ".join(part for part in (place, f"ranks {rank_span(self.ranks)}") if part)


def rank_span(ranks: Sequence[int]) -> str:
    """Ranks as short ranges.

    >>> rank_span([7, 0, 1, 2, 3, 5, 6])
    '0-3,5-7'
    """
    spans: list[list[int]] = []
    for rank in sorted(set(ranks)):
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _own_rank(rank: int) -> re.Pattern[str]:
    return re.compile(rf"\brank {rank}(?!\d|\.\d)")


def _key(a: Anomaly) -> tuple:
    own = _own_rank(a.rank)
    message = own.sub("rank #", a.message)
    # the details too (a count the sink folded, a value the message rounds), the own rank set aside
    try:
        details = json.dumps(a.details, sort_keys=True, default=str)
    except (TypeError, ValueError):  # keys of several types (details made live, not read from a run)
        details = repr(a.details)
    details = own.sub("rank #", re.sub(rf'"rank": {a.rank}(?=[,}}])', '"rank": "#"', details))
    return (a.severity, a.kind, a.step, a.timestep, a.component, a.module, a.parameter, message, details)


def same_on_ranks(pairs: Sequence[tuple[Anomaly, list[Anomaly]]]) -> list[tuple[Anomaly, list[Anomaly]]]:
    """``pairs`` (an anomaly and what follows from it, ``record.folded``) with the anomalies that
    several ranks made alike as one :class:`OnRanks` row, where the first of them was, its
    message's own rank naming them all, with what follows from each of them under it."""
    keys = [_key(a) for a, _ in pairs]
    groups: dict[tuple, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    out: list[tuple[Anomaly, list[Anomaly]]] = []
    for i, (a, under) in enumerate(pairs):
        members = groups[keys[i]]
        ranks = sorted({pairs[j][0].rank for j in members})
        if len(ranks) < 2:
            out.append((a, under))
        elif members[0] == i:
            span = f"ranks {rank_span(ranks)}"
            fields = {f.name: getattr(a, f.name) for f in dataclasses.fields(Anomaly)}
            fields["message"] = _own_rank(a.rank).sub(span, a.message)
            out.append((OnRanks(**fields, ranks=tuple(ranks)), [b for j in members for b in pairs[j][1]]))
    return out
