"""An fp16 run whose every step is skipped (the loss scale falls each step, nothing trains) escalates: its
``skipped_step`` is a warning from the ``UNSETTLED_SKIPS``-th (16th) skip in a row from the start (before, the
skips of a scale that never settled stayed the settling's info, and the run's headline an info NaN gradient),
naming the step since which every one was skipped and the loss scale now. A GradScaler loop and a ZeRO-2 fp16
engine (one CPU rank in this process), both at their default initial scale 2**16: DeepSpeed stops the run
at its minimum scale two skips later. A scale that settles stays info (test_training_debugger.py's
``test_skips_while_the_scale_settles...``), a high initial one after 16 and more skips too."""

import math

import pytest
import torch
from test_pre_reduction import _model

from diffusion_debug import DebugConfig, TrainingDebugger
from diffusion_debug.record import headline
from diffusion_debug.training.judges.step_checks import UNSETTLED_SKIPS


def _skips(tdbg):
    return [
        (a.severity, a.step, a.rank, a.details["reason"], a.details.get("skipped_since"), a.details["scale_after"])
        + (a.details["count"],)
        for a in tdbg.report().anomalies
        if a.kind == "skipped_step"
    ]


def _message(by, scale):
    return (
        f"Every optimizer step since step 0 was skipped by {by} ({UNSETTLED_SKIPS} in a row, the loss scale now "
        f"{scale}): nothing trains, the gradients are non-finite at every scale; fix what makes them NaN/Inf (the "
        "first non-finite gradient or loss named), or train in bf16."
    )


def _every_step_nan(tmp_path, pass_scaler: bool) -> TrainingDebugger:
    """30 fp32 steps under a GradScaler (scale 2**16) whose gradients are NaN at every step, the scaler passed to
    ``monitor_training_step`` or not (found on the optimizer); the debugger closed (it judges the last step's skip)."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    model[2].weight.register_hook(lambda g: g * math.nan)
    tdbg = TrainingDebugger(model, config=DebugConfig(output_dir=str(tmp_path), stream_events=False))
    x = torch.randn(16, 4)
    for step in range(30):
        loss = model(x).pow(2).mean()
        scaler.scale(loss).backward()
        tdbg.monitor_training_step(loss, optimizer=optimizer, step=step, **({"scaler": scaler} if pass_scaler else {}))
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    tdbg.close()
    return tdbg


def test_a_grad_scaler_loop_that_skips_every_step_warns_at_the_16th_naming_the_scale(tmp_path):
    tdbg = _every_step_nan(tmp_path, pass_scaler=True)
    # 15 skips of the settling (info, folded), then a warning from step 15 (scale 2**16 / 2**16) to 29
    assert _skips(tdbg) == [
        ("info", 0, 0, "grad_scaler", None, 32768.0, 15),
        ("warning", 15, 0, "grad_scaler", 0, 1.0, 15),
    ]
    top = headline(tdbg.report().anomalies)
    assert (top["kind"], top["severity"], top["where"]) == ("skipped_step", "warning", "model, step 15")
    assert top["message"] == _message("the GradScaler", 1)


def test_a_grad_scaler_not_passed_that_skips_every_step_counts_its_held_first_skip_in_the_row(tmp_path):
    """The same loop with the scaler not passed (``step.found_scaler``): step 0's verdict is held until the scaler
    is confirmed at step 1, and its skip released then. That skip counts in the row from the start as a judged one
    does: the warning comes at the 16th skip, since step 0, as with the scaler passed. Before, the released skip
    went around the count: the row began at step 1 and the warning came one skip later, at step 16."""
    tdbg = _every_step_nan(tmp_path, pass_scaler=False)
    assert _skips(tdbg) == [
        ("info", 0, 0, "grad_scaler", None, 32768.0, 15),
        ("warning", 15, 0, "grad_scaler", 0, 1.0, 15),
    ]
    assert [a.step for a in tdbg.report().anomalies if a.kind == "scaler_not_passed"] == [0]


def test_a_zero_fp16_engine_that_skips_every_step_warns_before_deepspeed_stops_the_run(
    one_rank_group, tmp_path, deepspeed_engine
):
    """DeepSpeed's scaler lowers the scale from the second skip on (hysteresis 2): 2**16 reaches its minimum 1
    at the 17th skip and the 18th raises ("Current loss scale already at minimum"); the warning comes at the 16th."""
    torch.manual_seed(0)
    engine, optimizer = deepspeed_engine(_model(), 2, {"fp16": {"enabled": True, "initial_scale_power": 16}})
    engine.module[2].weight.register_hook(lambda g: g * math.nan)
    tdbg = TrainingDebugger(engine, config=DebugConfig(output_dir=str(tmp_path), stream_events=False))
    for step in range(17):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step)).half()
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        tdbg.monitor_training_step(loss, optimizer=optimizer, step=step)
        engine.step()
    tdbg.close()
    assert engine.skipped_steps == 17
    assert _skips(tdbg) == [
        ("info", 0, 0, "deepspeed_overflow", None, 65536.0, 15),
        ("warning", 15, 0, "deepspeed_overflow", 0, 2.0, 2),
    ]
    top = headline(tdbg.report().anomalies)
    assert (top["kind"], top["severity"], top["where"]) == ("skipped_step", "warning", "model, step 15")
    assert top["message"] == _message("DeepSpeed's overflow check", 2)


@pytest.mark.parametrize(("init", "size", "skipped"), [(2.0**32, 1.0, 14), (2.0**24, 1e3, 16), (2.0**32, 1e3, 24)])
def test_a_high_initial_scale_that_settles_after_16_and_more_skips_stays_info(tmp_path, init, size, skipped):
    """A healthy run whose loss scale starts high (``init_scale`` 2**32, DeepSpeed's ``initial_scale_power`` 32,
    or 2**24) with large gradients (``size`` times, stored as fp16: inf past 65504) skips 16 and more in a row on
    its way down, then trains: the skips stay the settling's info, since the scale never came down to
    ``UNSETTLED_SCALE``."""
    torch.manual_seed(0)
    model = _model()
    for p in model.parameters():
        p.register_hook(lambda g: (g * size).half().float())
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    scaler = torch.amp.GradScaler("cpu", init_scale=init)
    tdbg = TrainingDebugger(model, config=DebugConfig(output_dir=str(tmp_path), stream_events=False))
    x = torch.randn(16, 4)
    for step in range(40):
        loss = model(x).pow(2).mean()
        scaler.scale(loss).backward()
        tdbg.monitor_training_step(loss, optimizer=optimizer, step=step, scaler=scaler)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    tdbg.close()
    assert scaler.get_scale() == init / 2**skipped  # settled: no skip after the first `skipped`
    assert _skips(tdbg) == [("info", 0, 0, "grad_scaler", None, init / 2, skipped)]
    assert [a for a in tdbg.report().anomalies if a.severity != "info"] == []


def test_the_kind_s_meaning_says_the_scale_must_be_down_to_2_for_skips_in_a_row_to_warn():
    """The in-a-row warning needs the scale at or below ``UNSETTLED_SCALE`` too (a high initial scale skips 16 and
    more on its way down, and trains): the meaning the report's legend shows says so."""
    from diffusion_debug.record import kind_info
    from diffusion_debug.training.judges.step_checks import FREQUENT_SKIPS, SKIP_WINDOW, UNSETTLED_SCALE

    assert (FREQUENT_SKIPS, SKIP_WINDOW, UNSETTLED_SKIPS, UNSETTLED_SCALE) == (3, 20, 16, 2.0)
    assert kind_info("skipped_step").meaning == (
        "The optimizer step was skipped (fp16 loss scaler found Inf/NaN gradients, or the policy skipped it); "
        "a warning when 3 skips fall within 20 steps after the scale settled, or 16 come in a row from the start "
        "with the scale down to 2."
    )
