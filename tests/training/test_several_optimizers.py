"""Several optimizers on one plain TrainingDebugger (no Accelerate, no launch): a GAN's discriminator
and generator, each monitored after its own backward with the optimizer that steps next, as the
debugger's TypeError for a list of optimizers tells. Each step judges its own optimizer's gradients
(``training.measure.several_optimizers``)."""

import math

import pytest
import torch

from diffusion_debug import DebugConfig, TrainingDebugger


def _models() -> tuple[torch.nn.Module, torch.nn.Module]:
    """The GAN's generator and discriminator, seeded."""
    torch.manual_seed(0)
    generator = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    discriminator = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return generator, discriminator


def _batch(generator: torch.nn.Module, data: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """An iteration's real samples and the generator's fakes."""
    real = torch.randn(16, 4, generator=data) * 3 + 5
    return real, generator(torch.randn(16, 4, generator=data))


def _loss_d(discriminator: torch.nn.Module, real: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
    loss = torch.nn.functional.softplus(-discriminator(real)).mean()
    return loss + torch.nn.functional.softplus(discriminator(fake.detach())).mean()


def _loss_g(discriminator: torch.nn.Module, fake: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.softplus(-discriminator(fake)).mean()


def _norm(parameters) -> float:
    """The naive norm of ``parameters``' gradients (a norm of their norms)."""
    return float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in parameters])))


def _module_norms(model: torch.nn.Module, prefix: str = "") -> dict[str, float]:
    """The naive gradient norm of each child of ``model`` that has parameters, by ``prefix`` + its name."""
    return {
        prefix + name: _norm(m.parameters()) for name, m in model.named_children() if any(True for _ in m.parameters())
    }


def _gan(tdbg_of=None, nan_in_dropped_at=None, steps=4, optimizer=torch.optim.Adam):
    """``opt_d.zero_grad(); loss_d.backward(); [monitor]; opt_d.step(); opt_g.zero_grad();
    loss_g.backward(); [monitor]; opt_g.step()``. ``nan_in_dropped_at``: at that iteration a NaN
    in the discriminator's gradient after ``loss_g.backward()`` (its share of the generator's loss,
    which the next ``opt_d.zero_grad()`` drops: the run never applies it). Returns each monitored
    step's measured norm and its own optimizer's (``clip_grad_norm_``'s), and the final weights."""
    generator, discriminator = _models()
    opt_g = optimizer(generator.parameters(), lr=1e-3)
    opt_d = optimizer(discriminator.parameters(), lr=1e-4)
    tdbg = tdbg_of({"generator": generator, "discriminator": discriminator}) if tdbg_of else None
    data = torch.Generator().manual_seed(1)
    measured, reference = [], []

    def monitor(loss, optimizer, model, step):
        if tdbg is not None:
            measured.append(tdbg.monitor_training_step(loss, optimizer=optimizer, step=step)["grad_norm"])
            reference.append(_norm(model.parameters()))

    for it in range(steps):
        real, fake = _batch(generator, data)
        opt_d.zero_grad()
        loss_d = _loss_d(discriminator, real, fake)
        loss_d.backward()
        monitor(loss_d, opt_d, discriminator, 2 * it)
        opt_d.step()
        opt_g.zero_grad()
        loss_g = _loss_g(discriminator, fake)
        loss_g.backward()  # the discriminator's gradients get loss_g's share too (dropped by its zero_grad)
        if it == nan_in_dropped_at:
            discriminator[0].weight.grad[0, 0] = math.nan
        monitor(loss_g, opt_g, generator, 2 * it + 1)
        opt_g.step()
    weights = [p.detach().clone() for p in (*generator.parameters(), *discriminator.parameters())]
    if tdbg is not None:
        tdbg.close()
    return measured, reference, weights, tdbg


def test_a_gans_two_optimizers_each_judge_their_own_gradients(tmp_path):
    """Each step's gradient norm is its optimizer's own parameters' (the discriminator's step leaves
    out the generator's gradients of its last step, the generator's the discriminator's share of
    ``loss_g``); a NaN in that dropped share, which the run never applies, is no error of the run.
    Before, each step's norm was both models' (14.5 for the discriminator's 1.8 at its second
    step) and that NaN was a ``nonfinite`` error at the generator's step. The weights are those
    of the loop without the debugger."""
    *_, plain, _ = _gan(nan_in_dropped_at=2)
    config = DebugConfig(output_dir=str(tmp_path))
    measured, reference, weights, tdbg = _gan(lambda models: TrainingDebugger(models, config=config), 2)
    assert all(torch.equal(a, b) for a, b in zip(weights, plain))
    assert len(measured) == 8 and measured == pytest.approx(reference, rel=1e-6)
    assert tdbg.report().anomalies == []
    assert tdbg.get_summary()["total_steps"] == 8


def _gan_with_stale_discriminator(tdbg, explode_at: int, steps: int = 3) -> list[dict]:
    """The GAN loop of :func:`_gan` with the discriminator's gradients left large (x1e5: its share of
    ``loss_g``, never zeroed before the generator steps) at every generator step, and at iteration
    ``explode_at`` the generator's last layer's gradient x1e6 (an explosion of the generator's own).
    Returns each generator step's ``info`` with the naive per-module norms of the generator."""
    generator, discriminator = _models()
    opt_g = torch.optim.SGD(generator.parameters(), lr=1e-9)
    opt_d = torch.optim.SGD(discriminator.parameters(), lr=1e-4)
    tdbg = tdbg({"generator": generator, "discriminator": discriminator})
    data = torch.Generator().manual_seed(1)
    out = []
    for it in range(steps):
        real, fake = _batch(generator, data)
        opt_d.zero_grad()
        loss_d = _loss_d(discriminator, real, fake)
        loss_d.backward()
        tdbg.monitor_training_step(loss_d, optimizer=opt_d, step=2 * it)
        opt_d.step()
        opt_g.zero_grad()
        loss_g = _loss_g(discriminator, fake)
        loss_g.backward()
        with torch.no_grad():
            for p in discriminator.parameters():
                p.grad.mul_(1e5)
            if it == explode_at:
                generator[2].weight.grad.mul_(1e6)
        reference = _module_norms(generator)
        info = tdbg.monitor_training_step(loss_g, optimizer=opt_g, step=2 * it + 1)
        out.append({**info, "reference": reference})
        opt_g.step()
    tdbg.close()
    return out


def test_a_generator_steps_explosion_names_a_generator_module_not_the_stale_discriminator(tmp_path):
    """At the generator's step the discriminator still holds large gradients (its share of ``loss_g``:
    1.9e5 at its last layer against the generator's exploded 5.0e4), which the generator's optimizer
    never applies: the explosion is the generator's last layer's, and the step's module norms are the
    generator's alone (a naive per-module norm of its gradients). Before, the module norms were both
    models' and the explosion named ``discriminator`` ``2``, whose gradient its next ``zero_grad`` drops."""
    config = DebugConfig(output_dir=str(tmp_path))
    tdbg = None

    def make(models):
        nonlocal tdbg
        tdbg = TrainingDebugger(models, config=config)
        return tdbg

    infos = _gan_with_stale_discriminator(make, explode_at=1)
    explosions = [a for a in tdbg.report().anomalies if a.kind == "gradient_explosion"]
    assert [(a.step, a.component, a.module) for a in explosions] == [(3, "generator", "2")]
    top = explosions[0].details["top_module_grad_norms"]
    assert list(top) == ["generator.2", "generator.0"]
    for info in infos:  # every generator step: the generator's modules only, at their naive norms
        assert set(info["module_grad_norms"]) == {"generator.0", "generator.2"}
        assert [info["module_grad_norms"][f"generator.{m}"] for m in ("0", "2")] == pytest.approx(
            [info["reference"][m] for m in ("0", "2")], rel=1e-6
        )
    assert top["generator.2"] == pytest.approx(infos[1]["reference"]["2"], rel=1e-6)


def test_a_param_group_added_mid_run_is_judged_at_its_optimizers_step_only(tmp_path):
    """A text encoder that feeds the generator, watched and trained from the start but stepped by
    no optimizer until ``opt_g.add_param_group`` at iteration 2 (then the generator's): a NaN in
    its gradient at iteration 3's generator step is named there, at its exact parameter, and not
    again at the discriminator's next step, where it is the stale gradient ``opt_g.zero_grad``
    drops. Before, each optimizer's parameters left to the other were kept from the first step
    they were seen: the discriminator's next step judged it too (the error folded over steps 7-8,
    two NaN steps in the summary)."""
    torch.manual_seed(0)
    encoder = torch.nn.Linear(4, 4)
    generator = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    discriminator = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt_g = torch.optim.SGD(generator.parameters(), lr=1e-3)
    opt_d = torch.optim.SGD(discriminator.parameters(), lr=1e-3)
    models = {"text_encoder": encoder, "generator": generator, "discriminator": discriminator}
    tdbg = TrainingDebugger(models, config=DebugConfig(output_dir=str(tmp_path)))
    data = torch.Generator().manual_seed(1)
    nonfinite_counts = []
    for it in range(5):
        if it == 2:
            opt_g.add_param_group({"params": list(encoder.parameters()), "lr": 1e-4})
        real = torch.randn(16, 4, generator=data) * 3 + 5
        fake = generator(encoder(torch.randn(16, 4, generator=data)))
        opt_d.zero_grad()
        loss_d = _loss_d(discriminator, real, fake)
        loss_d.backward()
        info = tdbg.monitor_training_step(loss_d, optimizer=opt_d, step=2 * it)
        nonfinite_counts.append(info["nonfinite_parameters"])
        opt_d.step()
        opt_g.zero_grad()
        encoder.zero_grad()
        loss_g = _loss_g(discriminator, fake)
        loss_g.backward()
        if it == 3:
            encoder.weight.grad[1, 2] = math.nan
        info = tdbg.monitor_training_step(loss_g, optimizer=opt_g, step=2 * it + 1)
        nonfinite_counts.append(info["nonfinite_parameters"])
        if it != 3:
            opt_g.step()
    tdbg.close()
    errors = [a for a in tdbg.report().anomalies if a.severity == "error"]
    assert [(a.kind, a.step, a.component, a.parameter) for a in errors] == [("nonfinite", 7, "text_encoder", "weight")]
    assert errors[0].details.get("count", 1) == 1 and "last_step" not in errors[0].details
    assert nonfinite_counts == [0, 0, 0, 0, 0, 0, 0, 1, 0, 0]
    assert tdbg.get_summary()["nonfinite_steps"] == 1


def test_each_modules_last_norm_in_the_report_is_the_one_of_its_own_optimizers_last_step(tmp_path):
    """The report's last gradient norm of a module is the one its own optimizer's last step read
    (the discriminator's at the last discriminator step: the naive norm of its gradients then),
    as the module health's last reading is. Before, the generator's last step left the
    discriminator's modules NaN in ``module_grad_norm_last`` (null in the report's table) while
    ``module_grad_log10_last`` kept their last reading."""
    generator, discriminator = _models()
    opt_g = torch.optim.SGD(generator.parameters(), lr=1e-3)
    opt_d = torch.optim.SGD(discriminator.parameters(), lr=1e-3)
    models = {"generator": generator, "discriminator": discriminator}
    tdbg = TrainingDebugger(models, config=DebugConfig(output_dir=str(tmp_path)))
    data = torch.Generator().manual_seed(1)
    last = {}  # each module's naive gradient norm at its own optimizer's last step

    for it in range(3):
        real, fake = _batch(generator, data)
        opt_d.zero_grad()
        loss_d = _loss_d(discriminator, real, fake)
        loss_d.backward()
        last.update(_module_norms(discriminator, "discriminator."))
        tdbg.monitor_training_step(loss_d, optimizer=opt_d, step=2 * it)
        opt_d.step()
        opt_g.zero_grad()
        loss_g = _loss_g(discriminator, fake)
        loss_g.backward()
        last.update(_module_norms(generator, "generator."))
        tdbg.monitor_training_step(loss_g, optimizer=opt_g, step=2 * it + 1)
        opt_g.step()
    tdbg.close()
    model = tdbg.report().components["model"]
    assert list(model["module_grad_norm_last"]) == list(last)[2:] + list(last)[:2]  # the watched order
    assert model["module_grad_norm_last"] == pytest.approx(last, rel=1e-6)
    assert model["module_grad_log10_last"] == {name: round(math.log10(v), 2) for name, v in last.items()}


def test_each_optimizers_mask_of_judged_parameters_is_made_once(tmp_path, monkeypatch):
    """The mask of the parameters a step judges is made once per optimizer (a list over every
    parameter and a copy to the device, pinned on a GPU), not at every step of a GAN whose steps
    alternate between the two: four iterations make two masks, the generator's and the
    discriminator's. Before, the one mask kept was the last step's, so each step made its own (7)."""
    from diffusion_debug.training.measure import step_measurer

    made = []
    to_device = step_measurer.to_device

    def counted(values, dtype, device):
        made.append(dtype) if dtype is torch.bool else None
        return to_device(values, dtype, device)

    monkeypatch.setattr(step_measurer, "to_device", counted)
    config = DebugConfig(output_dir=str(tmp_path))
    measured, reference, *_ = _gan(lambda models: TrainingDebugger(models, config=config))
    assert measured == pytest.approx(reference, rel=1e-6)
    assert len(made) == 2


def test_each_optimizers_modules_groups_are_worked_out_once(tmp_path, monkeypatch):
    """The param group of each module (the update ratios' learning rates) is worked out once per
    optimizer, not at every step of a GAN (a loop over every parameter): four iterations, each step
    with module norms, work out two. Before, the one kept was the last step's optimizer's (7). SGD's: the
    learning rates serve the lr x gradient / weight estimate, made only for a gradient step (an Adam's has
    none, and works out no group)."""
    from diffusion_debug.training.measure.gradients import ModuleNormBook

    made = []
    group_of_modules = ModuleNormBook._group_of_modules

    def counted(self, param_groups, params):
        made.append(id(param_groups))
        return group_of_modules(self, param_groups, params)

    monkeypatch.setattr(ModuleNormBook, "_group_of_modules", counted)
    config = DebugConfig(output_dir=str(tmp_path))
    measured, reference, *_ = _gan(lambda models: TrainingDebugger(models, config=config), optimizer=torch.optim.SGD)
    assert measured == pytest.approx(reference, rel=1e-6)
    assert len(made) == 2 and len(set(made)) == 2


def _gan_one_step_number(tmp_path, fail_recording_at=None):
    """D then G monitored under one step number (``step=it``), policy ``skip``, a NaN in G's gradients at
    iteration 1 (its loss finite). ``fail_recording_at``: the monitored call (1-based) whose ``add_step`` raises
    (the record failed: the call adds no row). Returns the kept rows, the run directory and the events."""
    from diffusion_debug.record import read_jsonl

    generator, discriminator = _models()
    opts = {"D": torch.optim.SGD(discriminator.parameters(), lr=1e-4), "G": torch.optim.SGD(generator.parameters())}
    config = DebugConfig(output_dir=str(tmp_path), policy="skip")
    tdbg = TrainingDebugger({"generator": generator, "discriminator": discriminator}, config=config)
    add_step, calls = tdbg.record.add_step, []

    def failing(row, **named):
        calls.append(row)
        if len(calls) == fail_recording_at:
            raise OSError("disk full")
        return add_step(row, **named)

    tdbg.record.add_step = failing
    data, actions = torch.Generator().manual_seed(1), []
    for it in range(2):
        real, fake = _batch(generator, data)
        for name, loss in (
            ("D", lambda: _loss_d(discriminator, real, fake)),
            ("G", lambda: _loss_g(discriminator, fake)),
        ):
            opts[name].zero_grad()
            loss().backward()
            if (name, it) == ("G", 1):
                generator[0].weight.grad[0, 0] = math.nan
            actions.append(tdbg.monitor_training_step(loss(), optimizer=opts[name], step=it).get("policy_action"))
            opts[name].step()
    kept, run_dir = [dict(row) for row in tdbg.record.steps], tdbg.record.run_dir
    tdbg.close()
    assert actions == [None, None, None, "skip"]  # G's step 1 alone
    return kept, run_dir, read_jsonl(run_dir / "events.jsonl")


def test_a_policy_skip_marks_its_own_optimizer_s_row_by_its_monitored_step(tmp_path):
    """A GAN's D and G monitored under one step number, policy ``skip``, a NaN in G's gradients at step 1: G's row
    of step 1 says ``skipped: policy``, D's not, in the kept rows and the stream alike; its ``step_skipped`` names
    that row's monitored step (4), which the main process's copy of it is matched by (``RankFiles`` keys the entry
    by it: without it, ``(rank, 1, None)`` named no copy, and a rank's policy skip never reached the main's)."""
    from diffusion_debug.record.run_dir import every_rank_steps

    kept, run_dir, events = _gan_one_step_number(tmp_path)
    truth = [None, None, None, "policy"]
    assert [row["step"] for row in kept] == [0, 0, 1, 1]
    assert [row.get("skipped") for row in kept] == truth
    assert [row.get("skipped") for row in every_rank_steps(run_dir)] == truth
    (skip,) = [e for e in events if e["type"] == "step_skipped"]
    assert (skip["step"], skip["joined"], skip["reason"]) == (1, 4, "policy")


def test_a_policy_skip_at_a_call_whose_row_was_not_recorded_marks_no_other_optimizer_s_row(tmp_path):
    """The same loop, G's step-1 call failing to record its row (``add_step`` raised: a ``debugger_error``): the
    policy still skips it (its gradients zeroed, its ``policy_skip`` event) and marks no row: D's row of step 1,
    the last row of that step number, stays unmarked. Before, the skip marked D's row (``mark_skipped`` with no
    monitored step took the last row of step 1)."""
    kept, run_dir, events = _gan_one_step_number(tmp_path, fail_recording_at=4)
    assert [(row["step"], row.get("skipped")) for row in kept] == [(0, None), (0, None), (1, None)]
    assert [e["type"] for e in events if e["type"] in ("step_skipped", "policy_skip")] == ["policy_skip"]
    assert [e["details"]["where"] for e in events if e.get("kind") == "debugger_error"] == ["recording"]
