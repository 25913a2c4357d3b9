"""The step's fixed-size exchange, without processes: every rank's packed values reduced by an
element-wise max (what ``all_reduce(MAX)`` computes) against a naive min / max / argmin / argmax
over the ranks' values; the details exchange with simulated ranks."""

import math
import random

import pytest

from diffusion_debug.record import Anomaly
from diffusion_debug.training.judges.step_checks import StepFlags
from diffusion_debug.training.measure.step_row import SLOTS, StepRow
from diffusion_debug.training.ranks.exchange import RankExchange, same_on_other_ranks
from diffusion_debug.training.ranks.summary import AGGREGATED, FLAGS, WIDTH, ReduceLayout, from_order_key, order_key
from diffusion_debug.training.step.outputs import across_ranks


def _reduce(layout: ReduceLayout, per_rank: list[dict], flags: list[dict]):
    packed = [layout.pack(values, f, rank) for rank, (values, f) in enumerate(zip(per_rank, flags))]
    assert all(len(p) == WIDTH for p in packed)
    return layout.unpack([max(column) for column in zip(*packed)])


@pytest.mark.parametrize("world", [1, 2, 8, 64, 1000])
def test_extremes_and_their_ranks_match_a_naive_reference(world):
    rng = random.Random(world)
    specials = [0.0, -0.0, 1e-300, -1e-300, 1e300, -1e300, math.inf, -math.inf, 3.0]
    for _ in range(20):
        losses = [rng.choice([rng.gauss(0, 1), rng.uniform(-1e6, 1e6), rng.choice(specials)]) for _ in range(world)]
        norms = [abs(rng.gauss(0, 1)) for _ in range(world)]
        summary = _reduce(
            ReduceLayout(world), [{"loss": a, "grad_norm": b} for a, b in zip(losses, norms)], [{}] * world
        )
        for name, values in (("loss", losses), ("grad_norm", norms)):
            got = summary.aggregates[name]
            # the first rank holding the extreme (exact rank; the value to 2**-40 relative at 1,000 ranks)
            assert (got["min_rank"], got["max_rank"]) == (values.index(min(values)), values.index(max(values)))
            for key, want in (("min", min(values)), ("max", max(values))):
                value = {"inf": math.inf, "-inf": -math.inf}.get(got[key], got[key])
                assert value == pytest.approx(want, rel=2**-40, abs=0)
        assert set(summary.aggregates) == {"loss", "grad_norm"}  # memory not sampled: left out


def test_a_nan_is_the_largest_and_names_its_rank_while_the_smallest_stays_a_number():
    losses = [0.5, 0.25, math.nan, 0.75]
    summary = _reduce(ReduceLayout(4), [{"loss": v} for v in losses], [{}] * 4)
    assert summary.aggregates["loss"] == {"min": 0.25, "min_rank": 1, "max": "nan", "max_rank": 2}
    every = _reduce(ReduceLayout(2), [{"loss": math.nan}] * 2, [{}] * 2)
    assert every.aggregates["loss"] == {"min": "nan", "min_rank": 0, "max": "nan", "max_rank": 0}


def test_flags_are_ored_and_a_failed_rank_adds_no_extreme():
    flags = [{}, {"nonfinite_loss": True, "anomalies": True}, {"failed": True}]
    summary = _reduce(ReduceLayout(3), [{"loss": 1.0}, {"loss": 2.0}, {}], flags)
    expected = {name: name in ("anomalies", "nonfinite_loss", "failed") for name in FLAGS}
    lower = {"stalled": False, "unheld": True, "nonfinite_held": False, "explosion_held": False}
    assert summary.flags == {**expected, **lower}  # (a failed rank's level implies ``unheld``)
    assert summary.needs_detail and summary.aggregates["loss"]["max_rank"] == 1
    assert not _reduce(ReduceLayout(2), [{"loss": 1.0}] * 2, [{}] * 2).needs_detail


def test_order_keys_sort_as_the_floats_and_round_trip():
    values = sorted([-math.inf, -1e300, -1.0, -1e-300, 0.0, 1e-300, 1.0, 1e300, math.inf])
    keys = [order_key(v) for v in values]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)
    assert [from_order_key(k) for k in keys] == values and order_key(-0.0) == order_key(0.0)


class _Ranks:
    """Stands for ``world`` processes: each call returns what every simulated rank sent."""

    def __init__(self, rank: int, sent: list):
        self.rank, self.world_size, self.distributed, self.is_main, self.sent = (
            rank,
            len(sent) + 1,
            True,
            rank == 0,
            sent,
        )

    def gather_objects(self, payload):
        return [payload, *self.sent]

    def all_reduce_max(self, values):
        return [max(column) for column in zip(values, *self.sent)]


def _row(**values) -> StepRow:
    return StepRow.from_row([values.get(name, 0.0) for name in SLOTS] + [1.0, 2.0, 0.0])


def test_details_bring_every_rank_anomalies_rows_earlier_rows_and_bucket_sums():
    nan = Anomaly("nonfinite", "error", "NaN", "model", step=3, rank=0, parameter="0.weight")
    others = [
        {
            "row": _row(loss=float(r)).to_list(),
            "anomalies": [
                Anomaly("nonfinite", "error", "NaN", "model", step=3, rank=r, parameter="0.weight").to_dict()
            ],
            "records": [(2, {"step": 2, "rank": r}), (3, {"step": 3, "rank": r})],
            "buckets": [1.0, 1.0, 0.0],
        }
        for r in (1, 2)
    ]
    exchange = RankExchange(_Ranks(0, others))
    exchange.add_buckets((1.0, 1.0, 0.0))
    exchange.add_buckets((2.0, 1.0, 0.0))
    details = exchange.details(_row(loss=0.5), [nan], (3, {"step": 3, "rank": 0}), lambda error: None)
    assert [row.loss for row in details.rows] == [0.5, 1.0, 2.0]
    assert details.buckets[0] == [3.0, 2.0, 0.0] and exchange.pending_buckets is None
    assert [(a.rank, a.parameter) for a in details.anomalies] == [(0, "0.weight"), (1, "0.weight"), (2, "0.weight")]
    assert exchange.unrecorded(details) == [  # each with its monitored step (what a step_amended names it by)
        (2, {"step": 2, "rank": 1}),
        (3, {"step": 3, "rank": 1}),
        (2, {"step": 2, "rank": 2}),
        (3, {"step": 3, "rank": 2}),
    ]
    assert exchange.unrecorded(details) == []  # recorded once
    assert same_on_other_ranks(details.anomalies) == {1, 2}
    assert details.anomalies[0].details["also_on_ranks"] == [1, 2]


def test_a_step_without_anomalies_sends_only_the_reduce_and_keeps_its_row_for_the_next_detail_step():
    other = ReduceLayout(2).pack({"loss": 3.0, "grad_norm": 1.0}, {"loss": True}, rank=0)  # rank 0 saw a spike
    exchange = RankExchange(_Ranks(1, [other]))
    exchange.remember(1, {"step": 1})
    exchange.remember(2, {"step": 2})
    exchange.remember(3, {"step": 3})  # the last two stay
    assert list(exchange.context) == [(2, {"step": 2}), (3, {"step": 3})]
    flags = StepFlags()
    summary = exchange.summarize(_row(loss=1.0, loss_count=1.0, grad_norm=1.0), [], flags, failed=False)
    assert not summary.needs_detail and summary.flags["loss"] and not flags.loss  # ORed into the summary only
    assert summary.aggregates["loss"] == {"min": 1.0, "min_rank": 1, "max": 3.0, "max_rank": 0}


def test_aggregated_slots_are_row_slots():
    assert set(AGGREGATED) <= set(SLOTS)


def test_a_rank_whose_step_had_no_loss_is_absent_from_the_loss_extremes_and_the_losses_by_rank():
    """A pipeline stage's rank: its step's calls gave ``NO_LOSS`` (no micro-step), its row's loss slot
    is NaN as the exchange carries it. That NaN is no loss: the loss extremes are the other ranks'
    (not a NaN maximum naming the stage), its gradient norm still counts, its loss is None."""
    unknown = dict.fromkeys(["clip_norm", "grad_scale", "input_nonfinite", "local_nonfinite", "rss_mb"], math.nan)
    unknown.update(cuda_allocated_mb=math.nan, lr_jump_from=math.nan, lr_jump_to=math.nan)  # as a CPU rank sends
    rows = [
        _row(loss=0.5, loss_count=1.0, grad_norm=2.0, **unknown),
        _row(loss=math.nan, loss_count=0.0, grad_norm=3.0, **unknown),  # the stage: gradients, no loss
        _row(loss=0.25, loss_count=2.0, grad_norm=1.0, **unknown),
    ]
    sent = [_packed(r, rows[r], world=3) for r in (1, 2)]
    summary = RankExchange(_Ranks(0, sent)).summarize(rows[0], [], StepFlags(), failed=False)
    assert summary.aggregates["loss"] == {"min": 0.25, "min_rank": 2, "max": 0.5, "max_rank": 0}
    assert summary.aggregates["grad_norm"] == {"min": 1.0, "min_rank": 2, "max": 3.0, "max_rank": 1}
    assert not summary.needs_detail  # no flag but ``unheld``: no rank holds a verdict (a clean step's)
    assert [name for name, value in summary.flags.items() if value] == ["unheld"]
    assert across_ranks(rows, summary.aggregates) == {
        "losses_by_rank": [0.5, None, 0.25],
        "grad_norms_by_rank": [2.0, 3.0, 1.0],
        "ranks": summary.aggregates,
    }
    # every rank without a loss (each a stage): no loss extreme at all
    alone = RankExchange(_Ranks(0, [_packed(1, rows[1], world=2)]))
    assert alone.summarize(rows[1], [], StepFlags(), failed=False).aggregates == {
        "grad_norm": {"min": 3.0, "min_rank": 0, "max": 3.0, "max_rank": 0}
    }


def _packed(rank: int, row: StepRow, world: int) -> list[int]:
    """What simulated rank ``rank`` of ``world`` sends to the step's reduce for its ``row``."""
    sent = []
    ranks = _Ranks(rank, [None] * (world - 1))
    ranks.all_reduce_max = lambda values: sent.append(values) or values
    RankExchange(ranks).summarize(row, [], StepFlags(), failed=False)
    return sent[0]


def test_a_stall_alone_rides_in_the_anomalies_slot_and_asks_for_details_only_where_it_stands():
    layout = ReduceLayout(2)

    def reduced(rank0, rank1):
        summary = layout.unpack([max(a, b) for a, b in zip(layout.pack({}, rank0, 0), layout.pack({}, rank1, 1))])
        return summary.flags["anomalies"], summary.flags["stalled"], summary.needs_detail

    assert WIDTH == 18  # no slot more: the stall is the anomalies slot's lower level
    assert [
        reduced({}, {}),
        reduced({"stalled": True}, {}),  # it stands: every rank exchanges
        reduced({"stalled": True}, {"weights_moved": True}),  # withdrawn: no exchange
        reduced({"stalled": True}, {"anomalies": True, "weights_moved": True}),  # another rank's finding
    ] == [(False, False, False), (False, True, True), (False, True, False), (True, False, True)]


def test_each_optimizer_s_stall_is_a_copy_only_of_the_same_optimizer_s_stall_on_other_ranks():
    """``not_learning`` of one optimizer of several (``stalled_optimizer``, what tells two stalls at ``optimizer``
    apart): rank 1's stall of the discriminator's optimizer is not a copy of rank 0's of the generator's, and is
    logged as its own; rank 2's of the generator's is one of rank 0's."""

    def stall(rank, optimizer):
        details = {"reason": "lr_zero", "stalled_optimizer": optimizer}
        return Anomaly("not_learning", "warning", "no update", "optimizer", step=7, rank=rank, details=details)

    stalls = [stall(0, "SGD holding generator.0.weight"), stall(1, "SGD holding discriminator.0.weight")]
    assert same_on_other_ranks(stalls) == set()
    assert [a.details.get("also_on_ranks") for a in stalls] == [None, None]
    stalls = [*stalls, stall(2, "SGD holding generator.0.weight")]
    assert same_on_other_ranks(stalls) == {2}
    assert [a.details.get("also_on_ranks") for a in stalls] == [[2], None, None]
