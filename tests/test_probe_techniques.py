"""The hooks layer's techniques other than the probe itself: one handle type, argument callbacks,
profiler ranges, backward order, and the probe's abs-max signal; each checked against torch's own
hook dicts or a naive reference."""

import pytest
import torch
from torch import nn

from diffusion_debug.probes import (
    BackwardOrder,
    CallArgsConfig,
    Probe,
    ProbeConfig,
    ProbeHandle,
    apply_call_args,
    apply_grad_order,
    apply_probes,
    apply_ranges,
)


@pytest.fixture
def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def _hook_counts(model):
    return [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()]


def test_a_handle_removes_every_hook_once_then_runs_on_remove_once(model):
    calls = []
    before = _hook_counts(model)
    handle = ProbeHandle(
        [model[0].register_forward_hook(lambda *a: None), model[2].register_forward_pre_hook(lambda *a: None)],
        on_remove=lambda: calls.append("done"),
    )
    assert handle.attached and _hook_counts(model) != before
    handle.remove()
    handle.remove()
    assert _hook_counts(model) == before and calls == ["done"] and not handle.attached


def test_call_args_sees_each_calls_arguments_and_output_and_skips_while_busy(model):
    seen, busy = [], [False]
    config = CallArgsConfig(
        before=lambda m, args, kwargs: seen.append(("before", args[0].clone())),
        after=lambda m, args, kwargs, out: seen.append(("after", out.clone())),
        skip=lambda: busy[0],
    )
    x = torch.randn(2, 3)
    before = _hook_counts(model)
    with apply_call_args(model[0], config):
        expected = model(x)
        busy[0] = True
        model(x)
    assert [kind for kind, _ in seen] == ["before", "after"]
    assert torch.equal(seen[0][1], x) and torch.equal(seen[1][1], model[0](x))
    assert torch.equal(model(x), expected) and _hook_counts(model) == before


def test_call_args_config_refuses_what_it_cannot_run():
    with pytest.raises(TypeError, match="before must be callable"):
        CallArgsConfig(before="print")
    with pytest.raises(ValueError, match="needs `before`, `after` or both"):
        CallArgsConfig()


def test_call_args_reports_an_error_raised_in_the_call_once_and_it_goes_on_unchanged(model):
    """``on_error``: the post-hook (``always_call``) sees an OOM raised inside the call, skipped or
    not, and ``after`` does not run for it; an error already in flight when the call began (a retry
    in the ``except`` block) is no error of this call; any other error passes unseen."""
    from diffusion_debug.testing import plant_oom

    seen, busy = [], [False]
    config = CallArgsConfig(
        after=lambda m, args, kwargs, out: seen.append(("after", m)),
        skip=lambda: busy[0],
        on_error=lambda m, error: seen.append(("error", m, error)),
    )
    x, expected = torch.randn(2, 3), model(torch.zeros(2, 3))
    tables = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_always_called", "_forward_hooks_with_kwargs")
    before = [[len(getattr(m, t)) for t in tables] for m in model.modules()]
    with apply_call_args(model, config):
        with plant_oom(model[2]), pytest.raises(torch.OutOfMemoryError) as caught:
            model(x)
        assert seen == [("error", model, caught.value)]
        assert caught.traceback[-1].name == "hook"  # raised where it was planted, not by us
        try:
            with plant_oom(model[2]):
                model(x)
        except torch.OutOfMemoryError as error:  # a retry while it is handled: a clean call
            seen.clear()
            assert torch.equal(model(torch.zeros(2, 3)), expected)
            assert seen == [("after", model)] and error is not None
        seen.clear()
        busy[0] = True
        with plant_oom(model[0]), pytest.raises(torch.OutOfMemoryError):
            model(x)
        assert [kind for kind, *_ in seen] == ["error"]  # skipped calls are watched too
        seen.clear()
        busy[0] = False
        with model[0].register_forward_pre_hook(lambda m, a: 1 / 0), pytest.raises(ZeroDivisionError):
            model(x)
        assert seen == []
        model(x)
        assert seen == [("after", model)]
    assert [[len(getattr(m, t)) for t in tables] for m in model.modules()] == before


def interrupted_inside_except(model: nn.Module, x: torch.Tensor):
    """Call ``model`` inside an ``except`` block and stop the call with KeyboardInterrupt (torch runs
    no ``always_call`` hook for it, so no post-hook runs); after a collection, a weak reference to an
    object only the handled error's frame holds."""
    import gc
    import weakref

    class Held:  # only the handled error's frame holds one
        pass

    def fail():
        held = Held()  # noqa: F841 (held by the frame)
        raise ValueError("handled")

    def interrupt(module, args):
        raise KeyboardInterrupt

    try:
        try:
            fail()
        except ValueError as error:
            ref = weakref.ref(error.__traceback__.tb_next.tb_frame.f_locals["held"])
            with model[0].register_forward_pre_hook(interrupt):
                model(x)
    except KeyboardInterrupt:
        pass
    gc.collect()
    return ref


def test_call_args_keeps_nothing_of_an_error_handled_around_a_call_that_keyboard_interrupt_stops(model):
    """A call made inside an ``except`` block and stopped by KeyboardInterrupt: nothing of the
    handled error is kept (its frames, and what they hold, are freed once the user lets go of it),
    the module's next OOM is still reported once as raised in its call, and its next clean call is
    seen."""
    from diffusion_debug.testing import plant_oom

    seen = []
    config = CallArgsConfig(after=lambda m, *a: seen.append("after"), on_error=lambda m, e: seen.append(str(e)))
    x = torch.randn(2, 3)
    with apply_call_args(model, config):
        ref = interrupted_inside_except(model, x)
        assert ref() is None and seen == []
        with plant_oom(model[2]), pytest.raises(torch.OutOfMemoryError) as caught:
            model(x)
        assert seen == [str(caught.value)]
        seen.clear()
        model(x)
        assert seen == ["after"]


def test_call_errors_keeps_nothing_of_an_error_handled_around_a_call_that_keyboard_interrupt_stops(model):
    """The training debugger's OOM watch (apply_call_errors) reads the error as call_args does: a
    call made inside an ``except`` block and stopped by KeyboardInterrupt keeps nothing of the
    handled error; a retry inside an ``except`` block is no error; the next OOM is reported once."""
    from diffusion_debug.probes import CallErrorsConfig, apply_call_errors
    from diffusion_debug.testing import plant_oom

    seen, started = [], []
    config = CallErrorsConfig(lambda m, e: seen.append((m, str(e))), on_start=lambda: started.append(1))
    x = torch.randn(2, 3)
    with apply_call_errors(model, config):
        ref = interrupted_inside_except(model, x)
        assert ref() is None and seen == [] and started == [1]
        try:
            with plant_oom(model[2]):
                model(x)
        except torch.OutOfMemoryError as error:
            assert seen == [(model, str(error))]
            model(x)  # a retry while it is handled: a clean call
        assert len(seen) == 1 and len(started) == 3
    assert not model._forward_hooks and not model._forward_pre_hooks


def test_ranges_name_each_block_in_the_profile_and_remove_leaves_nothing(model):
    before = _hook_counts(model)
    with torch.profiler.profile() as profile, apply_ranges([("net", model), ("net.first", model[0])]) as handle:
        model(torch.ones(1, 3))
        model(torch.ones(1, 3))
    counts = {e.key: e.count for e in profile.key_averages() if e.key.startswith("net")}
    assert counts == {"net": 2, "net.first": 2}
    assert handle.state is not None and _hook_counts(model) == before


def test_a_range_opened_by_hand_and_never_closed_is_ended_by_remove(model):
    with torch.profiler.profile() as profile:
        handle = apply_ranges([("net", model)])
        handle.state.enter("net", model)  # as the step profiler opens the range of a call already begun
        handle.remove()
    assert handle.state._open == {}
    assert [e.count for e in profile.key_averages() if e.key == "net"] == [1]


def test_grad_order_records_the_last_backward_and_its_handle_removes_the_hooks(model):
    order = BackwardOrder(model.parameters())
    with apply_grad_order(order) as handle:
        model(torch.randn(2, 3)).sum().backward()
    assert handle.state is order
    # backward reaches the last layer's parameters first (2.weight, 2.bias are indices 2, 3)
    assert set(list(order.order)[:2]) == {2, 3} and sorted(order.order) == [0, 1, 2, 3]
    assert not any(p._post_accumulate_grad_hooks for p in model.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_an_absmax_probe_reads_the_range_of_every_dtype(model, dtype):
    model = model.to(dtype)
    x = (torch.randn(2, 3) * 100).to(dtype)
    with apply_probes(model, ProbeConfig("full", measure_inputs=False, signal="absmax")) as handle:
        model(x)
    readings = {r.module: r for r in handle.state.collect()}
    assert list(readings) == ["0", "2", ""]  # the Tanh cannot make NaN/Inf: not watched
    assert readings["0"].output_absmax == model[0](x).abs().max().item()
    assert readings[""].output_absmax == model(x).abs().max().item()
    assert all(r.input_value is None for r in readings.values())


def test_probe_config_names_what_it_accepts():
    with pytest.raises(ValueError, match="signal must be one of"):
        ProbeConfig("full", signal="sum")
    with pytest.raises(ValueError, match="granularity must be one of"):
        Probe(nn.Linear(1, 1), "blocks")


class _Watcher:
    """What a debugger's hook holds (a bound method's ``__self__``): a deep copy of it would copy this."""

    def __init__(self):
        self.calls = 0

    def seen(self, module, args, kwargs):
        self.calls += 1


def _scripts_kwargs_hook(module, args, kwargs, output):
    """The script's own hook, ``with_kwargs`` (module-level: it pickles by name)."""
    return output + kwargs.get("shift", 0)


class _Shifted(nn.Linear):
    def forward(self, x, shift=0):
        return super().forward(x)


def test_a_copy_or_pickle_leaves_out_our_hooks_and_their_flags_and_keeps_the_scripts_own_with_its_flags():
    """Ours put in by ``ForwardHooks`` (``always_call``) and by torch's ``register_*`` with the handle marked
    (a bound method: its watcher must not be copied) are left out of a deep copy and a pickle, their flag
    entries too; the script's own ``with_kwargs`` hook stays with its flag, and runs in the copy as torch copies
    it; the original runs all of them. The patch is in while held, out when the last holder lets go."""
    import copy
    import pickle

    from diffusion_debug.probes import copies
    from diffusion_debug.probes.handles import ForwardHooks

    torch.manual_seed(0)
    layer = _Shifted(2, 2)
    x = torch.ones(1, 2)
    own = layer.register_forward_hook(_scripts_kwargs_hook, with_kwargs=True)
    held, watcher = copies.HELD[0], _Watcher()
    ours = ForwardHooks([(layer, lambda *args: None)], always_call=True)
    copies.hold()
    marked = copies.mark(layer.register_forward_pre_hook(watcher.seen, with_kwargs=True))
    try:
        memo: dict = {}
        twin = copy.deepcopy(layer, memo)
        thawed = pickle.loads(pickle.dumps(layer))
        assert id(watcher) not in memo
        for made in (twin, thawed):
            assert list(made._forward_hooks.values()) == [_scripts_kwargs_hook] and not made._forward_pre_hooks
            assert set(made._forward_hooks_with_kwargs) == {own.id} and not made._forward_hooks_always_called
            assert not made._forward_pre_hooks_with_kwargs
            assert torch.equal(made(x, shift=1.5), layer(x, shift=1.5))
        assert watcher.calls == 2  # the original's two calls alone
        assert len(layer._forward_hooks) == 2 and len(layer._forward_pre_hooks) == 1  # the original keeps ours
    finally:
        marked.remove()
        copies.unmark(marked)
        copies.release()
        ours.remove()
    assert copies.HELD[0] == held and bool(copies._PATCH) == bool(held)
    assert not copies.MARKED & {marked.id}


def test_a_release_without_a_hold_is_an_error_here_and_a_warning_in_a_users_run():
    """Clamped at 0, a holder's second release went unseen. Now it leaves the count and the patch as they
    were and warns: an error under the suite's filter, a RuntimeWarning where a user's run goes on."""
    import warnings

    from diffusion_debug.errors import UnbalancedRelease
    from diffusion_debug.probes import copies

    original = nn.Module.__getstate__
    assert copies.HELD[0] == 0 and not copies._PATCH  # nothing holds between tests (the leak check's)
    copies.hold()
    copies.hold()
    copies.release()
    assert copies.HELD[0] == 1 and nn.Module.__getstate__ is not original  # one holder left: still in
    copies.release()
    assert copies.HELD[0] == 0 and nn.Module.__getstate__ is original
    with pytest.raises(UnbalancedRelease, match=r"^probes.copies.release\(\) with no hold left"):
        copies.release()
    assert copies.HELD[0] == 0 and nn.Module.__getstate__ is original
    copies.hold()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # a user's run: a plain interpreter's filter
        copies.release()
        copies.release()  # the holder that releases twice
    assert [(w.category, str(w.message)) for w in caught] == [
        (UnbalancedRelease, "probes.copies.release() with no hold left: a holder released twice")
    ]
    assert copies.HELD[0] == 0 and nn.Module.__getstate__ is original


def test_a_forward_hooks_that_fails_half_way_leaves_the_copies_count_as_it_found_it():
    """Its undo (before the error goes on) lets go of no hold it never took: another holder's patch stays in."""
    from diffusion_debug.probes import copies
    from diffusion_debug.probes.handles import ForwardHooks

    bare = nn.Linear(2, 2)
    del bare.__dict__["_forward_hooks_with_kwargs"]  # the planted fault: its second hook cannot go in
    copies.hold()
    held = copies.HELD[0]
    try:
        with pytest.raises(KeyError, match="_forward_hooks_with_kwargs"):
            ForwardHooks([(nn.Linear(2, 2), print), (bare, print)], with_kwargs=True)
        assert copies.HELD[0] == held and copies._PATCH
    finally:
        copies.release()
