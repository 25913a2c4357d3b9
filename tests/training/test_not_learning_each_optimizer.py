"""A run with two optimizers (a GAN's generator and discriminator) where only one of them stalls: the other
one's update ended the whole model's run of still updates at every step, so the stalled optimizer was never
reported. Each optimizer given to the monitor now keeps its own run of still updates (the update a reading
shows is the step of the optimizer the monitored step before it was given, as the monitor's contract asks:
one call before each optimizer's step, with that optimizer), and the stalled one is named at its fifth still
update; a clean two-optimizer run, and one whose discriminator steps every other iteration, stay quiet."""

import json

import pytest
import torch
from torch.nn.functional import softplus

from diffusion_debug import DebugConfig, TrainingDebugger
from diffusion_debug.record import severity_rank

pytestmark = pytest.mark.usefixtures("only_the_tests_objects")

DISCRIMINATOR = "SGD holding discriminator.0.weight and 3 more"
GENERATOR = "SGD holding generator.0.weight and 3 more"


def _config(tmp_path):
    return DebugConfig(output_dir=str(tmp_path), log_level="error", memory_tracking=False, stream_events=False)


def _serious(tdbg):
    return [a for a in tdbg.report().anomalies if severity_rank(a.severity) >= 1]


def _models():
    torch.manual_seed(0)
    generator = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    discriminator = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return generator, discriminator


@pytest.fixture
def _gan(gan_loop):
    """``_gan(tmp_path, **options)``: the shared GAN loop (``conftest.gan_loop``: its options), the discriminator
    stepped once an iteration by default. Returns the debugger (closed) and each optimizer's monitored steps."""

    def run(tmp_path, **options):
        return gan_loop(_config(tmp_path), **options)

    return run


def _stall(found, reason, optimizer, first, last, step):
    d = found.details
    assert (found.kind, found.step, d["reason"], d["stalled_optimizer"]) == ("not_learning", step, reason, optimizer)
    assert (d["first_step"], d["last_step"], d["updates"], d["max_update_ratio"]) == (first, last, 5, 0.0)
    assert found.message.startswith(f"The optimizer {optimizer} (one of 2) moved none of its weights")
    return d


def test_a_clean_gan_stays_quiet(tmp_path, _gan):
    tdbg, _ = _gan(tmp_path)
    assert _serious(tdbg) == []


def test_a_discriminator_whose_lr_is_0_is_named_while_the_generator_learns(tmp_path, _gan):
    tdbg, steps = _gan(tmp_path, lr_d=0.0)
    # its updates are read at the monitored step after each of its own: 1, 3, 5, 7, 9 (the fifth clear at 9)
    assert steps["d"][:5] == [0, 2, 4, 6, 8]
    (found,) = _serious(tdbg)
    d = _stall(found, "lr_zero", DISCRIMINATOR, 0, 8, 9)
    assert (d["lr"], d["held_by_optimizer"], d["watched_parameters"]) == (0.0, 4, 8)
    assert "the learning rate is 0" in found.message


def test_a_generator_whose_gradients_are_cleared_before_its_step_is_named(tmp_path, _gan):
    tdbg, steps = _gan(tmp_path, clear_g=True)
    assert steps["g"][:5] == [1, 3, 5, 7, 9]
    (found,) = _serious(tdbg)
    d = _stall(found, "gradients_cleared", GENERATOR, 1, 9, 10)
    # what the generator's own step received (read by its step's hook), not the discriminator's later step
    assert (d["held_at_step"], d["cleared_at_step"], d["held_by_optimizer"]) == (4, 4, 4)


def test_a_discriminator_stepped_every_other_iteration_is_no_stall_and_its_lr_0_is_one(tmp_path, _gan):
    tdbg, steps = _gan(tmp_path, d_every=2, iterations=12)
    assert steps["d"][:3] == [0, 3, 6] and _serious(tdbg) == []
    tdbg, steps = _gan(tmp_path / "lr0", d_every=2, iterations=18, lr_d=0.0)
    # its updates are read at 1, 4, 7 and 10 (the first ten monitored steps read every update; step 9's at 10,
    # the weight norms' refresh), then in turn with the generator's (one scheduled reading in five steps,
    # ``step.detail``): the generator's step 14 at 15, its step 19's at the refresh 20 (not the one in turn: a
    # reading stays owed), then its own next step's in its turn, 21's at 22
    assert steps["d"][:8] == [0, 3, 6, 9, 12, 15, 18, 21]
    (found,) = _serious(tdbg)
    _stall(found, "lr_zero", DISCRIMINATOR, 0, 21, 22)


def test_a_discriminator_whose_step_never_runs_is_named(tmp_path, _gan):
    tdbg, _ = _gan(tmp_path, skip_d=True)
    (found,) = _serious(tdbg)
    # no step seen: its optimizer keeps no state (SGD without momentum keeps none anyway)
    _stall(found, "gradients_cleared", DISCRIMINATOR, 0, 8, 9)


def test_both_optimizers_stalled_are_one_stall_of_the_whole_run(tmp_path, _gan):
    """Both stalled: the whole model's stall (at the fifth still update, step 5) is the one reported; neither
    optimizer's own run is reported beside it while every update stays still."""
    tdbg, _ = _gan(tmp_path, lr_d=0.0, lr_g=0.0)
    (found,) = _serious(tdbg)
    assert (found.kind, found.step, found.details["first_step"], found.details["last_step"]) == (
        "not_learning",
        5,
        0,
        4,
    )
    assert "stalled_optimizer" not in found.details


def test_under_accelerate_a_stalled_discriminator_is_named(tmp_path, fresh_accelerate_state):
    from accelerate import Accelerator

    generator, discriminator = _models()
    opt_d = torch.optim.SGD(discriminator.parameters(), lr=0.0)
    opt_g = torch.optim.SGD(generator.parameters(), lr=1e-2)
    accelerator = Accelerator(cpu=True)
    generator, discriminator, opt_g, opt_d = accelerator.prepare(generator, discriminator, opt_g, opt_d)
    tdbg = TrainingDebugger(
        {"generator": generator, "discriminator": discriminator}, accelerator=accelerator, config=_config(tmp_path)
    )
    data = torch.Generator().manual_seed(1)
    for it in range(6):
        real, fake = torch.randn(16, 4, generator=data) + 3, generator(torch.randn(16, 4, generator=data))
        opt_d.zero_grad()
        loss_d = softplus(-discriminator(real)).mean() + softplus(discriminator(fake.detach())).mean()
        accelerator.backward(loss_d)
        tdbg.monitor_training_step(loss_d, optimizer=opt_d, step=2 * it)
        opt_d.step()
        opt_g.zero_grad()
        loss_g = softplus(-discriminator(fake)).mean()
        accelerator.backward(loss_g)
        tdbg.monitor_training_step(loss_g, optimizer=opt_g, step=2 * it + 1)
        opt_g.step()
    tdbg.close()
    (found,) = _serious(tdbg)
    _stall(found, "lr_zero", DISCRIMINATOR, 0, 8, 9)


def test_a_stall_of_one_optimizer_goes_on_after_clear_debug_history_and_is_reported_again(tmp_path, _gan):
    tdbg, _ = _gan(tmp_path, lr_d=0.0, iterations=9, clear_at=5)  # cleared after step 11, reported at 9
    (found,) = _serious(tdbg)
    # the next reading of its update: step 12's, read in full at 13 (the steps after a finding read in full)
    d = found.details
    assert (found.step, d["stalled_optimizer"], d["first_step"]) == (13, DISCRIMINATOR, 0)
    assert (d["last_step"], d["updates"]) == (12, 7)


def _stalls(tdbg):
    """Each ``not_learning`` as (step, the optimizer named stalled or, for the whole run's, None)."""
    return [(a.step, a.details.get("stalled_optimizer")) for a in _serious(tdbg) if a.kind == "not_learning"]


def test_a_wgan_critic_whose_lr_is_0_is_its_own_stall_told_once_while_the_generator_learns(tmp_path, _gan):
    """n_critic 5 (D, D, D, D, D, G): the first five readings are all the critic's updates. The whole model's
    run counted them as the run's stall at step 5 (naming the critic as the one that stepped last) while the
    generator learns, then the critic's own run at step 10 and the run's again at 17 and 23 (five of the critic's
    between two of the generator's): one stall, told four times. A whole run's stall needs a still update of
    every optimizer in its run; this one is the critic's, told once."""
    tdbg, steps = _gan(tmp_path, lr_d=0.0, critic=5, iterations=4)
    assert steps["d"][:6] == [0, 1, 2, 3, 4, 6] and steps["g"][:2] == [5, 11]
    # clear at step 5 (its updates 0-4), held until the generator's moving update (its step 5's) is read at 6:
    # told at its next still update read, step 6's at 7
    assert _stalls(tdbg) == [(7, DISCRIMINATOR)]
    (found,) = _serious(tdbg)
    d = found.details
    assert (d["reason"], d["stalled_optimizer"], d["first_step"], d["last_step"], d["updates"]) == (
        "lr_zero",
        DISCRIMINATOR,
        0,
        6,
        6,
    )
    assert "stepped_optimizer" not in d


def test_a_wgan_whose_optimizers_both_have_lr_0_is_one_stall_of_the_whole_run(tmp_path, _gan):
    """n_critic 5, both lr 0: the critic's five still updates (read at 1-5) were told at step 5 as its own stall
    "while the other optimizer's updates moved theirs", though no update of the generator had been read (its
    first, step 5's, is read at 6) and it never moves. An optimizer's own stall is told only once another one's
    update read in its run moved weights: held until then, the whole run's stall follows at 6 (the generator's
    still update in it), told once, as the run's."""
    tdbg, _ = _gan(tmp_path, lr_d=0.0, lr_g=0.0, critic=5, iterations=4)
    assert _stalls(tdbg) == [(6, None)]
    (found,) = _serious(tdbg)
    d = found.details
    assert (d["reason"], d["first_step"], d["last_step"], d["updates"], d["stepped_optimizer"]) == (
        "lr_zero",
        0,
        5,
        6,
        GENERATOR,
    )
    assert "stalled_optimizer" not in d and d["count"] == 1
    assert d["still_optimizers"] == [DISCRIMINATOR, GENERATOR]  # both named
    assert found.message.startswith("No weight moved in the 6 optimizer steps 0-5 ")
    assert (
        f"; the updates of all 2 optimizers are still ({DISCRIMINATOR}; {GENERATOR}); read from {GENERATOR}, the "
        "optimizer that stepped last: the learning rate is 0" in found.message
    )


def test_a_critic_that_stalls_after_the_first_ten_steps_is_read_in_its_turn(tmp_path, _gan):
    """n_critic 4 (D, D, D, D, G: five steps a cycle), the critic's lr 0 from step 15: after the first ten
    monitored steps one in five reads an update (``step.detail``), always at the same phase of a five-step
    cycle, the generator's step: the critic's stall was never read. The scheduled reading goes to each
    optimizer's update in turn: the critic's steps 15, 25, 35, 45 and 55 (the generator's 19, 29, ... between),
    the fifth read at step 56."""
    tdbg, steps = _gan(tmp_path, critic=4, iterations=12, d_stops=3)
    assert steps["g"][:4] == [4, 9, 14, 19] and steps["d"][12] == 15
    assert _stalls(tdbg) == [(56, DISCRIMINATOR)]
    (found,) = _serious(tdbg)
    assert (found.details["first_step"], found.details["last_step"], found.details["reason"]) == (15, 55, "lr_zero")


@pytest.mark.parametrize("iterations", [12, 24])
def test_a_long_stall_of_both_optimizers_reads_the_whole_weights_a_fixed_number_of_times(
    tmp_path, monkeypatch, iterations, _gan
):
    """Both stalled: the run's stall stands, and each optimizer's own, clear at its fifth still update, is held
    back. Its flag was dropped there with its count at five or more, so every later still reading of it read the
    whole weights again (``weight_fingerprint``: a fused norm and a host read) to be held back again. Read once
    when each run begins and once when it is clear (the run's and each optimizer's): six, however long."""
    from diffusion_debug.training.measure import gradients

    calls = []
    fingerprint = gradients.weight_fingerprint
    monkeypatch.setattr(gradients, "weight_fingerprint", lambda params: calls.append(1) or fingerprint(params))
    tdbg, _ = _gan(tmp_path, lr_d=0.0, lr_g=0.0, iterations=iterations)
    assert _stalls(tdbg) == [(5, None)]
    assert len(calls) == 6


def test_an_optimizers_stall_held_back_beside_the_runs_is_told_once_the_other_learns_again(tmp_path, _gan):
    """Both stalled, then the generator's lr set from step 16: the run's stall (step 5) ends at the first of its
    moving updates read, and the critic's own stall, held back since its fifth still update, is told at its next
    still update read (its step 24's, in its turn), once."""
    tdbg, _ = _gan(tmp_path, lr_d=0.0, lr_g=0.0, iterations=16, g_starts=8)
    assert _stalls(tdbg) == [(5, None), (25, DISCRIMINATOR)]
    found = _serious(tdbg)[1]
    assert (found.details["first_step"], found.details["last_step"], found.details["updates"]) == (0, 24, 9)


def _recreated(tmp_path, *, recreate_at=3, second_model_steps=0, steps=9):
    """One model under Accelerate whose optimizer is recreated at iteration ``recreate_at`` (a new phase, a
    resume), the new one at lr 0 and prepared again: the accelerator keeps the old one alive (``_optimizers``).
    With ``second_model_steps``, a second model's optimizer is given, before the first one's, at that many first
    iterations only (a text encoder trained for a while, its optimizer kept). The debugger (closed)."""
    from accelerate import Accelerator

    generator, discriminator = _models()
    accelerator = Accelerator(cpu=True)
    first = torch.optim.SGD(generator.parameters(), lr=1e-2)
    other = torch.optim.SGD(discriminator.parameters(), lr=1e-2)
    generator, discriminator, first, other = accelerator.prepare(generator, discriminator, first, other)
    models = {"generator": generator, "discriminator": discriminator}
    tdbg = TrainingDebugger(models, accelerator=accelerator, config=_config(tmp_path))
    data, optimizer, step = torch.Generator().manual_seed(1), first, 0
    for it in range(steps):
        if it == recreate_at:
            optimizer = accelerator.prepare(torch.optim.SGD(generator.parameters(), lr=0.0))
        if it < second_model_steps:
            other.zero_grad()
            loss = discriminator(torch.randn(16, 4, generator=data)).pow(2).mean()
            accelerator.backward(loss)
            tdbg.monitor_training_step(loss, optimizer=other, step=step)
            other.step()
            step += 1
        optimizer.zero_grad()
        loss = generator(torch.randn(16, 4, generator=data)).pow(2).mean()
        accelerator.backward(loss)
        tdbg.monitor_training_step(loss, optimizer=optimizer, step=step)
        optimizer.step()
        step += 1
    tdbg.close()
    return tdbg


def test_an_optimizer_recreated_under_accelerate_is_not_one_of_two(tmp_path, fresh_accelerate_state):
    """The accelerator keeps the replaced optimizer alive, so the run looked like one of two optimizers: the
    stall of the new one at lr 0 named it as ``stepped_optimizer`` ("read from ..., the optimizer that stepped
    last"). An optimizer of the same parameters replaces the one before it: one optimizer, named by no one."""
    tdbg = _recreated(tmp_path)
    (found,) = _serious(tdbg)
    d = found.details
    assert (found.step, d["reason"], d["first_step"], d["last_step"], d["updates"]) == (8, "lr_zero", 3, 7, 5)
    assert "stepped_optimizer" not in d and "stalled_optimizer" not in d
    assert found.message.startswith("No weight moved in the 5 optimizer steps 3-7 (the largest update 0x")
    assert "read from" not in found.message


def test_an_optimizer_no_longer_given_is_not_one_of_two(tmp_path, fresh_accelerate_state):
    """A second model's optimizer given at the first two iterations only (steps 0 and 2), kept alive by the
    accelerator: the stall of the first model's new optimizer at lr 0 (from step 10), told twenty and more
    monitored steps later, named the optimizer that stepped last as one of two. An optimizer given within the
    last ten monitored steps (or twice its longest gap) is live; this one is not: the stall is the run's, read
    on one optimizer's schedule (updates 14, 19, ... 34: step 10's is read by none)."""
    tdbg = _recreated(tmp_path, recreate_at=8, second_model_steps=2, steps=36)
    (found,) = _serious(tdbg)
    d = found.details
    assert (found.step, d["reason"], d["first_step"], d["last_step"], d["updates"]) == (35, "lr_zero", 14, 34, 5)
    assert "stepped_optimizer" not in d and "stalled_optimizer" not in d
    assert tdbg._steps.history.stall.several is False


def test_an_optimizers_added_param_group_counts_in_its_own_updates(tmp_path, _gan):
    """The generator's optimizer holds its first layer at lr 0 until iteration 1, then its last layer too
    (``add_param_group``, lr 1e-2): its updates move that layer from step 3. Its holdings were fixed at its first
    step, so its own run read only the first layer and its stall was told ("moved none of its weights"); they
    follow its ``param_groups`` now."""
    tdbg, _ = _gan(tmp_path, lr_g=0.0, g_grows_at=1, iterations=10)
    assert _stalls(tdbg) == []


def test_an_unmeasured_steps_update_is_credited_to_its_own_optimizer(tmp_path, _gan):
    """The critic's step 2 measured nothing (a failed measurement, recorded): the update it applies, read at
    step 3, was credited to the optimizer of the last step judged, the generator's (at lr 0), whose own run it
    joined (its modules still in the critic's update): the generator's stall was told at step 8 with a critic's
    update among its five. Credited to the critic's (whose gradients were not measured: no run of its own goes
    on), the generator's stall is its own five steps 3-11 (its step 1's update was to be read at step 2)."""
    tdbg, steps = _gan(tmp_path, lr_g=0.0, fail_at=2)
    assert 2 in steps["d"] and [a.step for a in _serious(tdbg) if a.kind == "debugger_error"] == [2]
    (found,) = [a for a in _serious(tdbg) if a.kind == "not_learning"]
    _stall(found, "lr_zero", GENERATOR, 3, 11, 12)


def test_the_runs_stall_read_from_a_compiled_step_names_the_optimizer_of_the_last_still_update(tmp_path, _gan):
    """Both compiled steps still (the critic's lr 0, the generator's gradients cleared before its step): the run's
    stall, clear at step 5 with the critic's step 4, named the optimizer from what the step's hook recorded last,
    and a compiled step records nothing: no name, and the cause read from step 5's optimizer, the generator's
    (its cleared gradients). Named from the reading: the critic's, whose lr is 0."""
    tdbg, _ = _gan(tmp_path, lr_d=0.0, clear_g=True, compiled=True)
    (found,) = _serious(tdbg)
    d = found.details
    assert (found.step, d["reason"], d["first_step"], d["last_step"], d["stepped_optimizer"]) == (
        5,
        "lr_zero",
        0,
        4,
        DISCRIMINATOR,
    )
    assert "held_at_step" not in d  # a compiled step: nothing seen


def _ten_step_cycle(tmp_path, position, *, lr_d=1e-2, lr_g=1e-2, steps=60):
    """A loop of ten-step cycles: the discriminator stepped at the cycle's ``position``-th step, the generator
    at the other nine. Returns the debugger (closed)."""
    generator, discriminator = _models()
    opt_d = torch.optim.SGD(discriminator.parameters(), lr=lr_d)
    opt_g = torch.optim.SGD(generator.parameters(), lr=lr_g)
    tdbg = TrainingDebugger({"generator": generator, "discriminator": discriminator}, config=_config(tmp_path))
    data = torch.Generator().manual_seed(1)
    for step in range(steps):
        real, fake = torch.randn(16, 4, generator=data) + 3, generator(torch.randn(16, 4, generator=data))
        opt = opt_d if step % 10 == position else opt_g
        opt.zero_grad()
        if opt is opt_d:
            loss = softplus(-discriminator(real)).mean() + softplus(discriminator(fake.detach())).mean()
        else:
            loss = softplus(-discriminator(fake)).mean()
        loss.backward()
        tdbg.monitor_training_step(loss, optimizer=opt, step=step)
        opt.step()
    tdbg.close()
    return tdbg


@pytest.mark.parametrize("position", [0, 1, 2, 3])
def test_a_discriminator_stepped_just_after_a_weight_norm_refresh_is_read_in_its_turn(tmp_path, position):
    """Ten-step cycles, the discriminator (lr 0) stepped at the cycle's 0th-3rd step: the refresh of the weight
    norms (the monitored steps 11, 21, ...: the update of the steps 9, 19, ..., the generator's) took the scheduled
    reading at once and the reading waiting for the update in turn began only at the monitored steps 15, 25, ...
    (steps 4-8 of the cycle): the discriminator's updates were never read after the first ten steps, its stall
    never told. A refresh that reads another optimizer's update keeps the reading owed: its steps 20, 30, 40 and
    50 (and 10, the first ten's) are read, the fifth at 51 + ``position``."""
    tdbg = _ten_step_cycle(tmp_path, position, lr_d=0.0)
    ((step, optimizer),) = _stalls(tdbg)
    assert (step, optimizer) == (51 + position, DISCRIMINATOR)


def test_a_generator_at_lr_0_beside_a_discriminator_stepped_just_after_a_refresh_is_told(tmp_path):
    """The same cycle, the discriminator at its 0th step learning, the generator at lr 0: its stall waited for a
    discriminator's moving update to be read (held back), which never was. Its tenth still update (the 18th step's)
    tells it at 19, before the discriminator's step 20 is read: as not known to be alone."""
    tdbg = _ten_step_cycle(tmp_path, 0, lr_g=0.0, steps=30)
    assert _stalls(tdbg) == [(19, GENERATOR)]
    (found,) = _serious(tdbg)
    assert (found.details["first_step"], found.details["last_step"], found.details["updates"]) == (1, 18, 10)
    assert found.details["others_moved"] is False


def test_an_optimizers_stall_held_back_for_want_of_another_moving_update_is_told_at_twice_five(tmp_path):
    """The generator first, then eleven critic steps (lr 0) per iteration; every generator step is skipped by its
    GradScaler (its loss is Inf), so no update of it is ever read moving. The critic's own stall, clear at its fifth
    still update, waited for another optimizer's moving update to be read: never told (the one-optimizer monitor
    told it at step 6). Held back without a stall of the run, it is told at its tenth still update or later, as
    not known to be alone: its message does not say the other's updates moved."""
    generator, discriminator = _models()
    opt_d = torch.optim.SGD(discriminator.parameters(), lr=0.0)
    opt_g = torch.optim.SGD(generator.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    tdbg = TrainingDebugger({"generator": generator, "discriminator": discriminator}, config=_config(tmp_path))
    data = torch.Generator().manual_seed(1)
    step = 0

    def generator_step(fake):
        nonlocal step
        opt_g.zero_grad()
        loss = softplus(-discriminator(fake)).mean() * float("inf")
        scaler.scale(loss).backward()
        tdbg.monitor_training_step(loss, optimizer=opt_g, step=step)
        step += 1
        scaler.step(opt_g)
        scaler.update()

    generator_step(generator(torch.randn(16, 4, generator=data)))
    for _ in range(2):
        real, fake = torch.randn(16, 4, generator=data) + 3, generator(torch.randn(16, 4, generator=data))
        for _ in range(11):
            opt_d.zero_grad()
            loss = softplus(-discriminator(real)).mean() + softplus(discriminator(fake.detach())).mean()
            loss.backward()
            tdbg.monitor_training_step(loss, optimizer=opt_d, step=step)
            step += 1
            opt_d.step()
        generator_step(fake)
    tdbg.close()
    assert _stalls(tdbg) == [(15, DISCRIMINATOR)]
    (found,) = [a for a in _serious(tdbg) if a.kind == "not_learning"]
    d = found.details
    assert (d["reason"], d["first_step"], d["last_step"], d["updates"], d["others_moved"]) == (
        "lr_zero",
        1,
        14,
        11,
        False,
    )
    assert "(no update of the other optimizer read in that time moved weights either), although" in found.message
    assert "moved theirs" not in found.message


def test_a_stall_told_as_one_optimizers_is_not_told_again_as_the_runs_when_the_other_is_no_longer_given(
    tmp_path, _gan
):
    """n_critic 8 for four iterations, then the generator (lr 0) alone: its own stall is told at 40 (its steps
    8-39) while the critic is still live; once the critic is no longer live (one optimizer: the whole run's watch
    again) the same stall was told a second time as the run's at 45. The one left takes its told stall over."""
    tdbg, _ = _gan(tmp_path, lr_g=0.0, critic=lambda it: 8 if it < 4 else 0, iterations=60)
    assert _stalls(tdbg) == [(40, GENERATOR)]
    (found,) = _serious(tdbg)
    assert (found.details["first_step"], found.details["last_step"], found.details["reason"]) == (8, 39, "lr_zero")


def test_a_discriminator_whose_step_never_runs_beside_a_generator_at_lr_0_is_one_stall_of_the_run(tmp_path, _gan):
    """The critic's step never runs (a loop's bug), the generator at lr 0: an optimizer whose ``step()`` is not seen
    in the run while the other's is may be stepped at one iteration in k (not stalled: the run's stall is withheld),
    but not for ever: after its tenth still update the run's stall is told, once, naming each one's cause (its own
    stalls, held back beside it, are not told: the critic's own was told at its tenth "alone", and the generator's
    folded under it)."""
    tdbg, _ = _gan(tmp_path, skip_d=True, lr_g=0.0, iterations=30)
    ((step, optimizer),) = _stalls(tdbg)
    (found,) = _serious(tdbg)
    d = found.details
    assert (step, optimizer, d["first_step"], d["last_step"], d["updates"]) == (40, None, 0, 39, 20)
    assert d["still_optimizers"] == [DISCRIMINATOR, GENERATOR]
    assert [(c["reason"], c["lr"]) for c in d["still_causes"]] == [("gradients_cleared", 1e-2), ("lr_zero", 0.0)]


def test_two_stalled_optimizers_of_three_are_each_told_as_their_own(tmp_path):
    """A GAN's generator and discriminator both at lr 0 beside an encoder that learns (three optimizers, each given
    with its step in turn): each one's own stall is clear at its fifth still update, the discriminator's at 25 and
    the generator's at 26. Both were ``not_learning`` at component ``optimizer``, module ``""``, rank 0: the
    generator's folded into the discriminator's (one anomaly, count 2), named nowhere. Each is its own, in memory
    and in the saved summary."""
    generator, discriminator = _models()
    encoder = torch.nn.Linear(4, 4)
    opt_g, opt_d = (torch.optim.SGD(m.parameters(), lr=0.0) for m in (generator, discriminator))
    opt_e = torch.optim.SGD(encoder.parameters(), lr=1e-2)
    models = {"generator": generator, "discriminator": discriminator, "encoder": encoder}
    tdbg = TrainingDebugger(models, config=_config(tmp_path))
    data, step = torch.Generator().manual_seed(1), 0
    for _ in range(12):
        for model, optimizer in ((discriminator, opt_d), (generator, opt_g), (encoder, opt_e)):
            optimizer.zero_grad()
            batch = torch.randn(16, 4, generator=data)
            loss = model(generator(batch) if model is discriminator else batch).pow(2).mean()
            loss.backward()
            tdbg.monitor_training_step(loss, optimizer=optimizer, step=step)
            step += 1
            optimizer.step()
    tdbg.close()
    assert _stalls(tdbg) == [(25, DISCRIMINATOR), (26, GENERATOR)]
    for found, first in zip(_serious(tdbg), (0, 1)):
        d = found.details
        assert (found.component, found.module, d["reason"], d["count"], d["optimizers"]) == (
            "optimizer",
            "",
            "lr_zero",
            1,
            3,
        )
        assert (d["first_step"], d["last_step"], d["updates"]) == (first, first + 24, 5)
        assert found.message.startswith(f"The optimizer {d['stalled_optimizer']} (one of 3) moved none of its weights")
    saved = json.loads((tdbg.report().save() / "summary.json").read_text())
    told = [(a["step"], a["details"]["stalled_optimizer"], a["details"]["count"]) for a in saved["anomalies"]]
    assert [t for t in told if t[1]] == [(25, DISCRIMINATOR, 1), (26, GENERATOR, 1)]
