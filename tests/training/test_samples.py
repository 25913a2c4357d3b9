"""Per-sample and per-timestep forensics on the tiny SD UNet with AdamW and diffusers' min-SNR
weighting: a loss weight that is NaN at the last timestep of a zero-terminal-SNR schedule is the
headline, named with its timestep and sample; the step's NaN loss names that sample; a sample whose
loss is far above the run's is named with its timestep; clean runs of the same loop stay quiet."""

import copy
import math

import pytest
import torch
from diffusers import DDPMScheduler
from diffusers.training_utils import compute_snr

from diffusion_debug import DebugConfig, TrainingDebugger
from diffusion_debug.record import severity_rank
from diffusion_debug.training.judges.samples import OUTLIER_RATIO, SampleAccumulator, SampleHistory, judge_samples

IDS = ["cat.png", "dog.png", "fox.png", "owl.png"]


def _warnings(anomalies):
    return [a for a in anomalies if severity_rank(a.severity) >= severity_rank("warning")]


@pytest.fixture
def min_snr_loop(_tiny_unet, tmp_path):
    """``run(steps, timesteps_at=..., corrupt=None)``: batch 4, DDPM noise on a zero-terminal-SNR
    schedule, epsilon MSE per sample weighted by min-SNR (gamma 5) as diffusers' scripts do;
    ``timesteps_at(step)`` the batch's timesteps; ``corrupt(step)`` -> (sample index, factor) scales
    that sample's target. Returns the debugger (closed) and every step's per-sample losses."""
    scheduler = DDPMScheduler(num_train_timesteps=1000, rescale_betas_zero_snr=True)

    def run(steps, timesteps_at, corrupt=None, unreduced=False):
        unet = copy.deepcopy(_tiny_unet).train()
        optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-4)
        config = DebugConfig(output_dir=str(tmp_path), log_level="error")
        tdbg = TrainingDebugger(unet, config=config, noise_scheduler=scheduler)
        generator = torch.Generator().manual_seed(0)
        latents = torch.randn(4, unet.config.in_channels, 8, 8, generator=generator)
        context = torch.randn(4, 4, unet.config.cross_attention_dim, generator=generator)
        seen = []
        for step in range(steps):
            timesteps = torch.tensor(timesteps_at(step))
            noise = torch.randn(latents.shape, generator=generator)
            target = noise.clone()
            if corrupt is not None and corrupt(step) is not None:
                index, factor = corrupt(step)
                target[index] *= factor
            noisy = scheduler.add_noise(latents, noise, timesteps)
            snr = compute_snr(scheduler, timesteps)
            weights = torch.stack([snr, 5.0 * torch.ones_like(timesteps)], dim=1).min(dim=1)[0] / snr
            elementwise = (unet(noisy, timesteps, context).sample - target) ** 2  # reduction="none"
            per_sample = elementwise.mean(dim=(1, 2, 3)) * weights
            loss = per_sample.mean()
            loss.backward()
            tdbg.monitor_training_step(
                loss,
                optimizer=optimizer,
                step=step,
                timesteps=timesteps,
                # unreduced: the loss before reduction, [batch, C, H, W], weighted per sample
                per_sample_loss=elementwise * weights[:, None, None, None] if unreduced else per_sample,
                loss_weights=weights,
                sample_ids=IDS,
            )
            if torch.isfinite(loss):
                optimizer.step()
            optimizer.zero_grad()
            seen.append(per_sample.detach().tolist())
        tdbg.close()
        return tdbg, seen

    return run


def _spread(step):
    return [50 + 97 * step, 300 + 31 * step, 600 + 17 * step, 900 - 23 * step]


def test_min_snr_with_zero_terminal_snr_names_the_timestep_whose_weight_is_nan(min_snr_loop):
    tdbg, seen = min_snr_loop(4, lambda step: [120, 480, 999, 730] if step == 2 else _spread(step))
    assert math.isnan(seen[2][2]) and all(math.isfinite(v) for v in seen[2][:2] + seen[2][3:])
    anomalies = tdbg.report().anomalies
    (weight,) = [a for a in anomalies if a.kind == "nonfinite_loss_weight"]
    assert (weight.step, weight.timestep, weight.severity) == (2, 999, "error")
    assert weight.details["timesteps"] == [999]
    assert weight.details["count"] == 1 and weight.details["samples_in_step"] == 4
    (named,) = weight.details["samples"]
    assert (named["sample"], named["timestep"]) == ("fox.png", 999) and math.isnan(named["weight"])
    assert weight.message.startswith(
        "The loss weight is nan at timestep(s) 999 (1 of 4 samples: fox.png (t=999)) at step 2 on rank 0: min-SNR "
        "weighting divides by the SNR, 0 at the last timestep of a zero-terminal-SNR schedule"
    )
    (loss,) = [a for a in anomalies if a.kind == "nonfinite_loss"]
    assert (loss.step, loss.timestep) == (2, 999)
    assert loss.message == (
        "The loss is nan at step 2 on rank 0, from the non-finite loss weight of this step; non-finite in "
        "sample(s) fox.png (t=999)."
    )
    assert tdbg.report().summary["headline"]["kind"] == "nonfinite_loss_weight"
    assert tdbg.report().summary["headline"]["where"] == "model, step 2 (t=999)"
    assert not [a for a in anomalies if a.step != 2]  # the step was not applied: nothing after it


@pytest.mark.parametrize("unreduced", [False, True], ids=["per_sample", "before_reduction"])
def test_an_outlying_sample_is_named_with_its_timestep_and_a_clean_run_stays_quiet(min_snr_loop, unreduced):
    # the loss before reduction (README: "Pass the loss before reduction as per_sample_loss="), one
    # [C, H, W] block a sample, is each sample's mean: the same finding, not a debugger_error every step
    tdbg, seen = min_snr_loop(6, _spread, corrupt=lambda step: (1, 40.0) if step == 5 else None, unreduced=unreduced)
    assert not [a for a in tdbg.report().anomalies if a.kind == "debugger_error"]
    (outlier,) = [a for a in tdbg.report().anomalies if a.kind == "sample_loss_outlier"]
    assert (outlier.step, outlier.timestep, outlier.severity) == (5, _spread(5)[1], "warning")
    (named,) = outlier.details["samples"]
    assert (named["sample"], named["timestep"]) == ("dog.png", _spread(5)[1])
    # against the naive reference: the 90th percentile of every earlier per-sample loss
    earlier = sorted(v for losses in seen[:5] for v in losses)
    p90 = earlier[(9 * len(earlier)) // 10]
    assert outlier.details["p90"] == pytest.approx(p90, rel=1e-9)
    assert named["loss"] == pytest.approx(seen[5][1], rel=1e-6) and named["loss"] > OUTLIER_RATIO * p90
    assert [v for v in seen[5] if v > OUTLIER_RATIO * p90] == [seen[5][1]]
    assert outlier.message.startswith(f"Sample dog.png (t={_spread(5)[1]}) has a loss of ")
    # the batch's loss spikes with it: the outlier is its cause, and the headline
    (spike,) = [a for a in tdbg.report().anomalies if a.kind == "loss_spike"]
    assert spike.step == 5 and spike.details["follows"] == {"kind": "sample_loss_outlier", "rank": 0}
    assert spike.message.endswith(
        ", from the outlying sample(s) of this step (sample_loss_outlier): look at those samples."
    )
    assert len(_warnings(tdbg.report().anomalies)) == 2
    assert tdbg.report().summary["headline"]["kind"] == "sample_loss_outlier"
    clean, _ = min_snr_loop(6, _spread, unreduced=unreduced)
    assert _warnings(clean.report().anomalies) == []


def test_samples_are_added_up_over_micro_steps_and_named_by_an_id_tensor():
    accumulated = SampleAccumulator()
    cpu = torch.device("cpu")
    accumulated.add(cpu, torch.tensor([0.5, 0.25]), torch.tensor([10, 20]), None, torch.tensor([7, 8]))
    accumulated.add(cpu, torch.tensor([0.75, float("inf")]), torch.tensor([30, 999]), None, torch.tensor([9, 11]))
    values = accumulated.device_vector().tolist()
    assert values[:8] == [0.5, 0.25, 0.75, math.inf, 10.0, 20.0, 30.0, 999.0]
    found = judge_samples(values, accumulated.ids, 5, 0, SampleHistory(), accumulated.given)
    assert found.anomalies == []  # the step's NaN loss carries them
    assert found.nonfinite == [{"sample": 11, "timestep": 999, "loss": math.inf}]
    with pytest.raises(ValueError, match="timesteps has 3 values for 2 samples"):
        accumulated.add(cpu, torch.tensor([0.5, 0.6]), torch.tensor([1, 2, 3]), None, None)


def test_a_nonfinite_sample_under_a_finite_step_loss_is_an_error_outlier():
    from types import SimpleNamespace

    from diffusion_debug.training.judges.samples import SampleFindings

    judged = SimpleNamespace(anomalies=[])  # a step's judgement with nothing else in it
    found = SampleFindings([], [{"sample": "#3", "timestep": 12, "loss": math.nan}])
    found.add_to(judged, rank=1, step=4)
    (error,) = judged.anomalies
    assert (error.kind, error.severity, error.step, error.rank, error.timestep) == (
        "sample_loss_outlier",
        "error",
        4,
        1,
        12,
    )
    assert error.message == (
        "Sample #3 (t=12) had a NaN/Inf loss at step 4 on rank 1 although the step's loss was finite (masked or "
        "replaced): check those samples and the loss at their timesteps."
    )


def test_the_samples_ride_in_the_steps_one_transfer(tmp_path, mlp, monkeypatch):
    """As many device-to-host reads (``tolist``, ``item``, ``__float__``) per monitored step with the
    per-sample arguments as without them."""
    reads = []
    for name in ("tolist", "item", "__float__", "__bool__"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(
            torch.Tensor, name, lambda self, *a, _o=original, _n=name, **k: reads.append(_n) or _o(self, *a, **k)
        )

    def reads_per_step(**per_sample):
        optimizer = torch.optim.SGD(mlp.parameters(), lr=0.01)
        tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path), log_level="error"))
        counts = []
        for step in range(3):
            x = torch.linspace(-1, 1, 16).reshape(4, 4) * (step + 1)
            per_sample_loss = (mlp(x).squeeze(1) - x.sum(1)) ** 2
            per_sample_loss.mean().backward()
            del reads[:]
            extra = {k: v(per_sample_loss) for k, v in per_sample.items()}
            tdbg.monitor_training_step(per_sample_loss.mean(), optimizer=optimizer, step=step, **extra)
            counts.append(len(reads))
            optimizer.step()
            optimizer.zero_grad()
        tdbg.close()
        return counts[1:]  # the first step compares the optimizer with the model once

    plain = reads_per_step()
    assert plain == [1, 1]  # the step's one transfer (``step_row.gathered_rows_to_host``)
    assert (
        reads_per_step(
            per_sample_loss=lambda losses: losses,
            timesteps=lambda losses: torch.tensor([1, 2, 3, 4]),
            loss_weights=lambda losses: torch.ones(4),
            sample_ids=lambda losses: ["a", "b", "c", "d"],
        )
        == plain
    )
