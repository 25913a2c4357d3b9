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
