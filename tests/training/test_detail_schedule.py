"""The per-module figures on a schedule (``training.step.detail``): the first monitored steps, then one
in ``DETAIL_EVERY``, and every step after one that found something. The global checks stay every
step: a fault planted on a step off the schedule is named at its step and module; the applied update
read on a scheduled step is the previous step's, against a naive reference."""

import math

import pytest
import torch

from diffusion_debug import DebugConfig, TrainingDebugger
from diffusion_debug.training.step.detail import DETAIL_EVERY, DETAIL_FIRST, DetailSchedule

STEPS = DETAIL_FIRST + 2 * DETAIL_EVERY + 1  # past the first steps: two scheduled steps and quiet ones


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))  # blocks <= 128


def _scheduled(step):
    """Whether the 0-based ``step`` (the ``step + 1``-th monitored one) is on the schedule, with no trouble."""
    return DetailSchedule()(step + 1)


def _train(model, tdbg, steps, plant=None, weights=None):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    infos = []
    for step in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if plant is not None:
            plant(step, model)
        infos.append(tdbg.monitor_training_step(loss, optimizer=optimizer, step=step))
        if weights is not None:  # each module's weights before this step's update
            weights.append({name: [p.detach().clone() for p in m.parameters()] for name, m in _modules(model)})
        optimizer.step()
        optimizer.zero_grad()
    return infos


def _modules(model):
    return [(name, m) for name, m in model.named_modules() if name and list(m.parameters(recurse=False))]


def _config(tmp_path, **kwargs):
    return DebugConfig(output_dir=str(tmp_path), log_level="error", memory_tracking=False, **kwargs)


def test_a_clean_run_reads_the_per_module_figures_on_the_scheduled_steps_only(tmp_path):
    model = _model()
    tdbg = TrainingDebugger(model, config=_config(tmp_path))
    weights = []
    infos = _train(model, tdbg, STEPS, weights=weights)
    assert [i["step"] for i in infos if "module_grad_norms" in i] == [s for s in range(STEPS) if _scheduled(s)]
    # the applied update: from the second step, then on the scheduled steps, each the previous step's
    assert [i["step"] for i in infos if "applied_update_ratio" in i] == [s for s in range(1, STEPS) if _scheduled(s)]
    assert all(math.isfinite(i["grad_norm"]) for i in infos)  # the global norm every step
    late = max(s for s in range(STEPS) if _scheduled(s))
    assert not _scheduled(late - 1)  # its blocks were kept at a step off the schedule
    for name, _ in _modules(model):  # naive: ||w(late) - w(late - 1)|| / ||w(late - 1)||, whole modules
        before, after = weights[late - 1][name], weights[late][name]
        change = math.sqrt(sum(float((a - b).double().pow(2).sum()) for a, b in zip(after, before)))
        norm = math.sqrt(sum(float(b.double().pow(2).sum()) for b in before))
        assert infos[late]["applied_update_ratio"][name] == pytest.approx(change / norm, rel=1e-5)
    tdbg.close()


def test_a_nan_gradient_planted_off_the_schedule_is_named_at_its_step_and_module(tmp_path):
    quiet = next(s for s in range(DETAIL_FIRST, STEPS) if not _scheduled(s))

    def plant(step, model):
        if step == quiet:
            model[2].weight.grad[0, 3] = float("nan")

    model = _model()
    tdbg = TrainingDebugger(model, config=_config(tmp_path))
    infos = _train(model, tdbg, quiet + 3, plant=plant)
    a = [a for a in tdbg.report().anomalies if a.kind == "nonfinite"][0]  # then its consequences, linked to it
    assert (a.step, a.parameter, a.module, a.severity) == (quiet, "2.weight", "2", "error")
    assert "module_grad_norms" in infos[quiet]  # found something: its module norms read too
    assert all("module_grad_norms" in i for i in infos[quiet + 1 :])  # and the steps after it
    tdbg.close()


def test_an_explosion_planted_off_the_schedule_names_its_module_at_its_step(tmp_path):
    quiet = next(s for s in range(DETAIL_FIRST, STEPS) if not _scheduled(s))
    planted = {}

    def plant(step, model):
        if step == quiet:
            model[0].weight.grad.mul_(1e6)
            planted.update({name: [p.grad.double().clone() for p in m.parameters()] for name, m in _modules(model)})

    model = _model()
    tdbg = TrainingDebugger(model, config=_config(tmp_path, grad_explosion_threshold=1e3))
    infos = _train(model, tdbg, quiet + 1, plant=plant)
    (a,) = [a for a in tdbg.report().anomalies if a.kind == "gradient_explosion"]
    assert (a.step, a.module) == (quiet, "0")
    assert list(a.details["top_module_grad_norms"])[0] == "0"
    # the module norms this light step made once it found something (of the kept per-gradient norms,
    # squared there), and the global norm: naive references, the root of the summed squares
    naive = {name: math.sqrt(sum(float(g.square().sum()) for g in grads)) for name, grads in planted.items()}
    assert a.details["top_module_grad_norms"] == pytest.approx(naive, rel=1e-6)
    assert infos[quiet]["grad_norm"] == pytest.approx(math.sqrt(sum(n * n for n in naive.values())), rel=1e-6)
    tdbg.close()


def _two_optimizers(tmp_path, order, spike_at=None):
    """A GAN's two models, each under its own SGD, monitored before each optimizer's step with it: ``order``, the
    optimizer of each monitored step (``"d"`` or ``"g"``). ``spike_at``: that step's loss is shown a million times
    larger (a ``loss_spike``: the steps after it read in full, on this rank alone under several processes).
    The monitored steps (0-based) that read the per-module figures."""
    torch.manual_seed(0)
    generator = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    discriminator = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt_d = torch.optim.SGD(discriminator.parameters(), lr=1e-2)
    opt_g = torch.optim.SGD(generator.parameters(), lr=1e-2)
    config = _config(tmp_path, stream_events=False)
    tdbg = TrainingDebugger({"generator": generator, "discriminator": discriminator}, config=config)
    data, detailed = torch.Generator().manual_seed(1), []
    softplus = torch.nn.functional.softplus
    for step, which in enumerate(order):
        real, fake = torch.randn(16, 4, generator=data) + 3, generator(torch.randn(16, 4, generator=data))
        optimizer = opt_d if which == "d" else opt_g
        optimizer.zero_grad()
        if which == "d":
            loss = softplus(-discriminator(real)).mean() + softplus(discriminator(fake.detach())).mean()
        else:
            loss = softplus(-discriminator(fake)).mean()
        loss.backward()
        shown = loss.detach() * 1e6 if step == spike_at else loss
        if "module_grad_norms" in tdbg.monitor_training_step(shown, optimizer=optimizer, step=step):
            detailed.append(step)
        optimizer.step()
    tdbg.close()
    return detailed


@pytest.mark.parametrize(
    ("cycle", "count"),
    [
        (["d", "g"], 38),
        (["d"] * 2 + ["g"], 44),
        (["d"] * 3 + ["g"], 47),
        (["d"] * 4 + ["g"], 38),
        (["d"] * 5 + ["g"], 49),
        (["d"] * 20 + ["g"] * 20, 46),
    ],
)
def test_two_optimizers_read_each_refresh_and_one_step_in_five_and_at_most_one_more_per_refresh(
    tmp_path, cycle, count
):
    """Two optimizers take the scheduled readings in turn (a WGAN's n_critic 4 was read at the generator's phase
    alone). The reading waited for a step of the optimizer in turn and not on a weight-norm refresh, itself a
    detailed step: 44, 48 and 51 of the 190 monitored steps past the first ten read at n_critic 2, 3 and 5, not
    38; and in phases of twenty steps an optimizer still live and not given held every reading back (31). A refresh is
    a reading of its five steps, the one between waits four steps at most. A refresh whose step's update is not
    the one in turn keeps a second reading owed, taken at a step in turn within four steps (an optimizer given
    only in the four steps after each refresh was never read): one or two detailed steps in each five, 38 with
    one optimizer, at most 38 + 19."""
    order = (cycle * 200)[:200]
    detailed = _two_optimizers(tmp_path, order)
    late = [s for s in detailed if s >= DETAIL_FIRST]
    assert detailed[:DETAIL_FIRST] == list(range(DETAIL_FIRST))
    assert len([s for s in range(DETAIL_FIRST, 200) if _scheduled(s)]) == 38
    assert len(late) == count
    fives = [len([s for s in late if k <= s < k + DETAIL_EVERY]) for k in range(DETAIL_FIRST, 200, DETAIL_EVERY)]
    assert set(fives) <= {1, 2} and len(fives) == 38
    assert set(range(DETAIL_FIRST, 200, 2 * DETAIL_EVERY)) <= set(late)  # each weight-norm refresh


def test_a_ranks_readings_after_a_finding_do_not_move_its_schedule(tmp_path):
    """The readings after a finding are one rank's (a loss spike there); counted in the turns, that rank read
    other steps from then on than the ranks without it (n_critic 4, a spike at step 22: 35, 40, 41, 45, 50, 51, ...
    against 36, 40, 46, 50, 56, ...). Past the ten steps read in full, the spiked run reads the clean run's steps."""
    order = ((["d"] * 4 + ["g"]) * 20)[:100]
    clean = _two_optimizers(tmp_path / "clean", order)
    spiked = _two_optimizers(tmp_path / "spiked", order, spike_at=22)
    assert [s for s in spiked if s > 22 + 10] == [s for s in clean if s > 22 + 10]
    assert set(range(23, 33)) <= set(spiked)  # the ten after the spike, read in full


def test_the_schedules_refresh_is_the_weight_norms_refresh():
    """Of several optimizers a weight-norm refresh is the scheduled reading of its steps: the two must agree."""
    from diffusion_debug.training.measure.gradients import ModuleNormBook

    assert DetailSchedule().refresh == ModuleNormBook.refresh_every == 2 * DETAIL_EVERY
