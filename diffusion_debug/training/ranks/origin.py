"""Which rank made the non-finite gradients that the all-reduce gave every rank.

After DDP's all-reduce every rank holds the same NaN gradients, so every rank finds the same
``nonfinite`` (same step, module and parameter). Each rank's row carries whether its own gradients
held NaN/Inf before the reduction (``local_nonfinite``, ``measure.pre_reduction``); on the
step's detail exchange every rank receives every row, so every rank names the same origin:

* the anomaly of a rank that made it says so (``details["reduction"]["made_here"]``, with its
  count of non-finite values);
* every other rank's says it received it through the all-reduce from those ranks, and
  ``follows`` the first of them: the headline, the terminal, report.html and ``export`` fold the
  copies under that one, so they name one rank, the same everywhere;
* the GradScaler's ``skipped_step`` (found at the next step) names the ranks whose own gradients
  overflowed in the step it skipped (``details["overflow_ranks"]``);
* not checked (a model with its own comm hook, an engine without the check): the copies follow
  the lowest rank's, and say that the rank that made it is not known;
* a rank that made it may hold none of it after the reduction (ZeRO keeps each parameter's
  reduced gradient in one rank's partition; a reduce-scatter sends a NaN element to one rank's
  shard): every rank then adds the same ``nonfinite`` for it (:func:`made_elsewhere`), which
  the copies follow, so the headline names the rank that made it, not the one that received it.

>>> from diffusion_debug.record import Anomaly
>>> nan = [Anomaly("nonfinite", "error", "x", "model", "0", step=12, rank=r, parameter="0.weight",
...                details={"nonfinite_parameters": 1}) for r in (0, 1)]
>>> out = name_origin(nan, [0.0, 1.0], 12)
>>> [(a.rank, a.details["reduction"]["made_here"], a.details.get("follows")) for a in out]
[(0, False, {'kind': 'nonfinite', 'rank': 1}), (1, True, None)]
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from ...record import Anomaly, distinct_details, make_anomaly, rebuilt


def copy_key(anomaly: Anomaly, *, severity: bool = True) -> tuple:
    """What makes two ranks' anomalies copies of one (DDP averages one rank's NaN into every rank's gradients):
    kind, severity, step and place, and the details that tell its kind apart at one place (``not_learning``'s
    ``stalled_optimizer``: each optimizer's stall is a copy only of the same optimizer's on another rank).
    ``severity=False``: whatever its severity (the exchange may grade a rank's own anomaly anew)."""
    grade = anomaly.severity if severity else None
    place = (anomaly.kind, grade, anomaly.step, anomaly.component, anomaly.module, anomaly.parameter)
    return (*place, *distinct_details(anomaly.kind, anomaly.details).values())


def name_origin(
    anomalies: list[Anomaly], local_nonfinite: Sequence[float], step: Any, through: str = "the gradient all-reduce"
) -> list[Anomaly]:
    """``anomalies`` (every rank's, after the exchange) with each of the step's non-finite gradient
    anomalies saying whether its rank made the NaN before the all-reduce or received it;
    ``local_nonfinite``: per rank, whether its own gradients held NaN/Inf before the reduction (NaN:
    not checked; above 0: held NaN/Inf); ``through``: the reduction, as messages name it. Copies
    on several ranks follow one of them (the origin's, else the lowest rank's); sharded, each rank
    names its own shards' parameters: the others follow an origin's anomaly of any parameter; an
    origin with none of its own (it holds none of the NaN after the reduction) gets one, appended
    (:func:`made_elsewhere`)."""
    checked = _checked(local_nonfinite)
    origins = made_nonfinite(local_nonfinite)
    groups: dict[tuple, list[int]] = {}
    for i, a in enumerate(anomalies):
        if a.kind == "nonfinite" and a.step == step and "nonfinite_parameters" in a.details:
            groups.setdefault(copy_key(a), []).append(i)
    out = list(anomalies)
    # sharded (FSDP2), the ranks' shards hold different parameters: an origin's anomaly of any of them
    named = sorted({anomalies[i].rank for members in groups.values() for i in members} & set(origins))
    received = [anomalies[i] for members in groups.values() for i in members]
    if origins and not named and any("follows" not in a.details and "cause" not in a.details for a in received):
        # the ranks that made it hold none of it (ZeRO's partition, a reduce-scatter's shard): theirs, added
        for added in made_elsewhere(received, origins, through):
            # its process and machine, where another anomaly of that rank says them ("": not known)
            same = next((a for a in anomalies if a.rank == added.rank), None)
            if same is not None:
                added.local_rank, added.host = same.local_rank, same.host
            out.append(added)
        named = list(origins)
    for members in groups.values():
        if len(members) < 2 and not origins:
            continue
        ranks = [anomalies[i].rank for i in members]
        made = [r for r in ranks if r in origins]
        head = min(made) if made else (named[0] if named else min(ranks))
        for i in members:
            a = anomalies[i]
            reduction: dict[str, Any] = {
                "origins": origins if checked else None,
                "made_here": a.rank in origins,
                "through": through,
            }
            details = {**a.details, "reduction": {**a.details.get("reduction", {}), **reduction}}
            if a.rank != head and "follows" not in a.details and "cause" not in a.details:
                details["follows"] = {"kind": "nonfinite", "rank": head}
            out[i] = rebuilt(a, details=details)
    return out


def made_elsewhere(received: list[Anomaly], origins: list[int], through: str) -> list[Anomaly]:
    """The ``nonfinite`` of each rank in ``origins`` whose own gradients held NaN/Inf before the
    reduction that gave them to the ranks of ``received`` (their anomalies of the step; none of
    the origins'): the same on every rank, since every rank received every row. Its place is the
    parameter the lowest receiving rank found (first in its order) when one rank made it (then
    that rank made that parameter's NaN); of several, which made which is not known: no parameter,
    the message names what the receiving rank found. The others follow the lowest origin's.

    >>> got = Anomaly("nonfinite", "error", "x", "model", "0", step=12, rank=0, parameter="0.weight",
    ...               details={"nonfinite_parameters": 1, "order": "registration"})
    >>> (made,) = made_elsewhere([got], [1], "DeepSpeed ZeRO's gradient reduction")
    >>> made.rank, made.parameter, made.details["reduction"]["found"]
    (1, '0.weight', {'rank': 0, 'parameter': '0.weight', 'module': '0'})
    >>> made.message.split(":")[0]  # doctest: +NORMALIZE_WHITESPACE
    "This rank's own gradients held NaN/Inf before DeepSpeed ZeRO's gradient reduction, which gave them to
    rank 0 (rank 0 holds 1 non-finite gradient(s), first registered 0.weight in module 0; this rank's own
    share holds none after it)"
    """
    first = min(received, key=lambda a: a.rank)
    known = len(origins) == 1
    holders = sorted({a.rank for a in received})
    found = {"rank": first.rank, "parameter": first.parameter, "module": first.module}
    made = []
    for rank in origins:
        details: dict[str, Any] = {
            "nonfinite_parameters": first.details["nonfinite_parameters"],
            "reduction": {
                "origins": list(origins),
                "made_here": True,
                "through": through,
                "received_by": holders,
                "found": found,
            },
        }
        # how it was named; the engine that replays no closure=; whose loss scale an overflow is under
        for kept in ("order", "sharded", "loss_scaler"):
            if kept in first.details:
                details[kept] = first.details[kept]
        if rank != origins[0]:
            details["follows"] = {"kind": "nonfinite", "rank": origins[0]}
        made.append(
            make_anomaly(
                "nonfinite",
                severity=first.severity,
                component=first.component,
                module=first.module if known else "",
                parameter=first.parameter if known else None,
                step=first.step,
                rank=rank,
                details=details,
            )
        )
    return made


def _checked(local_nonfinite: Sequence[float]) -> bool:
    return bool(local_nonfinite) and not any(math.isnan(v) for v in local_nonfinite)


def made_nonfinite(local_nonfinite: Sequence[float]) -> list[int]:
    """The ranks whose own gradients held NaN/Inf before the reduction ([] when a rank was not checked).

    >>> made_nonfinite([0.0, 3.0, 1.0]), made_nonfinite([0.0, float("nan")])
    ([1, 2], [])
    """
    return [r for r, v in enumerate(local_nonfinite) if v > 0] if _checked(local_nonfinite) else []


def name_overflow(anomalies: list[Anomaly], step: Any, origins: list[int]) -> list[Anomaly]:
    """``anomalies`` with the ``skipped_step`` of ``step`` (the GradScaler's, found a step later)
    naming ``origins``, the ranks whose own gradients overflowed in it.

    >>> from diffusion_debug.record import make_anomaly
    >>> skip = make_anomaly("skipped_step", component="model", step=1, rank=0,
    ...                     details={"scale_before": 16.0, "scale_after": 8.0, "reason": "grad_scaler"})
    >>> name_overflow([skip], 1, [1])[0].message.split("; scale")[0][51:]
    "(rank 1's own gradients overflowed, before the gradient all-reduce"
    """
    if not origins:
        return anomalies
    return [
        rebuilt(a, details={**a.details, "overflow_ranks": list(origins)})
        if a.kind == "skipped_step" and a.step == step and "overflow_ranks" not in a.details
        else a
        for a in anomalies
    ]
