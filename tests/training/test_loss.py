"""loss: spike detector, timestep buckets, the step's accumulated loss."""

import math

import pytest
import torch

from diffusion_debug.training.judges.loss_spikes import LossSpikeDetector
from diffusion_debug.training.measure.loss import LossAccumulator, TimestepBuckets, num_train_timesteps


def test_spike_detector_needs_history_and_ignores_nonfinite():
    detector = LossSpikeDetector(window=20, threshold=6.0)
    assert not detector.update(100.0).spike  # no history yet
    assert detector.update(float("nan")).median is None and len(detector.history) == 1


def test_buckets_equal_a_naive_reference():
    buckets = TimestepBuckets(4, 1000)
    timesteps = torch.tensor([0, 249, 250, 999, 999])
    per_sample = torch.tensor([1.0, 2.0, 3.0, float("nan"), 5.0])
    buckets.add(buckets.device_vector(timesteps, torch.tensor(0.0), per_sample, torch.device("cpu")).tolist())
    summary = buckets.summary()
    assert [b["count"] for b in summary] == [2, 1, 0, 1]
    assert [b["nonfinite"] for b in summary] == [0, 0, 0, 1]
    assert [b["mean_loss"] for b in summary] == [1.5, 3.0, None, 5.0]
    assert summary[1]["timesteps"] == [250, 500]


@pytest.mark.parametrize("value", [2.5, -0.0, 1e308, float("nan"), float("inf"), float("-inf")])
def test_a_scalar_losss_buckets_are_the_per_sample_ones_bit_for_bit(value):
    # train18: a scalar loss's column (loss, 1, 0) or (0, 0, 1) in four ops; the per-sample path (six) is the reference
    buckets = TimestepBuckets(4, 1000)
    timesteps, cpu = torch.tensor([0, 249, 250, 999, 999, 600]), torch.device("cpu")
    loss = torch.tensor(value, dtype=torch.float64)
    scalar = buckets.device_vector(timesteps, loss, None, cpu)
    reference = buckets.device_vector(timesteps, loss, loss.expand(6), cpu)
    assert scalar.dtype == reference.dtype == torch.float64
    assert [(v, math.copysign(1.0, v)) for v in scalar.tolist()] == [
        (v, math.copysign(1.0, v)) for v in reference.tolist()
    ]


def test_integer_timesteps_take_the_bucket_the_float_formula_gives():
    # integer timesteps are bucketed in integers (three ops fewer a step): the same bucket as
    # floor(t * buckets / num_train_timesteps) in float64, clamped, below 0 and past the end too
    t = torch.arange(-3, 1203)
    for count, total in ((4, 1000), (7, 1000), (3, 999), (10, 1)):
        naive = [min(max(math.floor(v * count / total), 0), count - 1) for v in t.tolist()]
        rows = []
        for timesteps in (t, t.int(), t.double()):
            buckets = TimestepBuckets(count, total)
            buckets.add(buckets.device_vector(timesteps, torch.tensor(2.0), None, torch.device("cpu")).tolist())
            rows.append(buckets.count)
        assert rows == [[naive.count(b) for b in range(count)]] * 3


def test_a_one_micro_step_loss_is_its_own_mean_and_a_nonfinite_loss_counts_in_its_buckets():
    acc = LossAccumulator()
    buckets = TimestepBuckets(2, 1000)
    loss = torch.tensor(float("-inf"))
    acc.add(loss, torch.device("cpu"), buckets, torch.tensor([10, 900, 901]))
    assert acc.mean().item() == float("-inf") and acc.bucket_sum.tolist() == [0.0, 0.0, 0.0, 0.0, 1.0, 2.0]
    acc.add(torch.tensor([1.0, float("nan")]), torch.device("cpu"), buckets, torch.tensor([10, 900]))
    assert math.isnan(acc.mean().item()) and acc.bucket_sum.tolist() == [0.0, 0.0, 0.0, 0.0, 2.0, 3.0]


def test_accumulator_averages_micro_steps_and_counts_samples():
    acc = LossAccumulator()
    buckets = TimestepBuckets(2, 1000)
    acc.add(torch.tensor([1.0, 3.0]), torch.device("cpu"), buckets, torch.tensor([10, 900]))
    acc.add(4.0, torch.device("cpu"), buckets, batch_size=3)
    assert acc.mean().item() == pytest.approx(3.0) and acc.count == 2 and acc.samples == 5
    assert acc.bucket_sum.tolist() == [2.0, 2.0, 1.0, 1.0, 0.0, 0.0]  # the scalar loss 2.0 per sample
    acc.reset()
    assert (acc.loss_sum, acc.count, acc.bucket_sum, acc.samples) == (None, 0, None, 0)


def test_num_train_timesteps_from_a_scheduler_config():
    class Config:
        num_train_timesteps = 500

    class Scheduler:
        config = Config()

    class DictScheduler:
        config = {"num_train_timesteps": 300}

    assert num_train_timesteps(Scheduler()) == 500
    assert num_train_timesteps(DictScheduler()) == 300
    assert num_train_timesteps(None) == 1000


def test_spike_detector_judges_from_the_third_loss():
    detector = LossSpikeDetector(window=50, threshold=6.0, min_ratio=2.0)
    assert [detector.update(v).spike for v in (1.0, 1.1)] == [False, False]
    assert detector.update(40.0).spike  # the third loss is judged


def test_no_spike_on_a_healthy_adam_regression_of_60_steps():
    # fresh random batches, Adam at lr 1e-3: noisy early losses and a falling trend, no spike
    for seed in range(10):
        torch.manual_seed(seed)
        detector = LossSpikeDetector(window=50, threshold=6.0, min_ratio=2.0)
        w = torch.randn(8, 1) * 3
        model = torch.nn.Linear(8, 1)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        for step in range(60):
            x = torch.randn(16, 8)
            loss = ((model(x) - (x @ w + 0.5 * torch.randn(16, 1))) ** 2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            assert not detector.update(loss.item()).spike, (seed, step)


def test_no_spike_in_10000_converged_steps_and_a_real_one_is_flagged_at_its_step():
    generator = torch.Generator().manual_seed(0)
    values = (6e-10 * (1 + 0.1 * torch.randn(10_000, generator=generator))).tolist()
    values[7_000] = 6e-8  # a real spike: 100x
    detector = LossSpikeDetector(window=50, threshold=6.0, min_ratio=2.0)
    flagged = [i for i, v in enumerate(values) if detector.update(v).spike]
    assert flagged == [7_000]


def _mlp_regression_losses(steps: int) -> list[float]:
    """The clean loop of the multi-process tests and benchmarks: a 4-8-1 MLP regressing x.sum() on
    batches of 8 with SGD. One extreme sample rules a batch's loss: after convergence some batches
    are 30x the median loss, about once in a hundred steps."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator, losses = torch.Generator().manual_seed(100), []
    for _ in range(steps):
        x = torch.randn(8, 4, generator=generator)
        loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_a_heavy_tailed_clean_loss_is_quiet_and_a_spike_beyond_its_tail_is_not():
    """Before the tail rule this clean loop had twelve loss_spike warnings in 1,000 steps."""
    losses = _mlp_regression_losses(1000)
    median = sorted(losses[500:])[250]
    assert max(losses[500:]) > 15 * median  # the outliers of the kind that flagged
    detector = LossSpikeDetector(window=50, threshold=6.0, min_ratio=2.0)
    assert [i for i, loss in enumerate(losses) if detector.update(loss).spike] == []
    assert detector.update(100 * median).spike  # far beyond anything the run has shown


def test_a_float64_loss_on_the_device_is_kept_as_a_value_not_a_view():
    """A one-element float64 loss already on the device needs no conversion: the accumulator keeps
    a copy, so the user's in-place change to their loss (or a buffer reused for the next one)
    before the step's transfer is not read; a float32 loss is kept by its conversion."""
    for dtype in (torch.float64, torch.float32):
        acc = LossAccumulator()
        buckets = TimestepBuckets(2, 1000)
        loss = torch.tensor([1.5], dtype=dtype)
        acc.add(loss, torch.device("cpu"), buckets, torch.tensor([10, 900]))
        loss.fill_(1000.0)
        assert acc.mean().item() == 1.5 and acc.mean().dtype == torch.float64
        assert acc.bucket_sum.tolist() == [1.5, 1.5, 1.0, 1.0, 0.0, 0.0]


def test_an_in_place_change_to_a_float64_loss_after_its_monitor_call_is_not_recorded(tmp_path, fresh_accelerate_state):
    """Gradient accumulation over 2 micro-steps of a float64 model: the first micro-step's loss
    waits on the device for the step's transfer; the user overwrites it in place right after
    its monitor call. The recorded loss is the mean of the two losses as they were passed."""
    from accelerate import Accelerator

    from diffusion_debug import DebugConfig, TrainingDebugger

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    tdbg = TrainingDebugger(model, accelerator=accelerator, config=DebugConfig(output_dir=str(tmp_path)))
    generator = torch.Generator().manual_seed(3)
    passed, infos = [], []
    for i in range(4):
        x = torch.randn(8, 4, generator=generator, dtype=torch.float64)
        with accelerator.accumulate(model):
            loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
            accelerator.backward(loss)
            passed.append(loss.item())
            infos.append(tdbg.monitor_training_step(loss, optimizer=optimizer, step=i // 2))
            with torch.no_grad():
                loss.fill_(1000.0)  # the user's own loss, changed in place before the step is read
            optimizer.step()
            optimizer.zero_grad()
    assert [info["gradients_read"] for info in infos] == [False, True, False, True]
    assert [infos[1]["loss"], infos[3]["loss"]] == [(passed[0] + passed[1]) / 2, (passed[2] + passed[3]) / 2]
    assert [row["loss"] for row in tdbg.report().steps] == [infos[1]["loss"], infos[3]["loss"]]
    tdbg.close()


def test_two_backward_calls_a_batch_over_an_epoch_the_accumulation_does_not_divide(tmp_path, fresh_accelerate_state):
    """Accelerate's ``accumulate`` of 3 over a prepared DataLoader of 7 batches (its last step syncs
    at the end of the epoch, after one batch), each batch two losses of shape [1], each with its own
    ``accelerator.backward`` (the first ``retain_graph=True``, monitored with ``accumulating=True``):
    the steps are the optimizer's, 3 / 3 / 1 batches, each loss the mean of its calls' losses, the
    weights bitwise the unwatched run's, and a NaN planted in the short step's gradient named there."""
    from accelerate import Accelerator
    from torch.utils.data import DataLoader, TensorDataset

    from diffusion_debug import DebugConfig, TrainingDebugger

    def run(watch):
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(True)  # the second run's Accelerator starts clean too
        GradientState._reset_state()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        data = DataLoader(TensorDataset(torch.randn(7, 2, 4, generator=torch.Generator().manual_seed(1))))
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=3)
        model, optimizer, data = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.1), data)
        config = DebugConfig(output_dir=str(tmp_path), stream_events=False)
        tdbg = TrainingDebugger(model, accelerator=accelerator, config=config) if watch else None
        step, passed, infos = 0, [], []
        for i, (x,) in enumerate(data):
            with accelerator.accumulate(model):
                out = model(x[0])
                losses = [out.pow(2).mean().reshape(1), (out - 1).abs().mean().reshape(1)]
                accelerator.backward(losses[0], retain_graph=True)
                if tdbg is not None:
                    infos.append(
                        tdbg.monitor_training_step(losses[0], optimizer=optimizer, step=step, accumulating=True)
                    )
                accelerator.backward(losses[1])
                if i == 6:
                    model[2].weight.grad[0, 0] = math.nan
                if tdbg is not None:
                    infos.append(tdbg.monitor_training_step(losses[1], optimizer=optimizer, step=step))
                optimizer.step()
                optimizer.zero_grad()
            passed += [loss.item() for loss in losses]
            step += accelerator.sync_gradients
        return tdbg, [p.detach().clone() for p in model.parameters()], passed, infos

    _, reference, _, _ = run(False)
    tdbg, weights, passed, infos = run(True)
    assert all(torch.equal(a.nan_to_num(), b.nan_to_num()) for a, b in zip(reference, weights))
    steps = [info for info in infos if info["gradients_read"]]
    assert [(info["step"], info["micro_steps"]) for info in steps] == [(0, 6), (1, 6), (2, 2)]
    means = [sum(passed[:6]) / 6, sum(passed[6:12]) / 6, sum(passed[12:]) / 2]
    assert [info["loss"] for info in steps] == pytest.approx(means, rel=1e-6)
    (nan,) = [a for a in tdbg.report().anomalies if a.severity == "error"]
    assert (nan.kind, nan.step, nan.parameter) == ("nonfinite", 2, "2.weight")
    tdbg.close()
