"""The cause a GAN's stall is told with: the lr each still update was made with (recorded at the monitored step
whose update it is), not the lr a per-iteration LR scheduler has set by the time the stall is clear; a stall whose
every still update was made at lr 0 is not told where the lr has left 0 since (a warmup from 0: the clean run
stays quiet), only if it goes on; and a stall of the whole run names each still optimizer's own reason."""

import pytest

from diffusion_debug import DebugConfig
from diffusion_debug.record import severity_rank

pytestmark = pytest.mark.usefixtures("only_the_tests_objects")

DISCRIMINATOR = "SGD holding discriminator.0.weight and 3 more"
GENERATOR = "SGD holding generator.0.weight and 3 more"


def warmup(s):  # the usual linear warmup from lr 0, stepped once per iteration
    return min(1.0, s / 20)


def _config(tmp_path):
    return DebugConfig(output_dir=str(tmp_path), log_level="error", memory_tracking=False, stream_events=False)


def _serious(tdbg):
    return [a for a in tdbg.report().anomalies if severity_rank(a.severity) >= 1]


def _stalls(tdbg):
    """Each ``not_learning`` as (step, the optimizer named stalled or, for the whole run's, None)."""
    serious = _serious(tdbg)
    assert all(a.kind == "not_learning" for a in serious), serious
    return [(a.step, a.details.get("stalled_optimizer")) for a in serious]


@pytest.fixture
def _gan(gan_loop):
    """``_gan(tmp_path, **options)``: the shared GAN loop (``conftest.gan_loop``: its options) with a WGAN's critic
    stepped ``critic=4`` times an iteration by default, each optimizer under its own ``LambdaLR`` where
    ``schedule_d`` / ``schedule_g`` is given (stepped once an iteration). Returns the debugger (closed)."""

    def run(tmp_path, *, critic=4, **options):
        return gan_loop(_config(tmp_path), critic=critic, **options)[0]

    return run


def test_a_gan_warming_up_from_lr_0_per_iteration_stays_quiet(tmp_path, _gan):
    """n_critic 4, both optimizers warmed up from lr 0 by a scheduler stepped once per iteration: iteration 0's
    five updates (steps 0-4, the critic's four and the generator's one) are all made at lr 0 and move nothing, so
    the whole run's five still updates, every live optimizer's in them, were clear at step 5, where the scheduler
    has set lr 5e-4 already: told as ``undone_after_step`` (the lr read then). A warmup from 0 is expected to move
    nothing at its first step; the next update, at lr above 0, moves: nothing to tell."""
    assert _stalls(_gan(tmp_path, schedule_d=warmup, schedule_g=warmup)) == []


@pytest.mark.parametrize("critic", [6, 8])
def test_a_gan_whose_critic_steps_six_times_or_more_warming_up_from_lr_0_stays_quiet(tmp_path, critic, _gan):
    """n_critic 6 (and 8), the same warmup: the critic's first five updates, all at lr 0, are read before the
    generator is first given (step 6): one optimizer's run, whose lr is still 0 at step 5 (the scheduler steps after
    the generator's step), told there as ``lr_zero``. Its scheduler, not stepped yet, set that lr 0 from a base above
    0: a warmup from 0 at its start, waited for as the n_critic 4 one is (2 x STALL_UPDATES still updates at most); the
    next updates move."""
    assert _stalls(_gan(tmp_path, schedule_d=warmup, schedule_g=warmup, critic=critic, iterations=4)) == []


def test_a_gan_whose_generator_stays_at_lr_0_is_told_lr_zero_naming_the_generator(tmp_path, _gan):
    """The same warmup, the generator's lr 0 at every step (0 x the schedule): the run's stall at step 5 is not
    told (the critic leaves lr 0 there, and its next update moves); the generator's own still updates (its steps 4
    and 9 read among the first ten monitored steps, then one in two scheduled readings: the optimizers' in turn) are
    told as its own stall, once, at the fifth (its step 39's), with the lr its updates were made with: 0."""
    tdbg = _gan(tmp_path, lr_g=0.0, schedule_d=warmup, schedule_g=warmup, iterations=12)
    assert _stalls(tdbg) == [(40, GENERATOR)]
    (found,) = _serious(tdbg)
    d = found.details
    assert (d["reason"], d["lr"], d["first_step"], d["last_step"], d["updates"]) == ("lr_zero", 0.0, 4, 39, 5)
    assert "the learning rate is 0" in found.message


def test_a_stall_made_at_lr_above_0_is_not_told_as_lr_0_set_since(tmp_path, _gan):
    """Both optimizers' gradients cleared before their steps at lr 1e-2, the scheduler setting lr 0 from the second
    iteration on: the run's stall (steps 0-4) is clear at step 5, where the lr is 0: it was told as ``lr_zero``
    ("set it") though its updates were made at 1e-2. Told from the lr recorded at each still update: cleared."""
    tdbg = _gan(
        tmp_path, schedule_d=lambda s: float(s == 0), schedule_g=lambda s: float(s == 0), iterations=3, clear=True
    )
    assert _stalls(tdbg) == [(5, None)]
    (found,) = _serious(tdbg)
    d = found.details
    assert (d["reason"], d["lr"], d["first_step"], d["last_step"], d["stepped_optimizer"]) == (
        "gradients_cleared",
        1e-2,
        0,
        4,
        GENERATOR,
    )
    assert [c["reason"] for c in d["still_causes"]] == ["gradients_cleared", "gradients_cleared"]
    assert [c["lr"] for c in d["still_causes"]] == [1e-2, 1e-2]


def test_the_runs_stall_names_each_still_optimizers_own_reason(tmp_path, _gan):
    """The critic at lr 1e-12 (each update rounds away in float32), the generator at lr 0, alternating: the run's
    stall, clear at step 5 with the critic's step 4, was read from the critic alone, the generator's lr 0 unnamed.
    Each still optimizer's reason is a detail (``still_causes``, in the order of ``still_optimizers``) and the
    message names the one that differs. The critic's is its float32 rounding (was ``undone_after_step``)."""
    tdbg = _gan(tmp_path, lr_d=1e-12, lr_g=0.0, critic=1, iterations=4)
    assert _stalls(tdbg) == [(5, None)]
    (found,) = _serious(tdbg)
    d = found.details
    assert (d["reason"], d["dtype"], d["stepped_optimizer"], d["still_optimizers"]) == (
        "below_precision",
        "float32",
        DISCRIMINATOR,
        [DISCRIMINATOR, GENERATOR],
    )
    (critic, gen) = d["still_causes"]
    assert (critic["reason"], critic["dtype"], critic["lr"]) == ("below_precision", "float32", 1e-12)
    assert (gen["reason"], gen["lr"]) == ("lr_zero", 0.0)
    assert (
        f"read from {DISCRIMINATOR}, the optimizer that stepped last: the weights are float32 and each update "
        "(lr 1e-12) is smaller than their rounding step: raise the learning rate" in found.message
    )
    assert found.message.endswith(
        f"; for {GENERATOR}: the learning rate is 0 in every param group that holds them: set it (check the "
        "scheduler's warmup)."
    )


def test_a_generators_stall_told_as_its_own_is_not_told_again_as_the_runs(tmp_path, _gan):
    """The generator at lr 0; the critic monitored at every iteration and stepped at one in six (the sixth, the 12th,
    ...: the others' updates move nothing). The run's stall of both (steps 0-4) was told at 5, the critic's cause
    guessed (``gradients_cleared``: its step never ran), and the generator's own, held back beside it, again at 12
    once the critic's step 10 is read moving: one stall told twice (and, before, a third time as the run's at 16).
    A critic whose ``step()`` is not seen in the run while the generator's is was not stepped, not stalled: no run's
    stall; the generator's own is told once, with its cause, lr 0."""
    tdbg = _gan(tmp_path, lr_g=0.0, critic=1, iterations=30, d_stepped=lambda it: it % 6 == 5)
    assert _stalls(tdbg) == [(12, GENERATOR)]
    (own,) = _serious(tdbg)
    assert (own.details["reason"], own.details["lr"], own.details["first_step"], own.details["last_step"]) == (
        "lr_zero",
        0.0,
        1,
        11,
    )
    assert own.message == (
        f"The optimizer {GENERATOR} (one of 2) moved none of its weights in its {own.details['updates']} steps 1-11 "
        "(the largest update 0x a module's norm) while the other optimizer's updates moved theirs, although its "
        f"gradients are normal (norm {own.details['grad_norm']:.3g}): the learning rate is 0 in every param group "
        "that holds them: set it (check the scheduler's warmup)."
    )


def test_a_generators_stall_whose_reading_falls_on_its_lr_0_iterations_is_told(tmp_path, _gan):
    """n_critic 4, the generator's gradients cleared before every step, its lr 0 at iterations 0-1 and then at every
    odd one (a scheduler stepped per iteration): the scheduled readings take its updates of the odd iterations only,
    each made at lr 0 and read once the lr is 1 again, so the hold of a warmup from lr 0 kept its stall from being
    told at all (300 steps). The hold lasts 2 x STALL_UPDATES still updates at most: told at its tenth (its step 89's),
    from the lr those were made with (0: the readings' own; the cleared gradients of its lr-1 steps are not read)."""
    tdbg = _gan(tmp_path, schedule_g=lambda s: 0.0 if s < 2 else float(s % 2 == 0), iterations=60, clear_g=True)
    assert _stalls(tdbg) == [(90, GENERATOR)]
    d = _serious(tdbg)[0].details
    assert (d["reason"], d["lr"], d["first_step"], d["last_step"], d["updates"]) == ("lr_zero", 0.0, 4, 89, 10)
