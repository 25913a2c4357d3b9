"""The module-tree key that lets a reused debugger skip re-deriving its probe lists at attach: every
change that matters to attach gives another key, and an unchanged tree (an in-place dtype change
included) keeps it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from diffusion_debug.diffusion.components.structure import TreeMemo, tree_key
from diffusion_debug.testing.features import HAS_CACHE_HOOKS

NO_HOOKS = pytest.mark.skipif(not HAS_CACHE_HOOKS, reason="this diffusers has no hook registry (diffusers.hooks)")


def tree() -> nn.Module:
    return nn.Sequential(
        nn.Sequential(nn.Linear(2, 2), nn.ReLU()),
        nn.Sequential(nn.Linear(2, 2)),
        nn.Linear(2, 2),
    )


def add_child(net):
    net[1].add_module("extra", nn.Linear(2, 2))


def replace_child(net):
    net[0][0] = nn.Linear(2, 2)  # what a LoRA loader does


def delete_child(net):
    del net[0][1]


def child_to_none(net):
    net[0]._modules["1"] = None


def rename_child(net):
    net[0]._modules = {"other" if name == "1" else name: m for name, m in net[0]._modules.items()}


def move_child(net):  # the same modules, one of them under another parent
    relu = net[0]._modules.pop("1")
    net[1].add_module("1", relu)


def move_parameter(net):  # the same parameter objects, one under another module
    bias = net[1][0]._parameters.pop("bias")
    net[2]._parameters["bias2"] = bias


def replace_parameter(net):
    net[2].weight = nn.Parameter(torch.zeros(2, 2))


def compile_in_place(net):
    net[1].compile(backend="eager")  # regional compilation, in place


def diffusers_registry(net):
    from diffusers.hooks import HookRegistry

    HookRegistry.check_if_exists_or_initialize(net[0][0])


def hook_into_existing_registry(net):
    from diffusers.hooks import HookRegistry, ModelHook

    HookRegistry.check_if_exists_or_initialize(net[0][0]).register_hook(ModelHook(), "added")


@pytest.mark.parametrize(
    "change",
    [
        add_child,
        replace_child,
        delete_child,
        child_to_none,
        rename_child,
        move_child,
        move_parameter,
        replace_parameter,
        compile_in_place,
        pytest.param(diffusers_registry, marks=NO_HOOKS),
        pytest.param(hook_into_existing_registry, marks=NO_HOOKS),
    ],
)
def test_every_change_that_attach_depends_on_gives_another_key(change):
    net = tree()
    if change is hook_into_existing_registry:
        diffusers_registry(net)
    before, _, _ = tree_key(net)
    assert tree_key(net)[0] == before  # the same tree, walked again
    change(net)
    after = tree_key(net)[0]
    assert after != before and tree_key(net)[0] == after  # (a child registered as None: walked the long way)


def test_a_parameter_replaced_by_an_equal_one_and_a_module_that_compares_equal_give_another_key():
    """Modules and parameters are compared by identity: a one-element parameter replaced by another
    of the same value (whose ``==`` is True) and a module whose class defines ``==`` are changes."""

    class Same(nn.Module):
        def __eq__(self, other):
            return isinstance(other, Same)

        __hash__ = nn.Module.__hash__

    net = nn.Sequential(Same(), nn.Linear(2, 2))
    net[1].scale = nn.Parameter(torch.ones(()))
    before, _, _ = tree_key(net)
    net[1].scale = nn.Parameter(torch.ones(()))
    assert bool(net[1].scale == before[2][-1]) and tree_key(net)[0] != before
    before, _, _ = tree_key(net)
    net[0] = Same()
    assert tree_key(net)[0] != before


def test_an_unchanged_tree_keeps_its_memo_also_through_an_in_place_dtype_change():
    net = tree()
    memo = TreeMemo()
    memo.refresh([net])
    calls = []
    compute = lambda: calls.append(1) or len(calls)  # noqa: E731
    assert memo.get(net, "n", compute) == 1
    assert memo.dtype(net) == torch.float32
    net.half()  # in place: the same parameter objects
    memo.refresh([net])
    assert memo.get(net, "n", compute) == 1
    assert memo.dtype(net) == torch.float16  # read again at every attach
    replace_child(net)
    memo.refresh([net])
    assert memo.get(net, "n", compute) == 2


def test_the_majority_dtype_read_from_the_largest_parameters_is_the_one_counted_over_all():
    from diffusion_debug.diffusion.components.inventory import module_dtype

    net = nn.Sequential(nn.Linear(64, 64), nn.Linear(8, 8), nn.Linear(40, 40), nn.Embedding(10, 4))
    memo = TreeMemo()
    cases = [
        lambda: None,  # all float32
        lambda: net[0].half(),  # the largest layer: most of the parameters
        lambda: net[2].half(),  # now fp16 holds more than half
        lambda: (net.float(), net[1].to(torch.bfloat16), net[3].half()),  # small ones only
        lambda: net[0].to(torch.bfloat16),  # bf16 52% of all: the early stop
        lambda: net[1].half(),  # (the largest, read first at the next count, unchanged: bf16 still)
        # the largest replaced by an fp16 one: another tree, its parameters counted anew (not the old bf16 one's)
        lambda: setattr(net[0], "weight", nn.Parameter(torch.zeros(64, 64, dtype=torch.float16))),
    ]
    for change in cases:
        change()
        memo.refresh([net])
        assert memo.dtype(net) == module_dtype(net)
    int8 = nn.Module()
    int8.weight = nn.Parameter(torch.zeros(1000, dtype=torch.int8), requires_grad=False)  # quantized: not counted
    int8.scale = nn.Parameter(torch.ones(10, dtype=torch.float16))
    memo.refresh([int8])
    assert memo.dtype(int8) == module_dtype(int8) == torch.float16
    memo.refresh([nn.ReLU()])
    assert memo.dtype(nn.ReLU()) is None  # not seen by refresh (another object)


def test_a_debugger_made_per_call_finds_what_the_last_one_worked_out_while_the_tree_is_unchanged(
    tmp_path, monkeypatch
):
    """``with DiffusionModelDebugger(pipe, config): pipe(...)``: the second debugger lists no module
    of an unchanged component again, and probes the same modules; a changed component is listed again."""
    from diffusion_helpers import run

    from diffusion_debug import DebugConfig, DiffusionModelDebugger
    from diffusion_debug.diffusion.components import component_probes as call_sites
    from diffusion_debug.testing import tiny_pipeline

    listed = []
    probed_modules = call_sites.probed_modules
    monkeypatch.setattr(call_sites, "probed_modules", lambda m, level: listed.append(m) or probed_modules(m, level))
    pipe = tiny_pipeline("sd")
    config = DebugConfig(output_dir=str(tmp_path), probes="full", log_level="error")

    def one_call() -> dict[str, tuple[str, ...]]:
        with DiffusionModelDebugger(pipe, config) as dbg:
            run(pipe, steps=1)
            return {name: tuple(probe.module_names) for name, probe in dbg._steps.probes.probes.items()}

    first = one_call()
    assert sorted(id(m) for m in listed) == sorted(id(m) for m in (pipe.unet, pipe.vae, pipe.text_encoder))
    listed.clear()
    assert one_call() == first and listed == []
    pipe.vae.decoder.extra = nn.Linear(2, 2)
    third = one_call()
    assert listed == [pipe.vae] and "decoder.extra" in third["vae"] and "decoder.extra" not in first["vae"]
    del pipe.vae.decoder.extra


@pytest.mark.usefixtures("only_the_tests_objects")  # its gc.collect() walks only what the test made
def test_the_shared_memo_holds_neither_the_pipeline_nor_a_component_it_no_longer_has(tmp_path):
    import copy
    import gc
    import weakref

    from diffusion_debug import DebugConfig, DiffusionModelDebugger
    from diffusion_debug.diffusion.components import structure
    from diffusion_debug.testing import tiny_pipeline

    pipe = tiny_pipeline("sd")
    config = DebugConfig(output_dir=str(tmp_path), log_level="error")
    with DiffusionModelDebugger(pipe, config):
        pass
    old = weakref.ref(pipe.vae)
    pipe.vae = copy.deepcopy(pipe.vae)  # replaced between two debuggers
    gc.collect()
    assert old() is None  # what the memo parked holds it weakly: let go with no debugger run since
    with DiffusionModelDebugger(pipe, config):
        pass
    dbg = DiffusionModelDebugger(pipe, config)
    dbg.attach()
    old = weakref.ref(pipe.vae)
    pipe.vae = copy.deepcopy(pipe.vae)  # replaced while a debugger is attached
    dbg.close()
    del dbg
    gc.collect()
    assert old() is None  # let go at close
    held, key = weakref.ref(pipe), id(pipe)
    assert key in structure._SHARED
    del pipe
    gc.collect()
    assert held() is None and key not in structure._SHARED


@pytest.mark.usefixtures("only_the_tests_objects")  # its gc.collect() walks only what the test made
def test_a_component_replaced_after_its_debuggers_are_gone_or_between_two_calls_is_let_go(tmp_path, monkeypatch):
    """Detached (the ``with`` ended, the debugger dropped), the memo is parked weakly: a UNet replaced
    then is collected with no debugger run since, and the next debugger still finds what was worked
    out of the unchanged VAE and text encoder (it lists only the new UNet's modules); a UNet replaced
    between two calls of an attached debugger is let go once the next call ran. Images stay bitwise
    the unwatched pipeline's."""
    import copy
    import gc
    import weakref

    from diffusion_helpers import run

    from diffusion_debug import DebugConfig, DiffusionModelDebugger
    from diffusion_debug.diffusion.components import component_probes as call_sites
    from diffusion_debug.testing import tiny_pipeline

    listed = []
    probed_modules = call_sites.probed_modules
    monkeypatch.setattr(call_sites, "probed_modules", lambda m, level: listed.append(m) or probed_modules(m, level))
    pipe = tiny_pipeline("sd")
    plain = run(pipe, steps=2)
    config = DebugConfig(output_dir=str(tmp_path), probes="full", log_level="error")
    with DiffusionModelDebugger(pipe, config):
        run(pipe, steps=2)
    listed.clear()
    gc.collect()  # the debugger is gone: its memo parked
    old = weakref.ref(pipe.unet)
    pipe.unet = copy.deepcopy(pipe.unet)
    gc.collect()
    assert old() is None
    with DiffusionModelDebugger(pipe, config):
        assert (run(pipe, steps=2) == plain).all()
    assert [id(m) for m in listed] == [id(pipe.unet)]  # the VAE's and text encoder's lists revived
    listed.clear(), monkeypatch.undo()  # (the list holds what it saw)
    dbg = DiffusionModelDebugger(pipe, config)
    with dbg:
        run(pipe, steps=2)
        old = weakref.ref(pipe.unet)
        pipe.unet = copy.deepcopy(pipe.unet)  # between two calls of one attach
        assert (run(pipe, steps=2) == plain).all()
        gc.collect()
        assert old() is None
    dbg.close()
