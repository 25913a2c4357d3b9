"""The script's models and optimizers are found without collecting or walking the user's heap: a
launch-watched run makes no ``gc.collect()`` and no ``gc.get_objects()`` (counted), yet finds its
models and names a parameter no optimizer holds as before; a debugger the script makes itself, after
its models, walks once at most and collects nothing; what the registry notes (made, rebuilt by
``copy.deepcopy``/``pickle``) and what it does not (made before it, half-built), and that removing it
leaves torch as it was."""

from __future__ import annotations

import copy
import gc
import pickle
import weakref

import pytest
import torch
from torch import nn

from diffusion_debug import DebugConfig, TrainingDebugger
from diffusion_debug.record import load_run

X = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))


@pytest.fixture
def gc_calls(monkeypatch):
    """How many times ``gc.collect`` and ``gc.get_objects`` are called (they still run)."""
    calls = {"collect": 0, "get_objects": 0}
    collect, get_objects = gc.collect, gc.get_objects

    def counted_collect(*args, **kwargs):
        calls["collect"] += 1
        return collect(*args, **kwargs)

    def counted_get_objects(*args, **kwargs):
        calls["get_objects"] += 1
        return get_objects(*args, **kwargs)

    monkeypatch.setattr(gc, "collect", counted_collect)
    monkeypatch.setattr(gc, "get_objects", counted_get_objects)
    return calls


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _plain_loop(steps: int = 3) -> list[torch.Tensor]:
    """A plain script: its optimizer holds the weights, not the biases (they never change); each step
    zeroes before its backward and clips before its step, so launch looks for the live optimizers
    at the first ``zero_grad``, at step 0's clip and at its first step."""
    model = _model()
    optimizer = torch.optim.SGD([model[0].weight, model[2].weight], lr=0.1)
    for _ in range(steps):
        optimizer.zero_grad()
        model(X).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def test_a_launch_watched_run_collects_nothing_and_walks_nothing(tmp_path, gc_calls):
    """Every look-up launch makes for a plain script (the first ``zero_grad``, step 0's clip, the
    first step's models and optimizers, the judge's search for another optimizer holding the
    biases) is answered from what the script made: no ``gc.collect()`` (a full collection of the
    user's heap, finalizers at a moment the user did not choose) and no walk of ``gc.get_objects()``.
    It collected and walked 4 times a run."""
    from diffusion_debug.jobs.launched import LaunchWatch

    plain = _plain_loop()
    watch = LaunchWatch({"output_dir": str(tmp_path / "runs")}, "train.py")
    watch.check_settings()
    calls_before = dict(gc_calls)
    watch.install()
    try:
        watched = _plain_loop()
        watch.finish()
    finally:
        watch.uninstall()
    assert gc_calls == calls_before == {"collect": 0, "get_objects": 0}
    assert all(torch.equal(a, b) for a, b in zip(watched, plain))
    (run_dir,) = (tmp_path / "runs").iterdir()
    run = load_run(run_dir)
    assert [row["step"] for row in run.steps] == [0, 1, 2]
    (found,) = [a for a in run.anomalies if a.kind == "unwatched_parameters"]
    not_optimized = {"count": 2, "groups": {"model 0": 1, "model 2": 1}}  # the biases
    assert (found.step, found.details) == (0, {"not_optimized": not_optimized, "count": 1})


def test_a_debugger_made_after_its_models_walks_once_and_collects_nothing(tmp_path, gc_calls):
    """No launch: the script made its models and optimizers before the debugger, so only a walk finds
    the other optimizer (the biases') and the module holding the outside parameter: one walk of the
    garbage collector's list for both, with no collection first. It collected and walked twice."""
    model, head = _model(), nn.Linear(1, 1)
    weights = torch.optim.SGD([model[0].weight, model[2].weight, *head.parameters()], lr=0.1)
    biases = torch.optim.SGD([model[0].bias, model[2].bias], lr=0.1)
    tdbg = TrainingDebugger(model, config=DebugConfig(output_dir=str(tmp_path), log_level="error"))
    try:
        loss = head(model(X)).pow(2).mean()
        loss.backward()
        tdbg.monitor_training_step(loss, optimizer=weights, step=0)
        weights.step()
        biases.step()
    finally:
        tdbg.close()
    assert gc_calls == {"collect": 0, "get_objects": 1}
    (found,) = [a for a in tdbg.report().anomalies if a.kind == "unwatched_parameters"]
    assert found.details == {"outside": {"count": 2, "groups": {"Linear (root)": 2}, "values": 2}, "count": 1}


def test_live_objects_notes_what_is_made_or_rebuilt_while_installed_and_leaves_torch_as_it_was():
    """Made while installed, in order: modules (by their parameters, buffers and submodules) and
    optimizers once ``__init__`` returned; rebuilt by ``copy.deepcopy`` and ``pickle``. Not noted: what
    was made before, an optimizer whose ``__init__`` raised, anything freed since. Removed: torch's
    methods and global hooks as they were, and nothing more noted."""
    from torch.nn.modules import module as torch_module

    from diffusion_debug.training.judges.live_objects import LiveObjects, live_objects

    hooks = [
        torch_module._global_parameter_registration_hooks,
        torch_module._global_buffer_registration_hooks,
        torch_module._global_module_registration_hooks,
    ]
    before_hooks = [len(h) for h in hooks]
    own = [vars(torch.optim.Optimizer)["__init__"], vars(torch.optim.Optimizer)["__setstate__"]]
    own.append(vars(nn.Module)["__setstate__"])
    made_before = nn.Linear(2, 2)
    with LiveObjects().install() as live:
        norm = nn.BatchNorm1d(2, affine=False)  # buffers only
        model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        with pytest.raises(ValueError):
            torch.optim.AdamW(model.parameters(), lr=-1.0)  # raises before torch's __init__: holds nothing
        twin, twin_optimizer = copy.deepcopy((model, optimizer))
        unpickled = pickle.loads(pickle.dumps(made_before))
        dropped = nn.Linear(2, 2)
        gone = weakref.ref(dropped)
        del dropped
        assert gone() is None
        modules = [norm, model[0], model, model[1], twin[0], twin[1], twin, unpickled]  # ReLU: as a submodule
        assert [id(m) for m in live_objects(nn.Module)] == [id(m) for m in modules]
        assert [id(o) for o in live_objects(torch.optim.Optimizer)] == [id(optimizer), id(twin_optimizer)]
    assert [len(h) for h in hooks] == before_hooks
    assert own == [
        vars(torch.optim.Optimizer)["__init__"],
        vars(torch.optim.Optimizer)["__setstate__"],
        vars(nn.Module)["__setstate__"],
    ]
    nn.Linear(2, 2)
    assert len(live.of(nn.Module)) == len(modules)
    live.remove()  # idempotent


class _SlicesItsBlocks(nn.Module):
    """A forward that makes a module: ``self.blocks[1:]`` is a new ModuleList at every call (as
    diffusers' ``UNetMidBlock2DCrossAttn`` zips ``self.resnets[1:]``), which calls torch's global
    registration hooks inside the forward."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x):
        for block in self.blocks[1:]:
            x = torch.tanh(block(x))
        return x


def _compiled_run(installed: bool) -> tuple[list[torch.Tensor], int, dict]:
    """Two forwards and backwards of the compiled model (aot_eager), LiveObjects installed or not: the
    output and gradients, dynamo's graph count and its graph breaks."""
    from torch._dynamo.utils import counters

    from diffusion_debug.training.judges.live_objects import LiveObjects

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = _SlicesItsBlocks()
    registry = LiveObjects().install() if installed else None
    try:
        compiled = torch.compile(model, backend="aot_eager")
        outputs = []
        for _ in range(2):
            out = compiled(X)
            out.square().mean().backward()
            outputs.append(out.detach())
    finally:
        if registry is not None:
            registry.remove()
    return (
        outputs + [p.grad for p in model.parameters() if p.grad is not None],
        counters["stats"]["unique_graphs"],
        dict(counters["graph_break"]),
    )


def test_a_module_made_inside_a_compiled_forward_adds_no_graph_break():
    """The registry's hooks run inside the compiled forward of a model that makes a module there: they
    note nothing there, and the compiled run is as without them. Before, dynamo traced ``id()`` of the
    new module in them: a graph break it could not resume from, the rest of the forward run eagerly
    (a compiled DDP UNet under launch: final weights an ulp off the unwatched run's)."""
    plain, plain_graphs, plain_breaks = _compiled_run(installed=False)
    watched, graphs, breaks = _compiled_run(installed=True)
    assert (graphs, breaks) == (plain_graphs, plain_breaks)
    assert all(torch.equal(a, b) for a, b in zip(watched, plain))
