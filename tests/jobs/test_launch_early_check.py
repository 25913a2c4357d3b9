"""``launch`` with no Accelerator attaches a check of this rank's gradients before the first
``backward`` (:class:`~diffusion_debug.jobs.launch_plain.EarlyCheck`), before
the debugger is made. When launch stops watching first, that check lets go: the script runs on as
under a plain launch, no bucket of its read (one process, gloo: DDP's hook runs on one rank too)."""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

from diffusion_debug.jobs.launch_plain import _model_of, plain_models
from diffusion_debug.jobs.launched import LaunchWatch
from diffusion_debug.training.measure.pre_reduction import PreReductionCheck


def _grads(ddp, x):
    ddp.zero_grad()
    ddp(x).pow(2).mean().backward()
    return [p.grad.clone() for p in ddp.parameters()]


def _ddp():
    torch.manual_seed(0)
    return DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)))


def test_the_check_attached_before_the_first_backward_lets_go_when_launch_gives_up(one_rank_group, capsys):
    plain, watched = _ddp(), _ddp()
    watch = LaunchWatch({}, "train.py")
    early = watch.early.check = PreReductionCheck.attach_live([watched])
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    _grads(watched, x)
    assert early.spread is not None  # step 0's buckets read before the debugger is made
    early.spread = None
    watch.give_up("the debugger could not be made (OSError: disk full)")
    assert capsys.readouterr().err == (
        "diffusion-debug launch: not watching train.py: the debugger could not be made (OSError: disk full);"
        " it runs unwatched, as under accelerate launch.\n"
    )
    assert watch.early.check is None and not early.active
    for _ in range(2):  # the script's later steps: no bucket read, the gradients DDP's own
        assert all(torch.equal(a, b) for a, b in zip(_grads(watched, x), _grads(plain, x)))
    assert early.spread is None


def test_a_plain_ddp_script_s_model_is_its_ddp_wrapper_whichever_the_garbage_collector_lists_first(one_rank_group):
    """The wrapper and the module inside it hold the same parameters: the model watched is the
    wrapper, whose all-reduce the debugger checks each rank's gradients on (the module alone has none)."""
    inner = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    ddp = DistributedDataParallel(inner)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    for modules in ([inner, *inner, ddp], [ddp, inner, *inner]):
        assert _model_of(optimizer, modules) is ddp
    # other tests' optimizers may still be alive in this process (the search goes through the
    # garbage collector's list): this optimizer and its model come first, the inner module never
    models, optimizers = plain_models(optimizer)
    assert models[0] is ddp and optimizers[0] is optimizer
    assert not any(model is inner or any(model is part for part in inner) for model in models)


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    def forward(self, x):
        return self.layers(x)


def test_a_plain_script_s_model_is_the_outermost_callable_module_holding_its_parameters_in_any_order():
    """Of the modules holding exactly the optimizer's parameters, the trained model is the outermost one
    that has a ``forward``: what ``torch.compile`` returned around the script's model (not ``layers``, its
    one part holding them all), and the script's model, not an ``nn.ModuleDict`` or ``nn.ModuleList`` that
    also holds it (for a checkpoint): one was watched, its hook never called, the NaN input of a step only
    its NaN loss, the names ``unet.layers.0``."""
    net = _Net()
    held = [torch.nn.ModuleDict({"unet": net}), torch.nn.ModuleList([net])]
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    for modules in ([*held, net, net.layers], [net.layers, net, *held]):
        assert _model_of(optimizer, modules) is net
    compiled = torch.compile(net)
    for modules in ([*held, net, compiled, net.layers], [net.layers, compiled, net, *held]):
        assert _model_of(optimizer, modules) is compiled


def test_the_debugger_made_at_the_first_step_takes_the_check_over_and_it_lets_go(one_rank_group, tmp_path):
    """The handover (``TrainingDebugger._carry_pre_reduction``): on one rank the debugger has no
    check of its own (no reduction to name a rank by), and the early one lets go all the same."""
    plain, watched = _ddp(), _ddp()
    watch = LaunchWatch({"output_dir": str(tmp_path / "runs")}, "train.py")
    watch.check_settings()
    watch.models = [watched]
    early = watch.early.check = PreReductionCheck.attach_live([watched])
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    assert all(torch.equal(a, b) for a, b in zip(_grads(watched, x), _grads(plain, x)))
    assert watch._debugger_ready()
    try:
        assert watch.early.check is None and not early.active and watch.debugger._pre_reduction is None
        early.spread = None
        assert all(torch.equal(a, b) for a, b in zip(_grads(watched, x), _grads(plain, x)))
        assert early.spread is None  # no bucket read by the check that let go
    finally:
        watch.debugger.close()
        watch.inputs.remove()  # its global module-registration hook: left, it fires in every later test


def test_torch_autograd_backward_on_one_scalar_is_a_backward_of_the_loss_as_tensor_backward_is():
    """``torch.autograd.backward(loss)``, ``([loss])`` or ``(tensors=(loss,))``: the loss, and the
    early check tried before it; on several tensors at once, their sum. The gradients are those of
    the same calls unwatched, and uninstalling gives torch its own functions back."""
    own = torch.Tensor.backward, torch.autograd.backward
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    calls = [
        lambda loss: torch.autograd.backward(loss),
        lambda loss: torch.autograd.backward([loss], retain_graph=False),
        lambda loss: torch.autograd.backward(tensors=(loss,)),
        lambda loss: loss.backward(),
        lambda loss: torch.autograd.backward([loss, loss * 2]),
    ]

    def grads(model, call):
        model.zero_grad()
        loss = model(x).pow(2).mean()
        call(loss)
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    plain = [grads(model, call) for call in calls]
    watch = LaunchWatch({}, "train.py")
    watch.install()
    try:
        found = []
        for call, (plain_loss, plain_grads) in zip(calls, plain):
            watch.loss = None
            loss, watched = grads(model, call)
            assert all(torch.equal(a, b) for a, b in zip(watched, plain_grads)) and torch.equal(loss, plain_loss)
            found.append(
                watch.loss is not None and torch.equal(watch.loss, loss + loss * 2 if call is calls[-1] else loss)
            )
        assert found == [True, True, True, True, True]
        assert watch.early.tried and watch.early.check is None  # one process: nothing to check before
    finally:
        watch.uninstall()
    assert (torch.Tensor.backward, torch.autograd.backward) == own


def test_a_handover_that_fails_closes_the_debugger_it_made_and_launch_gives_up(
    one_rank_group, tmp_path, monkeypatch, capsys
):
    """The debugger made at the first step fails to take the early check's count (planted): launch
    gives up with one line, and that debugger is closed, not left on the model with its hooks
    (the script runs on unwatched: its gradients DDP's own, no hook of ours on any module)."""
    from diffusion_debug.training import TrainingDebugger

    def fail(debugger, early):
        raise RuntimeError("planted handover failure")

    monkeypatch.setattr(TrainingDebugger, "_carry_pre_reduction", fail)
    plain, watched = _ddp(), _ddp()
    hooks = lambda model: sum(  # noqa: E731
        len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules()
    )
    before = hooks(watched)
    watch = LaunchWatch({"output_dir": str(tmp_path / "runs")}, "train.py")
    watch.check_settings()
    watch.models = [watched]
    watch.early.check = PreReductionCheck.attach_live([watched])
    closed, close = [], TrainingDebugger.close
    monkeypatch.setattr(TrainingDebugger, "close", lambda self: closed.append(close(self)))
    assert not watch._debugger_ready()
    assert watch.debugger is None and watch.early.check is None and len(closed) == 1
    assert hooks(watched) == before
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    assert all(torch.equal(a, b) for a, b in zip(_grads(watched, x), _grads(plain, x)))
    assert capsys.readouterr().err == (
        "diffusion-debug launch: not watching train.py: the debugger could not be made "
        "(RuntimeError: planted handover failure); it runs unwatched, as under accelerate launch.\n"
    )


def _launch_hooks():
    from torch.optim.optimizer import _global_optimizer_pre_hooks

    return [getattr(hook, "__self__", None) for hook in _global_optimizer_pre_hooks.values()]


def test_launch_that_gives_up_leaves_nothing_of_its_own_on_torch_nor_the_last_loss(capsys):
    """A give-up (here inside the script's backward, as a failed handover at a step would) puts
    ``Tensor.backward``, ``torch.autograd.backward``, the optimizer's and the module's ``zero_grad``
    and the global optimizer pre-hook back, and
    keeps no loss: not the one of the backward it gave up in, nor any later one (a detached tensor of
    the script's). The gradients are those of the same calls unwatched."""
    own = torch.Tensor.backward, torch.autograd.backward
    own_zero = torch.optim.Optimizer.zero_grad, torch.nn.Module.zero_grad
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))

    def grads(hook=None):
        model.zero_grad()
        loss = model(x).pow(2).mean()
        if hook is not None:
            loss.register_hook(hook)
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    plain = grads()
    watch = LaunchWatch({}, "train.py")
    watch.install()
    try:
        assert torch.Tensor.backward is not own[0] and torch.nn.Module.zero_grad is not own_zero[1]
        assert watch in _launch_hooks()
        assert all(torch.equal(a, b) for a, b in zip(grads(), plain)) and watch.loss is not None
        watched = grads(lambda grad: watch.give_up("the debugger could not be made (OSError: disk full)"))
        assert all(torch.equal(a, b) for a, b in zip(watched, plain))
        assert watch.loss is None and watch._undo == [] and watch not in _launch_hooks()
        assert (torch.Tensor.backward, torch.autograd.backward) == own
        assert (torch.optim.Optimizer.zero_grad, torch.nn.Module.zero_grad) == own_zero
        torch.autograd.backward(model(x).pow(2).mean())
        assert watch.loss is None
        assert capsys.readouterr().err.startswith("diffusion-debug launch: not watching train.py: the debugger")
    finally:
        watch.uninstall()
        torch.Tensor.backward, torch.autograd.backward = own


def test_launch_that_gives_up_inside_the_optimizer_step_hook_lets_the_step_run_and_removes_the_hook_at_the_end():
    """An optimizer stepping parameters that no module holds: launch gives up inside torch's global
    optimizer pre-hook, whose dict torch is iterating (a removal there would raise in the script's
    ``step``): the step runs as unwatched, the backward seams and the loss are gone at once, the
    hook (returning at once) at the end."""
    own = torch.Tensor.backward, torch.autograd.backward
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=0.5)
    watch = LaunchWatch({}, "train.py")
    watch.install()
    try:
        (weight * 2.0).sum().backward()
        assert watch.loss is not None
        optimizer.step()
        assert torch.equal(weight.detach(), torch.zeros(3))  # 1 - 0.5 * 2: the script's own step
        assert watch.failed == "no module holds the parameters its optimizer steps"
        assert watch.loss is None and (torch.Tensor.backward, torch.autograd.backward) == own
        assert watch in _launch_hooks()
        optimizer.step()  # the hook left till the end returns at once
        assert torch.equal(weight.detach(), torch.full((3,), -1.0))
        watch.finish()
        assert watch not in _launch_hooks()
    finally:
        watch.uninstall()
        torch.Tensor.backward, torch.autograd.backward = own


def _lr_after_prepare(watch=None):
    """An Accelerate script that makes its LR scheduler after ``prepare`` (torch's LRScheduler then
    wraps the prepared optimizer's ``step``): the learning rates of three steps and the weights."""
    import accelerate

    torch.manual_seed(0)
    accelerator = accelerate.Accelerator(cpu=True)
    model = torch.nn.Linear(4, 1)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    rates = []
    for step in range(3):
        accelerator.backward(model(x).pow(2).mean())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        rates.append(scheduler.get_last_lr()[0])
        if step == 0 and watch is not None:
            watch.give_up("the debugger could not be made (OSError: disk full)")
            assert getattr(vars(optimizer).get("step"), "_wrapped_by_lr_sched", False)  # the scheduler's stays
    return rates, [p.detach().clone() for p in model.parameters()]


def test_an_lr_scheduler_made_after_prepare_runs_as_unwatched_and_keeps_its_wrapper_at_a_give_up(tmp_path):
    """torch's LRScheduler wraps ``optimizer.step.__func__``: launch's step wrapper is a bound
    method as the optimizer's own is (a plain function raised AttributeError in the script), and a
    give-up leaves the scheduler's wrapper of it in place (ours inside passes through)."""
    import accelerate

    own = torch.Tensor.backward, torch.autograd.backward, accelerate.Accelerator.prepare
    plain = _lr_after_prepare()
    watch = LaunchWatch({"output_dir": str(tmp_path)}, "train.py")
    watch.check_settings()
    watch.install()
    try:
        watched = _lr_after_prepare(watch)
    finally:
        watch.uninstall()
        torch.Tensor.backward, torch.autograd.backward, accelerate.Accelerator.prepare = own
        if watch.debugger is not None:
            watch.debugger.close()
    assert watched[0] == plain[0] == [0.05, 0.025, 0.0125]
    assert all(torch.equal(a, b) for a, b in zip(watched[1], plain[1]))
    assert watch.failed == "the debugger could not be made (OSError: disk full)"


def test_a_give_up_leaves_a_wrapper_the_script_set_over_launchs_backward():
    """A wrapper of ``Tensor.backward`` the script (or a library) set after launch installed its own
    stays through a give-up in the middle of the run; launch's, inside it, passes through."""
    own = torch.Tensor.backward, torch.autograd.backward
    watch = LaunchWatch({}, "train.py")
    watch.install()
    calls = []
    try:
        launchs = torch.Tensor.backward

        def theirs(tensor, *args, **kwargs):
            calls.append(1)
            return launchs(tensor, *args, **kwargs)

        torch.Tensor.backward = theirs
        weight = torch.nn.Parameter(torch.ones(3))
        watch.give_up("the debugger could not be made (OSError: disk full)")
        assert torch.Tensor.backward is theirs and torch.autograd.backward is own[1]
        (weight * 2.0).sum().backward()
        assert calls == [1] and torch.equal(weight.grad, torch.full((3,), 2.0)) and watch.loss is None
    finally:
        watch.uninstall()
        torch.Tensor.backward, torch.autograd.backward = own
