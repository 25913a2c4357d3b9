"""A loop that turns gradient sync off and never back on (``training.step.sync_off``): every call reads as a
micro-step and no optimizer step follows, told once a stretch as ``not_learning`` of reason
``gradient_sync_off``, naming what holds the sync off: the caller's ``accumulating=True``, FSDP2's
``set_requires_gradient_sync(False)``, Accelerate's ``sync_gradients``, a raw DeepSpeed engine's boundary.
Clean accumulation stays quiet, and so do loops that step under DDP's ``no_sync()`` (Local SGD, a GAN). One
process (the gloo group of world size 1 where the engine needs one)."""

import math

import torch
from test_pre_reduction import NEEDS_FSDP2, _fully_shard, _model

from diffusion_debug import DebugConfig, TrainingDebugger
from diffusion_debug.record import headline
from diffusion_debug.training.step.sync_off import FLOOR


def _debugger(model, tmp_path, **kwargs):
    return TrainingDebugger(model, config=DebugConfig(output_dir=str(tmp_path), stream_events=False), **kwargs)


def _said(tdbg):
    """The run's ``gradient_sync_off`` findings: (severity, step, rank, since, passes, last step, cause)."""
    return [
        (a.severity, a.step, a.rank, a.details["since_step"], a.details["backward_passes"])
        + (a.details["last_optimizer_step"], a.details["cause"])
        for a in tdbg.report().anomalies
        if a.kind == "not_learning" and a.details.get("reason") == "gradient_sync_off"
    ]


def _message(passes, since, last, held_by):
    stepped = f"the last at step {last}" if last is not None else "none since the run began"
    return (
        f"{passes} backward passes since step {since} with no optimizer step ({stepped}): gradient sync is off "
        f"({held_by}), so every call reads as a micro-step of gradient accumulation and the weights never move; "
        "turn the sync back on for the backward before each optimizer step."
    )


def _told_from_the_start(tdbg, cause, held_by):
    """The one finding of a loop whose sync was off from its first call: at the floor's last micro-step, rank 0,
    since step 0, no optimizer step before it, ``cause``; the headline's message naming ``held_by``."""
    assert _said(tdbg) == [("warning", FLOOR - 1, 0, 0, FLOOR, None, cause)]
    assert headline(tdbg.report().anomalies)["message"] == _message(FLOOR, 0, None, held_by)


def _backward(model, x):
    loss = model(x).pow(2).mean()
    loss.backward()
    return loss


def test_clean_accumulation_with_a_short_last_stretch_stays_quiet_and_counts_its_micro_steps(tmp_path):
    """Accumulation of 8 for 70 optimizer steps (560 calls, past the floor twice over) and an epoch's last
    stretch of 3: no finding; every call counted."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    tdbg = _debugger(model, tmp_path)
    x = torch.randn(16, 4)
    for step in range(71):
        length = 3 if step == 70 else 8
        for micro in range(length):
            loss = _backward(model, x)
            tdbg.monitor_training_step(loss, optimizer=optimizer, step=step, accumulating=micro < length - 1)
        optimizer.step()
        optimizer.zero_grad()
    assert _said(tdbg) == []
    assert [a for a in tdbg.report().anomalies if a.severity != "info"] == []
    counts = tdbg._steps.history.counts
    assert (counts.total_steps, counts.micro_steps) == (71, 70 * 7 + 2)
    tdbg.close()


def test_accumulating_forever_after_steps_of_four_is_told_once_at_the_floor_naming_the_flag(tmp_path):
    """Three optimizer steps of 4 calls, then ``accumulating=True`` on every call: 4 x 4 is below the floor
    (256), so the finding comes at the 256th call since step 3, once however many follow."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    tdbg = _debugger(model, tmp_path)
    x = torch.randn(16, 4)
    for step in range(3):
        for micro in range(4):
            tdbg.monitor_training_step(_backward(model, x), optimizer=optimizer, step=step, accumulating=micro < 3)
        optimizer.step()
        optimizer.zero_grad()
    for _ in range(FLOOR + 40):
        tdbg.monitor_training_step(_backward(model, x), optimizer=optimizer, step=3, accumulating=True)
    assert _said(tdbg) == [("warning", 3, 0, 3, FLOOR, 2, "accumulating")]
    top = headline(tdbg.report().anomalies)
    assert top["message"] == _message(FLOOR, 3, 2, "the loop passes accumulating=True to every call")
    tdbg.close()


def test_a_stretch_four_times_the_longest_accumulation_seen_is_told_past_the_floor(tmp_path):
    """Accumulation of 100 seen (one optimizer step): a stretch is told at 400 calls, not at the floor."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    tdbg = _debugger(model, tmp_path)
    x = torch.randn(16, 4)
    for micro in range(100):
        tdbg.monitor_training_step(_backward(model, x), optimizer=optimizer, step=0, accumulating=micro < 99)
    optimizer.step()
    optimizer.zero_grad()
    for _ in range(399):
        tdbg.monitor_training_step(_backward(model, x), optimizer=optimizer, step=1, accumulating=True)
    assert _said(tdbg) == []
    tdbg.monitor_training_step(_backward(model, x), optimizer=optimizer, step=1, accumulating=True)
    assert _said(tdbg) == [("warning", 1, 0, 1, 400, 0, "accumulating")]
    tdbg.close()


@NEEDS_FSDP2
def test_fsdp2_gradient_sync_turned_off_and_never_on_is_the_headline_naming_it(one_rank_group, tmp_path):
    model = _model()
    _fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    tdbg = _debugger(model, tmp_path)
    model.set_requires_gradient_sync(False)
    x = torch.randn(16, 4)
    for step in range(FLOOR + 5):
        info = tdbg.monitor_training_step(_backward(model, x), optimizer=optimizer, step=step)
        assert info["gradients_read"] is False
    _told_from_the_start(tdbg, "fsdp2_gradient_sync", "FSDP2 set_requires_gradient_sync(False)")
    tdbg.close()


def _nan_grad(param):
    return param.register_hook(lambda g: g * math.nan)


def test_local_sgd_under_ddp_no_sync_steps_every_call_and_its_nan_is_found(one_rank_group, tmp_path):
    """Accelerate's LocalSGD pattern: the whole loop inside DDP's ``no_sync()``, ``optimizer.step()`` every batch,
    parameters averaged every 8 steps. ``no_sync()`` is no micro-step (``require_backward_grad_sync`` not read):
    a NaN gradient planted at step 5 is found there, and past the floor no ``not_learning`` is said."""
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    tdbg = _debugger(model, tmp_path)
    x = torch.randn(16, 4)
    read = []
    with model.no_sync():
        for step in range(FLOOR + 8):
            hook = _nan_grad(model.module[2].weight) if step == 5 else None
            read.append(tdbg.monitor_training_step(_backward(model, x), optimizer=optimizer, step=step))
            optimizer.step()
            optimizer.zero_grad()
            if hook is not None:
                hook.remove()
                with torch.no_grad():
                    for p in model.parameters():
                        p.nan_to_num_(0.0)
            if step % 8 == 7:
                for p in model.parameters():
                    torch.distributed.all_reduce(p.data)
    tdbg.close()
    assert all(info.get("gradients_read", True) for info in read)
    counts = tdbg._steps.history.counts
    assert (counts.total_steps, counts.micro_steps) == (FLOOR + 8, 0)
    anomalies = tdbg.report().anomalies
    assert [(a.severity, a.step, a.component, a.parameter) for a in anomalies if a.kind == "nonfinite"] == [
        ("error", 5, "model", "2.weight")
    ]
    assert [a for a in anomalies if a.kind == "not_learning"] == []
    assert headline(anomalies)["where"] == "model 2.weight, step 5"


def test_gan_generator_step_under_the_discriminators_no_sync_is_a_step(one_rank_group, tmp_path):
    """A GAN under DDP: G's step runs inside ``D.no_sync()`` (D's gradients from the G loss are thrown away), its
    monitor call inside; D's own step synced. G's NaN gradient planted at step 3 is found at G's parameter."""
    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel
    gen, disc = ddp(_model()), ddp(torch.nn.Linear(1, 1))
    opt_g = torch.optim.SGD(gen.parameters(), lr=0.01)
    opt_d = torch.optim.SGD(disc.parameters(), lr=0.01)
    tdbg = _debugger({"g": gen, "d": disc}, tmp_path)
    x = torch.randn(16, 4)
    for step in range(8):
        hook = _nan_grad(gen.module[2].weight) if step == 3 else None
        with disc.no_sync():
            g_loss = -disc(gen(x)).mean()
            g_loss.backward()
            tdbg.monitor_training_step(g_loss, optimizer=opt_g, step=step)
        opt_g.step()
        opt_g.zero_grad()
        opt_d.zero_grad()
        if hook is not None:
            hook.remove()
            with torch.no_grad():
                for p in gen.parameters():
                    p.nan_to_num_(0.0)
        d_loss = disc(gen(x).detach()).pow(2).mean()
        d_loss.backward()
        tdbg.monitor_training_step(d_loss, optimizer=opt_d, step=step)
        opt_d.step()
        opt_d.zero_grad()
    tdbg.close()
    anomalies = tdbg.report().anomalies
    assert [(a.severity, a.step, a.component, a.parameter) for a in anomalies if a.kind == "nonfinite"] == [
        ("error", 3, "g", "2.weight")
    ]
    assert [a for a in anomalies if a.kind == "not_learning"] == []


def test_accelerate_sync_gradients_never_true_is_told_with_its_accumulation_steps(tmp_path, fresh_accelerate_state):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(_model(), torch.optim.SGD(_model().parameters(), lr=0.01))
    tdbg = _debugger(model, tmp_path, accelerator=accelerator)
    accelerator.gradient_accumulation_steps = 10_000  # set after the debugger read it (1): the floor holds
    x = torch.randn(16, 4)
    for step in range(FLOOR):
        with accelerator.accumulate(model):
            loss = model(x).pow(2).mean()
            accelerator.backward(loss)
            tdbg.monitor_training_step(loss, optimizer=optimizer, step=step)
            optimizer.step()
            optimizer.zero_grad()
    held_by = "Accelerate's sync_gradients stays False, gradient_accumulation_steps=10000"
    _told_from_the_start(tdbg, "accelerate_sync_gradients", held_by)
    tdbg.close()


def test_a_raw_deepspeed_engine_whose_boundary_is_never_reached_is_told_with_its_accumulation_steps(
    one_rank_group, tmp_path, deepspeed_engine
):
    torch.manual_seed(0)
    engine, optimizer = deepspeed_engine(_model(), 2)
    tdbg = _debugger(engine, tmp_path)
    engine._config.gradient_accumulation_steps = 10_000  # after the debugger read it (1): the floor holds
    x = torch.randn(8, 4)
    for step in range(FLOOR):
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        tdbg.monitor_training_step(loss, optimizer=optimizer, step=step)
        engine.step()
    held_by = (
        "DeepSpeed's gradient-accumulation boundary not reached, gradient_accumulation_steps=10000; monitor before "
        "engine.step()"
    )
    _told_from_the_start(tdbg, "deepspeed_boundary", held_by)
    tdbg.close()


def test_a_declared_accumulation_longer_than_the_floor_is_quiet_and_sets_the_stretch_told(
    tmp_path, fresh_accelerate_state
):
    """Accelerate's ``gradient_accumulation_steps`` of 300 (past the floor): two optimizer steps of 300 calls
    each stay quiet; a stretch is told at four times the declared length, not at the floor."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=300)
    model = _model()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    tdbg = _debugger(model, tmp_path, accelerator=accelerator)
    assert tdbg._steps.sync_off.at == 4 * 300
    x = torch.randn(16, 4)
    for step in range(600):
        with accelerator.accumulate(model):
            loss = model(x).pow(2).mean()
            accelerator.backward(loss)
            tdbg.monitor_training_step(loss, optimizer=optimizer, step=step)
            optimizer.step()
            optimizer.zero_grad()
    counts = tdbg._steps.history.counts
    assert (counts.total_steps, counts.micro_steps) == (2, 598)
    assert _said(tdbg) == []
    assert [a for a in tdbg.report().anomalies if a.severity != "info"] == []
    tdbg.close()


def test_a_sync_off_finding_never_folds_with_another_not_learning_at_the_model():
    """``not_learning`` folds by place and ``stalled_optimizer``: the sync's finding names its own, so a whole-model
    stall at the same place (no ``stalled_optimizer``) and the sync's stay two, each with its message."""
    from diffusion_debug.record import Anomaly, kind_info
    from diffusion_debug.training.step.sync_off import SyncOffWatch, held_by, sync_off

    watch = SyncOffWatch()
    watch.run, watch.since = FLOOR, 0
    said = sync_off(watch, FLOOR - 1, 0, held_by("accumulating", None, None), None)
    stall = Anomaly("not_learning", "warning", "lr 0", "model", step=FLOOR - 1, details={"reason": "lr_zero"})
    key = kind_info("not_learning").fold_key
    assert key(said) != key(stall)
    assert said.details["stalled_optimizer"] == "none: gradient sync off"
    assert said.message == _message(FLOOR, 0, None, "the loop passes accumulating=True to every call")
