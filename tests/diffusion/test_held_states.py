"""A hook's state kept for ``why()`` beyond its step (:func:`~.cache_hooks.held_apart`, :class:`HeldStates`)
holds the hooks' objects by weak reference, so that it never keeps a module alive: an object a stateful hook
replaces at each call is gone by the replay, and is counted (:func:`lost_values`) and said in why()'s note,
never silently left as it is now."""

from __future__ import annotations

import functools
import gc
import weakref
from dataclasses import dataclass

import pytest
import torch

from diffusion_debug.diffusion.components.cache_hooks import (
    HeldStates,
    held_apart,
    hook_state,
    hook_state_kept,
    lost_values,
)
from diffusion_debug.testing.features import HAS_CACHE_HOOKS

pytestmark = pytest.mark.skipif(not HAS_CACHE_HOOKS, reason="this diffusers has no caching hooks (diffusers.hooks)")


@dataclass
class Rec:
    it: int
    cache: torch.Tensor | None


def _hooked():
    """A module with a stateful diffusers hook that replaces its state object and a callable at each call (odd
    calls answer from its cache, as a caching hook does)."""
    from diffusers.hooks import HookRegistry, ModelHook

    class Replacing(ModelHook):
        _is_stateful = True

        def initialize_hook(self, module):
            return self.reset_state(module)

        def reset_state(self, module):
            self.state, self.scale = Rec(0, None), functools.partial(float, 0)
            return module

        def post_forward(self, module, output):
            state, scale, it = self.state, self.scale, self.state.it
            self.state, self.scale = Rec(it + 1, output.detach()), functools.partial(float, it)
            return state.cache * 0 + 100 * scale() if it % 2 and state.cache is not None else output

    torch.manual_seed(0)
    module, hook = torch.nn.Linear(2, 2), Replacing()
    HookRegistry.check_if_exists_or_initialize(module).register_hook(hook, "replacing")
    return module, hook


def test_a_state_object_and_callable_the_hook_replaced_since_are_counted_and_the_module_still_collected():
    """The hook replaces ``self.state`` and ``self.scale`` at each call: the held state holds both weakly (they
    may reach the module), so both are gone two calls later; before, nothing said so and why() ran from the
    live ones as if from the call's. They are counted; the live ones stay in their place during the replay and
    after it; the module and its hook are still collected with the held state alive."""
    module, hook = _hooked()
    x = torch.ones(1, 2)
    with torch.no_grad():
        for _ in range(3):
            module(x)
        _, state = hook_state(module)
        held = HeldStates()
        held[module] = held_apart(state)
        assert lost_values(held.get(module)) == 0  # (the call's own are alive through the live hook)
        del state
        for _ in range(2):
            module(x)
        gc.collect()
        live = hook.state
        assert (live.it, lost_values(held.get(module))) == (5, 2)
        with hook_state_kept(module, None, held.get(module)):
            assert hook.state is live
        assert hook.state is live and hook.state.it == 5
    gone, hook_gone = weakref.ref(module), weakref.ref(hook)
    del module, hook, live
    gc.collect()
    assert (gone(), hook_gone(), len(held), lost_values(None)) == (None, None, 0, 0)


def test_why_says_how_many_objects_of_the_bundled_calls_state_it_could_not_put_back(tmp_path):
    """A hook on the transformer replaces, at each call, a callable that holds it: the bundled call's is held
    weakly and gone by ``why()``, which replays with the live one and says so (before: said nothing)."""
    from diffusers.hooks import HookRegistry, ModelHook

    from diffusion_debug import DebugConfig, DiffusionModelDebugger
    from diffusion_debug.testing import tiny_pipeline
    from diffusion_debug.testing.faults import plant_nonfinite

    class Replacing(ModelHook):
        _is_stateful = True

        def initialize_hook(self, module):
            return self.reset_state(module)

        def reset_state(self, module):
            self.calls, self.on = 0, None
            return module

        def post_forward(self, module, output):
            self.calls, self.on = self.calls + 1, functools.partial(torch.nn.Module.forward, module)
            return output

    pipe = tiny_pipeline("flux")
    HookRegistry.check_if_exists_or_initialize(pipe.transformer).register_hook(Replacing(), "replacing")
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    with plant_nonfinite(pipe.transformer.proj_out, from_call=1, value=float("nan")):
        with dbg:
            pipe("a cat", num_inference_steps=3, output_type="pt", height=16, width=16)
        gc.collect()
        result = dbg.report().why()
    dbg.close()
    assert (result.module, result.step, result.baseline.finite) == ("proj_out", 1, False)
    assert result.note == (
        "1 object of transformer's hooks' state as the call began could not be put back (held weakly, as they "
        "may reach the module, and replaced by the hooks since): the replays ran with the hooks' objects of now"
    )
