"""What the ranks exchange in a monitored step (several processes): one fixed-size
``all_reduce`` every step (``summary``), and every rank's details only on a step where some
rank judged something in its own row, or on the replica-check schedule (``rank_check_every``,
``rank_desync``).

A rank judges only its own row (``checks``) and its own histories; the step's reduce tells every
rank whether any rank found anything, and the step counts' flags, ORed; the extremes of the
loss, the gradient norm and memory, with the rank of each, go to the main process's step row.
On a detail step one ``all_gather_object`` carries each rank's row, its anomalies (with their
local details), the record rows of its last :data:`CONTEXT_STEPS` steps (the main process records
them as rows of their own: the steps leading to the anomaly on every rank) and its timestep-bucket
sums since the last detail step. So every collective and the policy's decision come from what
every rank received, as before; the bytes moved on a clean step do not grow with the world.

Limits: on a clean step the main process records every rank's extremes, not every rank's row; its
timestep-bucket table holds the other ranks' samples up to their last detail step (every
``rank_check_every`` steps, and every flagged step).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ...record import Anomaly
from ...stats import read_now
from .. import failures
from ..judges.local_judging import Judgement
from ..judges.step_checks import StepFlags
from ..measure.gradients import TrainableParameters
from ..measure.step_row import StepRow
from . import desync as rank_desync
from .origin import copy_key
from .processes import RankContext
from .summary import AGGREGATED, RankSummary, ReduceLayout

CONTEXT_STEPS = 2
"""A rank's earlier steps whose record rows ride in a detail exchange."""
_ONE_PER_STEP = ("skipped_step",)
"""Kinds the ranks share (the GradScaler skips a step on every rank): kept for the first rank only."""


@dataclass
class Details:
    """What every rank received on a detail step."""

    rows: list[StepRow]
    anomalies: list[Anomaly]
    records: list[list[tuple[int, dict]]]
    """Per rank: ``(joined, record row)`` of its current and last :data:`CONTEXT_STEPS` steps."""
    buckets: list[list[float] | None]
    """Per rank: its timestep-bucket sums since its last detail step (None: none)."""


class RankExchange:
    """This rank's side of the step's exchange, and what it keeps for the next detail step."""

    def __init__(self, ctx: RankContext, *, strict: bool = False):
        self.ctx = ctx
        self.strict = strict
        """``strict=True``: a failure inside the exchange is still kept, not raised (its sentence says so)."""
        self.layout = ReduceLayout(ctx.world_size)
        self.context: deque[tuple[int, dict]] = deque(maxlen=CONTEXT_STEPS)
        self.pending_buckets: list[float] | None = None
        self.recorded: dict[int, int] = {}
        """Main process: per rank, the last joined step whose row it recorded."""

    def step(
        self,
        own: StepRow,
        judged: Judgement,
        *,
        index: Any,
        joined: int,
        record: dict | None,
        check_ranks: bool,
        checksums: Callable[[], torch.Tensor],
        params: TrainableParameters,
        before_details: Callable[[RankSummary], None] = lambda summary: None,
        stalled: bool = False,
        held: dict[str, bool] | None = None,
    ) -> tuple[RankSummary, Details | None]:
        """The step's exchange: the reduce; on a detail step (some rank flagged, or a replica-check
        step) every rank's details, and on a replica-check step whose checksums differ every rank's
        per-parameter ``checksums()``. ``judged`` becomes what every rank received alike: its flags
        ORed, and on a detail step every rank's anomalies. Every branch is taken from what every
        rank received. ``before_details`` runs after the reduce (``judged.flags`` ORed) on every
        rank, before the details are gathered: work every rank does together or none does, whose
        findings the details then carry. ``stalled``: this rank's anomalies are its stall alone
        (``LocalJudge.stall_alone``), which asks for the details only where no rank's weights moved. ``held``:
        this rank holds the step's verdict (``step.found_scaler``; None: it does not), with the flags its hold kept
        out of ``judged.flags`` (``nonfinite``, ``explosion``; reduced at the summary's lower levels): the details
        are exchanged, so that a rank that releases it in place (``before_details``, some rank not holding) has
        every rank see it."""
        summary = self.summarize(own, judged.anomalies, judged.flags, not own.measured, stalled, held)
        for name in dataclasses.asdict(judged.flags):  # the step counts: the same on every rank
            setattr(judged.flags, name, summary.flags[name])
        before_details(summary)
        if not (summary.needs_detail or check_ranks):
            self.remember(joined, record)
            return summary, None
        rank = self.ctx.rank
        mine = (joined, record) if record else None
        strict = self.strict
        failed = lambda e: failures.judging_failed(rank, index, e, kept=strict)  # noqa: E731
        details = self.details(own, judged.anomalies, mine, failed)
        judged.anomalies = details.anomalies
        judged.skipped = [a for a in judged.anomalies if a.kind == "skipped_step"]
        desync = rank_desync.differing_checksums(details.rows) if check_ranks else []
        if desync:
            per_param = read_now(self.ctx.gather(checksums()))
            judged.anomalies += rank_desync.judge_checksums(details.rows, desync, per_param, index, params)
        return summary, details

    def summarize(
        self,
        own: StepRow,
        anomalies: list[Anomaly],
        flags: StepFlags,
        failed: bool,
        stalled: bool = False,
        held: dict[str, bool] | None = None,
    ) -> RankSummary:
        """The step's one collective: every rank learns whether any found something (a stall alone,
        ``stalled``, apart; a verdict ``held`` counts as found), whether any held none (``unheld``), the flags
        ORed (the held ones apart: ``nonfinite_held``, ``explosion_held``), and the extremes of
        :data:`~.summary.AGGREGATED` with their ranks."""
        values = {name: own.pre_clip_norm if name == "grad_norm" else getattr(own, name) for name in AGGREGATED}
        values = values if own.measured else {}
        if values and not own.loss_count:  # no call of the step gave a loss (NO_LOSS: a pipeline stage's
            del values["loss"]  # backward): its row's NaN is no loss, so not the step's largest one
        found = {"anomalies": (bool(anomalies) and not stalled) or held is not None, "stalled": stalled}
        found.update(failed=failed, unheld=held is None)
        held = held or {}
        flag_values = {**dataclasses.asdict(flags), **found, **{f"{k}_held": v for k, v in held.items()}}
        packed = self.layout.pack(values, flag_values, self.ctx.rank)
        return self.layout.unpack(self.ctx.all_reduce_max(packed))

    def add_buckets(self, buckets: tuple[float, ...]) -> None:
        """Keep this rank's timestep-bucket sums until the next detail step."""
        if self.pending_buckets is None:
            self.pending_buckets = list(buckets)
        else:
            self.pending_buckets = [a + b for a, b in zip(self.pending_buckets, buckets)]

    def details(
        self,
        own: StepRow,
        anomalies: list[Anomaly],
        record: tuple[int, dict] | None,
        failed: Callable[[Exception], Anomaly],
    ) -> Details:
        """Every rank's row, anomalies, recent record rows and bucket sums (one
        ``all_gather_object``). A rank that cannot serialise its anomalies still joins, with
        ``failed(error)`` instead."""
        try:
            mine = [a.to_dict() for a in anomalies]
        except Exception as error:
            mine = [failed(error).to_dict()]
        records = list(self.context) + ([record] if record is not None else [])
        payload = {"row": own.to_list(), "anomalies": mine, "records": records, "buckets": self.pending_buckets}
        self.pending_buckets = None
        self.context.clear()
        gathered = self.ctx.gather_objects(payload)
        every = [Anomaly.from_dict(d) for p in gathered for d in p["anomalies"]]
        return Details(
            rows=[StepRow.from_row(p["row"]) for p in gathered],
            anomalies=one_per_step(every),
            records=[p["records"] for p in gathered],
            buckets=[p["buckets"] for p in gathered],
        )

    def remember(self, joined: int, record: dict | None) -> None:
        """This rank's record row of a step no detail exchange carried (for the next one)."""
        if record is not None:
            self.context.append((joined, record))

    def unrecorded(self, details: Details) -> list[tuple[int, dict]]:
        """Main process: the other ranks' record rows it has not recorded yet, oldest first, each with the
        monitored step it was taken at (``joined``, what a rank's ``step_amended`` names it by)."""
        out = []
        for rank, rows in enumerate(details.records):
            if rank == self.ctx.rank:
                continue
            for joined, row in rows:
                if joined > self.recorded.get(rank, -1):
                    out.append((joined, row))
                    self.recorded[rank] = joined
        return out


def one_per_step(anomalies: list[Anomaly]) -> list[Anomaly]:
    """The ranks' anomalies with each kind of :data:`_ONE_PER_STEP`, and each learning-rate jump,
    kept once per step (the first rank's): the ranks share the optimizer's schedule and scaler.

    >>> skipped = [Anomaly("skipped_step", "warning", "skipped", "model", step=3, rank=r) for r in (0, 1)]
    >>> [(a.kind, a.rank) for a in one_per_step(skipped)]
    [('skipped_step', 0)]
    """
    seen, out = set(), []
    for a in anomalies:
        if a.kind in _ONE_PER_STEP or (a.kind == "lr_spike" and a.details.get("reason") == "lr_jump"):
            if (a.kind, a.step) in seen:
                continue
            seen.add((a.kind, a.step))
        out.append(a)
    return out


def same_on_other_ranks(anomalies: list[Anomaly]) -> set[int]:
    """Positions of the anomalies that repeat another one of the list on another rank (same
    kind, severity, step and place, and the details that tell its kind apart there: ``origin.copy_key``;
    DDP averages one rank's NaN into every rank's gradients). The
    one of each group that the others follow (the rank that made it, ``ranks.origin``, also where
    every copy follows another kind's anomaly, as the gradients of a rank's NaN loss; else the
    first of the list, which is in cause order) gets ``details["also_on_ranks"]``, the ranks of its
    copies, and is logged as one line for all ("first on rank 5 at step 88, then 63 ranks").

    >>> from diffusion_debug.record import Anomaly
    >>> nan = [Anomaly("nonfinite", "error", "NaN", "model", step=3, rank=r, parameter="0.weight") for r in (5, 0, 1)]
    >>> sorted(same_on_other_ranks(nan)), nan[0].details["also_on_ranks"]
    ([1, 2], [0, 1])
    >>> nan[0].details.clear(); nan[0].details["follows"] = {"kind": "nonfinite", "rank": 0}
    >>> sorted(same_on_other_ranks(nan)), nan[1].details["also_on_ranks"]
    ([0, 2], [5, 1])
    >>> for a in nan:  # each follows rank 1's NaN loss; rank 1's own gradients held the NaN first
    ...     a.details.clear(); a.details["follows"] = {"kind": "nonfinite_loss", "rank": 1}
    ...     a.details["reduction"] = {"made_here": a.rank == 1}
    >>> sorted(same_on_other_ranks(nan)), nan[2].details["also_on_ranks"]
    ([0, 1], [5, 0])
    """
    groups: dict[tuple, list[int]] = {}
    for i, a in enumerate(anomalies):
        groups.setdefault(copy_key(a), []).append(i)
    copies = set()
    for members in groups.values():
        spread = [i for i in members if anomalies[i].details.get("follows", {}).get("kind") != anomalies[i].kind]
        made = [i for i in spread if anomalies[i].details.get("reduction", {}).get("made_here")]
        head = anomalies[(made or spread or members)[0]]
        for i in members:
            a = anomalies[i]
            if a is not head and a.rank != head.rank:
                head.details.setdefault("also_on_ranks", []).append(a.rank)
                copies.add(i)
    return copies
