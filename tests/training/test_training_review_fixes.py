"""Regression tests for review findings on the training debugger and the train job: anomaly
mode that must not break the user's backward, RNG untouched by the replay, CUDA memory growth,
a mapping as config, policy stop in the job."""

import gc

import pytest
import torch

from diffusion_debug import DebugConfig, DiffusionDebugError, TrainingDebugger
from diffusion_debug.record import load_json
from diffusion_debug.training import debugger as debugger_mod


@pytest.fixture
def restore_anomaly_mode():
    before = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
    yield before
    torch.set_anomaly_enabled(*before)


def _nan_backward(model):
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    return (model(x) - 100).sqrt().mean()  # sqrt of a negative: NaN in forward and backward


def test_enable_autograd_anomaly_records_a_nan_instead_of_raising_in_the_users_backward(
    mlp, tmp_path, restore_anomaly_mode
):
    tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path), enable_autograd_anomaly=True))
    assert torch.is_anomaly_enabled() and not torch.is_anomaly_check_nan_enabled()
    loss = _nan_backward(mlp)
    loss.backward()  # the user's own backward: must not raise on the NaN
    tdbg.monitor_training_step(loss, step=0)
    kinds = {a.kind for a in tdbg.report().anomalies}
    assert "nonfinite_loss" in kinds and "nonfinite" in kinds
    tdbg.config = tdbg.config.replace(autograd_anomaly_mode="raise")
    with pytest.raises(DiffusionDebugError, match="SqrtBackward0"):  # anomaly_mode() still names the op
        with tdbg.anomaly_mode():
            _nan_backward(mlp).backward()
    assert torch.is_anomaly_enabled() and not torch.is_anomaly_check_nan_enabled()  # anomaly_mode() restored it
    tdbg.detach()
    assert (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()) == restore_anomaly_mode


def test_anomaly_mode_is_restored_when_a_debugger_is_collected_without_detach(mlp, tmp_path, restore_anomaly_mode):
    tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path), enable_autograd_anomaly=True))
    assert torch.is_anomaly_enabled()
    del tdbg
    gc.collect()
    assert (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()) == restore_anomaly_mode


def test_closure_replay_leaves_the_users_random_numbers_alone(tmp_path):
    def run(localize: bool) -> torch.Tensor:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
        x = torch.randn(6, 4)
        shift = torch.tensor(100.0)

        def closure():
            return torch.sqrt(model(x) - shift).mean()  # dropout draws random numbers on replay

        loss = closure()
        loss.backward()
        tdbg = TrainingDebugger(model, config=DebugConfig(output_dir=str(tmp_path), stream_events=False))
        tdbg.monitor_training_step(loss, step=0, closure=closure if localize else None)
        if localize:
            assert any(a.details.get("localization", {}).get("found") for a in tdbg.report().anomalies)
        tdbg.detach()
        return torch.rand(5)

    assert torch.equal(run(localize=True), run(localize=False))


def test_localize_leaves_the_users_random_numbers_alone(mlp, tmp_path):
    tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path), stream_events=False))
    x = torch.randn(4, 4)

    def closure():
        return torch.nn.functional.dropout(mlp(x), 0.5).sub(100).sqrt().mean()

    torch.manual_seed(3)
    assert tdbg.localize(closure)["found"]
    after = torch.rand(3)
    torch.manual_seed(3)
    assert torch.equal(after, torch.rand(3))


def test_cuda_allocated_growth_is_judged_like_rss(mlp, tmp_path):
    tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path), memory_growth_mb=100.0))
    base = dict(component="model", step=15, rank=0)
    anomalies = []
    for i in range(16):  # RSS flat, CUDA allocated climbing 50 MB per step
        row = [0.0] * debugger_mod._SCALARS
        row[debugger_mod._RSS] = 1000.0
        row[debugger_mod._CUDA_ALLOCATED] = 500.0 + 50.0 * i
        anomalies += tdbg._judge_memory(0, row, base)
    (growth,) = anomalies
    assert growth.kind == "memory_growth" and growth.details["source"] == "cuda_allocated"
    assert growth.details["growth_mb"] == 300.0 and growth.details["window_steps"] == 8  # judged at 8 steps
    assert "CUDA allocated" in growth.message and growth.details["cuda_allocated_mb"] == 850.0


def test_measurement_carries_cuda_allocated_from_the_memory_sample(mlp, tmp_path, monkeypatch):
    monkeypatch.setattr(debugger_mod, "memory_sample", lambda device: {"rss_mb": 10.0, "cuda_allocated_mb": 42.0})
    tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path), memory_tracking=True))
    loss = mlp(torch.randn(2, 4)).sum()
    loss.backward()
    tdbg._accumulate(loss, None, None, None)
    row = tdbg._measure(None, None, False, False).vector.tolist()
    assert (row[debugger_mod._RSS], row[debugger_mod._CUDA_ALLOCATED], row[debugger_mod._LOSS_COUNT]) == (
        10.0,
        42.0,
        1.0,
    )
    assert row[debugger_mod._LOSS] == pytest.approx(loss.item())


def test_positions_are_made_once(mlp, tmp_path, monkeypatch):
    tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path), stream_events=False))
    calls = []
    arange = torch.arange
    monkeypatch.setattr(torch, "arange", lambda *a, **k: calls.append(1) or arange(*a, **k))
    for step in range(3):
        loss = mlp(torch.randn(2, 4)).pow(2).mean()
        loss.backward()
        tdbg.monitor_training_step(loss, step=step)
        mlp.zero_grad()
    assert len(calls) == 1


def test_a_mapping_is_accepted_as_config(mlp, tmp_path):
    tdbg = TrainingDebugger(mlp, config={"output_dir": str(tmp_path), "policy": "skip"})
    assert isinstance(tdbg.config, DebugConfig) and tdbg.config.policy == "skip"
    tdbg.detach()
    with pytest.raises(DiffusionDebugError):
        TrainingDebugger(mlp, config={"output_dir": str(tmp_path / "out"), "polcy": "skip"})
    assert not (tmp_path / "out").exists()


def test_a_tracker_failure_still_applies_the_policy(mlp, tmp_path, monkeypatch):
    # A failure after the gather (here: recording the step) must not skip the policy.
    tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path), policy="skip"))
    loss = mlp(torch.randn(2, 4)).pow(2).mean()
    loss.backward()
    mlp[0].weight.grad[0, 0] = float("nan")

    def failing(row):
        raise RuntimeError("planted failure in add_step")

    monkeypatch.setattr(tdbg.record, "add_step", failing)
    info = tdbg.monitor_training_step(loss, step=0)
    assert info["policy_action"] == "skip"
    assert all(torch.count_nonzero(p.grad) == 0 for p in mlp.parameters())
    (error,) = [a for a in tdbg.report().anomalies if a.kind == "debugger_error"]
    assert error.details["where"] == "recording" and "planted failure in add_step" in error.message
    assert tdbg.get_training_summary()["skipped_by_policy"] == 1


def test_strict_raises_a_late_failure_after_the_policy(mlp, tmp_path, monkeypatch):
    tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path), policy="stop", strict=True))
    loss = mlp(torch.randn(2, 4)).pow(2).mean()
    loss.backward()
    mlp[0].weight.grad[0, 0] = float("nan")
    monkeypatch.setattr(tdbg.record, "add_step", lambda row: (_ for _ in ()).throw(RuntimeError("planted")))
    with pytest.raises(RuntimeError, match="planted"):
        tdbg.monitor_training_step(loss, step=0)
    assert tdbg.should_stop  # the policy ran first


def test_train_job_policy_stop_ends_the_loop(tmp_path, fresh_accelerate_state, monkeypatch):
    from diffusion_debug.cli import main

    detached = []
    original = TrainingDebugger.detach
    monkeypatch.setattr(TrainingDebugger, "detach", lambda self: detached.append(1) or original(self))
    code = main(
        ["train", "--cpu", "--steps", "6", "--policy", "stop", "--inject", "nan-grad@2", "--output-dir", str(tmp_path)]
    )
    assert code == 0
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    summary = load_json(run_dir / "summary.json")
    assert summary["training"]["total_steps"] == 3  # steps 0, 1 and 2, where the NaN gradient stopped it
    assert any(a["kind"] == "nonfinite" and a["step"] == 2 for a in summary["anomalies"])
    assert detached == [1]
