"""A converged run stays quiet (issue 21, item 6): jumps at the noise floor of a fitted loss, and
the tiny gradients of a fitted model, are judged against the run's own early loss scale; a real
spike after convergence is still flagged at its step."""

import math
import statistics

import torch

from diffusion_debug import DebugConfig, TrainingDebugger
from diffusion_debug.record import severity_rank
from diffusion_debug.training.judges.loss_spikes import LossSpikeDetector


def _converging_losses():
    """A loss that falls from ~1 to ~6e-10, sits there with float noise and the issue's jumps
    (5.7e-10 -> 3.8e-9), wobbles 1e-4 -> 5e-4 once (the clean 8-process run's false alarm), and
    has one real spike (0.5) at index 700."""
    generator = torch.Generator().manual_seed(0)
    noise = (1 + 0.2 * torch.randn(1_000, generator=generator)).abs().tolist()
    values = [1.2 * math.exp(-0.11 * i) * noise[i] + 5.7e-10 * noise[i] for i in range(1_000)]
    for i in (300, 420, 555, 810):
        values[i] = 3.8e-9
    values[600:606] = [1e-4, 5e-4, 3e-4, 1e-4, 1e-6, 1e-8]
    values[700] = 0.5
    return values


def test_floor_jumps_are_no_spike_against_the_early_loss_scale_and_a_real_one_is():
    values = _converging_losses()
    detector = LossSpikeDetector(window=50, threshold=6.0, min_ratio=2.0)
    assert [i for i, v in enumerate(values) if detector.update(v).spike] == [700]
    assert detector.early_level == statistics.median(values[:8])
    # judged against the float noise alone (no floor from the early scale), they were alarms
    noisy = LossSpikeDetector(window=50, threshold=6.0, min_ratio=2.0, min_jump=0.0)
    flagged = [i for i, v in enumerate(values) if noisy.update(v).spike]
    assert {555, 601, 700} <= set(flagged)


def test_the_early_level_is_the_median_of_the_first_8_losses_and_converged_is_relative_to_it():
    detector = LossSpikeDetector(window=50, threshold=6.0)
    assert detector.early_level is None and not detector.converged(0.0)
    for v in (4.0, 1.0, 3.0, 2.0, 8.0, 5.0, 7.0, 6.0, 100.0):  # the 9th is not early any more
        detector.update(v)
    assert detector.early_level == 4.5
    assert detector.converged(4.5e-6) and not detector.converged(5e-6) and not detector.converged(math.nan)
    dead = LossSpikeDetector(window=50, threshold=6.0)
    for _ in range(8):
        dead.update(0.0)
    assert not dead.converged(0.0)  # a loss that was 0 from its start never converged: it never learned


def test_overfitting_one_batch_to_convergence_is_quiet_and_a_later_bad_batch_is_a_spike(tmp_path):
    # a 4-64-1 MLP fitting a teacher of its own shape on one batch with AdamW at a constant 1e-2:
    # the loss reaches ~1e-12, with jumps at its floor and a wobble up to ~1e-4 (early level ~0.03)
    torch.manual_seed(5)
    teacher, model = (
        torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)) for _ in "ab"
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        y = teacher(x)
    config = DebugConfig(output_dir=str(tmp_path), log_level="error", memory_tracking=False, stream_events=False)
    tdbg = TrainingDebugger(model, config=config)
    losses = []
    for step in range(1_001):
        target = y + 1.0 if step == 1_000 else y  # a bad batch once converged
        loss = ((model(x) - target) ** 2).mean()
        loss.backward()
        tdbg.monitor_training_step(loss, optimizer=optimizer, step=step)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert min(losses[:1_000]) < 1e-11 and losses[1_000] > 0.5
    serious = [(a.kind, a.step) for a in tdbg.report().anomalies if severity_rank(a.severity) >= 1]
    assert serious == [("loss_spike", 1_000)]
