"""The cause a one-optimizer stall is told with: the lr its still updates were made with (recorded at the monitored
step whose update each is, as several optimizers' are), not the lr at the report; float32 weights whose every update
is below their rounding step (lr 1e-12) told ``below_precision``, not ``undone_after_step`` (what step() received
decides first); and an lr 0 that a scheduler at its start set (a warmup from 0) waited for up to 2 x STALL_UPDATES
still updates, one of a schedule stepped past its start or set to 0 by hand not."""

import copy
import math

import pytest
import torch

from diffusion_debug import DebugConfig
from diffusion_debug.record import severity_rank
from diffusion_debug.training.judges.stall_causes import diagnose
from diffusion_debug.training.measure.gradients import TrainableParameters

pytestmark = pytest.mark.usefixtures("only_the_tests_objects")


def _config(tmp_path):
    return DebugConfig(output_dir=str(tmp_path), log_level="error", memory_tracking=False, stream_events=False)


def _serious(tdbg):
    return [a for a in tdbg.report().anomalies if severity_rank(a.severity) >= 1]


def _stall_text(d, cause):
    return (
        f"No weight moved in the {d['updates']} optimizer steps {d['first_step']}-{d['last_step']} (the largest "
        f"update 0x a module's norm) although the gradients are normal (norm {d['grad_norm']:.3g}): {cause}."
    )


LR_ZERO = "the learning rate is 0 in every param group that holds them: set it (check the scheduler's warmup)"


def test_one_optimizer_at_lr_0_for_five_steps_then_raised_is_told_lr_zero(tmp_path, unet_loop):
    """AdamW at lr 0 for steps 0-4, its lr set to 1e-4 by hand after step 4's step: the stall (the updates of steps
    0-4) is clear at step 5, where the lr is 1e-4 already. Read then, it was ``undone_after_step`` ("something after
    step() puts them back"); read from the lr each still update was made with, 0: ``lr_zero``."""

    def raise_lr(step, unet, optimizer):
        if step == 4:
            optimizer.param_groups[0]["lr"] = 1e-4

    tdbg, losses = unet_loop(_config(tmp_path), 7, lr=0.0, after_step=raise_lr)
    assert len(set(losses[:6])) == 1 and losses[6] != losses[5]  # still at lr 0, learning from step 5's update
    (found,) = _serious(tdbg)
    d = found.details
    assert (found.kind, found.step, d["reason"], d["lr"], d["first_step"], d["last_step"], d["updates"]) == (
        "not_learning",
        5,
        "lr_zero",
        0.0,
        0,
        4,
        5,
    )
    assert found.message == _stall_text(d, LR_ZERO)


def test_float32_weights_whose_updates_round_away_are_told_below_precision(tmp_path, mlp):
    """AdamW at lr 1e-12 on float32 weights (none of them 0: an update of 1e-12 moves a weight at 0): each update,
    about 1e-12 an element, is below half a float32 ulp of every weight, so none moves; the rounding check was fp16/
    bf16's only and the step's reading (the gradients received) made it ``undone_after_step``. An adaptive step moves
    each element by about the lr: its norm lr x sqrt(numel) over the weights' norm is below float32's epsilon / 2."""
    from diffusion_debug import TrainingDebugger

    optimizer = torch.optim.AdamW(mlp.parameters(), lr=1e-12)
    tdbg = TrainingDebugger(mlp, config=_config(tmp_path))
    x, before = torch.randn(8, 4, generator=torch.Generator().manual_seed(0)), copy.deepcopy(mlp.state_dict())
    for step in range(7):
        loss = mlp(x).pow(2).mean()
        loss.backward()
        tdbg.monitor_training_step(loss, optimizer=optimizer, step=step)
        optimizer.step()
        optimizer.zero_grad()
    tdbg.close()
    assert all(torch.equal(before[name], value) for name, value in mlp.state_dict().items())  # rounded away
    (found,) = _serious(tdbg)
    d = found.details
    assert (found.kind, found.step, d["reason"], d["dtype"], d["lr"], d["state_empty"]) == (
        "not_learning",
        5,
        "below_precision",
        "float32",
        1e-12,
        False,
    )
    weight_norm = math.sqrt(sum(float(p.detach().double().square().sum()) for p in mlp.parameters()))
    numel = sum(p.numel() for p in mlp.parameters())
    assert d["step_ratio"] == pytest.approx(1e-12 * max(d["grad_norm"], math.sqrt(numel)) / weight_norm, rel=1e-9)
    assert d["step_ratio"] < torch.finfo(torch.float32).eps / 4
    assert found.message == _stall_text(
        d,
        "the weights are float32 and each update (lr 1e-12) is smaller than their rounding step: raise the learning "
        "rate (check its units and the scheduler's base lr)",
    )


def test_float32_weights_under_sgd_read_the_plain_step_with_its_momentum():
    # SGD: lr x |g| / |w|, with momentum at most |g| / (1 - momentum), read once step() received the gradients (the
    # hook: none cleared, their norm); above float32's epsilon / 4 it is no sure rounding: the update was undone
    model = torch.nn.Linear(64, 64)
    model(torch.ones(16, 64)).pow(2).mean().backward()
    params = TrainableParameters.of(model)
    grad_norm = math.sqrt(sum(float(p.grad.double().square().sum()) for p in model.parameters()))
    weight_norm = math.sqrt(sum(float(p.detach().double().square().sum()) for p in model.parameters()))
    reached = {"held_at_step": 2, "cleared_at_step": 0, "grad_norm_at_step": grad_norm}
    plain, momentum, large = (
        diagnose(torch.optim.SGD(model.parameters(), lr=1e-12), params, grad_norm, reached),
        diagnose(torch.optim.SGD(model.parameters(), lr=1e-12, momentum=0.9), params, grad_norm, reached),
        diagnose(torch.optim.SGD(model.parameters(), lr=1e-3), params, grad_norm, reached),
    )
    assert (plain["reason"], plain["dtype"], plain["state_empty"]) == ("below_precision", "float32", True)
    assert plain["step_ratio"] == pytest.approx(1e-12 * grad_norm / weight_norm, rel=1e-9)
    assert momentum["step_ratio"] == pytest.approx(1e-12 * grad_norm / 0.1 / weight_norm, rel=1e-9)
    assert large["step_ratio"] > torch.finfo(torch.float32).eps / 4 and large["reason"] == "undone_after_step"


def _sgd_pair():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Tanh(), torch.nn.Linear(512, 512))


def test_float32_gradients_cleared_before_step_are_told_cleared_not_below_precision(tmp_path):
    """SGD without momentum at an lr whose plain step lr x |g| / |w| is 0.67 x float32's epsilon / 2 (0.0743, 18.5,
    lr 9.94e-6: 41% of the elements move in a clean step), its gradients cleared between the monitor and step(): the
    step's hook read no gradient, and that reading decides (``gradients_cleared``, as main told it); the float32
    estimate, checked before it, told ``below_precision`` (raise the lr: wrong advice). The estimate runs only where
    the step received the gradients, and below epsilon / 4 (a sure rounding) only."""
    from diffusion_debug import TrainingDebugger

    x = torch.randn(32, 512, generator=torch.Generator().manual_seed(0))
    model = _sgd_pair()
    model(x).pow(2).mean().backward()
    grad_norm = math.sqrt(sum(float(p.grad.double().square().sum()) for p in model.parameters()))
    weight_norm = math.sqrt(sum(float(p.detach().double().square().sum()) for p in model.parameters()))
    lr = 0.67 * torch.finfo(torch.float32).eps / 2 * weight_norm / grad_norm
    model = _sgd_pair()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    tdbg = TrainingDebugger(model, config=_config(tmp_path))
    for step in range(7):
        loss = model(x).pow(2).mean()
        loss.backward()
        tdbg.monitor_training_step(loss, optimizer=optimizer, step=step)
        optimizer.zero_grad()  # the fault: before step()
        optimizer.step()
    tdbg.close()
    (found,) = _serious(tdbg)
    d = found.details
    assert (found.step, d["reason"], d["first_step"], d["last_step"], d.get("cleared_at_step"), "step_ratio" in d) == (
        5,
        "gradients_cleared",
        0,
        4,
        4,
        False,
    )


def _linear(warmup, total):  # transformers' get_linear_schedule_with_warmup(optimizer, warmup, total)'s lambda
    return lambda s: s / max(1, warmup) if s < warmup else max(0.0, (total - s) / max(1, total - warmup))


def _by_hand_at_2(step, optimizer, scheduler):
    if step == 2:
        optimizer.param_groups[0]["lr"] = 0.0


def _saved_at_0(step, optimizer, scheduler):  # a checkpoint: its state_dict() makes the scheduler's __dict__
    if step == 0:
        scheduler.state_dict()


# (lambda, stepped each step, before each step, (step told, first, last, updates)): main's steps, but the unstepped
# warmup's (a scheduler at its start: an epoch's, a GAN iteration's), waited for up to 2 x STALL_UPDATES
SCHEDULED = {
    "linear_ends_at_0": (_linear(1, 3), True, None, (8, 3, 7, 5)),
    "lambda_held_at_0": (lambda s: s // 100, True, None, (5, 0, 4, 5)),
    "set_to_0_by_hand": (lambda s: 1.0, False, _by_hand_at_2, (7, 2, 6, 5)),
    "at_its_start": (lambda s: 0.0, False, None, (10, 0, 9, 10)),
    "at_its_start_saved": (lambda s: 0.0, False, _saved_at_0, (10, 0, 9, 10)),
}


@pytest.mark.parametrize("case", list(SCHEDULED))
def test_one_optimizer_at_lr_0_under_a_scheduler_is_waited_for_only_at_the_schedulers_start(tmp_path, case):
    """AdamW at 1e-4 under a ``LambdaLR`` (kept, as a loop keeps it). Its lr is 0 (from a base above 0, so
    ``initial_lr`` > 0 in the group: every group once any scheduler is built) in each case; only a scheduler not
    stepped since it was built and whose lr 0 is still there can be a warmup from 0 about to go on. gan31 held every
    one up to 2 x STALL_UPDATES readings, one in five steps read after the first ten: a linear schedule ended at 0 from
    step 3 (warmup 1, total 3) was told at 25 (main 8), a lambda s // 100 at 10 (main 5), an lr set to 0 by hand at
    step 2 under an unstepped scheduler at 20 (main 7)."""
    from diffusion_debug import TrainingDebugger

    schedule, stepped, before_step, expected = SCHEDULED[case]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    tdbg = TrainingDebugger(model, config=_config(tmp_path))
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    for step in range(30):
        if before_step is not None:
            before_step(step, optimizer, scheduler)
        loss = model(x).pow(2).mean()
        loss.backward()
        tdbg.monitor_training_step(loss, optimizer=optimizer, step=step)
        optimizer.step()
        optimizer.zero_grad()
        if stepped:
            scheduler.step()
    tdbg.close()
    (found,) = _serious(tdbg)
    d = found.details
    assert (found.step, d["first_step"], d["last_step"], d["updates"]) == expected
    assert (d["reason"], d["lr"]) == ("lr_zero", 0.0)
    assert found.message == _stall_text(d, LR_ZERO)
