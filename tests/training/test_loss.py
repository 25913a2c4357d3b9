"""loss: spike detector, timestep buckets, the step's accumulated loss."""

import pytest
import torch

from diffusion_debug.training.loss import LossAccumulator, LossSpikeDetector, TimestepBuckets, num_train_timesteps


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
