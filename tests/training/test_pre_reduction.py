"""Each rank's gradients checked before the engine reduces them (``measure.pre_reduction``: DDP's
all-reduce, FSDP2's reduce-scatter, DeepSpeed ZeRO's bucket reduction), and the rank named from it
(``ranks.origin``): in one process, a gloo group of world size 1 (the launches of test_multiprocess.py
and test_deepspeed.py run the two-rank cases). Over 500 lines: the check on each engine, its cost in
host reads and collectives, and the naming it feeds, kept together."""

import collections
import math

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode

from diffusion_debug import DebugConfig, TrainingDebugger
from diffusion_debug.record import Anomaly, by_cause, folded, headline, rebuilt
from diffusion_debug.testing.features import FSDP2_ON_CPU
from diffusion_debug.training.measure.optimizer_state import gradients_incomplete
from diffusion_debug.training.measure.pre_reduction import (
    REDUCTIONS,
    PreReductionCheck,
    attach_before_backward,
    ddp_models,
    engine_of,
    fsdp_groups,
)
from diffusion_debug.training.ranks.origin import name_origin

NAN = float("nan")
NEEDS_FSDP2 = pytest.mark.skipif(not FSDP2_ON_CPU, reason="this torch's FSDP2 needs CUDA streams")


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _grads(ddp, x):
    ddp.zero_grad()
    ddp(x).pow(2).mean().backward()
    return [p.grad.clone() for p in ddp.parameters()]


def test_the_hook_counts_this_rank_s_own_nan_before_the_all_reduce_and_changes_no_gradient(one_rank_group):
    plain, checked = DistributedDataParallel(_model()), DistributedDataParallel(_model())
    check = PreReductionCheck.attach([checked])
    assert check.watching and check.off == []
    zero = torch.zeros((), dtype=torch.float64)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    for a, b in zip(_grads(plain, x), _grads(checked, x)):
        assert torch.equal(a, b)  # bitwise: the default all-reduce, wrapped
    assert check.take(zero).item() == 0.0
    planted = [False]
    checked.module[2].weight.register_hook(lambda g: g * NAN if planted[0] else g)
    planted[0] = True
    _grads(checked, x)
    assert check.take(zero).item() == 1.0
    assert torch.isnan(check.take(zero)).item()  # it starts again: no bucket since is "not checked"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_bucket_is_non_finite_exactly_when_one_of_its_values_is(dtype):
    check, zero = PreReductionCheck(), torch.zeros((), dtype=torch.float64)
    check.watching = True
    top = torch.finfo(dtype).max  # the largest values, both signs: their spread overflows no float64
    check.add(torch.tensor([top, -top, 0.0], dtype=dtype))
    check.add(torch.tensor([top, -top], dtype=dtype))
    assert check.take(zero).item() == 0.0
    for bad in (NAN, float("inf"), -float("inf")):
        buckets = [torch.ones(5, dtype=dtype), torch.ones(7, dtype=dtype)]
        buckets[1][-1] = bad
        for bucket in buckets:
            check.add(bucket)
        assert check.take(zero).item() == 1.0, bad


def test_a_check_attached_after_a_backward_says_not_checked_until_the_next_one(one_rank_group):
    ddp = DistributedDataParallel(_model())
    _grads(ddp, torch.randn(8, 4))
    check, zero = PreReductionCheck.attach([ddp]), torch.zeros((), dtype=torch.float64)
    assert torch.isnan(check.take(zero)).item()  # `launch` makes the debugger at the first optimizer step
    _grads(ddp, torch.randn(8, 4))
    assert check.take(zero).item() == 0.0


def test_a_check_attached_before_the_first_backward_gives_its_count_to_the_debugger_s(one_rank_group):
    """``launch`` with no Accelerator: the check attached on every live module before step 0's
    backward (each DDP model once, its inner modules left alone), the debugger's made after it."""
    ddp = DistributedDataParallel(_model())
    assert attach_before_backward(lambda: [ddp]) is None  # one rank: no reduction to name a rank by
    early, zero = PreReductionCheck.attach_live([ddp.module[0], ddp, ddp.module, ddp]), torch.zeros(())
    assert early.watching and early.off == []
    planted = [True]
    ddp.module[2].bias.register_hook(lambda g: g * NAN if planted[0] else g)
    _grads(ddp, torch.randn(8, 4))
    later = PreReductionCheck.attach([ddp])  # the debugger's, made at the first optimizer step
    later.carry(early)
    assert not early.active and early.spread is not None
    assert later.take(zero).item() == 1.0  # step 0's NaN, counted before the debugger was made
    planted[0] = False
    _grads(ddp, torch.randn(8, 4))
    assert later.take(zero).item() == 0.0 and later.failure is None


def test_a_second_debugger_on_the_same_model_takes_the_hook_over(one_rank_group):
    ddp = DistributedDataParallel(_model())
    first = PreReductionCheck.attach([ddp])
    first.active = False  # closed
    second, zero = PreReductionCheck.attach([ddp]), torch.zeros((), dtype=torch.float64)
    assert second.watching and second.off == []
    ddp.module[2].bias.register_hook(lambda g: g * NAN)
    _grads(ddp, torch.randn(8, 4))
    assert second.take(zero).item() == 1.0 and first.spread is None


def test_a_hook_registered_before_keeps_the_check_off_and_says_so(one_rank_group):
    calls = []

    def compress(state, bucket):
        calls.append(bucket.index())
        return allreduce_hook(state, bucket)

    ddp = DistributedDataParallel(_model())
    ddp.register_comm_hook(None, compress)
    check = PreReductionCheck.attach([ddp])
    assert not check.watching
    assert check.off == [
        "the DDP model has a communication hook already (test_a_hook_registered_before_keeps_the_check_off_and_says_so"
        ".<locals>.compress), and DDP takes one: the gradients are not checked before the all-reduce, so the rank "
        "that made a NaN is not known"
    ]
    _grads(ddp, torch.randn(8, 4))
    assert calls == [0]  # the user's hook runs
    assert torch.isnan(check.take(torch.zeros((), dtype=torch.float64))).item()  # not checked


@pytest.mark.parametrize("size", [2, 4, 8, 3, 6, 12])
def test_a_comm_hook_keeps_ddp_s_rounding_only_on_a_power_of_two_ranks(size):
    """DDP's default scales a gradient by 1/size as it copies it into the bucket; a comm hook gets the
    copy and divides by size: the same values exactly when size is a power of two (naive reference)."""
    grads = torch.randn(100_000, generator=torch.Generator().manual_seed(size), dtype=torch.float32)
    same = torch.equal(grads * (1.0 / size), grads / size)
    assert same is (size & (size - 1) == 0)


def test_a_world_size_not_a_power_of_two_keeps_the_check_off_and_ddp_s_own_all_reduce(one_rank_group, monkeypatch):
    from diffusion_debug.training.measure import pre_reduction

    monkeypatch.setattr(pre_reduction, "_world_size", lambda process_group: 6)
    ddp = DistributedDataParallel(_model())
    check = PreReductionCheck.attach([ddp])
    assert not check.watching and not getattr(ddp, "_comm_hooks", [])
    assert check.off == [
        "the DDP model runs on 6 ranks, not a power of two: DDP's own all-reduce scales a gradient by 1/size as "
        "it copies it and a communication hook divides by size, which round differently, so the gradients are "
        "not checked before the all-reduce (the rank that made a NaN is not known) rather than changed"
    ]


def test_a_hook_registered_after_runs_inside_the_check(one_rank_group):
    calls = []

    def compress(state, bucket):
        calls.append(bucket.index())
        return allreduce_hook(state, bucket)

    ddp = DistributedDataParallel(_model())
    check = PreReductionCheck.attach([ddp])
    ddp.register_comm_hook(None, compress)  # DDP's own would refuse a second hook
    # DDP's list holds the user's hook as without the check: a copy takes it (and not ours), and
    # DDP's compiled-autograd reducer, which runs that list, runs it
    assert ddp._comm_hooks == [(compress, None)]
    ddp.module[0].bias.register_hook(lambda g: g * NAN)
    _grads(ddp, torch.randn(8, 4))
    assert calls == [0]
    assert check.take(torch.zeros((), dtype=torch.float64)).item() == 1.0
    import copy

    assert copy.deepcopy(ddp)._comm_hooks[0][1] is None


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_of_a_checked_ddp_model_takes_nothing_of_the_check_and_runs_as_without_it(one_rank_group, how):
    """``copy.deepcopy`` / ``pickle`` of a DDP model the check is on (an EMA copy, ``torch.save(model)``)
    works as without the debugger: the copy holds DDP's own ``register_comm_hook``, no hook of ours,
    a hook the user registers on it runs on its all-reduce, and a NaN of its backward is no NaN of
    the original's check (nothing of the copy reaches it); the original stays checked. Before, both
    raised ``TypeError: cannot pickle 'ProcessGroup' object`` (our hook's state in DDP's hook list)."""
    import copy
    import pickle

    plain = DistributedDataParallel(_model())
    ddp = DistributedDataParallel(_model())
    check, zero = PreReductionCheck.attach([ddp]), torch.zeros((), dtype=torch.float64)
    twin = copy.deepcopy(ddp) if how == "deepcopy" else pickle.loads(pickle.dumps(ddp))
    assert set(vars(twin)) == set(vars(plain)) | {"register_comm_hook"}
    assert twin.register_comm_hook.__func__ is DistributedDataParallel.register_comm_hook
    assert twin.register_comm_hook.__self__ is twin and twin._comm_hooks == [] and ddp._comm_hooks == []
    calls = []

    def compress(state, bucket):
        calls.append(bucket.index())
        return allreduce_hook(state, bucket)

    twin.register_comm_hook(None, compress)
    twin.module[0].bias.register_hook(lambda g: g * NAN)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    _grads(twin, x)
    assert calls == [0] and math.isnan(check.take(zero).item())  # the original's check saw no bucket
    ddp.module[0].bias.register_hook(lambda g: g * NAN)
    _grads(ddp, x)
    assert check.take(zero).item() == 1.0 and calls == [0]
    again = PreReductionCheck.attach([ddp])  # a later debugger on the original takes its hook over
    assert again.watching and again.off == [] and ddp._comm_hooks == []
    _grads(ddp, x)
    assert again.take(zero).item() == 1.0


def test_a_hook_ddp_refuses_leaves_nothing_of_the_check_in_its_list_and_copies_work(one_rank_group, monkeypatch):
    """A built-in hook this torch does not report (``_builtin_hook`` says none): DDP's
    ``register_comm_hook`` lists ours, then its reducer refuses a second hook. The check is off and
    says so, and nothing of it stays in DDP's list of hooks: a copy of the model works as without the
    debugger. Before, our hook (its state holds the process group) stayed listed: ``copy.deepcopy``
    raised ``cannot pickle 'ProcessGroup' object``."""
    import copy

    import torch.distributed as dist

    from diffusion_debug.training.measure import pre_reduction

    ddp = DistributedDataParallel(_model())
    ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    monkeypatch.setattr(pre_reduction, "_builtin_hook", lambda ddp: False)  # not reported
    check = PreReductionCheck.attach([ddp])
    assert not check.watching and len(check.off) == 1
    assert check.off[0].startswith("the DDP communication hook could not be registered (")
    assert ddp._comm_hooks == []
    twin = copy.deepcopy(ddp)
    assert twin._comm_hooks == [] and twin.module[0].weight is not ddp.module[0].weight
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    assert all(torch.equal(a, b) for a, b in zip(_grads(twin, x), _grads(ddp, x)))


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")  # the batch needs no gradient
@NEEDS_FSDP2
def test_fsdp2_groups_are_checked_before_their_reduce_scatter(one_rank_group):
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch 2.5, the floor: FSDP2 is not yet public
        from torch.distributed._composable.fsdp import fully_shard

    model = _model()
    for module in (model[0], model[2], model):
        fully_shard(module)
    check, zero = PreReductionCheck.attach([model]), torch.zeros((), dtype=torch.float64)
    assert check.watching
    planted = [False]  # a tensor hook on a sharded parameter never fires: the module's grad_output instead
    model[0].register_full_backward_pre_hook(lambda m, grad_output: (grad_output[0] * NAN,) if planted[0] else None)
    found = []
    for plant in (False, True, False):
        planted[0] = plant
        model(torch.randn(8, 4)).pow(2).mean().backward()
        found.append(check.take(zero).item())
        model.zero_grad()
    assert found == [0.0, 1.0, 0.0]
    groups = [vars(g) for g in fsdp_groups(model)]
    assert groups and all("post_backward" in g for g in groups)
    live = PreReductionCheck.attach_live([*model.modules(), model])  # launch's list: each group wrapped once
    assert len(live._wrapped) == len(groups)
    live.release()
    check.release()  # the debugger closed: each group holds its class's post_backward again
    assert not any("post_backward" in g for g in groups)
    model(torch.randn(8, 4)).pow(2).mean().backward()
    assert check.spread is None  # nothing of the check runs any more


class _Reducer:
    """A stage-0 DeepSpeed engine's seam (module level: picklable): ``allreduce_gradients`` of its ``module``."""

    def __init__(self, grad):
        self.module, self.ran = torch.nn.Linear(2, 1), []
        self.module.weight.grad = torch.full((1, 2), grad)

    def is_gradient_accumulation_boundary(self):
        return True

    def allreduce_gradients(self):
        self.ran.append(self.module.weight.grad[0, 0].item())


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_of_an_engine_whose_reduction_is_checked_reduces_its_own_gradients(how):
    """``copy.deepcopy`` / ``pickle`` of an object whose reduction the check wraps (a stage-0 engine's
    ``allreduce_gradients``; ZeRO's bucket and FSDP2's ``post_backward`` are set the same way) gives the
    copy its own method, bound to it: the copy all-reduces its own gradients and feeds nothing to the
    original's check. Before, the copy held the check's closure: it read the original's gradients (their NaN
    counted for the copy's step) and all-reduced the original's, never its own; a pickle failed on it."""
    import copy
    import pickle

    engine, check = _Reducer(NAN), PreReductionCheck()
    check.wrap_engine(engine)
    twin = copy.deepcopy(engine) if how == "deepcopy" else pickle.loads(pickle.dumps(engine))
    twin.module.weight.grad = torch.full((1, 2), 2.0)
    twin.allreduce_gradients()
    assert (twin.ran, engine.ran) == ([2.0], [])
    assert math.isnan(check.take(torch.zeros((), dtype=torch.float64)).item())  # no bucket seen: not checked
    engine.allreduce_gradients()
    assert check.take(torch.zeros((), dtype=torch.float64)).item() == 1.0 and math.isnan(engine.ran[0])
    check.release()
    assert "allreduce_gradients" not in vars(engine)


def test_a_failing_check_leaves_the_reduction_alone_and_reads_as_not_checked(one_rank_group):
    ddp = DistributedDataParallel(_model())
    check, zero = PreReductionCheck.attach([ddp]), torch.zeros((), dtype=torch.float64)
    expected = _grads(DistributedDataParallel(_model()), torch.ones(8, 4))

    def broken(buffer):
        raise RuntimeError("planted")

    check.add = broken
    for a, b in zip(expected, _grads(ddp, torch.ones(8, 4))):
        assert torch.equal(a, b)
    assert str(check.failure) == "planted" and torch.isnan(check.take(zero)).item()


def test_the_prepared_wrapper_of_a_watched_model_is_found(one_rank_group):
    inner = _model()
    wrapper = DistributedDataParallel(inner)

    class Accelerator:
        _models = [wrapper]

    assert ddp_models([inner], Accelerator()) == [wrapper]
    assert ddp_models([wrapper], None) == [wrapper]
    # compiled after accelerator.prepare (launch gives the debugger torch.compile's wrapper of DDP): DDP found inside
    compiled = torch.compile(wrapper, backend="aot_eager")
    assert ddp_models([compiled], None) == [wrapper]
    assert ddp_models([compiled], Accelerator()) == [wrapper]


class _Syncs(TorchDispatchMode):
    """What a step makes the host wait for, counted by name: every read of a value (``item``, ``bool``,
    ``float``: ``aten._local_scalar_dense``; ``tolist``, patched) and every collective (``c10d`` ops)."""

    def __init__(self, monkeypatch):
        super().__init__()
        self.seen = []
        original = torch.Tensor.tolist

        def tolist(tensor):
            self.seen.append("tolist")
            return original(tensor)

        monkeypatch.setattr(torch.Tensor, "tolist", tolist)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d" or func is torch.ops.aten._local_scalar_dense.default:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def _fully_shard(module):
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch 2.5, the floor: FSDP2 is not yet public
        from torch.distributed._composable.fsdp import fully_shard

    fully_shard(module)


def _fsdp2():
    model = _model()
    for module in (model[0], model[2], model):
        _fully_shard(module)
    return model


def _deepspeed(stage, deepspeed_engine, model=None):
    """A DeepSpeed ZeRO engine of ``model`` (else ``_model()``) on the CPU and its ZeRO optimizer."""
    return deepspeed_engine(_model() if model is None else model, stage)


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
@pytest.mark.parametrize(
    "engine",
    [
        "ddp",
        pytest.param("fsdp2", marks=NEEDS_FSDP2),
        "zero2",
        "zero3",
    ],
)
def test_the_check_adds_no_host_read_and_no_collective_to_a_step(
    one_rank_group, tmp_path, monkeypatch, engine, deepspeed_engine
):
    """The flag rides in the step's row (its one host transfer; at several ranks, the row's
    ``local_nonfinite`` slot of the exchange's fixed all_reduce, which a world of one skips): a whole
    watched step (forward, backward, the debugger, the optimizer step) reads the host and calls
    collectives exactly as often with the check as without it, each by name, on every engine."""
    counter = _Syncs(monkeypatch)

    def syncs_per_step(with_check):
        if engine.startswith("zero"):
            model, optimizer = _deepspeed(int(engine[-1]), deepspeed_engine)
            backward, step, zero_grad = model.backward, model.step, lambda: None
        else:
            model = DistributedDataParallel(_model()) if engine == "ddp" else _fsdp2()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
            backward, step, zero_grad = (lambda loss: loss.backward()), optimizer.step, optimizer.zero_grad
        config = DebugConfig(output_dir=str(tmp_path / f"{with_check}"), stream_events=False)
        tdbg = TrainingDebugger(model, config=config)
        taken = []
        if with_check:  # what the debugger attaches at several ranks (training/debugger.py)
            if engine.startswith("zero"):
                check = PreReductionCheck()
                for zero in tdbg.params.partitions.optimizers:
                    check.wrap_zero(zero)
            else:
                check = PreReductionCheck.attach([model])
            assert check.watching and check.off == []
            take = check.take
            check.take = lambda zero: taken.append(take(zero)) or taken[-1]
            tdbg._steps.measurer.pre_reduction = check
        counts = []
        for index in range(3):
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(index))
            counter.seen.clear()
            with counter:
                loss = model(x).pow(2).mean()
                backward(loss)
                tdbg.monitor_training_step(loss, optimizer=optimizer, step=index)
                step()
                zero_grad()
            counts.append(collections.Counter(counter.seen))
        tdbg.close()
        if with_check:
            check.release()
            assert [t.item() for t in taken] == [0.0, 0.0, 0.0]  # each step's gradients were checked: clean
        return counts

    without = syncs_per_step(False)
    assert syncs_per_step(True) == without
    assert all(c["tolist"] >= 1 for c in without)  # counted: at least the debugger's one transfer a step


def _hint(engine: str) -> str:
    """The advice of a NaN gradient's message: ``closure=``, which FSDP2 and ZeRO never replay."""
    if engine == "ddp":
        return "lower the learning rate, check the loss for NaN/Inf, or use closure= to name the backward op."
    return (
        "lower the learning rate, check the loss for NaN/Inf, or, as closure= replays nothing under "
        f"{'FSDP2' if engine == 'fsdp2' else 'DeepSpeed ZeRO'}, rerun this batch without it (on one process or "
        "under DDP) with closure= to name the backward op."
    )


class _ConvIn(torch.nn.Module):
    """A UNet's order in small: ``conv`` is registered first, ``embed`` (its time embedding) runs
    first; a NaN made in ``conv``'s backward reaches no ``embed`` gradient."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv1d(1, 2, 3)
        self.embed = torch.nn.Linear(1, 8)
        self.out = torch.nn.Linear(8, 1)

    def forward(self, x):
        embedded = self.embed(x[:, :, :1].flatten(1))
        return self.out(torch.tanh(self.conv(x)).flatten(1) + embedded)


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")  # the batch needs no gradient
@pytest.mark.parametrize(
    "engine",
    [
        "ddp",
        pytest.param("fsdp2", marks=NEEDS_FSDP2),
        "zero2",
    ],
)
def test_a_nan_made_in_one_module_s_backward_is_named_alike_on_every_engine(
    one_rank_group, tmp_path, engine, deepspeed_engine
):
    """A NaN made in the convolution's backward at step 3 (its grad_output, as launch_unet_loop.py
    plants it in ``conv_in``'s) makes its weight's and bias's gradients NaN together, from one op:
    every engine names the first registered, ``conv.weight``, in the same words (but for its advice: FSDP2
    and ZeRO replay no ``closure=``). DDP's recorded
    backward accumulates the bias last, which made it "first in forward order" in an earlier version (FSDP2 and
    ZeRO, which record no order, named the weight). At step 4 the NaN weights make the loss and
    every gradient NaN, each its own anomaly pointing at step 3 on both engines; the gradients
    follow step 4's NaN loss and are named alike, by registration (``conv.weight``, step 3's place:
    it was folded into step 3's as its repeat), not in DDP's recorded order. ZeRO skips the step:
    its weights stay finite."""
    net = _ConvIn()
    if engine == "zero2":
        model, optimizer = _deepspeed(2, deepspeed_engine, net)
        backward, step, zero_grad = model.backward, model.step, lambda: None
    else:
        if engine == "ddp":
            model = DistributedDataParallel(net)
        else:
            for module in (net.conv, net.embed, net):
                _fully_shard(module)
            model = net
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        backward, step, zero_grad = (lambda loss: loss.backward()), optimizer.step, optimizer.zero_grad
    planted = [False]
    net.conv.register_full_backward_pre_hook(lambda m, grad_output: (grad_output[0] * NAN,) if planted[0] else None)
    config = DebugConfig(output_dir=str(tmp_path), stream_events=False)
    with TrainingDebugger(model, config=config) as tdbg:
        for index in range(5):
            planted[0] = index == 3
            loss = model(torch.randn(8, 1, 6, generator=torch.Generator().manual_seed(index))).pow(2).mean()
            backward(loss)
            tdbg.monitor_training_step(loss, optimizer=optimizer, step=index)
            step()
            zero_grad()
        if engine == "ddp":  # the order recorded at step 0: the bias after the weight, embed the first in forward
            assert tdbg._order.first_in_forward([0, 1]) == 1 and tdbg._order.first_in_forward([0, 2]) == 2
        anomalies = tdbg.report().anomalies
    (made,) = [a for a in anomalies if a.kind == "nonfinite" and a.step == 3]
    assert (made.step, made.parameter, made.module) == (3, "conv.weight", "conv")
    assert made.details["order"] == "registration"
    assert made.details["parameters"] == ["conv.weight", "conv.bias"]
    assert made.message == f"2 gradient(s) hold NaN/Inf, first registered conv.weight in module conv: {_hint(engine)}"
    if engine == "zero2":
        assert [a.kind for a in anomalies] == ["nonfinite", "skipped_step"]
        return
    (loss,) = [a for a in anomalies if a.kind == "nonfinite_loss"]
    assert loss.step == 4 and loss.details["weights"]["parameters"] == ["conv.weight", "conv.bias"]
    (later,) = [a for a in anomalies if a.kind == "nonfinite" and a.step == 4]
    assert (later.parameter, later.details["order"]) == ("conv.weight", "registration")
    for a in (loss, later):
        assert a.details["cause"]["where"] == "model conv.weight, step 3"
    assert made.details["count"] == 1 and by_cause(anomalies)[0] is made  # the headline, with no repeat


class _ThreeStages(torch.nn.Module):
    """``inp``, ``mid``, ``out``: registered in their forward order."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(4, 8)
        self.mid = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))


@pytest.mark.parametrize("engine", ["ddp", pytest.param("fsdp2", marks=NEEDS_FSDP2), "zero2"])
def test_a_nan_made_in_a_middle_module_s_backward_is_named_at_that_module_on_every_engine(
    one_rank_group, tmp_path, engine, deepspeed_engine
):
    """A NaN made in ``mid``'s backward at step 3 (its grad_output) under a finite loss makes the
    gradients of ``mid`` and of ``inp`` before it NaN; ``out``'s stay finite. Every engine names
    ``mid.weight``: DDP by its recorded backward (the last in forward order), FSDP2 and ZeRO, which
    record none, by registration (the last registered), each saying which."""
    net = _ThreeStages()
    if engine == "zero2":
        model, optimizer = _deepspeed(2, deepspeed_engine, net)
        backward, step, zero_grad = model.backward, model.step, lambda: None
    else:
        if engine == "ddp":
            model = DistributedDataParallel(net)
        else:
            for module in (net.inp, net.mid, net.out, net):
                _fully_shard(module)
            model = net
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        backward, step, zero_grad = (lambda loss: loss.backward()), optimizer.step, optimizer.zero_grad
    planted = [False]
    net.mid.register_full_backward_pre_hook(lambda m, grad_output: (grad_output[0] * NAN,) if planted[0] else None)
    config = DebugConfig(output_dir=str(tmp_path), stream_events=False)
    losses = []
    with TrainingDebugger(model, config=config) as tdbg:
        for index in range(4):
            planted[0] = index == 3
            loss = model(torch.randn(8, 4, generator=torch.Generator().manual_seed(index))).pow(2).mean()
            backward(loss)
            tdbg.monitor_training_step(loss, optimizer=optimizer, step=index)
            losses.append(loss.item())
            step()
            zero_grad()
        anomalies = tdbg.report().anomalies
    assert all(math.isfinite(v) for v in losses)
    (made,) = [a for a in anomalies if a.kind == "nonfinite"]
    rule = "last_in_forward" if engine == "ddp" else "last_registered"
    assert (made.step, made.parameter, made.module, made.details["order"]) == (3, "mid.weight", "mid", rule)
    assert made.details["parameters"] == ["inp.weight", "inp.bias", "mid.weight", "mid.bias"]
    which = (
        "the last in forward order of those that hold NaN/Inf"
        if engine == "ddp"
        else "the last registered of those that hold NaN/Inf (no backward order was recorded)"
    )
    assert made.message == (
        f"4 gradient(s) hold NaN/Inf, made in backward at mid.weight in module mid, {which}: {_hint(engine)}"
    )


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_buckets_are_checked_before_their_reduction_and_no_value_changes(one_rank_group, stage, deepspeed_engine):
    engines = [_deepspeed(stage, deepspeed_engine) for _ in range(2)]  # the second checked, the first not
    check, zero = PreReductionCheck(), torch.zeros((), dtype=torch.float64)
    check.wrap_zero(engines[1][1])
    assert check.watching and check.off == []
    planted = [False]
    weight = dict(engines[1][0].module.named_parameters())["2.weight"]
    weight.register_hook(lambda g: g * NAN if planted[0] else g)
    found = []
    for step in range(3):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        for engine, _ in engines:
            engine.backward(engine(x).pow(2).mean())
        found.append(check.take(zero).item())
        if step < 2:
            for engine, _ in engines:
                engine.step()
            local = [[getattr(p, "ds_tensor", p) for p in e.module.parameters()] for e, _ in engines]  # ZeRO-3's shard
            assert all(torch.equal(a, b) for a, b in zip(*local))  # bitwise: the check changed no gradient
        planted[0] = step == 1  # rank 0's own 2.weight gradient, in backward, before ZeRO reduces it
    assert found == [0.0, 0.0, 1.0]
    assert "reduce_independent_p_g_buckets_and_remove_grads" in vars(engines[1][1])
    check.release()  # the debugger closed: the ZeRO optimizer holds its class's method again
    assert "reduce_independent_p_g_buckets_and_remove_grads" not in vars(engines[1][1])


def _nan(rank, **details):
    return Anomaly(
        "nonfinite",
        "error",
        "x",
        "model",
        "2",
        step=12,
        rank=rank,
        parameter="2.weight",
        details={"nonfinite_parameters": 1, "order": "registration", **details},
    )


def test_the_rank_that_made_the_nan_is_the_headline_and_the_others_received_it():
    from diffusion_debug.record import make_anomaly

    copies = [
        make_anomaly(
            "nonfinite", **{k: getattr(a, k) for k in ("component", "module", "step", "rank", "parameter", "details")}
        )
        for a in (_nan(0), _nan(1), _nan(2))
    ]
    named = name_origin(copies, [0.0, 1.0, 0.0], 12)
    assert [a.details["reduction"]["made_here"] for a in named] == [False, True, False]
    assert named[0].message == (
        "1 gradient(s) hold NaN/Inf (first registered: 2.weight), received through the gradient all-reduce "
        "from rank 1, whose own gradients were non-finite before it."
    )
    assert named[1].message.startswith(
        "1 gradient(s) hold NaN/Inf, first registered 2.weight in module 2, non-finite in this rank's own "
        "gradients before the gradient all-reduce: "
    )
    top = headline(named, world_size=3)
    assert top["where"] == "model 2.weight, step 12, rank 1" and top["consequences"]["count"] == 2


def test_not_checked_the_copies_follow_the_lowest_rank_and_say_the_origin_is_unknown():
    from diffusion_debug.record import make_anomaly

    copies = [
        make_anomaly(
            "nonfinite", **{k: getattr(a, k) for k in ("component", "module", "step", "rank", "parameter", "details")}
        )
        for a in (_nan(1), _nan(0))
    ]
    named = name_origin(copies, [NAN, NAN], 12)
    assert named[0].message == (
        "1 gradient(s) hold NaN/Inf (first registered: 2.weight), the same as rank 0's after the gradient "
        "all-reduce (which rank's own gradients were non-finite is not known: they were not checked before it)."
    )
    assert headline(named, world_size=2)["where"] == "model 2.weight, step 12, rank 0"


def test_a_clean_step_and_a_lone_anomaly_are_left_as_they_are():
    lone = [_nan(0)]
    assert name_origin(lone, [0.0, 0.0], 12) == lone
    assert name_origin([], [0.0, 0.0], 12) == []


ZERO = "DeepSpeed ZeRO's gradient reduction"
HINT = _hint("zero2")  # a sharding engine: no closure= replay runs under it (local_judging.LocalJudge.sharding)


def _built(anomaly):
    """``anomaly`` as the ZeRO debugger makes it: its advice knows no ``closure=`` replay runs there."""
    from diffusion_debug.record import make_anomaly

    fields = ("component", "module", "step", "rank", "parameter")
    details = {**anomaly.details, "sharded": "zero"}
    return make_anomaly("nonfinite", **{k: getattr(anomaly, k) for k in fields}, details=details)


def test_zero_the_rank_that_made_the_nan_but_holds_none_of_it_is_the_headline():
    # ZeRO keeps 2.weight's reduced gradient in rank 0's partition: rank 1 made the NaN, only rank 0 holds it
    named = name_origin([_built(_nan(0))], [0.0, 1.0], 12, ZERO)
    assert [a.to_dict() for a in named] == [
        {
            "kind": "nonfinite",
            "severity": "error",
            "message": (
                f"1 gradient(s) hold NaN/Inf (first registered: 2.weight), received through {ZERO} from rank "
                "1, whose own gradients were non-finite before it."
            ),
            "component": "model",
            "module": "2",
            "step": 12,
            "timestep": None,
            "rank": 0,
            "details": {
                "nonfinite_parameters": 1,
                "order": "registration",
                "sharded": "zero",
                "reduction": {"origins": [1], "made_here": False, "through": ZERO},
                "follows": {"kind": "nonfinite", "rank": 1},
            },
            "parameter": "2.weight",
            "local_rank": 0,
            "host": "",
        },
        {
            "kind": "nonfinite",
            "severity": "error",
            "message": (
                f"This rank's own gradients held NaN/Inf before {ZERO}, which gave them to rank 0 (rank 0 holds 1 "
                "non-finite gradient(s), first registered 2.weight in module 2; this rank's own share holds "
                f"none after it): {HINT}"
            ),
            "component": "model",
            "module": "2",
            "step": 12,
            "timestep": None,
            "rank": 1,
            "details": {
                "nonfinite_parameters": 1,
                "reduction": {
                    "origins": [1],
                    "made_here": True,
                    "through": ZERO,
                    "received_by": [0],
                    "found": {"rank": 0, "parameter": "2.weight", "module": "2"},
                },
                "order": "registration",
                "sharded": "zero",
            },
            "parameter": "2.weight",
            "local_rank": 0,
            "host": "",
        },
    ]
    # summary.json's headline, report.html's and the terminal's first row (folded), Report.headline (by_cause)
    top = headline(named, world_size=2)
    assert (top["where"], top["consequences"]) == (
        "model 2.weight, step 12, rank 1",
        {"count": 1, "kinds": {"nonfinite": 1}},
    )
    assert [(a.rank, [b.rank for b in under]) for a, under in folded(named)] == [(1, [0])]
    assert by_cause(named)[0] is named[1]
    # named again from the same rows: nothing added, nothing changed
    assert name_origin(named, [0.0, 1.0], 12, ZERO) == named


def test_zero_several_ranks_made_it_and_hold_none_the_parameter_each_made_is_not_known():
    zero, three = _built(_nan(0)), _built(_nan(3, nonfinite_parameters=2))
    three = rebuilt(three, parameter="0.weight", module="0")
    named = name_origin([zero, three], [0.0, 1.0, 1.0, 0.0], 12, ZERO)
    assert [(a.rank, a.parameter, a.details.get("follows")) for a in named] == [
        (0, "2.weight", {"kind": "nonfinite", "rank": 1}),
        (3, "0.weight", {"kind": "nonfinite", "rank": 1}),
        (1, None, None),
        (2, None, {"kind": "nonfinite", "rank": 1}),
    ]
    assert (
        named[2].message
        == named[3].message
        == (
            f"This rank's own gradients held NaN/Inf before {ZERO}, which gave them to ranks 0, 3 (rank 0 holds 1 "
            "non-finite gradient(s), first registered 2.weight in module 2; ranks 1, 2 made NaN/Inf: which made "
            f"which is not known; this rank's own share holds none after it): {HINT}"
        )
    )
    assert headline(named, world_size=4)["where"] == "model, step 12, rank 1"


def test_zero_the_added_origin_says_its_process_and_machine_where_another_of_its_anomalies_does():
    spike = Anomaly("loss_spike", "warning", "x", "model", step=12, rank=1, local_rank=1, host="node-b")
    named = name_origin([_built(_nan(0)), spike], [0.0, 1.0], 12, ZERO)
    assert [(a.kind, a.rank, a.local_rank, a.host) for a in named] == [
        ("nonfinite", 0, 0, ""),
        ("loss_spike", 1, 1, "node-b"),
        ("nonfinite", 1, 1, "node-b"),
    ]


def test_zero_not_checked_a_lone_received_nan_is_left_as_it_is():
    lone = [_built(_nan(0))]
    assert name_origin(lone, [NAN, NAN], 12, ZERO) == lone
    assert lone[0].message == f"1 gradient(s) hold NaN/Inf, first registered 2.weight in module 2: {HINT}"


def test_a_received_nan_that_follows_a_nan_loss_gets_no_origin_of_its_own():
    # rank 1's NaN loss made every gradient NaN: the loss is the headline, no rank-1 nonfinite is added
    follows = {"follows": {"kind": "nonfinite_loss", "rank": 1}}
    named = name_origin([_built(_nan(0, **follows))], [0.0, 1.0], 12, ZERO)
    assert len(named) == 1 and named[0].details["follows"] == follows["follows"]


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_the_debugger_knows_which_engine_reduces_the_gradients_and_its_stall_positions_say_it(
    one_rank_group, tmp_path
):
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch 2.5, the floor: FSDP2 is not yet public
        from torch.distributed._composable.fsdp import fully_shard

    sharded = _model()
    for module in (sharded[0], sharded[2], sharded):
        fully_shard(module)
    compiled = torch.compile(DistributedDataParallel(_model()), backend="aot_eager")  # after prepare: DDP inside
    for model, engine in (
        (DistributedDataParallel(_model()), "ddp"),
        (sharded, "fsdp2"),
        (_model(), ""),
        (compiled, "ddp"),
    ):
        with TrainingDebugger(model, config=DebugConfig(output_dir=str(tmp_path), stream_events=False)) as tdbg:
            assert (engine_of(tdbg.params, [model]), tdbg._liveness.position.engine) == (engine, engine)

    class Partitions:  # DeepSpeed ZeRO's (training/measure/deepspeed_zero.py), found on the parameters
        pass

    class Params:
        partitions, sharded = Partitions(), True

    assert engine_of(Params(), [DistributedDataParallel(_model())]) == "zero"
    assert REDUCTIONS["zero"] == "DeepSpeed ZeRO's gradient reduction"


@pytest.mark.parametrize("engine", ["plain", "ddp", pytest.param("fsdp2", marks=NEEDS_FSDP2)])
def test_the_weights_a_nan_update_made_non_finite_are_named_alike_on_every_engine(one_rank_group, tmp_path, engine):
    """A NaN made in ``out``'s backward at step 3 reaches every gradient (``conv``, registered first,
    and ``embed``, run first, are both upstream of it); AdamW's step makes every weight NaN, and step
    4's NaN loss lists them in registration order on every engine, ``conv.weight`` first. DDP's
    recorded backward put ``embed.weight`` first (the first in forward order) where FSDP2, which
    records none, put ``conv.weight``."""
    net = _ConvIn()
    if engine == "ddp":
        model = DistributedDataParallel(net)
    elif engine == "fsdp2":
        for module in (net.conv, net.embed, net.out, net):
            _fully_shard(module)
        model = net
    else:
        model = net
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    planted = [False]
    net.out.register_full_backward_pre_hook(lambda m, grad_output: (grad_output[0] * NAN,) if planted[0] else None)
    config = DebugConfig(output_dir=str(tmp_path), stream_events=False)
    with TrainingDebugger(model, config=config) as tdbg:
        for index in range(5):
            planted[0] = index == 3
            loss = model(torch.randn(8, 1, 6, generator=torch.Generator().manual_seed(index))).pow(2).mean()
            loss.backward()
            tdbg.monitor_training_step(loss, optimizer=optimizer, step=index)
            optimizer.step()
            optimizer.zero_grad()
        anomalies = tdbg.report().anomalies
    (made,) = [a for a in anomalies if a.kind == "nonfinite" and a.step == 3]
    assert made.details["parameters"] == [
        "conv.weight",
        "conv.bias",
        "embed.weight",
        "embed.bias",
        "out.weight",
        "out.bias",
    ]
    (nan_loss,) = [a for a in anomalies if a.kind == "nonfinite_loss"]
    assert nan_loss.step == 4
    assert nan_loss.details["weights"]["parameters"] == [
        "conv.weight",
        "conv.bias",
        "embed.weight",
        "embed.bias",
        "out.weight",
        "out.bias",
    ]
    assert nan_loss.message == (
        "The loss is nan at step 4 on rank 0: the weights went non-finite in the optimizer step of step 3 (6 "
        "parameter(s) hold NaN/Inf, first conv.weight); it follows the nonfinite at model out.weight, step 3: fix "
        "that first."
    )


@pytest.mark.parametrize("inner", ["SGD", "AdamW"])
def test_the_update_ratio_is_judged_by_the_optimizer_a_zero_redundancy_one_holds(one_rank_group, tmp_path, inner):
    # ZeroRedundancyOptimizer(optimizer_class=SGD) steps by lr x gradient: its lr x |g| / |w| above 1 is an
    # lr_spike, as a bare SGD's; with AdamW inside it is not (the update measured from the weights judges it)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=getattr(torch.optim, inner), lr=1e-3)
    config = DebugConfig(output_dir=str(tmp_path), log_level="error", grad_explosion_threshold=1e9)
    tdbg = TrainingDebugger(model, config=config)
    x = torch.randn(64, 8)
    for step in range(2):
        loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean() * 2000
        loss.backward()
        info = tdbg.monitor_training_step(loss, optimizer=optimizer, step=step)
        if inner == "SGD":  # lr x |g| / |w|, recorded for a gradient step alone (AdamW's moved < 0.05)
            assert step or max(info["update_to_weight_ratio"].values()) > 1
        else:
            assert "update_to_weight_ratio" not in info
        optimizer.step()
        optimizer.zero_grad()
    spikes = [(a.step, a.details["reason"]) for a in tdbg.report().anomalies if a.kind == "lr_spike"]
    assert spikes[:1] == ([(0, "update_ratio")] if inner == "SGD" else [])
    tdbg.close()


@NEEDS_FSDP2
def test_an_fsdp2_micro_step_is_told_by_the_groups_that_train_each_listed_once(one_rank_group, tmp_path):
    """FSDP2's accumulation turns a group's sync off (``set_requires_gradient_sync(False)``; HSDP's
    ``set_requires_all_reduce(False)``): a call then is a micro-step. A frozen group's sync says nothing of the
    step (else every call of a run that froze a block and turned its sync off would be a micro-step, and nothing
    watched), and a group is listed once however many of its modules hold it."""
    model = _model()
    model[0].requires_grad_(False)
    for module in (model[0], model[2], model):
        _fully_shard(module)
    tdbg = TrainingDebugger(model, config=DebugConfig(output_dir=str(tmp_path), stream_events=False))
    monitor = tdbg._steps
    trained = [model[2]._get_fsdp_state()._fsdp_param_group]
    assert [id(g) for g in monitor.fsdp_groups] == [id(g) for g in trained]
    complete = lambda: gradients_incomplete(False, None, None, monitor.fsdp_groups)  # noqa: E731
    model[0].set_requires_gradient_sync(False, recurse=False)
    assert complete() is None
    model[2].set_requires_gradient_sync(False, recurse=False)
    assert complete() == "fsdp2_gradient_sync"
    model[2].set_requires_gradient_sync(True, recurse=False)
    model[2].set_requires_all_reduce(False, recurse=False)
    assert complete() == "hsdp_all_reduce"
    model[2].set_requires_all_reduce(True, recurse=False)
    assert complete() is None
    tdbg.close()
