"""Several optimizers on one plain TrainingDebugger (no Accelerate, no launch): a GAN's discriminator
and generator, each monitored after its own backward with the optimizer that steps next, as the
debugger's TypeError for a list of optimizers tells. Each step judges its own optimizer's gradients
(``training.measure.several_optimizers``)."""

import math

import pytest
import torch

from diffusion_debug import DebugConfig, TrainingDebugger


def _gan(tdbg_of=None, nan_in_dropped_at=None, steps=4):
    """``opt_d.zero_grad(); loss_d.backward(); [monitor]; opt_d.step(); opt_g.zero_grad();
    loss_g.backward(); [monitor]; opt_g.step()``. ``nan_in_dropped_at``: at that iteration a NaN
    in the discriminator's gradient after ``loss_g.backward()`` (its share of the generator's loss,
    which the next ``opt_d.zero_grad()`` drops: the run never applies it). Returns each monitored
    step's measured norm and its own optimizer's (``clip_grad_norm_``'s), and the final weights."""
    torch.manual_seed(0)
    generator = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    discriminator = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt_g = torch.optim.Adam(generator.parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(discriminator.parameters(), lr=1e-4)
    tdbg = tdbg_of({"generator": generator, "discriminator": discriminator}) if tdbg_of else None
    data = torch.Generator().manual_seed(1)
    measured, reference = [], []

    def monitor(loss, optimizer, model, step):
        if tdbg is not None:
            measured.append(tdbg.monitor_training_step(loss, optimizer=optimizer, step=step)["grad_norm"])
            reference.append(float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))))

    for it in range(steps):
        real = torch.randn(16, 4, generator=data) * 3 + 5
        fake = generator(torch.randn(16, 4, generator=data))
        opt_d.zero_grad()
        loss_d = torch.nn.functional.softplus(-discriminator(real)).mean()
        loss_d = loss_d + torch.nn.functional.softplus(discriminator(fake.detach())).mean()
        loss_d.backward()
        monitor(loss_d, opt_d, discriminator, 2 * it)
        opt_d.step()
        opt_g.zero_grad()
        loss_g = torch.nn.functional.softplus(-discriminator(fake)).mean()
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
