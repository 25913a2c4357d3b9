"""Autograd anomaly mode: the closure replay and localize() name the backward op and leave the
user's gradients and random numbers alone; anomaly_mode() records, warns or raises; process-wide
anomaly mode must not break the user's backward and is restored on detach or collection."""

import gc
import math
import warnings

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from diffusion_debug import DebugConfig, DiffusionDebugError, TrainingDebugger
from diffusion_debug.record import make_anomaly
from diffusion_debug.training.judges.anomaly_mode import localization_anomaly
from diffusion_debug.training.judges.causes import trace_causes

NAN = math.nan


@pytest.fixture
def restore_anomaly_mode():
    before = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
    yield before
    torch.set_anomaly_enabled(*before)


def _batch(generator, n=16):
    x = torch.randn(n, 4, generator=generator)
    return x, torch.sin(x).sum(1, keepdim=True)


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


@pytest.mark.usefixtures("only_the_tests_objects")  # its gc.collect() walks only what the test made
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


@pytest.mark.parametrize("several", [False, True])
def test_localize_leaves_the_running_statistics_alone(tmp_path, several):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)).train()
    other = torch.nn.Linear(4, 1)
    watched = {"model": model, "head": other} if several else model
    tdbg = TrainingDebugger(watched, config=DebugConfig(output_dir=str(tmp_path), stream_events=False))
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def closure():
        return other(model(torch.randn(8, 4))).sub(100).sqrt().mean()

    assert tdbg.localize(closure)["found"]
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    tdbg.close()


def test_closure_localizes_backward_op_and_keeps_grads(mlp, tmp_path):
    tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path)))
    x, y = _batch(torch.Generator().manual_seed(0))
    shift = torch.tensor(100.0)

    def closure():
        return torch.sqrt(mlp(x) - shift).mean()  # sqrt of a negative: NaN

    loss = closure()
    loss.backward()
    saved = [p.grad.clone() for p in mlp.parameters()]
    tdbg.monitor_training_step(loss, step=0, closure=closure)
    for p, g in zip(mlp.parameters(), saved):
        torch.testing.assert_close(p.grad, g, equal_nan=True)
    loss_anomaly = next(a for a in tdbg.report().anomalies if a.kind == "nonfinite_loss")
    found = loss_anomaly.details["localization"]
    assert found["found"] and found["op"] == "SqrtBackward0"
    assert "test_anomaly_mode.py" in found["forward_line"] and "torch.sqrt" in found["forward_line"]
    assert tdbg.localize(closure)["op"] == "SqrtBackward0"


def test_anomaly_mode_context_records(mlp, tmp_path):
    tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path), autograd_anomaly_mode="detect"))
    x, y = _batch(torch.Generator().manual_seed(0))
    with tdbg.anomaly_mode():
        (mlp(x).log() * 0 + mlp(x).sqrt()).mean().backward()
    (a,) = tdbg.report().anomalies
    assert a.kind == "nonfinite" and a.details["localization"]["op"] in ("LogBackward0", "SqrtBackward0")
    # backward stopped at the NaN: what gradients exist are zeroed, so optimizer.step() adds nothing
    assert all(p.grad is None or torch.count_nonzero(p.grad) == 0 for p in mlp.parameters())


def test_anomaly_mode_raise_and_warn_modes(mlp, tmp_path):
    x, _ = _batch(torch.Generator().manual_seed(0))
    raising = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path), autograd_anomaly_mode="raise"))
    with pytest.raises(DiffusionDebugError, match="SqrtBackward0"):
        with raising.anomaly_mode():
            (mlp(x) - 100).sqrt().mean().backward()
    raising.detach()
    warning = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path), autograd_anomaly_mode="warn"))
    with pytest.warns(UserWarning, match="from the user"), pytest.warns(RuntimeWarning, match="SqrtBackward0"):
        with warning.anomaly_mode():
            warnings.warn("from the user", UserWarning)
            (mlp(x) - 100).sqrt().mean().backward()
    with warning.anomaly_mode():  # a clean backward records nothing
        mlp(x).pow(2).mean().backward()
    assert [a.kind for a in warning.report().anomalies] == ["nonfinite"]


def test_a_localized_nonfinite_keeps_its_message_when_linked_to_its_cause():
    # what anomaly mode found has no gradient counts: linking it to the step's NaN loss must keep
    # its message, not rebuild the gradients' one from details it lacks
    found = localization_anomaly({"found": True, "op": "DivBackward0", "value": "nan"}, 3, 0)
    loss = make_anomaly("nonfinite_loss", step=3, component="model", details={"loss": "nan"})
    traced = trace_causes([found, loss])
    assert [a.kind for a in traced] == ["nonfinite_loss", "nonfinite"]
    assert traced[1].message == found.message and traced[1].details["follows"] == {"kind": "nonfinite_loss", "rank": 0}


def test_the_replay_adds_no_gradient_to_parameters_it_does_not_watch(tmp_path):
    # the same optimizer trains the watched `model` and an unwatched `other`: the closure's replay
    # must leave `other`'s gradients as the user's backward made them
    torch.manual_seed(0)
    model, other = torch.nn.Linear(8, 1), torch.nn.Linear(8, 1)
    x = torch.randn(64, 8)

    def closure():
        out = model(x)
        return torch.sqrt(out - out.detach()).mean() + other(x).pow(2).mean()  # sqrt(0): NaN in model's only

    tdbg = TrainingDebugger(model, config=DebugConfig(output_dir=str(tmp_path), stream_events=False))
    closure().backward()
    before = [p.grad.clone() for p in other.parameters()]
    tdbg.monitor_training_step(
        closure(), optimizer=torch.optim.SGD([*model.parameters(), *other.parameters()]), step=0, closure=closure
    )
    assert all(torch.equal(b, p.grad) for b, p in zip(before, other.parameters()))
    (found,) = [a for a in tdbg.report().anomalies if a.kind == "nonfinite"]
    assert found.details["localization"]["found"] is True
    tdbg.close()


PLANTED_OOM = "CUDA out of memory. Tried to allocate 2.00 GiB (planted by diffusion_debug.testing)"


@pytest.mark.parametrize("fault", ["oom", "closure_bug"])
def test_a_failed_closure_replay_is_the_debuggers_own_failure_at_its_step(mlp, tmp_path, fault):
    """The ``closure=`` replay (the debugger's own forward and backward) fails at step 1: an OOM in
    the model's first layer (seen by the OOM watch's hooks, but not the user's), or a closure that
    returns no tensor when called again. Recorded as a ``debugger_error`` at ``replay``, step 1,
    naming the error (and still in the NaN loss's localisation); no ``out_of_memory``; the user's
    gradients as their backward made them; training goes on."""
    from diffusion_debug.testing import plant_oom

    x, _ = _batch(torch.Generator().manual_seed(0))
    calls = {"n": 0}

    def closure():
        calls["n"] += 1
        if fault == "closure_bug" and calls["n"] == 3:  # the replay: the user's calls were the first two
            return None
        return torch.sqrt(mlp(x) + (100.0 if calls["n"] < 2 else -100.0)).mean()  # step 1: sqrt(<0), NaN

    tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path), stream_events=False))
    optimizer = torch.optim.SGD(mlp.parameters(), lr=0.0)
    with plant_oom(mlp[0], from_call=2 if fault == "oom" else 99):  # its 3rd forward: the replay's
        for step in range(2):
            optimizer.zero_grad()
            loss = closure()
            loss.backward()
            saved = [p.grad.clone() for p in mlp.parameters()]
            info = tdbg.monitor_training_step(loss, optimizer=optimizer, step=step, closure=closure)
            for before, p in zip(saved, mlp.parameters()):  # NaN included
                torch.testing.assert_close(p.grad, before, rtol=0, atol=0, equal_nan=True)
            assert info.get("monitored", True)  # training went on: the step was monitored
            optimizer.step()
    assert calls["n"] == 3
    anomalies = tdbg.report().anomalies
    assert [a for a in anomalies if a.kind == "out_of_memory"] == []
    expected = (
        f"OutOfMemoryError: {PLANTED_OOM}"
        if fault == "oom"
        else "TypeError: the closure must return the loss tensor, not NoneType"
    )
    (failure,) = [a for a in anomalies if a.kind == "debugger_error"]
    assert (failure.details["where"], failure.step, failure.rank, failure.details["error"]) == (
        "replay",
        1,
        0,
        expected,
    )
    assert failure.message == (
        f"Rank 0 failed to replay closure= for step 1 ({expected}) and training went on; "
        "set strict=True to see the traceback."
    )
    (loss_anomaly,) = [a for a in anomalies if a.kind == "nonfinite_loss"]
    assert loss_anomaly.details["localization"]["found"] is False
    tdbg.close()


@pytest.mark.parametrize("fault", ["oom", "closure_bug"])
def test_with_strict_a_closure_that_fails_on_its_replay_raises_and_the_nan_loss_says_the_replay_failed(
    mlp, tmp_path, fault
):
    """``strict=True``: the replay's failure reaches the caller, an OOM in it (the debugger's own
    forward, as the diffusion side's own replays) as well as the closure's own error (it returns no
    tensor); recorded once, as a ``debugger_error`` at ``replay`` of step 0 that says it was raised
    (not at ``judging`` with 'training went on; set strict=True'), the error marked as recorded; no
    ``out_of_memory``; the NaN loss it was meant to localise still says that the replay failed and
    why, not 'pass closure= to name the op' (closure= was passed)."""
    from diffusion_debug.core import raised_by_debugger
    from diffusion_debug.testing import plant_oom

    x, _ = _batch(torch.Generator().manual_seed(0))
    calls = {"n": 0}

    def closure():
        calls["n"] += 1
        if fault == "closure_bug" and calls["n"] == 2:  # the replay
            return None
        return torch.sqrt(mlp(x) - 100.0).mean()  # NaN

    tdbg = TrainingDebugger(mlp, config=DebugConfig(output_dir=str(tmp_path), stream_events=False, strict=True))
    loss = closure()
    loss.backward()
    error_type, text = (
        (torch.cuda.OutOfMemoryError, PLANTED_OOM)
        if fault == "oom"
        else (TypeError, "the closure must return the loss tensor, not NoneType")
    )
    with plant_oom(mlp[0], from_call=0 if fault == "oom" else 99):  # its next forward: the replay's
        with pytest.raises(error_type) as raised:
            tdbg.monitor_training_step(loss, step=0, closure=closure)
    assert str(raised.value) == text and raised_by_debugger(raised.value)
    anomalies = tdbg.report().anomalies
    assert [a for a in anomalies if a.kind == "out_of_memory"] == []
    (failure,) = [a for a in anomalies if a.kind == "debugger_error"]
    name = "OutOfMemoryError" if fault == "oom" else "TypeError"
    assert (failure.details["where"], failure.step, failure.details["raised"]) == ("replay", 0, True)
    assert failure.message == f"The debugger's replay failed ({name}: {text}) and was raised (strict=True)."
    (loss_anomaly,) = [a for a in anomalies if a.kind == "nonfinite_loss"]
    assert loss_anomaly.details["localization"]["found"] is False
    assert "pass closure=" not in loss_anomaly.message
    assert loss_anomaly.message.endswith(f"the closure= replay under anomaly mode failed ({name}({text!r})).")
    tdbg.close()


def _sharded(engine, model):
    """``model`` under FSDP2 (``fully_shard`` on each Linear and the root) or FSDP1
    (``FullyShardedDataParallel(use_orig_params=True)``), on the one-rank group, on the CPU."""
    if engine == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(model, use_orig_params=True, device_id=torch.device("cpu"))
    from diffusion_debug.testing.features import FSDP2_ON_CPU

    if not FSDP2_ON_CPU:
        pytest.skip("this torch's FSDP2 needs CUDA streams")
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch 2.5, the floor: FSDP2 is not yet public
        from torch.distributed._composable.fsdp import fully_shard
    for module in (model[0], model[2], model):
        fully_shard(module)
    return model


@pytest.mark.filterwarnings("ignore:FSDP.state_dict_type:FutureWarning", "ignore::UserWarning")
@pytest.mark.parametrize(("engine", "name"), [("fsdp2", "FSDP2"), ("fsdp1", "FSDP1")])
def test_under_a_sharding_engine_a_nan_step_says_to_rerun_it_unsharded_not_to_pass_the_closure_it_ignores(
    mlp, tmp_path, one_rank_group, engine, name
):
    """FSDP2 and FSDP1 (and DeepSpeed ZeRO: test_pre_reduction.py) run no ``closure=`` replay (a
    forward on one rank of a sharded model would hang; FSDP1's backward reaches none of the watched
    parameters): the NaN loss and gradients of a step monitored with ``closure=`` say so and what
    names the op instead (the batch again without the engine, on one process or under DDP), with
    no localization. Before, both said "pass closure= to name the op", which the user had done."""
    model = _sharded(engine, mlp)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, _ = _batch(torch.Generator().manual_seed(0))
    planted = [False]  # a NaN made in the last layer's backward, under a finite loss
    mlp[2].register_full_backward_pre_hook(lambda m, grad_output: (grad_output[0] * NAN,) if planted[0] else None)

    def closure():
        return model(x).pow(2).mean() if planted[0] else (model(x) - 100).sqrt().mean()  # sqrt of a negative: NaN

    found = {}
    for fault in ("nonfinite_loss", "nonfinite"):  # a run each: the second would follow the first
        planted[0] = fault == "nonfinite"
        with TrainingDebugger(model, config=DebugConfig(output_dir=str(tmp_path), stream_events=False)) as tdbg:
            loss = closure()
            loss.backward()
            tdbg.monitor_training_step(loss, optimizer=optimizer, step=0, closure=closure, inputs={"x": x})
            optimizer.zero_grad()
            (found[fault],) = [a for a in tdbg.report().anomalies if a.kind == fault]
    assert found["nonfinite_loss"].message == (
        "The loss is nan at step 0 on rank 0; the input batch was finite, so the forward pass or the loss made it: "
        f"check the forward pass (closure= replays nothing under {name}: to name the op, rerun this batch without "
        "it, on one process or under DDP, with closure=), or lower the learning rate."
    )
    assert found["nonfinite"].message.endswith(
        " 2.weight in module 2, the last registered of those that hold NaN/Inf (no backward order was recorded): "
        "lower the learning rate, check the loss for NaN/Inf, or, as closure= replays nothing under "
        f"{name}, rerun this batch without it (on one process or under DDP) with closure= to name the backward op."
    )
    for a in found.values():
        assert a.details["sharded"] == engine and "localization" not in a.details and "pass closure" not in a.message


class _Checkpointed(torch.nn.Module):
    """A middle block under reentrant gradient checkpointing (transformers' default before 4.48, or
    ``enable_gradient_checkpointing(partial(checkpoint, use_reentrant=True))``) whose backward alone
    makes a NaN: ``where(h > 0, sqrt(h), h)`` sends 0 * inf back through the masked square roots."""

    def __init__(self):
        super().__init__()
        self.first, self.inner, self.last = torch.nn.Linear(4, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)

    def block(self, h):
        h = self.inner(h)
        return torch.where(h > 0, h.sqrt(), h)

    def forward(self, x):
        return self.last(torch.utils.checkpoint.checkpoint(self.block, self.first(x), use_reentrant=True))


def test_the_replay_names_the_op_inside_a_reentrant_checkpoint_and_keeps_every_gradient(tmp_path):
    # a replay with backward(inputs=...) stopped at the checkpoint ("incompatible with ... inputs"),
    # and that error's op, CheckpointFunctionBackward, was named: the replay runs a plain backward
    # there, and the gradients of the watched model and of an unwatched one are the user's
    torch.manual_seed(0)
    model, other = _Checkpointed(), torch.nn.Linear(4, 1)
    x = torch.randn(16, 4)

    def closure():
        return model(x).pow(2).mean() + other(x).pow(2).mean()

    tdbg = TrainingDebugger(model, config=DebugConfig(output_dir=str(tmp_path), stream_events=False))
    loss = closure()
    loss.backward()
    before = [p.grad.clone() for p in [*model.parameters(), *other.parameters()]]
    optimizer = torch.optim.SGD([*model.parameters(), *other.parameters()])
    tdbg.monitor_training_step(loss, optimizer=optimizer, step=0, closure=closure)
    after = [p.grad for p in [*model.parameters(), *other.parameters()]]
    assert all(torch.equal(b.nan_to_num(), a.nan_to_num()) for b, a in zip(before, after))
    (found,) = [a for a in tdbg.report().anomalies if a.kind == "nonfinite"]
    localized = found.details["localization"]
    assert (found.module, localized["op"]) == ("inner", "SqrtBackward0")
    assert localized["forward_line"].endswith("return torch.where(h > 0, h.sqrt(), h)")
    assert not [a for a in tdbg.report().anomalies if a.kind == "debugger_error"]
    tdbg.close()


def test_a_plain_backward_replay_reduces_no_other_ddp_model_the_closure_runs(tmp_path, one_rank_group):
    # the reentrant checkpoint sends the replay to a plain backward, which reached the reducer of a
    # DDP-wrapped model the closure trains beside the watched one (a text encoder): a rank whose
    # replay stopped at the NaN before it, while another's went on, all-reduced alone and hung
    torch.manual_seed(0)
    model = DistributedDataParallel(_Checkpointed())
    other = DistributedDataParallel(torch.nn.Linear(4, 1))
    reductions = []

    def counted(state, bucket):  # every bucket other's reducer all-reduces
        reductions.append(bucket.index())
        return allreduce_hook(state, bucket)

    other.register_comm_hook(None, counted)
    x = torch.randn(16, 4)

    def closure():  # other's backward runs first (created last): before the NaN stops the replay
        return model(x).pow(2).mean() + other(x).pow(2).mean()

    tdbg = TrainingDebugger(model, config=DebugConfig(output_dir=str(tmp_path), stream_events=False))
    loss = closure()
    loss.backward()
    assert reductions == [0]
    params = [*model.parameters(), *other.parameters()]
    before = [p.grad.clone() for p in params]
    tdbg.monitor_training_step(loss, optimizer=torch.optim.SGD(params), step=0, closure=closure)
    assert reductions == [0]  # the replay all-reduced nothing of other's
    assert all(torch.equal(b.view(torch.int32), p.grad.view(torch.int32)) for b, p in zip(before, params))  # bitwise
    (found,) = [a for a in tdbg.report().anomalies if a.kind == "nonfinite"]
    assert (found.module, found.details["localization"]["op"]) == ("inner", "SqrtBackward0")
    for ddp in (model, other):  # as the user left them: the next forward broadcasts the buffers too
        assert ddp.require_backward_grad_sync and ddp.require_forward_param_sync
    closure().backward()  # the user's next step: both reducers as before the replay
    assert reductions == [0, 0]
    tdbg.close()
