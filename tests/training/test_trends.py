"""Slow divergence (issue 21, item 3): a loss whose median-of-halves trend rises beyond its own
noise is ``loss_divergence`` at the step it became clear, with the window and slope; flat, noisy,
heavy-tailed, decreasing and converged losses, and a single spike, are not."""

import copy
import math
import random
import statistics

import pytest
import torch

from diffusion_debug import DebugConfig, TrainingDebugger
from diffusion_debug.record import severity_rank
from diffusion_debug.training.judges.trends import MIN_LOSSES, RISE_RATIO, RISE_SCORE, TREND_WINDOW, LossTrend


def _reference(losses, early_level):
    """The rule written out plainly: the first step whose window of the last 50 losses (20 at
    least) has its later half's median >= 1.5 x the earlier half's, the later half's order
    statistic ceil(3 sqrt(k) / 2) below its median above the earlier half's as many above, and a
    rise above 1% of the early level."""
    for end in range(MIN_LOSSES, len(losses) + 1):
        window = losses[max(0, end - TREND_WINDOW) : end]
        k = len(window) // 2
        early, late = window[:k], window[len(window) - k :]
        reach = math.ceil(RISE_SCORE * math.sqrt(k) / 2)
        low_late = sorted(late)[max(0, (k - 1) // 2 - reach)]
        high_early = sorted(early)[min(k - 1, k // 2 + reach)]
        before, after = statistics.median(early), statistics.median(late)
        if after >= RISE_RATIO * before and low_late > high_early and after - before > 0.01 * early_level:
            return end - 1, dict(
                median_before=before, median_after=after, bound_before=high_early, bound_after=low_late
            )
    return None, None


def _first(losses, early_level):
    trend = LossTrend()
    for i, v in enumerate(losses):
        found = trend.update(i, v, early_level)
        if found is not None:
            return i, found
    return None, None


@pytest.mark.parametrize("sigma", [0.05, 0.1, 0.3])
def test_a_noisy_tripling_is_found_where_the_plain_rule_finds_it(sigma):
    rng = random.Random(7)
    losses = [3 ** (i / 50) * math.exp(rng.gauss(0, sigma)) for i in range(80)]
    step, found = _first(losses, early_level=1.0)
    expected_step, expected = _reference(losses, 1.0)
    assert step == expected_step and step is not None and 25 <= step <= 60
    d = found.details()
    assert {k: d[k] for k in expected} == pytest.approx(expected)
    window = min(step + 1, TREND_WINDOW)
    assert (d["window_steps"], d["from_step"], d["to_step"]) == (window, step + 1 - window, step)
    assert d["slope_per_step"] == pytest.approx((d["median_after"] - d["median_before"]) / (window - window // 2))


def test_flat_heavy_tailed_decreasing_and_converged_losses_and_a_spike_stay_quiet():
    rng = random.Random(3)
    series = {
        "heavy-tailed": [rng.expovariate(1.0) * rng.choice([1, 1, 1, 5]) for _ in range(3_000)],
        "timestep spread": [10 ** rng.uniform(-2, 0) for _ in range(3_000)],
        "decreasing": [0.1 + math.exp(-i / 300) + rng.gauss(0, 0.02) for i in range(3_000)],
        # falls to ~6e-10 and jumps at the floor (5.7e-10 -> 3.8e-9): tiny against the early level
        "converged": [
            1.2 * math.exp(-0.11 * i) + 5.7e-10 * (3.8e-9 / 5.7e-10 if i % 97 == 0 else 1) for i in range(999)
        ],
        "one spike": [1.0 + 0.05 * math.sin(i) + (9.0 if i == 60 else 0.0) for i in range(200)],
    }
    for name, losses in series.items():
        early = statistics.median(losses[:8])
        assert _first(losses, early) == (None, None), name
        assert _reference(losses, early) == (None, None), name


def test_the_trend_is_judged_again_only_after_it_fell_back():
    up = [1.0 + 0.1 * i for i in range(40)]
    down = [up[-1] - 0.2 * i for i in range(1, 20)]
    trend = LossTrend()
    flagged = [i for i, v in enumerate(up + down + up) if trend.update(i, v, 1.0) is not None]
    assert len(flagged) == 2 and flagged[0] == _reference(up, 1.0)[0] and flagged[1] > len(up + down)
    steady = LossTrend()  # a rise that goes on is reported once
    assert sum(steady.update(i, 1.0 + 0.1 * i, 1.0) is not None for i in range(300)) == 1


def _noisy_loop(tmp_path, unet, growth, steps):
    """A fresh batch of noise, latents and timesteps every step on the tiny UNet at lr 1e-5 (its
    loss barely moves), the loss scaled by ``growth ** (step / 50)``."""
    unet = copy.deepcopy(unet).train()
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-5)
    config = DebugConfig(output_dir=str(tmp_path), log_level="error", memory_tracking=False, stream_events=False)
    tdbg = TrainingDebugger(unet, config=config)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for step in range(steps):
        sample = torch.randn(1, unet.config.in_channels, 8, 8, generator=generator)
        context = torch.randn(1, 4, unet.config.cross_attention_dim, generator=generator)
        noise = torch.randn(sample.shape, generator=generator)
        timesteps = torch.randint(0, 1000, (1,), generator=generator)
        loss = ((unet(sample, timesteps, context).sample - noise) ** 2).mean() * growth ** (step / 50)
        loss.backward()
        tdbg.monitor_training_step(loss, optimizer=optimizer, step=step, timesteps=timesteps)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    tdbg.close()
    return tdbg, losses


def test_a_loss_tripling_over_50_steps_is_divergence_at_the_step_it_became_clear(tmp_path, _tiny_unet):
    tdbg, losses = _noisy_loop(tmp_path / "diverging", _tiny_unet, 3.0, 41)
    early = statistics.median(losses[:8])
    expected_step, expected = _reference(losses, early)
    serious = [a for a in tdbg.report().anomalies if severity_rank(a.severity) >= 1]
    assert [(a.kind, a.step, a.component) for a in serious] == [("loss_divergence", expected_step, "model")]
    assert not any(a.kind == "loss_spike" for a in tdbg.report().anomalies)  # no single step jumped
    d = serious[0].details
    assert {k: d[k] for k in expected} == pytest.approx(expected)
    assert serious[0].message == (
        f"The loss has been rising over steps {d['from_step']}-{expected_step} without a single spike: its median "
        f"went from {d['median_before']:.4g} to {d['median_after']:.4g} (x{d['rise_ratio']:.3g}, "
        f"{d['slope_per_step']:.3g} per step; beyond its noise: the later half's lower bound {d['bound_after']:.4g} "
        f"is above the earlier half's upper bound {d['bound_before']:.4g}): lower the learning rate or check the "
        "schedule and the data of that window."
    )
    assert tdbg.get_summary()["loss_anomalies"] == 1

    clean, clean_losses = _noisy_loop(tmp_path / "clean", _tiny_unet, 1.0, 41)
    assert [a for a in clean.report().anomalies if severity_rank(a.severity) >= 1] == []
    assert max(clean_losses) / min(clean_losses) > 1.2  # a noisy loss, judged quiet
