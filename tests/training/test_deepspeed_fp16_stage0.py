"""DeepSpeed fp16 without ZeRO (stage 0): ``engine.backward`` never scales the loss for
``FP16_UnfusedOptimizer`` / ``FP16_Optimizer``, whose ``step`` divides every gradient by its loss
scale (DeepSpeed's open bug, deepspeedai/DeepSpeed#8393): every update is the scale times too small.
Found by what the engine does at the first monitored step (``measure.deepspeed_fp16_scale``), never
by its version: the fp16 stage-0 run is named at step 0 and its norms are ``.grad``'s as they are;
bf16, float32, fp16 under ZeRO-1/2 and an engine that scales the loss (#8393's fix, simulated) are
quiet. One CPU rank in this process (the ``deepspeed_engine`` fixture; the helpers of
test_deepspeed_stage0.py); two ranks: test_deepspeed_stage0_launch.py's ``stage0_fp16_`` scenario."""

import pytest
import torch
from test_deepspeed_stage0 import _engine, _train

from diffusion_debug import DebugConfig, TrainingDebugger

UNSCALED = ("not_learning", "warning", 0, None, "deepspeed_fp16_unscaled_loss")
MESSAGE = (
    "DeepSpeed's fp16 engine without ZeRO (stage 0, FP16_UnfusedOptimizer) backpropagates the loss unscaled in "
    "engine.backward, yet its optimizer's step divides every gradient by the loss scale 256, so every update is "
    "256x too small and the run barely learns (DeepSpeed's bug, deepspeedai/DeepSpeed#8393; the gradient norms "
    "reported are the true ones): train in bf16, or with ZeRO stage >= 1, or with a DeepSpeed that has "
    "deepspeedai/DeepSpeed#8393's fix."
)


def _fixed_backward(monkeypatch, engine):
    """#8393's fix, simulated: ``engine.backward`` backpropagates the loss times the optimizer's loss scale."""
    original = type(engine).backward

    def backward(self, loss, *args, **kwargs):
        return original(self, loss * self.optimizer.loss_scale, *args, **kwargs)

    monkeypatch.setattr(type(engine), "backward", backward)


def test_fp16_stage0_unscaled_loss_is_named_at_step_0_and_the_norms_are_the_gradients_as_they_are(
    one_rank_group, tmp_path, deepspeed_engine
):
    """The one finding leads (the engine, the factor, DeepSpeed's issue, what to do); each step's norm is
    the naive one of ``.grad`` before the step, not divided by the scale (the debugger divided it: 256x
    too small); ``engine.backward`` is the engine's own again from the first call on."""
    engine, optimizer = _engine(deepspeed_engine, "fp16")
    norms, messages = [], []
    assert _train(engine, optimizer, tmp_path, norms=norms, messages=messages) == ([UNSCALED], 0)
    assert messages == [MESSAGE]
    for measured, reference in norms:
        assert measured == pytest.approx(reference, rel=1e-3), norms
    assert "backward" not in vars(engine)


@pytest.mark.parametrize("precision, stage", [("bf16", 0), ("fp32", 0), ("fp16", 1), ("fp16", 2)])
def test_bf16_fp32_and_zero_fp16_runs_stay_quiet_and_are_never_wrapped(
    one_rank_group, tmp_path, deepspeed_engine, precision, stage
):
    engine, optimizer = _engine(deepspeed_engine, precision, stage=stage)
    watched = []
    engine.register_forward_pre_hook(lambda *_: watched.append("backward" in vars(engine)))
    assert _train(engine, optimizer, tmp_path) == ([], 0)
    assert watched == [False] * 4  # no wrapper, not even before the first backward


def test_fp16_stage0_that_scales_the_loss_stays_quiet_and_its_norms_are_unscaled(
    one_rank_group, tmp_path, deepspeed_engine, monkeypatch
):
    """An engine whose ``backward`` scales the loss (#8393's fix): ``.grad`` holds the scale, divided out."""
    engine, optimizer = _engine(deepspeed_engine, "fp16")
    _fixed_backward(monkeypatch, engine)
    norms = []
    scales = []
    engine.register_forward_pre_hook(lambda *_: scales.append(float(optimizer.loss_scale)))
    assert _train(engine, optimizer, tmp_path, norms=norms) == ([], 0)
    for (measured, reference), scale in zip(norms, scales):
        assert measured == pytest.approx(reference / scale, rel=1e-3), (norms, scales)
    assert "backward" not in vars(engine)
    assert torch.isfinite(torch.tensor([n for n, _ in norms])).all()


def test_fp16_stage0_debugger_made_after_the_first_backward_names_it_at_step_1(
    one_rank_group, tmp_path, deepspeed_engine
):
    """``diffusion-debug launch`` makes the debugger inside step 0's ``engine.backward``: that call is not
    seen, so the next one decides (step 1's finding; step 0's norm divided by the scale as before); the
    wrapping waits one monitored step at most."""
    engine, optimizer = _engine(deepspeed_engine, "fp16")
    config = DebugConfig(output_dir=str(tmp_path), stream_events=False)
    tdbg, norms = None, []
    for step in range(3):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step)).half()
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        tdbg = tdbg or TrainingDebugger(engine, config=config)
        info = tdbg.monitor_training_step(loss, optimizer=optimizer, step=step)
        grads = float(sum(p.grad.double().square().sum() for p in engine.module.parameters()).sqrt())
        norms.append((info["grad_norm"], grads))
        engine.step()
    assert "backward" not in vars(engine)
    tdbg.close()
    assert [(a.kind, a.step, a.details["loss_scale"]) for a in tdbg.report().anomalies] == [("not_learning", 1, 256.0)]
    assert norms[0][0] == pytest.approx(norms[0][1] / 256, rel=1e-3), norms
    for measured, reference in norms[1:]:
        assert measured == pytest.approx(reference, rel=1e-3), norms


@pytest.mark.parametrize("fixed", [False, True])
def test_fp16_stage0_under_gradient_accumulation_with_extra_arguments_and_a_failed_backward_is_read_right(
    one_rank_group, deepspeed_engine, monkeypatch, fixed
):
    """``gradient_accumulation_steps`` 4: the loss reaches backward divided by 4 (unscaled: 1/4, not misread as
    scaled; #8393's fix: 256/4, quiet); ``retain_graph``/``scale_wrt_gas`` given as keywords or positionally
    reach the engine's own; a backward that raises (a loss with no graph) puts the engine's own back and
    decides nothing, the next one decides; detached before any backward, nothing stays on the engine."""
    from diffusion_debug.training.measure.deepspeed_fp16_scale import LossScaling

    engine, _ = _engine(deepspeed_engine, "fp16", extra={"gradient_accumulation_steps": 4})
    if fixed:
        _fixed_backward(monkeypatch, engine)
    untouched = LossScaling.of([engine])
    untouched.attach().remove()  # detached before the first backward
    assert "backward" not in vars(engine)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0)).half()
    scaling = LossScaling.of([engine])
    scaling.attach()
    with pytest.raises((RuntimeError, AssertionError)):  # DeepSpeed's own error, as without the debugger
        engine.backward(torch.zeros(()))
    assert "backward" not in vars(engine) and scaling.unscaled() is None
    scaling.attach()
    loss = engine(x).float().pow(2).mean()
    returned = engine.backward(loss, retain_graph=True)  # the graph kept: backward again below
    assert "backward" not in vars(engine)
    assert float(returned) == pytest.approx(float(loss) / 4 * (256 if fixed else 1), rel=1e-3)  # the engine's
    engine.backward(loss, False, False)  # positional retain_graph, scale_wrt_gas: the engine's own
    found = scaling.unscaled()
    assert found == (None if fixed else {"loss_scale": 256.0, "optimizer": "FP16_UnfusedOptimizer"})


@pytest.mark.parametrize("first_detached", ["outer", "inner"])
def test_two_watchers_on_one_fp16_engine_leave_its_own_backward_whichever_detaches_first(
    one_rank_group, deepspeed_engine, first_detached
):
    """Two debuggers' wrappers on one engine: one detached before any backward, the other still decides at
    the next backward, after which the engine's ``backward`` is its own again (no wrapper left behind)."""
    from diffusion_debug.training.measure.deepspeed_fp16_scale import LossScaling

    engine, _ = _engine(deepspeed_engine, "fp16")
    inner, outer = LossScaling.of([engine]), LossScaling.of([engine])
    handles = {"inner": inner.attach(), "outer": outer.attach()}
    handles[first_detached].remove()
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0)).half()
    engine.backward(engine(x).float().pow(2).mean())
    assert "backward" not in vars(engine)
    kept = outer if first_detached == "inner" else inner
    assert kept.unscaled() == {"loss_scale": 256.0, "optimizer": "FP16_UnfusedOptimizer"}
    handles["inner" if first_detached == "outer" else "outer"].remove()
    assert "backward" not in vars(engine)


def test_fp16_stage0_loss_the_user_scales_before_engine_backward_stays_quiet_and_its_norms_are_unscaled(
    one_rank_group, tmp_path, deepspeed_engine
):
    """#8393's workaround, ``engine.backward(loss * optimizer.loss_scale)``: ``.grad`` holds the scale (the
    debugger had named the run unscaled, and reported norms 256x too large); quiet, the scale divided out."""
    engine, optimizer = _engine(deepspeed_engine, "fp16")
    tdbg = TrainingDebugger(engine, config=DebugConfig(output_dir=str(tmp_path), stream_events=False))
    norms = []
    for step in range(2):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step)).half()
        loss = engine(x).float().pow(2).mean()
        scale = float(optimizer.loss_scale)
        engine.backward(loss * scale)
        info = tdbg.monitor_training_step(loss, optimizer=optimizer, step=step)
        grads = float(sum(p.grad.double().square().sum() for p in engine.module.parameters()).sqrt())
        norms.append((info["grad_norm"], grads / scale))
        engine.step()
    tdbg.close()
    assert [a.kind for a in tdbg.report().anomalies] == []
    assert "backward" not in vars(engine)
    for measured, reference in norms:
        assert measured == pytest.approx(reference, rel=1e-3), norms


def test_fp16_engine_deep_copied_before_its_first_backward_backpropagates_as_the_plain_one(
    one_rank_group, deepspeed_engine, monkeypatch
):
    """A deep copy of an engine whose next ``backward`` two watchers wrap gets DeepSpeed's own, bound to the
    copy, and nothing of theirs (before: a copy of the top wrapper and of both ``LossScaling``); its backward
    fills its own ``.grad`` only, and the engine's next backward is still read (and unwrapped)."""
    from test_deepspeed_stage0 import _deep_copy
    from test_shared_clip import _debuggers_objects

    from diffusion_debug.training.measure.deepspeed_fp16_scale import LossScaling

    engine, _ = _engine(deepspeed_engine, "fp16")
    watchers = [LossScaling.of([engine]), LossScaling.of([engine])]
    handles = [watcher.attach() for watcher in watchers]
    twin = _deep_copy(engine, monkeypatch)
    assert _debuggers_objects(twin, besides=[engine]) == set()  # DeepSpeed's hooks' closures hold it
    assert (twin.backward.__func__, twin.backward.__self__) == (type(engine).backward, twin)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0)).half()
    twin.backward(twin(x).float().pow(2).mean())
    assert all(p.grad is not None for p in twin.module.parameters())
    assert all(p.grad is None for p in engine.module.parameters())
    assert [w.unscaled() for w in watchers] == [None, None]
    engine.backward(engine(x).float().pow(2).mean())
    assert "backward" not in vars(engine)
    assert watchers[1].unscaled() == {"loss_scale": 256.0, "optimizer": "FP16_UnfusedOptimizer"}
    for handle in handles:
        handle.remove()
    assert "backward" not in vars(engine)
