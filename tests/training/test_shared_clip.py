"""The user's ``accelerator.clip_grad_norm_`` after ``monitor_training_step`` (diffusers' scripts
clip every optimizer step) is made of the gradient norms the monitored step took
(``training.measure.shared_clip``): the clip returns bitwise what it returns without the debugger
and leaves bitwise the same gradients and weights (fp16 under a GradScaler, bf16), the norms shared
are each gradient's own ``p.grad.norm()`` (unscaled under fp16), a NaN planted in one gradient is
still named at its module and step, and detach gives Accelerate its own methods back. Twins: the
same tiny SD UNet trained by ``benchmarks.training.AccelerateStep``, one watched, one not."""

import copy
import math
import sys
import types
from pathlib import Path

import pytest
import torch

from diffusion_debug import DebugConfig, TrainingDebugger
from diffusion_debug.testing import tiny_pipeline
from diffusion_debug.training.measure import shared_clip

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks import training  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

MODULE = "mid_block.resnets.0.conv1"
SHARES = hasattr(torch.nn.utils, "clip_grads_with_norm_")
"""Whether the clip is shared at all: torch 2.6 or later (the floor, 2.5.1, clips as Accelerate does)."""
needs_sharing = pytest.mark.skipif(not SHARES, reason="torch before 2.6: the clip is not wrapped")


@pytest.fixture(scope="module")
def unet():
    return tiny_pipeline("sd").unet.train()


@pytest.fixture
def twins(unet, tmp_path):
    """(plain step, watched step, debugger) for a precision and a max_grad_norm."""
    made = []

    def make(precision, max_grad_norm):
        steps = training.accelerate_steps(
            [copy.deepcopy(unet), copy.deepcopy(unet)],
            precision,
            device="cpu",
            size=8,
            context_len=8,
            max_grad_norm=max_grad_norm,
        )
        debugger = TrainingDebugger(
            steps[1].model, accelerator=steps[1].accelerator, config=DebugConfig(output_dir=str(tmp_path))
        )
        made.append(debugger)
        return steps[0], steps[1], debugger

    yield make
    for debugger in made:
        debugger.close()
    training.reset_accelerate()


def _backward(step, noise_scale=1):
    """The step's loss (the UNet's noise prediction, in the Accelerator's autocast) and its backward."""
    latents, noise, context, timesteps = step.inputs
    with step.accelerator.autocast():
        prediction = step.model(latents + noise * noise_scale, timesteps, encoder_hidden_states=context).sample
        loss = torch.nn.functional.mse_loss(prediction.float(), noise)
    step.accelerator.backward(loss)
    return loss


def _grads_at_step(step):
    """Each optimizer step's gradients, as the optimizer sees them (after the clip)."""
    seen = []
    raw = step.optimizer.optimizer
    raw.register_step_pre_hook(lambda *_: seen.append([p.grad.clone() for p in step.model.parameters()]))
    return seen


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("max_grad_norm", [0.01, 100.0])  # clipping every step, and never
def test_a_clip_made_of_the_monitors_norms_returns_and_leaves_bitwise_what_accelerates_does(
    twins, precision, max_grad_norm
):
    plain, watched, debugger = twins(precision, max_grad_norm)
    plain_grads, watched_grads = _grads_at_step(plain), _grads_at_step(watched)
    for i in range(4):
        plain()
        watched(debugger)
        assert torch.equal(plain.clipped_norm, watched.clipped_norm), i
        assert all(map(torch.equal, plain_grads[i], watched_grads[i])), i
        assert all(map(torch.equal, plain.model.parameters(), watched.model.parameters())), i
    # made of the monitor's norms from the second step, once the clip was seen after a monitored step
    # (fp16: the monitor then unscales the gradients itself)
    assert debugger._clip.shared == (3 if SHARES else 0)
    assert plain.clipped_norm.item() > 0.01  # clipped at 0.01 indeed


@needs_sharing
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_the_norms_shared_are_each_gradients_own_norm_unscaled(twins, precision, monkeypatch):
    plain, watched, debugger = twins(precision, 1.0)
    offered = []
    offer = shared_clip.SharedClip.offer

    def recording(self, norms, grads, scaler, optimizer):
        offer(self, norms, grads, scaler, optimizer)
        if self._norms is not None:  # kept for the clip: a naive reference of the gradients now
            naive = torch.stack([p.grad.norm() for p in self.params.params])
            offered.append((self._norms.clone(), naive))

    monkeypatch.setattr(shared_clip.SharedClip, "offer", recording)
    for _ in range(3):
        plain()
        watched(debugger)
    assert len(offered) == 2
    for norms, naive in offered:
        assert torch.equal(norms, naive)
    # the clip's total is the norm of those norms, and the plain run's (unscaled: not the scaled gradients')
    total = torch.linalg.vector_norm(offered[-1][1])
    assert torch.equal(total, watched.clipped_norm) and torch.equal(total, plain.clipped_norm)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_the_step_records_the_norms_the_clip_takes(twins, precision):
    _, watched, debugger = twins(precision, 100.0)
    recorded = []
    monitor = debugger.monitor_training_step
    debugger.monitor_training_step = lambda *a, **k: recorded.append(monitor(*a, **k))
    for _ in range(3):
        watched(debugger)
        # the global norm: the clip's own (fp16: unscaled, by the monitor itself or divided by the scale)
        assert recorded[-1]["grad_norm"] == pytest.approx(watched.clipped_norm.item(), rel=1e-6)


def test_fp16_gradients_a_clip_unscaled_before_monitoring_are_not_divided_by_the_scale_again(twins):
    _, step, debugger = twins("fp16", None)
    for _ in range(2):
        loss = _backward(step)
        total = step.accelerator.clip_grad_norm_(step.model.parameters(), 100.0)  # unscales, then clips
        module = step.model.get_submodule(MODULE)
        naive = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in module.parameters()]))
        info = debugger.monitor_training_step(loss, optimizer=step.optimizer, grad_norm=total)
        assert info["module_grad_norms"][MODULE] == pytest.approx(naive.item(), rel=1e-6)
        step.optimizer.step()
        step.optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_a_nan_planted_in_one_gradient_is_named_at_its_module_and_step_when_the_user_clips(twins, precision):
    plain, watched, debugger = twins(precision, 1.0)
    for i in range(4):
        if i == 3:  # one parameter's gradient, in both twins
            for step in (plain, watched):
                weight = step.model.get_submodule(MODULE).weight
                weight.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), math.nan))
        plain()
        watched(debugger)
        same = torch.equal(plain.clipped_norm.isnan(), watched.clipped_norm.isnan())
        assert same and torch.equal(plain.clipped_norm.nan_to_num(), watched.clipped_norm.nan_to_num())
    assert watched.clipped_norm.isnan()
    found = [a for a in debugger.report().anomalies if a.kind == "nonfinite"]
    assert [(a.module, a.step, a.parameter) for a in found][:1] == [(MODULE, 3, f"{MODULE}.weight")]
    assert debugger._clip.shared == (3 if SHARES else 0)


def _two_backwards(step, debugger, monitored):
    """One optimizer step of two ``accelerator.backward`` calls (two losses), the debugger monitoring
    after those in ``monitored`` (0: the first, 1: the second), then the clip and the step."""
    for call in range(2):
        loss = _backward(step, noise_scale=call + 1)
        if debugger is not None and call in monitored:
            debugger.monitor_training_step(loss, optimizer=step.optimizer)
    step.clipped_norm = step.accelerator.clip_grad_norm_(step.model.parameters(), 1.0)
    step.optimizer.step()
    step.optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("monitored", [(0,), (0, 1)], ids=["after-the-first", "after-each"])
def test_fp16_a_backward_after_the_monitor_adds_to_gradients_it_left_scaled(twins, monitored):
    """fp16: the monitor unscales the gradients early only where no backward follows it before the
    clip (seen at the first step): else the next backward would add scaled gradients to unscaled
    ones (the clip's norm 30000x the plain one's), or the clip would unscale twice (a RuntimeError)."""
    plain, watched, debugger = twins("fp16", 1.0)
    for i in range(2):  # the first step shows the second backward; the second would have been unscaled early
        _two_backwards(plain, None, monitored)
        _two_backwards(watched, debugger, monitored)
        assert torch.equal(plain.clipped_norm, watched.clipped_norm), i
        assert all(map(torch.equal, plain.model.parameters(), watched.model.parameters())), i
    assert debugger._clip.shared == 0 and [a.kind for a in debugger.report().anomalies] == []


@needs_sharing
def test_fp16_a_script_that_clips_only_from_its_third_step_keeps_the_early_unscale(twins):
    """Steps without a clip (a warm-up, a clip every N steps) are no second backward: the GradScaler's
    update came between the monitored steps. Before: two monitored steps before the first clip ended the
    early unscale for the run, so no fp16 clip was ever shared (0 here). Now the first clip (step 2) gives
    it back, the second (its step checked for a second backward) arms the sharing, the third is shared."""
    plain, watched, debugger = twins("fp16", 1.0)
    for i in range(5):
        for step in (plain, watched):
            step.max_grad_norm = 1.0 if i >= 2 else None
        plain()
        watched(debugger)
        assert all(map(torch.equal, plain.model.parameters(), watched.model.parameters())), i
    assert torch.equal(plain.clipped_norm, watched.clipped_norm)
    assert debugger._clip.early_unscale and debugger._clip.shared == 1


def _custom_diffusion_step(step, debugger):
    """train_custom_diffusion.py's step: the backward, the monitor, then all rows but the first of a
    gradient zeroed through ``.data`` (the script keeps only its new tokens' embedding rows; ``.data``
    moves no version counter), then the clip and the step."""
    loss = _backward(step)
    if debugger is not None:
        debugger.monitor_training_step(loss, optimizer=step.optimizer)
    grads = step.model.get_submodule("time_embedding.linear_1").weight.grad
    index_grads_to_zero = torch.arange(len(grads)) != 0
    grads.data[index_grads_to_zero, :] = grads.data[index_grads_to_zero, :].fill_(0)
    step.clipped_norm = step.accelerator.clip_grad_norm_(step.model.parameters(), 1.0)
    step.optimizer.step()
    step.optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("precision", ["no", "fp16"])
def test_a_gradient_written_through_data_between_the_monitor_and_the_clip_at_every_step_is_clipped_as_unwatched(
    twins, precision
):
    """The first clip's norm is not the monitor's (the write came between): the clip stays Accelerate's
    own for the run. Before: from the second step the clip was made of the norms before the write."""
    plain, watched, debugger = twins(precision, 1.0)
    for i in range(3):
        _custom_diffusion_step(plain, None)
        _custom_diffusion_step(watched, debugger)
        assert torch.equal(plain.clipped_norm, watched.clipped_norm), i
        assert all(map(torch.equal, plain.model.parameters(), watched.model.parameters())), i
    assert plain.clipped_norm.item() > 1.0  # clipped at 1.0 indeed
    assert debugger._clip.shared == 0 and "clip_grad_norm_" not in vars(watched.accelerator)


@needs_sharing
def test_fp16_a_first_clip_that_overflows_decides_nothing_the_first_finite_one_arms_the_sharing(twins):
    """A GradScaler's first steps may overflow (inf norms, the step skipped): no comparison, so the
    sharing is neither armed nor refused until a finite clip (here the third, at 2**18) matches."""
    plain, watched, debugger = twins("fp16", 1.0)
    for step in (plain, watched):
        step.accelerator.scaler._init_scale = 2.0**20  # fp16 activations' gradients overflow above ~2**18
    for i in range(4):
        plain()
        watched(debugger)
        assert torch.equal(plain.clipped_norm, watched.clipped_norm), i
        assert all(map(torch.equal, plain.model.parameters(), watched.model.parameters())), i
        assert debugger._clip.armed == (i >= 2) and not debugger._clip.refused, i
    assert plain.clipped_norm.item() < math.inf
    assert debugger._clip.shared == 1  # the fourth clip; before the first finite one compared, none


def test_a_clip_of_other_parameters_or_another_norm_is_accelerates_own(twins):
    plain, watched, debugger = twins("bf16", 0.01)
    for step, with_debugger in ((plain, None), (watched, debugger)):
        step.max_grad_norm = None
        step(with_debugger)  # monitored, not clipped by the step
    half = [p for i, p in enumerate(plain.model.parameters()) if i % 2]
    for step in (plain, watched):  # the same backward again, then the clips
        latents, noise, context, timesteps = step.inputs
        with step.accelerator.autocast():
            loss = torch.nn.functional.mse_loss(step.model(latents + noise, timesteps, context).sample.float(), noise)
        step.accelerator.backward(loss)
    debugger.monitor_training_step(loss)
    half_w = [p for i, p in enumerate(watched.model.parameters()) if i % 2]
    clipped = plain.accelerator.clip_grad_norm_(half, 0.01)
    assert torch.equal(clipped, watched.accelerator.clip_grad_norm_(half_w, 0.01))
    assert torch.equal(
        plain.accelerator.clip_grad_norm_(plain.model.parameters(), 0.01, norm_type=1),
        watched.accelerator.clip_grad_norm_(watched.model.parameters(), 0.01, norm_type=1),
    )
    grads = [[p.grad for p in step.model.parameters()] for step in (plain, watched)]
    assert all(map(torch.equal, *grads))
    assert debugger._clip.shared == 0


@needs_sharing
def test_detach_gives_accelerate_its_own_methods_back_and_attach_wraps_them_again(twins):
    plain, watched, debugger = twins("fp16", 1.0)
    accelerator = watched.accelerator
    plain(), watched(debugger), plain(), watched(debugger)  # fp16: the monitor unscaled at the second
    # the scaler's unscale_ wrapped from the monitor to the clip's unscale only: nothing held between steps
    assert "clip_grad_norm_" in vars(accelerator) and "unscale_" not in vars(accelerator.scaler)
    assert debugger._clip.shared == 1
    debugger.detach()
    assert "clip_grad_norm_" not in vars(accelerator) and "unscale_" not in vars(accelerator.scaler)
    for _ in range(2):  # monitored while detached: Accelerate's clip, bitwise the plain twin's
        plain()
        watched(debugger)
        assert torch.equal(plain.clipped_norm, watched.clipped_norm)
    assert debugger._clip.shared == 1
    debugger.attach()
    for _ in range(3):
        plain()
        watched(debugger)
        assert torch.equal(plain.clipped_norm, watched.clipped_norm)
    assert debugger._clip.shared == 3
    assert all(map(torch.equal, plain.model.parameters(), watched.model.parameters()))


@needs_sharing
def test_fp16_detached_between_the_monitors_unscale_and_the_clip_the_clip_does_not_unscale_twice(twins):
    """fp16: a monitored step unscaled the gradients early; a detach (or close) before the clip left
    Accelerate's clip to unscale them again: RuntimeError ``unscale_() has already been called``, the run
    broken. The scaler's one-shot wrapper now stays until that unscale_, then goes."""
    plain, watched, debugger = twins("fp16", 1.0)
    plain(), watched(debugger)  # the clip seen after a monitored step: the monitor unscales from now on
    for step, watching in ((plain, None), (watched, debugger)):
        loss = _backward(step)
        if watching is not None:
            watching.monitor_training_step(loss, optimizer=step.optimizer)
            watching.detach()
        step.clipped_norm = step.accelerator.clip_grad_norm_(step.model.parameters(), 1.0)
        step.optimizer.step()
        step.optimizer.zero_grad(set_to_none=True)
    assert torch.equal(plain.clipped_norm, watched.clipped_norm)
    assert all(map(torch.equal, plain.model.parameters(), watched.model.parameters()))
    assert "unscale_" not in vars(watched.accelerator.scaler) and "clip_grad_norm_" not in vars(watched.accelerator)


@needs_sharing
def test_the_clip_is_shared_only_on_one_process_with_no_wrapper_of_it():
    from diffusion_debug.training.measure.gradients import TrainableParameters

    params = TrainableParameters.of(torch.nn.Linear(2, 2))
    one = types.SimpleNamespace(distributed_type="NO")
    assert shared_clip.can_share(one, params)
    assert not shared_clip.can_share(types.SimpleNamespace(distributed_type="MULTI_CPU"), params)  # DDP
    assert not shared_clip.can_share(types.SimpleNamespace(distributed_type="DEEPSPEED"), params)
    assert not shared_clip.can_share(types.SimpleNamespace(distributed_type="FSDP"), params)
    wrapped = types.SimpleNamespace(distributed_type="NO", clip_grad_norm_=lambda *a, **k: None)  # launch's
    assert not shared_clip.can_share(wrapped, params)
    assert not shared_clip.can_share(None, params)


@needs_sharing
def test_the_scripts_own_unscale_after_the_monitor_unscaled_is_the_one_unscale_it_makes(twins):
    """fp16: once the monitor unscales the gradients itself, a script's own
    ``accelerator.scaler.unscale_(optimizer)`` before a clip of its own does not raise (without the
    debugger it is the step's one unscale); the gradients and weights stay bitwise the plain twin's,
    and a second call raises in both, as torch says."""
    plain, watched, debugger = twins("fp16", 0.01)
    plain(), watched(debugger)  # the clip seen after a monitored step: from now on the monitor unscales
    for step, watching in ((plain, None), (watched, debugger)):
        step.max_grad_norm = None  # the script clips by hand from here on
        loss = _backward(step)
        if watching is not None:
            watching.monitor_training_step(loss, optimizer=step.optimizer, timesteps=step.inputs[3])
            assert "unscale_" in vars(step.accelerator.scaler)
        step.accelerator.scaler.unscale_(step.optimizer.optimizer)
        assert "unscale_" not in vars(step.accelerator.scaler)
        with pytest.raises(RuntimeError, match="unscale_"):
            step.accelerator.scaler.unscale_(step.optimizer.optimizer)
        step.clipped_norm = torch.nn.utils.clip_grad_norm_(step.model.parameters(), 0.01)
        step.optimizer.step()
        step.optimizer.zero_grad(set_to_none=True)
    assert torch.equal(plain.clipped_norm, watched.clipped_norm)
    assert all(map(torch.equal, plain.model.parameters(), watched.model.parameters()))
    debugger.detach()
    assert "unscale_" not in vars(watched.accelerator.scaler)


def _debuggers_objects(obj, besides=()):
    """The objects of this package's types reachable from ``obj`` (a copied module's ``CopiedHook``,
    which holds nothing, left out), by ``gc.get_referents`` (a function's closure and defaults, not
    its module's globals), not through the objects ``besides`` (what a copy shares with its original)."""
    import gc

    from diffusion_debug.probes.handles import CopiedHook

    seen, stack, found = {id(item) for item in besides}, [obj], set()
    while stack:
        item = stack.pop()
        if id(item) in seen or isinstance(item, (type, types.ModuleType)):
            continue
        seen.add(id(item))
        if type(item).__module__.startswith("diffusion_debug") and type(item) is not CopiedHook:
            found.add(type(item).__name__)
            continue
        if isinstance(item, types.FunctionType):  # what it holds, not its module's globals
            stack.extend(
                [*(item.__closure__ or ()), *(item.__defaults__ or ()), *(item.__kwdefaults__ or {}).values()]
            )
            continue
        stack.extend(gc.get_referents(item))
    return found


@needs_sharing
def test_a_pickled_or_copied_accelerator_while_attached_carries_nothing_of_the_debuggers(tmp_path):
    """While attached, ``accelerator.clip_grad_norm_`` is the debugger's (an instance attribute). A
    pickled Accelerator (``copy.deepcopy`` returns the Accelerator itself) gets Accelerate's own clip,
    bound to the copy: no object of the debugger's (which held the watched model's parameters), and it
    clips as the plain one; the wrapper's own deep copy and a GradScaler-like owner's alike."""
    import pickle

    from accelerate import Accelerator

    steps = training.accelerate_steps(
        [tiny_pipeline("sd").unet.train()], "bf16", device="cpu", size=8, context_len=8, max_grad_norm=1.0
    )
    step = steps[0]
    debugger = TrainingDebugger(step.model, accelerator=step.accelerator, config=DebugConfig(output_dir=str(tmp_path)))
    try:
        step(debugger), step(debugger)
        accelerator = step.accelerator
        assert "clip_grad_norm_" in vars(accelerator)
        twin = pickle.loads(pickle.dumps(accelerator))
        assert _debuggers_objects(twin) == set()  # before: SharedClip (a bound method of it)
        clip = twin.clip_grad_norm_
        assert clip.__func__ is Accelerator.clip_grad_norm_ and clip.__self__ is twin
        assert copy.deepcopy(vars(accelerator)["clip_grad_norm_"]).__func__ is Accelerator.clip_grad_norm_
        assert shared_clip.can_share(twin, debugger._clip.params)  # the class's own: a debugger of the copy shares
        # it clips as torch does, on gradients of its own
        layer, reference = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        for module in (layer, reference):
            module.weight.grad, module.bias.grad = torch.full((4, 4), 3.0), torch.full((4,), -2.0)
        expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        assert torch.equal(twin.clip_grad_norm_(layer.parameters(), 0.5), expected)
        assert torch.equal(layer.weight.grad, reference.weight.grad)
    finally:
        debugger.close()
        training.reset_accelerate()


@needs_sharing
def test_a_parameter_without_a_gradient_at_the_first_step_does_not_refuse_the_sharing(twins):
    """An unused branch at the first step (its gradient None: torch's clip leaves it out, the monitor's
    norms count it 0) is a clean script: the first clip's total is compared with the norms of the
    gradients it clips. Before: the 0 among the norms moved vector_norm's sum, bf16's first clip differed
    in the last bit, and the sharing was refused for the run (silently: no clip shared)."""
    plain, watched, debugger = twins("bf16", 1.0)
    for i in range(3):
        for step, watching in ((plain, None), (watched, debugger)):
            loss = _backward(step)
            if i == 0:  # as if the branch did not run
                step.model.get_submodule("down_blocks.0.resnets.0.conv1").weight.grad = None
            if watching is not None:
                watching.monitor_training_step(loss, optimizer=step.optimizer)
            step.clipped_norm = step.accelerator.clip_grad_norm_(step.model.parameters(), 1.0)
            step.optimizer.step()
            step.optimizer.zero_grad(set_to_none=True)
        assert torch.equal(plain.clipped_norm, watched.clipped_norm), i
        assert all(map(torch.equal, plain.model.parameters(), watched.model.parameters())), i
    assert not debugger._clip.refused and debugger._clip.shared == 2
