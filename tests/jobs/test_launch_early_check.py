"""``launch`` with no Accelerator attaches a check of this rank's gradients before the first
``backward`` (:meth:`~diffusion_debug.jobs.launched.LaunchWatch._check_before_first_backward`), before
the debugger is made. When launch stops watching first, that check lets go: the script runs on as
under a plain launch, no bucket of its read (one process, gloo: DDP's hook runs on one rank too)."""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

from diffusion_debug.jobs.launched import LaunchWatch, _model_of, _plain_models
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
    early = watch.early = PreReductionCheck.attach_live([watched])
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    _grads(watched, x)
    assert early.spread is not None  # step 0's buckets read before the debugger is made
    early.spread = None
    watch.give_up("the debugger could not be made (OSError: disk full)")
    assert capsys.readouterr().err == (
        "diffusion-debug launch: not watching train.py: the debugger could not be made (OSError: disk full);"
        " it runs unwatched, as under accelerate launch.\n"
    )
    assert watch.early is None and not early.active
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
    models, optimizers = _plain_models(optimizer)
    assert models == [ddp] and optimizers == [optimizer]


def test_the_debugger_made_at_the_first_step_takes_the_check_over_and_it_lets_go(one_rank_group, tmp_path):
    """The handover (``TrainingDebugger._carry_pre_reduction``): on one rank the debugger has no
    check of its own (no reduction to name a rank by), and the early one lets go all the same."""
    plain, watched = _ddp(), _ddp()
    watch = LaunchWatch({"output_dir": str(tmp_path / "runs")}, "train.py")
    watch.check_settings()
    watch.models = [watched]
    early = watch.early = PreReductionCheck.attach_live([watched])
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    assert all(torch.equal(a, b) for a, b in zip(_grads(watched, x), _grads(plain, x)))
    assert watch._debugger_ready()
    try:
        assert watch.early is None and not early.active and watch.debugger._pre_reduction is None
        early.spread = None
        assert all(torch.equal(a, b) for a, b in zip(_grads(watched, x), _grads(plain, x)))
        assert early.spread is None  # no bucket read by the check that let go
    finally:
        watch.debugger.close()
