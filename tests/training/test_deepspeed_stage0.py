"""DeepSpeed without ZeRO (``zero_optimization.stage`` 0) in bf16, one CPU rank in this process (the
session's gloo group of one, DS_ACCELERATOR=cpu): the engine wraps the optimizer in its own
mixed-precision optimizer (``FP16_UnfusedOptimizer`` here, ``FP16_Optimizer`` / ``BF16_Optimizer``
elsewhere), whose torch optimizer trains float32 copies of the model's parameters, and skips a step
whose gradients overflow (its ``overflow`` flag). Skipped, saying why, where DeepSpeed does not
install or import (``pip install 'diffusion-debug[deepspeed]'``)."""

import importlib.util
import math

import pytest
import torch

from diffusion_debug import DebugConfig, TrainingDebugger


def _engine(monkeypatch, precision="bf16", stage=0, extra=None):
    """A stage-0 engine of a tiny MLP in ``precision`` (fp16: DeepSpeed's dynamic loss scale, from
    2**8) and its optimizer (DeepSpeed's wrapper of SGD)."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (pip install 'diffusion-debug[deepspeed]')")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # chosen at its first use
    monkeypatch.setenv("LOCAL_RANK", "0")  # the engine asks for it; the process group exists already
    try:
        import deepspeed
        from deepspeed.accelerator import get_accelerator
    except Exception as error:
        pytest.skip(f"deepspeed does not import: {error!r}")
    monkeypatch.setattr(deepspeed.ops, "__compatible_ops__", {})  # no shared-memory collectives to build
    # DeepSpeed keeps a clone of the world group for the process: cloned afresh from this module's
    # gloo group (another module's may be gone), the one before put back after the test
    monkeypatch.setattr(deepspeed.utils.groups, "_WORLD_GROUP", None)
    # BF16_Optimizer logs its memory twice, each after a gc.collect() of the whole session's heap
    monkeypatch.setattr(deepspeed.runtime.bf16_optimizer, "see_memory_usage", lambda *args, **kwargs: None)
    for supported in ("is_bf16_supported", "is_fp16_supported"):  # the CPU's says no
        monkeypatch.setattr(type(get_accelerator()), supported, lambda self: True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
        config={
            "train_micro_batch_size_per_gpu": 8,
            "zero_optimization": {"stage": stage},
            **(extra or {}),
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**6,
            precision: {"enabled": True, "initial_scale_power": 8} if precision == "fp16" else {"enabled": True},
        },
    )
    return engine, optimizer


def _train(engine, optimizer, tmp_path, nan_at=None, norms=None):
    """Four steps of a raw engine's loop, the monitor between backward and step; a NaN planted in
    the last linear's weight gradient at step ``nan_at``. The anomalies and the engine's skips;
    ``norms`` gets each step's ``(measured, reference)`` gradient norm."""
    planted = [False]
    engine.module[2].weight.register_hook(lambda g: g * math.nan if planted[0] else g)
    tdbg = TrainingDebugger(engine, config=DebugConfig(output_dir=str(tmp_path), stream_events=False))
    for step in range(4):
        planted[0] = step == nan_at
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step)).to(next(engine.parameters()).dtype)
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        info = tdbg.monitor_training_step(loss, optimizer=optimizer, step=step)
        if norms is not None:  # the reference: every .grad, unscaled by the loss scale the step divides by
            scale = float(getattr(optimizer, "loss_scale", 1.0))
            squares = sum(p.grad.double().square().sum() for p in engine.module.parameters())
            norms.append((info["grad_norm"], float(squares.sqrt()) / scale))
        engine.step()
    anomalies = tdbg.report().anomalies
    tdbg.close()
    found = [(a.kind, a.severity, a.step, a.parameter, a.details.get("reason")) for a in anomalies]
    return found, engine.skipped_steps


@pytest.mark.parametrize("stage", [0, 1])
def test_stage0_clean_run_is_quiet_its_optimizer_trains_copies_of_the_model_s_parameters(
    one_rank_group, tmp_path, monkeypatch, stage
):
    """The torch optimizer inside holds float32 copies: they stand for the model's parameters, not
    parameters outside the model (and the model's are in an optimizer). Also ZeRO-1 in bf16 with
    float32 gradient accumulation, which DeepSpeed hands to ``BF16_Optimizer`` (its flat partitions)."""
    extra = {"data_types": {"grad_accum_dtype": "fp32"}} if stage else None
    engine, optimizer = _engine(monkeypatch, stage=stage, extra=extra)
    assert type(optimizer).__name__ == ("BF16_Optimizer" if stage else "FP16_UnfusedOptimizer")
    assert _train(engine, optimizer, tmp_path) == ([], 0)


def test_stage0_overflow_skip_is_recorded_as_deepspeed_s(one_rank_group, tmp_path, monkeypatch):
    engine, optimizer = _engine(monkeypatch)
    found, skipped = _train(engine, optimizer, tmp_path, nan_at=1)
    assert skipped == 1
    assert found == [
        ("nonfinite", "error", 1, "2.weight", None),
        ("skipped_step", "info", 1, None, "deepspeed_overflow"),
    ]


def test_stage0_each_rank_s_own_gradients_are_checked_before_the_engine_s_all_reduce(
    one_rank_group, tmp_path, monkeypatch
):
    """What the debugger attaches at several ranks (training/debugger.py): the engine's own
    all-reduce is checked first, so the rank that made a NaN is named (not the first rank); the
    engine holds its class's method again once released."""
    from diffusion_debug.training.measure.pre_reduction import PreReductionCheck

    engine, optimizer = _engine(monkeypatch)
    check, zero = PreReductionCheck.attach([engine]), torch.zeros((), dtype=torch.float64)
    assert check.watching and check.off == []
    planted = [False]
    engine.module[2].weight.register_hook(lambda g: g * math.nan if planted[0] else g)
    found = []
    for step in range(3):
        planted[0] = step == 1
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step)).bfloat16()
        engine.backward(engine(x).float().pow(2).mean())
        found.append(check.take(zero).item())
        engine.step()
    assert found == [0.0, 1.0, 0.0]
    check.release()
    assert "allreduce_gradients" not in vars(engine)


def test_stage0_fp16_the_norms_are_unscaled_and_an_overflow_is_the_loss_scaler_s(
    one_rank_group, tmp_path, monkeypatch
):
    """fp16's dynamic loss scale (2**8 here) is in the gradients until the step: the norms are the
    true ones, unscaled, and a NaN under it an overflow its loss scaler skips (info)."""
    engine, optimizer = _engine(monkeypatch, "fp16")
    norms = []
    found, skipped = _train(engine, optimizer, tmp_path, nan_at=1, norms=norms)
    assert skipped == 1
    assert found == [
        ("nonfinite", "info", 1, "2.weight", None),
        ("skipped_step", "info", 1, None, "deepspeed_overflow"),
    ]
    for step in (0, 2, 3):
        assert norms[step][0] == pytest.approx(norms[step][1], rel=1e-3), norms
