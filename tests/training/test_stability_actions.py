"""Stability actions (opt-in): each one does exactly what its anomaly says, checked against the
gradients, learning rates and weights computed by hand; and an OOM in a training step."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from diffusion_debug import DebugConfig, TrainingDebugger
from diffusion_debug.core.out_of_memory import REMEDIES
from diffusion_debug.testing import plant_oom


def _grad_norm(model) -> float:
    return math.sqrt(sum(float(p.grad.double().square().sum()) for p in model.parameters() if p.grad is not None))


def _loop(model, tdbg, optimizer, steps, *, before_monitor=None, after_monitor=None, after_step=None, scheduler=None):
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 4, generator=generator), torch.randn(8, 1, generator=generator)
    seen = {}
    for step in range(steps):
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        if before_monitor is not None:
            before_monitor(step, seen)
        tdbg.monitor_training_step(loss, optimizer=optimizer, step=step)
        seen.setdefault("after_monitor", {})[step] = _grad_norm(model)
        if after_monitor is not None:
            after_monitor(step, seen)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad()
        if after_step is not None:
            after_step(step, seen)
    return seen


PLANTED = "CUDA out of memory. Tried to allocate 2.00 GiB (planted by diffusion_debug.testing)"


def _anomalies(tdbg, kind):
    return [a for a in tdbg.report().anomalies if a.kind == kind]


def test_clip_on_explosion_scales_the_gradients_to_the_given_norm(mlp, tmp_path):
    config = DebugConfig(level="basic", output_dir=str(tmp_path), clip_grad_on_explosion=2.0)
    tdbg = TrainingDebugger(mlp, config=config)

    def explode(step, seen):
        if step == 2:
            for p in mlp.parameters():
                p.grad.mul_(1e5)
            seen["before"] = _grad_norm(mlp)

    seen = _loop(mlp, tdbg, torch.optim.SGD(mlp.parameters(), lr=1e-3), 4, before_monitor=explode)
    assert seen["after_monitor"][2] == pytest.approx(2.0, rel=1e-5)
    assert seen["after_monitor"][1] < 2.0  # other steps untouched
    (clipped,) = _anomalies(tdbg, "gradients_clipped")
    assert clipped.step == 2 and clipped.severity == "info"
    assert clipped.details["factor"] == pytest.approx(2.0 / seen["before"], rel=1e-5)
    assert clipped.message.startswith(f"The gradients were scaled by {clipped.details['factor']:.3g} (global norm ")
    tdbg.close()


def test_lr_is_reduced_after_repeated_spikes_and_the_prepared_scheduler_follows(mlp, tmp_path, fresh_accelerate_state):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    optimizer = torch.optim.SGD(mlp.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model, optimizer, scheduler = accelerator.prepare(mlp, optimizer, scheduler)
    config = DebugConfig(level="basic", output_dir=str(tmp_path), lr_reduce_after_spikes=2, lr_reduce_factor=0.25)
    tdbg = TrainingDebugger(model, accelerator=accelerator, config=config)

    def explode(step, seen):
        if step in (1, 3):
            for p in model.parameters():
                p.grad.mul_(1e5)
        seen.setdefault("lr", {})[step] = optimizer.param_groups[0]["lr"]

    def undo(step, seen):  # the explosion is seen, the weights are not harmed by it
        if step in (1, 3):
            for p in model.parameters():
                p.grad.div_(1e5)

    seen = _loop(model, tdbg, optimizer, 6, before_monitor=explode, after_monitor=undo, scheduler=scheduler)
    assert seen["lr"] == {0: 0.1, 1: 0.1, 2: 0.1, 3: 0.1, 4: 0.025, 5: 0.025}  # LambdaLR did not set it back
    (reduced,) = _anomalies(tdbg, "lr_reduced")
    assert (reduced.step, reduced.details["lr_before"], reduced.details["lr"]) == (3, [0.1], [0.025])
    assert reduced.details["schedulers"] == 1
    tdbg.close()


def test_restore_puts_back_the_copy_of_the_last_finite_step(mlp, tmp_path):
    config = DebugConfig(level="basic", output_dir=str(tmp_path), restore_finite_weights_mb=1.0)
    tdbg = TrainingDebugger(mlp, config=config)
    optimizer = torch.optim.Adam(mlp.parameters(), lr=1e-2)
    seen = {}
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 4, generator=generator), torch.randn(8, 1, generator=generator)
    for step in range(4):
        loss = ((mlp(x) - y) ** 2).mean()
        loss.backward()
        if step == 2:
            seen["copy"] = [p.detach().clone() for p in mlp.parameters()]
        tdbg.monitor_training_step(loss, optimizer=optimizer, step=step)
        if step == 3:
            seen["after"] = [p.detach().clone() for p in mlp.parameters()]
            seen["grads"] = [p.grad.clone() for p in mlp.parameters()]
        optimizer.step()
        optimizer.zero_grad()
        if step == 2:  # the update of step 2 poisons a weight and one Adam moment
            with torch.no_grad():
                mlp[0].weight[0, 0] = float("nan")
            optimizer.state[mlp[2].bias]["exp_avg"].fill_(float("inf"))
    assert all(torch.equal(a, b) for a, b in zip(seen["after"], seen["copy"]))
    assert all(not g.any() for g in seen["grads"])
    # the poisoned moment was dropped: Adam started that parameter afresh at the step after the restore
    assert float(optimizer.state[mlp[2].bias]["step"]) == 1 and float(optimizer.state[mlp[0].weight]["step"]) == 4
    assert torch.isfinite(optimizer.state[mlp[2].bias]["exp_avg"]).all()
    assert all(torch.isfinite(p).all() for p in mlp.parameters())  # the step after the restore added nothing bad
    (restored,) = _anomalies(tdbg, "weights_restored")
    assert (restored.step, restored.details["from_step"], restored.details["optimizer_state_dropped"]) == (3, 2, 1)
    assert restored.details["restored"] is True
    mb = sum(p.numel() * 4 for p in mlp.parameters()) / 2**20
    assert restored.details["mb"] == pytest.approx(mb)
    tdbg.close()


def test_restore_puts_back_no_copy_that_holds_the_nan_too(tmp_path):
    # row 9 goes NaN at step 1 but the batches use it only from step 5: the copies kept at the finite
    # steps 2-4 hold the NaN, so there is nothing finite to restore, and it says so once
    torch.manual_seed(0)
    embedding, head = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 1)
    model = torch.nn.ModuleDict({"embedding": embedding, "head": head})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    config = DebugConfig(level="basic", output_dir=str(tmp_path), restore_finite_weights_mb=1.0)
    tdbg = TrainingDebugger(model, config=config)
    for step in range(8):
        loss = head(embedding(torch.tensor([9] if step >= 5 else [1, 2]))).pow(2).mean()
        loss.backward()
        tdbg.monitor_training_step(loss, optimizer=optimizer, step=step)
        optimizer.step()
        optimizer.zero_grad()
        if step == 1:
            with torch.no_grad():
                embedding.weight[9] = float("nan")
    (found,) = _anomalies(tdbg, "weights_restored")
    assert (found.step, found.details) == (5, {"from_step": 4, "restored": False, "count": 1})
    assert found.message == (
        "The weights are non-finite and so is the copy kept at step 4: nothing was restored (they went "
        "non-finite before the loss showed it; restore_finite_weights_mb)."
    )
    assert torch.isnan(embedding.weight[9]).all()  # left as it was
    tdbg.close()


def test_restore_keeps_no_copy_of_weights_over_the_bound(mlp, tmp_path):
    config = DebugConfig(level="basic", output_dir=str(tmp_path), restore_finite_weights_mb=1e-4)
    tdbg = TrainingDebugger(mlp, config=config)
    _loop(mlp, tdbg, torch.optim.SGD(mlp.parameters(), lr=1e-3), 2)
    (event,) = [e for e in tdbg.record.events if e["type"] == "restore_finite_weights_off"]
    assert event["note"].startswith("the trainable weights take 0.0 MB, over restore_finite_weights_mb (0.0001)")
    assert tdbg._steps.stability._copy is None
    tdbg.close()


def test_an_oom_in_a_training_step_names_the_block_and_step_and_is_re_raised(mlp, tmp_path):
    tdbg = TrainingDebugger(mlp, config=DebugConfig(level="basic", output_dir=str(tmp_path)))
    with plant_oom(mlp[2], from_call=2), pytest.raises(torch.OutOfMemoryError, match="planted"):
        _loop(mlp, tdbg, torch.optim.SGD(mlp.parameters(), lr=1e-3), 4)
    (anomaly,) = _anomalies(tdbg, "out_of_memory")
    assert (anomaly.component, anomaly.module, anomaly.step) == ("model", "2", 2)
    assert anomaly.details["remedies"] == list(REMEDIES["training"])

    @tdbg.watch
    def backward_step():
        raise torch.OutOfMemoryError("CUDA out of memory (planted in backward)")

    with pytest.raises(torch.OutOfMemoryError, match="planted in backward"):
        backward_step()
    assert tdbg._oom.last is None  # the failed call's frames are not kept once the block is left
    assert [(a.module, a.step) for a in _anomalies(tdbg, "out_of_memory")] == [("2", 2), ("", 2)]
    tdbg.close()


def test_an_oom_in_the_closure_replay_is_the_replays_failure_not_the_users_step(mlp, tmp_path):
    """A NaN loss at step 0 whose ``closure=`` replay (the debugger's own forward) runs out of
    memory in block 2: no ``out_of_memory`` for the user's step, the NaN said with the replay's
    failure (not "stayed finite", nor an op anomaly mode never named), the user's gradients as
    they were; the user's own OOM at step 1 is theirs, at block 2."""
    tdbg = TrainingDebugger(mlp, config=DebugConfig(level="basic", output_dir=str(tmp_path)))
    optimizer = torch.optim.SGD(mlp.parameters(), lr=1e-3)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))

    def closure():
        return (mlp(x) * float("nan")).mean()

    with plant_oom(mlp[2], from_call=1):  # the user's call passes, the replay's raises
        loss = closure()
        loss.backward()
        grads = [p.grad.clone() for p in mlp.parameters()]
        tdbg.monitor_training_step(loss, optimizer=optimizer, step=0, closure=closure)
    assert all(p.grad.numpy().tobytes() == g.numpy().tobytes() for p, g in zip(mlp.parameters(), grads))
    assert _anomalies(tdbg, "out_of_memory") == [] and tdbg._oom.last is None
    (nan_loss,) = _anomalies(tdbg, "nonfinite_loss")
    failed = f"OutOfMemoryError: {PLANTED}"
    assert {k: v for k, v in nan_loss.details["localization"].items() if k != "seconds"} == {
        "found": False,
        "error": failed,
    }
    assert nan_loss.message.endswith(f"; the closure= replay under anomaly mode failed ({failed}).")
    optimizer.zero_grad()
    with plant_oom(mlp[2]), pytest.raises(torch.OutOfMemoryError, match="planted"):
        mlp(x).mean().backward()
    assert [(a.component, a.module, a.step) for a in _anomalies(tdbg, "out_of_memory")] == [("model", "2", 1)]
    tdbg.close()


def test_an_oom_in_one_thread_while_another_thread_replays_is_the_users(mlp, tmp_path):
    """A replay is the debugger's own only in the thread that runs it: while one thread's
    ``localize(closure)`` is inside its replay (held there), the main thread's own forward of the
    same watched model runs out of memory in block 2, and that is recorded as the user's
    ``out_of_memory``; the replay then finishes and finds the op."""
    tdbg = TrainingDebugger(mlp, config=DebugConfig(level="basic", output_dir=str(tmp_path)))
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    inside, released, found = threading.Event(), threading.Event(), {}

    def closure():
        inside.set()
        released.wait(timeout=120)  # a safety net only: the main thread releases it
        return torch.sqrt(mlp(x) - 100.0).mean()  # sqrt of a negative: NaN

    replay = threading.Thread(target=lambda: found.update(tdbg.localize(closure)))
    replay.start()
    try:
        assert inside.wait(timeout=120)
        with plant_oom(mlp[2]), pytest.raises(torch.OutOfMemoryError, match="planted"):
            mlp(x).mean().backward()
    finally:
        released.set()
        replay.join()
    assert found["found"] and found["op"] == "SqrtBackward0"
    assert [(a.component, a.module) for a in _anomalies(tdbg, "out_of_memory")] == [("model", "2")]
    tdbg.close()


def test_an_oom_in_one_of_several_watched_models_names_that_model(tmp_path):
    torch.manual_seed(0)
    encoder, head = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh()), torch.nn.Linear(8, 1)
    config = DebugConfig(level="basic", output_dir=str(tmp_path))
    tdbg = TrainingDebugger({"text_encoder": encoder, "unet": head}, config=config)
    with plant_oom(encoder[0]), pytest.raises(torch.OutOfMemoryError, match="planted"):
        head(encoder(torch.randn(2, 4))).sum().backward()
    (anomaly,) = _anomalies(tdbg, "out_of_memory")
    assert (anomaly.component, anomaly.module) == ("text_encoder", "0")
    tdbg.close()


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(clip_grad_on_explosion=0), "Config key 'clip_grad_on_explosion' must be positive or None, not 0."),
        (dict(lr_reduce_factor=1.0), "Config key 'lr_reduce_factor' must be in (0, 1), not 1.0."),
        (dict(lr_reduce_after_spikes=-1), "Config key 'lr_reduce_after_spikes' must be an integer >= 0, not -1."),
        (dict(restore_finite_weights_mb=-1), "Config key 'restore_finite_weights_mb' must be >= 0 (0: off)."),
    ],
)
def test_stability_options_refuse_what_they_cannot_do(options, message):
    from diffusion_debug import ConfigError

    with pytest.raises(ConfigError) as caught:
        DebugConfig(**options)
    assert str(caught.value) == message


@pytest.mark.parametrize("strict", [False, True])
def test_a_failed_stability_action_is_recorded_or_raised_after_the_step_is_recorded(mlp, tmp_path, strict):
    config = DebugConfig(level="basic", output_dir=str(tmp_path), clip_grad_on_explosion=2.0, strict=strict)
    tdbg = TrainingDebugger(mlp, config=config)
    stability = tdbg._steps.stability

    def failing(*args, **kwargs):
        raise RuntimeError("planted failure in a stability action")

    stability._act = failing
    loss = mlp(torch.ones(2, 4)).pow(2).mean()
    loss.backward()
    if strict:  # raised by the policy's strict path, after the step's collectives and its record
        with pytest.raises(RuntimeError, match="planted failure"):
            tdbg.monitor_training_step(loss, step=0)
    else:
        tdbg.monitor_training_step(loss, step=0)
        (error,) = _anomalies(tdbg, "debugger_error")
        assert (error.step, error.rank, error.details["where"]) == (0, 0, "stability_actions")
    assert [row["step"] for row in tdbg.report().steps] == [0]
