"""checks (with rank_desync and debugger_errors): gathered rows (and the small per-rank history)
in, anomalies out. Pure: no model runs, exact expected messages."""

import math

import pytest
import torch

from diffusion_debug import DebugConfig
from diffusion_debug.probes import BackwardOrder
from diffusion_debug.record import by_cause
from diffusion_debug.training import failures
from diffusion_debug.training.judges import step_checks
from diffusion_debug.training.judges.causes import trace_causes
from diffusion_debug.training.measure import gradients
from diffusion_debug.training.measure.gradients import TrainableParameters
from diffusion_debug.training.measure.shards import ShardNorms
from diffusion_debug.training.measure.step_row import SKIPPED_BY_ACCELERATE, SKIPPED_BY_DEEPSPEED, SLOTS, StepRow
from diffusion_debug.training.ranks import desync
from diffusion_debug.training.step.outputs import StepCounts

NAN = math.nan


def _row(**slots):
    values = dict.fromkeys(SLOTS, 0.0)
    values.update(grad_scale=NAN, checksum=NAN, accelerate_skipped=NAN, rss_mb=NAN, cuda_allocated_mb=NAN)
    values.update(input_nonfinite=NAN, clip_norm=NAN, lr=NAN, lr_jump_from=NAN, lr_jump_to=NAN)
    values.update(loss=1.0, grad_norm=1.0, loss_count=1.0)
    buckets = slots.pop("buckets", ())
    values.update(slots)
    return StepRow.from_row([values[name] for name in SLOTS] + list(buckets))


@pytest.fixture
def params():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Tanh(), torch.nn.Linear(2, 1))
    return TrainableParameters.of(model)


@pytest.fixture
def config():
    return DebugConfig(output_dir="unused", grad_explosion_threshold=100.0, grad_vanishing_threshold=1e-8)


def _judge(row, params, config, rank=0, step=5, history=None):
    flags = step_checks.StepFlags()
    history = history or step_checks.RankHistory.new(config)
    return step_checks.judge_rank(rank, row, step, history, params, config, flags), flags


def test_a_clean_row_gives_nothing(params, config):
    assert _judge(_row(), params, config) == ([], step_checks.StepFlags())


def test_nonfinite_loss_with_its_timestep_buckets(params, config):
    buckets = [0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 2.0, 0.0]  # sum, count, nonfinite for 3 buckets
    (a,), flags = _judge(_row(loss=NAN, loss_count=2.0, buckets=buckets), params, config, rank=1, step=7)
    assert (a.kind, a.severity, a.rank, a.step, a.component) == ("nonfinite_loss", "error", 1, 7, "model")
    assert a.message == (
        "The loss is nan at step 7 on rank 1; the input batch was not checked (pass inputs=batch to tell a bad batch "
        "from a bad forward pass): check the forward pass (pass closure= to name the op), or lower the learning rate."
    )
    assert a.details["micro_steps"] == 2 and a.details["nonfinite_by_timestep_bucket"] == {1: 2}
    assert flags.loss and flags.nonfinite_loss and not flags.nonfinite


def _backward(params, *indices):
    """A recorded backward order (``indices``: the parameters as backward accumulated them)."""
    order = BackwardOrder(params.params)
    order.order.extend(indices)
    return order


HINT = "lower the learning rate, check the loss for NaN/Inf, or use closure= to name the backward op."


def test_nonfinite_gradients_of_several_modules_name_where_backward_made_them(params, config):
    """Under a finite loss, a NaN made in module 2's backward reaches module 2's gradients and those
    upstream (module 0's): the one named is the last in forward order, the first backward reached
    (the first in forward order, 0.weight, is the far end); where no backward order was recorded
    (FSDP2, ZeRO), the last registered."""
    (a,), flags = _judge(_row(nonfinite_parameters=2.0, first_nonfinite=0.0, grad_norm=NAN), params, config)
    assert (a.kind, a.severity, a.parameter, a.module) == ("nonfinite", "error", "0.weight", "0")
    assert a.message == f"2 gradient(s) hold NaN/Inf, first registered 0.weight in module 0: {HINT}"
    assert flags.nonfinite
    located = step_checks.locate_nonfinite(a, [0, 2], _backward(params, 3, 2, 1, 0), params)
    assert (located.parameter, located.module, located.details["order"]) == ("2.weight", "2", "last_in_forward")
    assert located.details["parameters"] == ["0.weight", "2.weight"] and located.details["modules"] == ["0", "2"]
    assert located.details["first_registered"] == {"component": "model", "parameter": "0.weight", "module": "0"}
    assert located.message == (
        "2 gradient(s) hold NaN/Inf, made in backward at 2.weight in module 2, the last in forward order of those "
        f"that hold NaN/Inf: {HINT}"
    )
    assert a.parameter == "0.weight"  # a new anomaly: the judged one is unchanged
    unrecorded = step_checks.locate_nonfinite(a, [0, 2], _backward(params), params)
    assert (unrecorded.parameter, unrecorded.details["order"]) == ("2.weight", "last_registered")
    assert unrecorded.message == (
        "2 gradient(s) hold NaN/Inf, made in backward at 2.weight in module 2, the last registered of those that "
        f"hold NaN/Inf (no backward order was recorded): {HINT}"
    )
    found = {"found": True, "op": "SqrtBackward0", "forward_line": "train.py:3 in step"}
    localized = step_checks.with_localization(located, found)
    assert localized.message == (
        "2 gradient(s) hold NaN/Inf, made in backward at 2.weight in module 2, the last in forward order of those "
        "that hold NaN/Inf: lower the learning rate or check the loss for NaN/Inf; anomaly mode names SqrtBackward0 "
        "from train.py:3 in step."
    )  # closure= was passed: no advice to pass it (issue 23)
    assert localized.details["localization"] is found
    stayed_finite = step_checks.with_localization(located, {"found": False, "seconds": 0.1})
    assert stayed_finite.message.endswith(
        "the last in forward order of those that hold NaN/Inf: lower the learning rate or check the loss for "
        "NaN/Inf; the closure= replay under anomaly mode stayed finite (the closure must recompute this batch's loss)."
    )


@pytest.mark.parametrize("loss_rank", [0, 1])
def test_nonfinite_gradients_that_follow_a_nan_loss_are_named_by_registration_on_every_engine(
    params, config, loss_rank
):
    """A NaN loss (this rank's, or another's that DDP averaged into this rank's gradients) makes every
    gradient NaN: the loss is the headline, and the gradients, its consequence, name the first
    registered (issue 13: not conv_out, where backward starts), as an engine that records no order does."""
    (loss,), _ = _judge(_row(loss=NAN), params, config, rank=loss_rank)
    (a,), _ = _judge(_row(nonfinite_parameters=4.0, first_nonfinite=0.0, grad_norm=NAN), params, config)
    everywhere = [0, 1, 2, 3]
    for order in (_backward(params, 3, 2, 1, 0), _backward(params)):
        located = step_checks.locate_nonfinite(a, everywhere, order, params)
        assert located.parameter == "2.weight"  # alone, the last module: where backward met the NaN
        traced = trace_causes([located, loss])
        assert [(t.kind, t.rank) for t in traced] == [("nonfinite_loss", loss_rank), ("nonfinite", 0)]
        gradients = traced[1]
        assert (gradients.parameter, gradients.module, gradients.details["order"]) == ("0.weight", "0", "registration")
        assert "first_registered" not in gradients.details
        assert gradients.message == (
            f"4 gradient(s) hold NaN/Inf, from the non-finite loss on rank {loss_rank} at this step (first "
            "registered: 0.weight)."
        )
        assert by_cause(traced)[0].kind == "nonfinite_loss"


@pytest.mark.parametrize("recorded", [True, False])
def test_gradients_made_non_finite_together_in_one_module_are_named_by_registration_on_every_engine(
    params, config, recorded
):
    """A NaN made in module 2's backward alone (its grad_output; the rest stays finite) reaches its
    weight and bias from one op: the order autograd accumulated them in (the bias last) tells
    nothing, so the first registered is named, in the words a sharded engine (no order recorded)
    uses; one gradient alone is named so too. Between several modules the backward order picks."""
    (a,), _ = _judge(_row(nonfinite_parameters=2.0, first_nonfinite=2.0, grad_norm=NAN), params, config)
    order = _backward(params, 2, 3, 0, 1) if recorded else _backward(params)  # the biases last
    together = step_checks.locate_nonfinite(a, [2, 3], order, params)
    assert (together.parameter, together.module, together.details["order"]) == ("2.weight", "2", "registration")
    assert "first_registered" not in together.details
    assert together.message == f"2 gradient(s) hold NaN/Inf, first registered 2.weight in module 2: {HINT}"
    alone = step_checks.locate_nonfinite(a, [3], order, params)
    assert (alone.parameter, alone.details["order"]) == ("2.bias", "registration")
    spread = step_checks.locate_nonfinite(a, [0, 1, 2, 3], order, params)
    assert (spread.parameter, spread.details["order"]) == (
        "2.weight",
        "last_in_forward" if recorded else "last_registered",
    )


def test_under_a_gradscaler_a_nonfinite_gradient_is_info(params, config):
    (a,), _ = _judge(_row(nonfinite_parameters=1.0, first_nonfinite=2.0, grad_scale=1024.0), params, config)
    assert (a.severity, a.parameter) == ("info", "2.weight")
    assert a.message.endswith(": the GradScaler will skip this optimizer step and lower the scale.")


def test_a_norm_overflow_without_nonfinite_values_is_an_explosion(params, config):
    (a,), _ = _judge(_row(nonfinite_parameters=1.0, first_nonfinite=0.0), params, config)
    explosion = step_checks.locate_nonfinite(a, [], _backward(params), params)
    assert (explosion.kind, explosion.severity, explosion.parameter, explosion.module) == (
        "gradient_explosion",
        "warning",
        None,
        "",
    )
    assert explosion.message == (
        "A gradient norm overflowed float32 (values above ~1e19): lower the learning rate or clip gradients."
    )


def test_shards_finite_whose_summed_norm_passes_float32_are_an_explosion_of_the_sum_not_a_nan(params, config):
    # two ranks' shards of one float64 gradient (each shard's norm finite in float32, the whole's not: its
    # float32 cast was inf on every rank, and no rank's own shard was non-finite); naive reference: the whole
    # tensor's norm in float64, and float32's own sum of the shard norms, which is inf
    grad = torch.tensor([3e38, -3e38], dtype=torch.float64)
    shards = [grad[:1], grad[1:]]
    own = [gradients.stacked_norms([s]) for s in shards]  # float32, as each rank measures it
    assert all(torch.isfinite(n).all() for n in own)
    assert torch.isinf(torch.linalg.vector_norm(torch.cat(own)))  # float32 sums the shards to inf
    whole = []
    for rank in (0, 1):  # ShardNorms.sum_over_ranks: the other rank's squares added, as all_reduce(SUM)
        other = own[1 - rank].double().square()
        norms, _ = ShardNorms(lambda t, other=other: t + other, 1).whole(own[rank], None)
        whole.append(norms.item())
    reference = torch.linalg.vector_norm(grad).item()
    assert whole == [pytest.approx(reference, rel=1e-6)] * 2  # no longer inf: the sum is float64
    (a,), flags = _judge(_row(grad_norm=whole[1]), params, config, rank=1)
    found = (a.kind, a.severity, a.rank, a.parameter, flags.explosion)
    assert found == ("gradient_explosion", "warning", 1, None, True)
    assert a.details["sum_overflow"] is True and a.details["grad_norm"] == whole[1]
    assert a.message == (
        "The global gradient norm is 4.243e+38, past the largest norm float32 sums (1.845e+19) though every "
        "parameter's (and shard's) own norm is finite: their sum overflows float32, so clip_grad_norm_ reads it "
        "as inf and scales every gradient by 0; lower the learning rate and look at this step's batch."
    )


def test_an_inf_grad_norm_passed_over_finite_gradients_is_the_sum_s_overflow(params, config):
    # clip_grad_norm_ returned inf and zeroed the finite gradients before the monitor measured them
    (a,), _ = _judge(_row(grad_norm=0.0, clip_norm=math.inf), params, config)
    assert (a.kind, a.details["grad_norm"]) == ("gradient_explosion", math.inf)
    assert a.message.startswith(
        "The gradient norm passed as grad_norm= is inf though every parameter's (and shard's) own norm is finite: "
    )
    (b,), _ = _judge(_row(grad_norm=math.inf, clip_norm=math.inf, nonfinite_parameters=1.0), params, config)
    assert b.kind == "nonfinite"  # a gradient itself non-finite: not the sum's overflow


def test_explosion_and_vanishing(params, config):
    (a,), flags = _judge(_row(grad_norm=250.0), params, config)
    assert a.kind == "gradient_explosion" and flags.explosion
    assert a.message == (
        "The global gradient norm (before clipping) is 250, above 100: lower the learning rate or clip gradients."
    )
    # a script that clips already (max_grad_norm= passed) is not told to clip
    (clipped,) = step_checks.note_clipping([a], 0, 1.0)
    assert clipped.details["clipping"] == 1.0 and clipped.message == (
        "The global gradient norm (before clipping) is 250, above 100: lower the learning rate and look at this "
        "step's batch (the gradients are clipped already)."
    )
    assert step_checks.note_clipping([a], 0, False) == [a] and step_checks.note_clipping([a], 1, 1.0) == [a]
    named = step_checks.name_top_module(a, {"0": 3.0, "2": 200.0, "1": NAN})
    assert named.module == "2" and named.details["top_module_grad_norms"] == {"2": 200.0, "0": 3.0}
    (v,), flags = _judge(_row(grad_norm=1e-12), params, config)
    assert v.kind == "gradient_vanishing" and flags.vanishing
    assert v.message == (
        "The global gradient norm is 1e-12, below 1e-08: check that the loss depends on the trained parameters and "
        "that zero_grad() runs after the step."
    )


def test_loss_spike_after_a_steady_history(params, config):
    history = step_checks.RankHistory.new(config)
    for loss in [1.0, 1.1, 0.9, 1.0, 1.05, 0.95, 1.0, 1.02, 0.98, 1.0]:
        assert _judge(_row(loss=loss), params, config, history=history)[0] == []
    (a,), flags = _judge(_row(loss=9.0), params, config, history=history)
    assert a.kind == "loss_spike" and flags.loss and a.details["median"] == 1.0
    assert a.message.startswith("The loss jumped to 9, ") and a.message.endswith(
        "robust deviations above its rolling median 1: look at the learning rate and this batch."
    )


def test_cuda_allocated_growth_is_judged_like_rss(config):
    config = config.replace(memory_growth_mb=100.0)
    history = step_checks.RankHistory.new(config)
    anomalies = []
    for i in range(16):  # RSS flat, CUDA allocated climbing 50 MB per step
        anomalies += step_checks.judge_memory(
            0, _row(rss_mb=1000.0, cuda_allocated_mb=500.0 + 50.0 * i), 15, history, config
        )
    (growth,) = anomalies
    assert growth.kind == "memory_growth" and growth.details["source"] == "cuda_allocated"
    assert growth.details["growth_mb"] == 300.0 and growth.details["window_steps"] == 8  # judged at 8 steps
    assert growth.details["cuda_allocated_mb"] == 850.0
    assert growth.message == (
        "CUDA allocated memory grew by 300 MB over the last 8 steps: look for tensors kept across steps (e.g. "
        "appending the loss without .item())."
    )


def test_skipped_step_is_reported_once_against_the_previous_step(config):
    histories = [step_checks.RankHistory.new(config) for _ in range(2)]
    assert step_checks.judge_skipped([_row(grad_scale=1024.0)] * 2, histories, 3, 4) == []
    (a,) = step_checks.judge_skipped([_row(grad_scale=512.0)] * 2, histories, 4, 5)
    assert (a.kind, a.step, a.rank, a.details["detected_at_step"]) == ("skipped_step", 4, 0, 5)
    assert a.message == (
        "The optimizer step 4 was skipped by the GradScaler (gradients overflowed; scale 1024 -> 512): frequent "
        "skips mean fp16 overflow, consider bf16 or a lower learning rate."
    )


def test_the_summary_counts_the_grad_scaler_s_skips_and_deepspeed_s_apart(config):
    # rows as a GradScaler run (the scale halves; Accelerate says it skipped) and a DeepSpeed run (its
    # overflow flag, read by ZeroPartitions.step_skipped: DeepSpeed itself runs in test_deepspeed.py) give them
    counts, scaler, deepspeed = StepCounts(), step_checks.RankHistory.new(config), step_checks.RankHistory.new(config)
    runs = [
        (scaler, [_row(grad_scale=1024.0), _row(grad_scale=512.0), _row(accelerate_skipped=SKIPPED_BY_ACCELERATE)]),
        (deepspeed, [_row(accelerate_skipped=0.0), _row(accelerate_skipped=SKIPPED_BY_DEEPSPEED)]),
    ]
    reasons = []
    for history, rows in runs:
        for step, row in enumerate(rows):
            skipped = step_checks.judge_skipped([row], [history], step - 1 if step else None, step)
            reasons += [a.details["reason"] for a in skipped]
            counts.add_step(skipped, step_checks.StepFlags(), skipped)
    assert reasons == ["grad_scaler", "grad_scaler", "deepspeed_overflow"]
    summary = counts.summary()
    assert (summary["skipped_steps"], summary["skipped_by_scaler"], summary["skipped_by_deepspeed"]) == (3, 2, 1)


def test_checksums_name_the_first_differing_parameter(params):
    failed = StepRow.from_row([NAN] * (len(SLOTS) - 1) + [1.0])
    rows = [failed, _row(checksum=10.0), _row(checksum=11.0)]
    assert desync.reference_rank(rows) == 1
    assert desync.differing_checksums(rows) == [2]
    per_param = [[NAN] * 4, [1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 5.0]]
    (a,) = desync.judge_checksums(rows, [2], per_param, 9, params)
    assert (a.kind, a.rank, a.step, a.parameter, a.module) == ("rank_desync", 2, 9, "2.bias", "2")
    assert a.details["parameter_checksum"] == 5.0 and a.details["reference_rank"] == 1
    assert a.message == (
        "Rank 2's parameters differ from rank 0's (first 2.bias): the replicas diverged; check that every rank loads "
        "the same weights and no rank updates outside DDP."
    )


def test_a_debugger_error_under_strict_never_advises_strict():
    """With ``strict=True`` a training failure is raised (its sentence says so) or, inside the
    step's exchange, kept: neither sentence tells to set strict=True, which is on."""
    error = RuntimeError("planted")
    raised = failures.judging_failed(0, 3, error, raised=True)
    kept = failures.judging_failed(0, 3, RuntimeError("unserialisable"), kept=True)
    assert raised.message == "The debugger's judging failed (RuntimeError: planted) and was raised (strict=True)."
    assert kept.message == (
        "Rank 0 failed to judge step 3 (RuntimeError: unserialisable) and training went on (not raised with "
        "strict=True: every rank must finish the step's exchange)."
    )
    assert getattr(error, "_diffusion_debug_raised", None) == "judging"  # marked: recorded once


def test_debugger_errors_share_one_details_layout():
    error = RuntimeError("planted")
    own = failures.measurement_failed(1, 3, error)
    other = failures.measurement_failed(1, 3, None)
    assert own.message.startswith("Rank 1 failed to measure step 3 (RuntimeError: planted) and training went on")
    assert other.message == (
        "Rank 1 failed to measure step 3 and training went on; set strict=True to see the traceback."
    )
    judging = failures.judging_failed(0, 3, error)
    recording = failures.recording_failed(0, 3, error)
    for a in (own, other, judging, recording):
        assert a.kind == "debugger_error" and set(a.details) == {"where", "error", "traceback"}
    assert [a.details["where"] for a in (own, other, judging, recording)] == [
        "measurement",
        "measurement",
        "judging",
        "recording",
    ]
    assert own.details["error"] == "RuntimeError: planted" and other.details["error"] is None
