"""DeepSpeed without ZeRO (``zero_optimization.stage`` 0), one CPU rank in this process (the
session's gloo group of one, DS_ACCELERATOR=cpu: the ``deepspeed_engine`` fixture): in bf16 and fp16
the engine wraps the optimizer in its own mixed-precision optimizer (``FP16_UnfusedOptimizer`` here,
``FP16_Optimizer`` / ``BF16_Optimizer`` elsewhere), whose torch optimizer trains float32 copies of the
model's parameters, and skips a step whose gradients overflow (its ``overflow`` flag); a raw engine's
loop, and the same under Accelerate's DeepSpeed plugin (built in-process as ``accelerator.prepare``
builds it). Two ranks, a NaN made on rank 1 before the engine's all-reduce named at rank 1:
test_deepspeed_stage0_launch.py's ``stage0_`` scenarios (the session's launch of deepspeed_job.py). Skipped, saying
why, where DeepSpeed does not install or import (``pip install 'diffusion-debug[deepspeed]'``)."""

import math

import pytest
import torch

from diffusion_debug import DebugConfig, TrainingDebugger


def _engine(deepspeed_engine, precision="bf16", stage=0, extra=None):
    """A stage-0 engine of a tiny MLP in ``precision`` (fp16: DeepSpeed's dynamic loss scale, from
    2**8) and its optimizer (DeepSpeed's wrapper of SGD, or of the optimizer ``extra`` configures)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    scale = {"initial_scale_power": 8} if precision == "fp16" else {}
    mixed = {precision: {"enabled": True, **scale}} if precision != "fp32" else {}  # fp32: no wrapper
    return deepspeed_engine(model, stage, {**(extra or {}), **mixed})


def _accelerated(engine, optimizer, monkeypatch):
    """An Accelerator with Accelerate's DeepSpeed plugin, and the optimizer as ``accelerator.prepare``
    returns it (``DeepSpeedOptimizerWrapper``), ``accelerator.backward`` running the engine's
    ``backward`` and ``step``: built by hand as ``prepare`` builds them, whose batch-size check
    fails on the CPU."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin
    from accelerate.utils.deepspeed import DeepSpeedEngineWrapper, DeepSpeedOptimizerWrapper

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # the Accelerator sets it: unset after the test
    plugin = DeepSpeedPlugin(hf_ds_config={"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 0}})
    accelerator = Accelerator(deepspeed_plugin=plugin)
    accelerator.deepspeed_engine_wrapped = DeepSpeedEngineWrapper(engine)
    accelerator._models.append(engine)
    optimizer = DeepSpeedOptimizerWrapper(optimizer)
    accelerator._optimizers.append(optimizer)
    return accelerator, optimizer


def _train(
    engine, optimizer, tmp_path, nan_at=None, norms=None, accelerator=None, messages=None, watched=None, then=None
):
    """Four steps of a raw engine's loop, the monitor between backward and step (with
    ``accelerator``: ``accelerator.backward``, which steps, then the monitor; ``optimizer`` None:
    none passed to the monitor); a NaN planted in the last linear's weight gradient at step
    ``nan_at`` (or each of a tuple). The anomalies and the engine's skips; ``norms`` gets each step's measured gradient
    norm, and on a raw engine's loop the reference: every .grad as it is (fp16: never scaled, DeepSpeed#8393),
    ``(measured, reference)``; ``messages`` gets the anomalies' messages; ``watched``: the
    model the debugger is given (else the engine); ``then``: one more ``accelerator.backward``, not
    monitored, before close (``"nan"``: its gradient NaN)."""
    planted = [False]
    engine.module[2].weight.register_hook(lambda g: g * math.nan if planted[0] else g)
    config = DebugConfig(output_dir=str(tmp_path), stream_events=False)
    tdbg = TrainingDebugger(engine if watched is None else watched, accelerator=accelerator, config=config)
    for step in range(4):
        planted[0] = step in (nan_at if isinstance(nan_at, tuple) else (nan_at,))
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step)).to(next(engine.parameters()).dtype)
        loss = engine(x).float().pow(2).mean()
        (accelerator or engine).backward(loss)
        info = tdbg.monitor_training_step(loss, optimizer=optimizer, step=step)
        if norms is not None and accelerator is not None:
            norms.append(info["grad_norm"])
        elif norms is not None:  # fp16: the loss unscaled by engine.backward (DeepSpeed#8393), .grad too
            squares = sum(p.grad.double().square().sum() for p in engine.module.parameters())
            norms.append((info["grad_norm"], float(squares.sqrt())))
        if accelerator is None:
            engine.step()
    if then is not None:
        planted[0] = then == "nan"
        accelerator.backward(engine(x).float().pow(2).mean())
    tdbg.close()  # judges the last step's skip
    anomalies = tdbg.report().anomalies
    found = [(a.kind, a.severity, a.step, a.parameter, a.details.get("reason")) for a in anomalies]
    if messages is not None:
        messages += [a.message for a in anomalies]
    return found, engine.skipped_steps


@pytest.mark.parametrize("stage", [0, 1])
def test_stage0_clean_run_is_quiet_its_optimizer_trains_copies_of_the_model_s_parameters(
    one_rank_group, tmp_path, deepspeed_engine, stage
):
    """The torch optimizer inside holds float32 copies: they stand for the model's parameters, not
    parameters outside the model (and the model's are in an optimizer). Also ZeRO-1 in bf16 with
    float32 gradient accumulation, which DeepSpeed hands to ``BF16_Optimizer`` (its flat partitions)."""
    extra = {"data_types": {"grad_accum_dtype": "fp32"}} if stage else None
    engine, optimizer = _engine(deepspeed_engine, stage=stage, extra=extra)
    assert type(optimizer).__name__ == ("BF16_Optimizer" if stage else "FP16_UnfusedOptimizer")
    assert _train(engine, optimizer, tmp_path) == ([], 0)


def test_stage0_overflow_skip_is_recorded_as_deepspeed_s(one_rank_group, tmp_path, deepspeed_engine):
    engine, optimizer = _engine(deepspeed_engine)
    found, skipped = _train(engine, optimizer, tmp_path, nan_at=1)
    assert skipped == 1
    assert found == [
        ("nonfinite", "error", 1, "2.weight", None),
        ("skipped_step", "info", 1, None, "deepspeed_overflow"),
    ]


def test_stage0_each_rank_s_own_gradients_are_checked_before_the_engine_s_all_reduce(
    one_rank_group, tmp_path, deepspeed_engine
):
    """What the debugger attaches at several ranks (training/debugger.py): the engine's own
    all-reduce is checked first, so the rank that made a NaN is named (not the first rank); the
    engine holds its class's method again once released."""
    from diffusion_debug.training.measure.pre_reduction import PreReductionCheck

    engine, optimizer = _engine(deepspeed_engine)
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


def test_stage0_the_reduction_a_nan_and_a_stall_are_named_through_is_deepspeed_s(
    one_rank_group, tmp_path, deepspeed_engine
):
    """The engine's own all-reduce (``allreduce_gradients``) is named as DeepSpeed's, in a NaN's origin and
    in a rank waiting in backward (before: DDP's words, "the gradient all-reduce")."""
    from diffusion_debug.training.hangs.patterns import Position, name_stall
    from diffusion_debug.training.measure.pre_reduction import REDUCTIONS, engine_of

    engine, _ = _engine(deepspeed_engine)
    with TrainingDebugger(engine, config=DebugConfig(output_dir=str(tmp_path), stream_events=False)) as tdbg:
        assert (engine_of(tdbg.params, [engine]), tdbg._liveness.position.engine) == ("deepspeed", "deepspeed")
    assert REDUCTIONS["deepspeed"] == "DeepSpeed's gradient all-reduce"
    stall = name_stall([Position(0, "validation", 2), Position(1, "backward", 3, engine="deepspeed")])
    assert (
        stall.text
        == "rank 0 is in validation at step 2; rank 1 waits in backward (DeepSpeed's gradient all-reduce) at step 3"
    )


def test_stage0_fp16_the_norms_are_unscaled_and_an_overflow_is_the_loss_scaler_s(
    one_rank_group, tmp_path, deepspeed_engine
):
    """fp16's dynamic loss scale (2**8 here), which ``engine.backward`` never put in the gradients
    (DeepSpeed#8393: named at step 0): the norms are ``.grad``'s as they are, and a NaN an overflow its
    loss scaler skips (info)."""
    engine, optimizer = _engine(deepspeed_engine, "fp16")
    norms, messages = [], []
    found, skipped = _train(engine, optimizer, tmp_path, nan_at=1, norms=norms, messages=messages)
    assert skipped == 1
    assert found == OVERFLOW_SKIPPED_AT_1
    assert messages[1].endswith(
        "in module 2: DeepSpeed's loss scaler will skip this optimizer step and lower the scale."
    )
    for step in (0, 2, 3):
        assert norms[step][0] == pytest.approx(norms[step][1], rel=1e-3), norms


OVERFLOW_SKIPPED_AT_1 = [
    ("not_learning", "warning", 0, None, "deepspeed_fp16_unscaled_loss"),  # DeepSpeed#8393
    ("nonfinite", "info", 1, "2.weight", None),
    ("skipped_step", "info", 1, None, "deepspeed_overflow"),
]
"""fp16, a NaN planted at step 1: an overflow under the loss scale, and DeepSpeed's skip of that step."""
OVERFLOW_SKIPPED_AT_1_AND_3 = [
    *OVERFLOW_SKIPPED_AT_1,
    ("nonfinite", "info", 3, "2.weight", None),
    ("skipped_step", "info", 3, None, "deepspeed_overflow"),
]
"""The same at steps 1 and 3, the last: its skip is found at close."""


FP32_NAN_APPLIED_AT_1 = [
    ("nonfinite", "error", 1, "2.weight", None),
    ("nonfinite_loss", "error", 2, None, None),
    ("nonfinite", "error", 2, "0.weight", None),
]
"""float32 (no overflow check), a NaN planted at step 1: that step applies it, step 2's loss and gradients follow."""


@pytest.mark.parametrize(
    "precision, nan_at, expected",
    [("fp16", (1, 3), OVERFLOW_SKIPPED_AT_1_AND_3), ("fp32", 1, FP32_NAN_APPLIED_AT_1)],
    ids=["fp16", "fp32"],
)
def test_stage0_under_accelerate_s_plugin_a_step_reads_as_on_a_raw_engine(
    one_rank_group, tmp_path, deepspeed_engine, monkeypatch, fresh_accelerate_state, precision, nan_at, expected
):
    """Accelerate's DeepSpeed plugin runs ``engine.step`` inside ``accelerator.backward``, which then
    zeroes ``.grad``: the gradients are read as that step found them, before its float32 clip (a raw
    engine's loop's norms, unscaled), an fp16 overflow skip is DeepSpeed's at the step that overflowed
    (Accelerate's ``step_was_skipped`` forwards the flag of the step just taken: "grad_scaler", a step
    early; the last step's at close), and float32 NaN gradients the step applied are the cause of the
    next step's NaN loss (not a NaN update of the step before): the same anomalies, word for word,
    as the raw engine's loop."""
    reference, raw_messages = [], []
    engine, optimizer = _engine(deepspeed_engine, precision)
    raw = _train(engine, optimizer, tmp_path / "raw", nan_at, norms=reference, messages=raw_messages)
    assert raw == (expected, 2 if precision == "fp16" else 0)
    engine, optimizer = _engine(deepspeed_engine, precision)
    accelerator, optimizer = _accelerated(engine, optimizer, monkeypatch)
    norms, messages = [], []
    assert _train(engine, optimizer, tmp_path / "accelerate", nan_at, norms, accelerator, messages) == raw
    assert messages == raw_messages
    assert "step" not in vars(engine)  # the engine's own step again, once closed
    assert norms[0] == pytest.approx(reference[0][1], rel=1e-3)
    assert math.isnan(norms[1])
    if precision == "fp16":  # float32's weights are NaN from step 2 on
        assert norms[2] == pytest.approx(reference[2][1], rel=1e-3), (norms, reference)


@pytest.mark.parametrize("passed", [True, False], ids=["optimizer-passed", "no-optimizer-passed"])
def test_stage0_with_the_config_s_optimizer_is_watched_the_same(one_rank_group, tmp_path, deepspeed_engine, passed):
    """``deepspeed.initialize`` without ``optimizer=`` builds the one its config names (torch's AdamW
    here) and wraps it alike: watched the same, whether the monitor is passed the optimizer it
    returned (the copies it trains are the model's: no unwatched parameters) or none (its loss scale
    and skip read through the engine the debugger was given)."""
    extra = {"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, optimizer = _engine(deepspeed_engine, "fp16", extra=extra)
    assert (type(optimizer).__name__, type(optimizer.optimizer).__name__) == ("FP16_UnfusedOptimizer", "AdamW")
    norms = []
    found = _train(engine, optimizer if passed else None, tmp_path, nan_at=1, norms=norms)
    assert found == (OVERFLOW_SKIPPED_AT_1, 1)
    for step in (0, 2, 3):
        assert norms[step][0] == pytest.approx(norms[step][1], rel=1e-3), norms


def test_stage0_under_accelerate_s_plugin_policy_skip_is_refused_before_the_run(
    one_rank_group, tmp_path, deepspeed_engine, monkeypatch, fresh_accelerate_state
):
    """The step that ``skip`` would keep from the batch's gradients has run inside
    ``accelerator.backward``: refused when the debugger is made, as under ZeRO, nothing written."""
    from diffusion_debug.errors import ConfigError

    engine, optimizer = _engine(deepspeed_engine)
    accelerator, _ = _accelerated(engine, optimizer, monkeypatch)
    with pytest.raises(ConfigError, match="^policy 'skip' cannot zero this run's gradients \\(Accelerate's DeepSpeed"):
        TrainingDebugger(engine, accelerator=accelerator, config=DebugConfig(output_dir=str(tmp_path), policy="skip"))
    assert list(tmp_path.iterdir()) == []


def test_stage0_a_raw_engine_s_module_watched_reads_the_optimizer_passed_as_before(
    one_rank_group, tmp_path, deepspeed_engine
):
    """``deepspeed.initialize(model=model)``'s loop watched through ``model`` (the engine's module, not
    the engine) with the optimizer it returned passed to the monitor: fp16's loss scale and overflow
    skip are that optimizer's, read as they were before the debugger found DeepSpeed at its making
    (a NaN under the scale is the loss scaler's overflow, info, not an error that stops the run). Limit:
    without the engine its ``backward`` is not seen, so DeepSpeed#8393's unscaled loss is not found
    and the norms are divided by the scale as if ``.grad`` held it (``deepspeed_fp16_scale``)."""
    engine, optimizer = _engine(deepspeed_engine, "fp16")
    norms = []
    found = _train(engine, optimizer, tmp_path, nan_at=1, norms=norms, watched=engine.module)
    assert found == (OVERFLOW_SKIPPED_AT_1[1:], 1)
    for step, scale in ((0, 2.0**8), (2, 2.0**7), (3, 2.0**7)):  # the scale halved by step 1's overflow
        assert norms[step][0] == pytest.approx(norms[step][1] / scale, rel=1e-3), norms


@pytest.mark.parametrize(
    "nan_at, then, expected",
    [((1, 3), "clean", OVERFLOW_SKIPPED_AT_1_AND_3), (1, "nan", OVERFLOW_SKIPPED_AT_1)],
    ids=["last-skipped-then-clean", "last-clean-then-overflow"],
)
def test_stage0_under_accelerate_s_plugin_a_backward_after_the_last_monitor_is_not_judged_at_close(
    one_rank_group, tmp_path, deepspeed_engine, monkeypatch, fresh_accelerate_state, nan_at, then, expected
):
    """fp16: an ``accelerator.backward`` after the last monitored step (its step runs DeepSpeed's own
    step, not monitored): the skip judged at close is the last monitored step's, not that one's
    (neither a missed skip of step 3 nor one made up from a step no monitor saw)."""
    engine, optimizer = _engine(deepspeed_engine, "fp16")
    accelerator, optimizer = _accelerated(engine, optimizer, monkeypatch)
    found, skipped = _train(engine, optimizer, tmp_path, nan_at, accelerator=accelerator, then=then)
    assert (found, skipped) == (expected, len(expected) // 2 + (then == "nan"))


@pytest.mark.parametrize("first_closed", ["first", "second"])
def test_stage0_two_debuggers_on_one_engine_each_closes_only_its_own_step_wrapper(
    one_rank_group, tmp_path, deepspeed_engine, monkeypatch, fresh_accelerate_state, first_closed
):
    """Two debuggers made on the same engine under Accelerate's plugin, neither closed before the
    other is made: closing one leaves the other's wrapper of the engine's ``step`` (it still reads
    the step's NaN), and closing both, in either order, leaves the engine's own ``step``."""
    engine, optimizer = _engine(deepspeed_engine)
    accelerator, optimizer = _accelerated(engine, optimizer, monkeypatch)
    planted = [False]
    engine.module[2].weight.register_hook(lambda g: g * math.nan if planted[0] else g)
    made = [
        TrainingDebugger(engine, accelerator=accelerator, config=DebugConfig(output_dir=str(tmp_path / n)))
        for n in ("first", "second")
    ]
    closing = made.pop(0 if first_closed == "first" else 1)
    closing.close()
    (kept,) = made
    for step in range(2):
        planted[0] = step == 1
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step)).bfloat16()
        accelerator.backward(engine(x).float().pow(2).mean())
        info = kept.monitor_training_step(engine(x).float().sum(), optimizer=optimizer, step=step)
        assert math.isnan(info["grad_norm"]) == (step == 1), info
    kept.close()
    assert "step" not in vars(engine)
    assert [(a.kind, a.step, a.parameter) for a in kept.report().anomalies] == [
        ("nonfinite", 1, "2.weight"),
        ("skipped_step", 1, None),  # bf16's wrapper skips a NaN step too: the last step's, judged at close
    ]


def test_stage0_under_accelerate_s_plugin_several_engines_norms_are_each_engine_s_own(
    one_rank_group, tmp_path, deepspeed_engine, monkeypatch, fresh_accelerate_state
):
    """A UNet's and a text encoder's engines both prepared, one debugger watching both: each engine's
    step (inside its backward) keeps its own gradients' norms, before it zeroes them; the first
    engine's are not read again after its step (zeros, a NaN missed): the same norms and anomalies
    as the raw engines' loop, which monitors before both steps; the step's skip is either engine's."""
    from accelerate.utils.deepspeed import DeepSpeedEngineWrapper

    def run(accelerate, out):
        engines = [_engine(deepspeed_engine) for _ in range(2)]
        accelerator = None
        if accelerate:
            accelerator, _ = _accelerated(*engines[0], monkeypatch)
            accelerator._models.append(engines[1][0])
        planted = [False]
        engines[0][0].module[2].weight.register_hook(lambda g: g * math.nan if planted[0] else g)
        config = DebugConfig(output_dir=str(out), stream_events=False)
        models = {"unet": engines[0][0], "text_encoder": engines[1][0]}
        tdbg, norms = TrainingDebugger(models, accelerator=accelerator, config=config), []
        for step in range(3):
            planted[0] = step == 1
            for k, (engine, _) in enumerate(engines):
                x = torch.randn(8, 4, generator=torch.Generator().manual_seed(10 * k + step)).bfloat16()
                loss = engine(x).float().pow(2).mean()
                (DeepSpeedEngineWrapper(engine).backward if accelerate else engine.backward)(loss)
            norms.append(tdbg.monitor_training_step(loss, optimizer=engines[1][1], step=step)["grad_norm"])
            for engine, _ in [] if accelerate else engines:
                engine.step()
        tdbg.close()
        found = [(a.kind, a.severity, a.step, a.component, a.parameter) for a in tdbg.report().anomalies]
        return found, norms

    raw_found, raw_norms = run(False, tmp_path / "raw")
    assert raw_found == [("nonfinite", "error", 1, "unet", "2.weight")]
    found, norms = run(True, tmp_path / "accelerate")
    # and the UNet's engine's skip of step 1 (bf16's wrapper skips a NaN step), which the raw loop,
    # given the text encoder's optimizer, does not read
    assert found == [*raw_found, ("skipped_step", "info", 1, "model", None)]
    assert norms[0] == pytest.approx(raw_norms[0], rel=1e-3) and math.isnan(norms[1])
    assert norms[2] == pytest.approx(raw_norms[2], rel=1e-3)


def _deep_copy(engine, monkeypatch):
    """``copy.deepcopy(engine)`` sharing its process groups and locks (which no deep copy takes, with or
    without a debugger): a copy made as a framework that clones a DeepSpeed engine would make it."""
    import copy
    import threading

    import torch.distributed as dist

    for shared in (dist.ProcessGroup, type(threading.Lock()), type(threading.RLock())):
        monkeypatch.setitem(copy._deepcopy_dispatch, shared, lambda kept, memo: kept)
    return copy.deepcopy(engine)


def test_stage0_an_engine_deep_copied_while_two_debuggers_watch_it_steps_as_the_plain_one_both_still_watching(
    one_rank_group, tmp_path, deepspeed_engine, monkeypatch, fresh_accelerate_state
):
    """Two debuggers' wrappers of ``engine.step`` (Accelerate's plugin): a deep copy of the engine gets
    DeepSpeed's own ``step``, bound to the copy, and nothing of the debuggers' (before: a copy of the top
    wrapper, holding copies of both debuggers' measures); it steps its own parameters, and both debuggers
    still read the engine's next step (its NaN); closed, the engine's own ``step`` again. The check of a run
    of several processes on its ``allreduce_gradients`` is left behind alike (before: the copy all-reduced
    the original's gradients through it)."""
    from test_shared_clip import _debuggers_objects

    from diffusion_debug.training.measure.pre_reduction import PreReductionCheck

    engine, optimizer = _engine(deepspeed_engine)
    accelerator, optimizer = _accelerated(engine, optimizer, monkeypatch)
    made = [
        TrainingDebugger(engine, accelerator=accelerator, config=DebugConfig(output_dir=str(tmp_path / n)))
        for n in ("first", "second")
    ]
    check = PreReductionCheck.attach([engine])  # as a debugger of two processes wraps it
    twin = _deep_copy(engine, monkeypatch)
    assert _debuggers_objects(twin, besides=[engine]) == set()  # DeepSpeed's hooks' closures hold it
    assert (twin.step.__func__, twin.step.__self__) == (type(engine).step, twin)
    reduce = twin.allreduce_gradients
    assert (reduce.__func__, reduce.__self__) == (type(engine).allreduce_gradients, twin)
    check.release()
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0)).bfloat16()
    kept = [p.detach().clone() for p in engine.module.parameters()]
    twin.backward(twin(x).float().pow(2).mean())
    before = [p.detach().clone() for p in twin.module.parameters()]
    twin.step()
    # an SGD step of lr 0.01 in bf16 (the first layer's bias rounds back to itself)
    assert [torch.equal(p, b) for p, b in zip(twin.module.parameters(), before)] == [False, True, False, False]
    assert all(torch.equal(p, k) for p, k in zip(engine.module.parameters(), kept))
    engine.module[2].weight.register_hook(lambda g: g * math.nan)
    accelerator.backward(engine(x).float().pow(2).mean())
    for debugger in made:
        info = debugger.monitor_training_step(engine(x).float().sum(), optimizer=optimizer, step=0)
        assert math.isnan(info["grad_norm"]), info
        debugger.close()
    assert "step" not in vars(engine)


class _Stepper:
    """A picklable owner of a ``step`` (module level): what a debugger's step wrapper may sit on."""

    def __init__(self):
        self.steps = 0

    def step(self):
        self.steps += 1


def test_a_pickled_owner_of_two_stacked_step_wrappers_unpickles_with_its_own_step():
    """Pickling an object whose ``step`` two debuggers wrap (each wrapper's calls are the debugger's: not
    picklable) gives its own ``step``, bound to the copy, where pickling failed (the wrapper's calls); the
    original still runs both wrappers; removed in either order, its own again."""
    import pickle

    from diffusion_debug.training.measure.deepspeed_zero import _StepWrap

    for first in (0, 1):
        owner, calls = _Stepper(), []
        wraps = [_StepWrap(owner, lambda k=k: calls.append(k), lambda overflow: None) for k in (0, 1)]
        twin = pickle.loads(pickle.dumps(owner))
        assert (twin.step.__func__, twin.step.__self__) == (_Stepper.step, twin)
        twin.step()
        assert (twin.steps, owner.steps, calls) == (1, 0, [])
        owner.step()
        assert (owner.steps, calls) == (1, [1, 0])
        wraps[first].remove(), wraps[1 - first].remove()
        assert "step" not in vars(owner)


def test_stage0_the_accumulation_boundary_is_read_from_the_engines_with_an_optimizer(one_rank_group, deepspeed_engine):
    """``DeepSpeedSteps.at_boundary`` over two stage-0 engines: one with an optimizer (at its boundary,
    ``gradient_accumulation_steps`` 1), and one kept without (``EngineWithoutZero.find`` keeps it; its optimizer
    taken away), at 2: never stepped, it never reaches its boundary. Read from it too, every call would be a
    micro-step; the stepping engine's boundary off, a call is one."""
    from diffusion_debug.training.measure.deepspeed_stage0 import EngineWithoutZero

    stepping, _ = _engine(deepspeed_engine, "fp32")
    idle, _ = _engine(deepspeed_engine, "fp32", extra={"gradient_accumulation_steps": 2})
    idle.optimizer = None
    params = [p for e in (stepping, idle) for p in e.module.parameters()]
    steps = EngineWithoutZero.find(params, [stepping, idle])
    assert steps.engines == [stepping, idle] and not idle.is_gradient_accumulation_boundary()
    read = [steps.at_boundary()]
    stepping.set_gradient_accumulation_boundary(False)
    assert read + [steps.at_boundary()] == [True, False]
