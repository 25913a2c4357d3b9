"""diffusion/pipeline_patches.py: instance-attribute wrappers removed exactly, and what the
debugger reads from scheduler.step / set_timesteps / encode_prompt calls."""

from __future__ import annotations

import inspect

import pytest
import torch

from diffusion_debug.diffusion.pipeline_patches import (
    AttributePatch,
    MethodPatch,
    patch_pipeline,
    prompt_texts,
    read_scheduler_step,
    read_set_timesteps,
)
from diffusion_debug.testing import tiny_pipeline


class Owner:
    def greet(self, name: str, *, loud: bool = False) -> str:
        return name.upper() if loud else name


def test_method_patch_wraps_keeps_the_signature_and_removes_exactly():
    owner = Owner()
    patch = MethodPatch(owner, "greet", lambda original: lambda *a, **k: "<" + original(*a, **k) + ">")
    assert owner.greet("cat", loud=True) == "<CAT>"
    assert inspect.signature(owner.greet) == inspect.signature(Owner().greet)  # diffusers inspects it
    patch.remove()
    patch.remove()  # idempotent
    assert "greet" not in vars(owner) and owner.greet("cat") == "cat"
    mine = lambda name, **k: "mine"  # noqa: E731 - a user's own instance attribute is put back
    owner.greet = mine
    MethodPatch(owner, "greet", lambda original: original).remove()
    assert vars(owner)["greet"] is mine


def test_attribute_patches_undo_in_reverse_order():
    owner = Owner()
    first, second = AttributePatch(owner, "_interrupt", True), AttributePatch(owner, "_interrupt", True)
    second.remove()
    first.remove()
    assert "_interrupt" not in vars(owner)
    owner._interrupt = False
    AttributePatch(owner, "_interrupt", True).remove()
    assert owner._interrupt is False


def test_patch_pipeline_reports_the_calls_and_skips_them_while_busy():
    pipe = tiny_pipeline("sd")
    scheduler = pipe.scheduler
    seen, busy = [], {"now": False}
    patches = patch_pipeline(
        pipe,
        busy=lambda: busy["now"],
        on_step=lambda args, kwargs, output, index: seen.append(("step", index)),
        on_set_timesteps=lambda args, kwargs: seen.append(
            ("set_timesteps", read_set_timesteps(pipe.scheduler, args, kwargs))
        ),
        on_encode_prompt=lambda signature, args, kwargs: seen.append(("encode_prompt", args[0])),
    )
    try:
        pipe("a cat", num_inference_steps=2, output_type="latent", generator=torch.Generator().manual_seed(0))
        busy["now"] = True
        pipe.scheduler.set_timesteps(3)
    finally:
        for patch in patches:
            patch.remove()
    assert [kind for kind, _ in seen] == ["encode_prompt", "set_timesteps", "step", "step"]
    assert seen[0][1] == "a cat" and seen[2][1] is None  # EulerDiscrete's step_index starts unset
    steps, first, init_noise_sigma = seen[1][1]
    scheduler.set_timesteps(2)
    # the first timestep unread (a view: on a GPU a read is a sync), read with the run's first step
    assert isinstance(first, torch.Tensor) and first.item() == scheduler.timesteps[0].item()
    assert steps == 2 and init_noise_sigma == scheduler.init_noise_sigma
    assert "step" not in vars(pipe.scheduler) and "encode_prompt" not in vars(pipe)


def test_read_scheduler_step_finds_the_sigmas_of_the_step():
    pipe = tiny_pipeline("sdxl")  # EulerDiscreteScheduler: sigmas
    scheduler = pipe.scheduler
    scheduler.set_timesteps(3)
    sample = torch.randn(1, 4, 8, 8)
    output = torch.randn(1, 4, 8, 8)
    result = scheduler.step(output, scheduler.timesteps[0], sample)
    inputs = read_scheduler_step(scheduler, (output, scheduler.timesteps[0], sample), {}, result, None)
    assert inputs.latents is result.prev_sample and inputs.denoiser_output is output
    assert inputs.pred_original_sample is result.pred_original_sample and inputs.batch == 1
    assert float(inputs.sigma) == float(scheduler.sigmas[0]) and float(inputs.sigma_next) == float(scheduler.sigmas[1])


def test_prompt_texts_per_tokenizer_and_role():
    pipe = tiny_pipeline("sdxl")
    signature = inspect.signature(pipe.encode_prompt)
    texts = list(prompt_texts(pipe, signature, ("a cat",), {"negative_prompt": ["blurry", "dark"]}))
    assert [(t.tokenizer_name, t.role, t.index, t.text) for t in texts] == [
        ("tokenizer", "prompt", 0, "a cat"),
        ("tokenizer", "negative_prompt", 0, "blurry"),
        ("tokenizer", "negative_prompt", 1, "dark"),
        ("tokenizer_2", "prompt", 0, "a cat"),
        ("tokenizer_2", "negative_prompt", 0, "blurry"),
        ("tokenizer_2", "negative_prompt", 1, "dark"),
    ]
    assert {t.max_length for t in texts} == {77}


def _tagging_patch(owner, tag, seen, name="greet"):
    def make(original):
        def wrapped(*args, **kwargs):
            seen.append(tag)
            return original(*args, **kwargs)

        return wrapped

    return MethodPatch(owner, name, make)


@pytest.mark.parametrize(
    "order",
    [(0, 1), (1, 0), (0, 1, 2), (2, 1, 0), (1, 0, 2), (1, 2, 0), (0, 2, 1), (2, 0, 1)],
    ids=lambda order: "-".join(map(str, order)),
)
@pytest.mark.parametrize("user_attribute", [False, True], ids=["class-method", "user-attribute"])
def test_stacked_method_patches_remove_in_any_order(order, user_attribute):
    owner = Owner()
    mine = None
    if user_attribute:
        mine = lambda name, **k: "mine:" + name  # noqa: E731
        owner.greet = mine
    seen: list[int] = []
    patches = [_tagging_patch(owner, tag, seen) for tag in range(len(order))]
    expected = "mine:cat" if user_attribute else "cat"
    assert owner.greet("cat") == expected and seen == list(reversed(range(len(order))))
    removed: set[int] = set()
    for tag in order:
        patches[tag].remove()
        removed.add(tag)
        seen.clear()
        assert owner.greet("cat") == expected
        # the removed ones never call back; the others still do, outermost first
        assert seen == [t for t in reversed(range(len(order))) if t not in removed]
    if user_attribute:
        assert vars(owner)["greet"] is mine
    else:
        assert "greet" not in vars(owner)


def test_a_removed_patch_wrapped_by_someone_else_passes_through():
    owner, seen = Owner(), []
    patch = _tagging_patch(owner, 0, seen)
    theirs = owner.greet
    owner.greet = lambda *a, **k: "[" + theirs(*a, **k) + "]"  # a foreign wrapper, not a MethodPatch
    patch.remove()
    assert owner.greet("cat") == "[cat]" and seen == []


def test_attribute_patches_undo_in_attach_order_too():
    owner = Owner()
    first, second = AttributePatch(owner, "_interrupt", True), AttributePatch(owner, "_interrupt", True)
    first.remove()
    assert owner._interrupt is True  # the second one still holds it
    second.remove()
    assert "_interrupt" not in vars(owner)


@pytest.mark.parametrize(("count", "detach_order"), [(2, "attach-order"), (3, "attach-order"), (3, "reverse")])
def test_debuggers_on_one_pipeline_detach_cleanly_in_any_order(tmp_path, count, detach_order):
    from diffusion_debug import DebugConfig
    from diffusion_debug.diffusion import DiffusionModelDebugger

    pipe = tiny_pipeline("sd")
    hooks_before = _hook_count(pipe)
    debuggers = [
        DiffusionModelDebugger(pipe, DebugConfig(level="basic", output_dir=str(tmp_path / f"d{i}")))
        for i in range(count)
    ]
    for dbg in debuggers:
        dbg.attach()
    run = lambda: pipe("a cat", num_inference_steps=2, generator=torch.Generator().manual_seed(0))  # noqa: E731
    run()
    assert all(len(dbg.report().steps) == 2 for dbg in debuggers)
    order = debuggers if detach_order == "attach-order" else list(reversed(debuggers))
    for index, dbg in enumerate(order):
        counts = [len(d.report().steps) for d in order]
        dbg.detach()
        run()
        for position, other in enumerate(order):
            grew = len(other.report().steps) - counts[position]
            assert grew == (0 if position <= index else 2), "a detached debugger kept recording, or one stopped"
    assert not {"step", "set_timesteps"} & set(vars(pipe.scheduler))
    assert "encode_prompt" not in vars(pipe)
    assert _hook_count(pipe) == hooks_before
    for dbg in debuggers:
        dbg.close()


def _hook_count(pipe) -> int:
    total = 0
    for name in ("unet", "vae", "text_encoder"):
        for module in getattr(pipe, name).modules():
            total += len(module._forward_hooks) + len(module._forward_pre_hooks)
    return total


def test_encode_prompts_signature_is_the_methods_and_read_once_per_function(monkeypatch):
    pipe, other = tiny_pipeline("sd"), tiny_pipeline("sd")
    signatures = []

    def attach_and_call(p):
        patches = patch_pipeline(
            p,
            busy=lambda: False,
            on_step=lambda *a: None,
            on_set_timesteps=lambda *a: None,
            on_encode_prompt=lambda signature, args, kwargs: signatures.append(signature),
        )
        try:
            p.encode_prompt("a cat", "cpu", 1, False)
        finally:
            for patch in patches:
                patch.remove()

    attach_and_call(pipe)  # the first attach reads it
    real, reads = inspect.signature, []
    monkeypatch.setattr(inspect, "signature", lambda *a, **k: reads.append(a) or real(*a, **k))
    for p in (pipe, pipe, other):  # a reused debugger attaches at every call; another instance, same class
        attach_and_call(p)
    assert reads == [] and len(signatures) == 4
    assert all(s == real(type(pipe).encode_prompt.__get__(pipe)) for s in signatures)
    assert "self" not in signatures[0].parameters and "prompt" in signatures[0].parameters


def test_call_values_match_inspect_and_its_binders_stay_bounded():
    """A signature that ``_signature`` does not keep is new at every attach: the binders it leaves
    are bounded, and every binding equals inspect's (names absent from the call stay absent)."""
    from diffusion_debug.diffusion import pipeline_patches

    def encode(prompt, device=None, num_images=1, *, negative_prompt=None, max_sequence_length=77):
        pass

    for args, kwargs in [(("a cat",), {}), (("a cat", "cpu", 2), {"negative_prompt": "dark"}), ((), {"prompt": "x"})]:
        for _ in range(200):
            signature = inspect.signature(encode)  # a new object each time
            bound = signature.bind_partial(*args, **kwargs)
            bound.apply_defaults()
            assert pipeline_patches.call_values(signature, args, kwargs) == dict(bound.arguments)
    assert len(pipeline_patches._BINDERS) <= pipeline_patches._MAX_BINDERS


@pytest.mark.parametrize("user_attribute", [False, True], ids=["class-method", "user-attribute"])
def test_a_copy_of_a_patched_owner_is_a_copy_of_the_unpatched_one(user_attribute):
    import copy
    import pickle

    owner, seen = Owner(), []
    if user_attribute:
        owner.greet = str.title  # picklable, and copied as itself
    class_method = Owner.__dict__["greet"]
    patches = [_tagging_patch(owner, 0, seen), _tagging_patch(owner, 1, seen)]
    twin, thawed = copy.deepcopy(owner), pickle.loads(pickle.dumps(owner))
    expected = "A Cat" if user_attribute else "a cat"
    assert (twin.greet("a cat"), thawed.greet("a cat"), seen) == (expected, expected, [])  # unwatched
    assert vars(twin) == vars(thawed) == ({"greet": str.title} if user_attribute else {})
    assert owner.greet("a cat") == expected and seen == [1, 0]
    for patch in patches:
        patch.remove()
    assert Owner.__dict__["greet"] is class_method
    assert vars(owner) == vars(twin)


@pytest.mark.parametrize("first_removed", ["watched-before", "watched-after"])
def test_a_class_method_replaced_while_watched_keeps_every_watched_instance_watched(first_removed):
    """Someone replaces the class's method while one instance is watched, then a second instance is
    watched: the dispatcher set over their method counts both patches, so removing either leaves
    the other one watched, and the last removal leaves their method in the class."""

    class Scheduler:
        def step(self, x):
            return x

    def theirs(self, x):
        return x + 1

    seen: list[str] = []
    before, after = Scheduler(), Scheduler()
    patches = {"watched-before": _tagging_patch(before, "before", seen, "step")}
    Scheduler.step = theirs
    patches["watched-after"] = _tagging_patch(after, "after", seen, "step")
    patches.pop(first_removed).remove()
    (still,) = patches
    seen.clear()
    watched_one = before if still == "watched-before" else after
    watched_one.step(1)
    assert seen == [still.removeprefix("watched-")]
    patches[still].remove()
    assert Scheduler.__dict__["step"] is theirs and after.step(1) == 2


def test_removed_patches_put_back_behave_as_new_ones_and_come_off_exactly():
    """A reused debugger's patches are removed at each detach and put back at the next attach
    (``reapply``): put back, they call back as new ones would (outermost first, over another
    patch still on); removed, the class is exactly as it was."""
    from diffusion_debug.diffusion.pipeline_patches import reapply

    owner, other, seen = Owner(), Owner(), []
    class_method = Owner.__dict__["greet"]
    mine = _tagging_patch(owner, "mine", seen)
    mine.remove()
    assert Owner.__dict__["greet"] is class_method and "greet" not in vars(owner)
    theirs = _tagging_patch(owner, "theirs", seen)  # another debugger's, on while mine is off
    watched_other = _tagging_patch(other, "other", seen)
    assert reapply([mine]) and mine.active
    assert (owner.greet("cat"), other.greet("dog"), seen) == ("cat", "dog", ["mine", "theirs", "other"])
    theirs.remove()
    watched_other.remove()
    seen.clear()
    assert owner.greet("cat") == "cat" and seen == ["mine"]
    mine.remove()
    assert Owner.__dict__["greet"] is class_method and vars(owner) == {} and reapply([mine])
    mine.remove()
    seen.clear()
    assert (owner.greet("cat"), seen) == ("cat", [])
    assert reapply([mine]) and reapply([mine]) is False  # on already: not put back twice
    seen.clear()
    assert (owner.greet("cat"), seen) == ("cat", ["mine"])
    mine.remove()
    assert Owner.__dict__["greet"] is class_method


@pytest.mark.parametrize("change", ["instance-attribute", "class-method"])
def test_a_removed_patch_is_not_put_back_over_a_method_changed_since(change):
    from diffusion_debug.diffusion.pipeline_patches import reapply

    class Scheduler:
        def step(self, x):
            return x

    owner, seen = Scheduler(), []
    first, second = _tagging_patch(owner, 0, seen, "step"), _tagging_patch(owner, 1, seen, "step")
    second.remove()
    first.remove()
    if change == "instance-attribute":
        owner.step = lambda x: x + 1
    else:
        Scheduler.step = lambda self, x: x + 1
    assert reapply([first, second]) is False and not first.active and not second.active  # neither put back
    assert owner.step(1) == 2 and seen == []


def test_pipeline_patches_are_made_once_and_leave_the_pipeline_as_it_was_between_attaches():
    from diffusion_debug.diffusion.pipeline_patches import PipelinePatches

    pipe, seen = tiny_pipeline("sd"), []
    scheduler_class, pipe_class = type(pipe.scheduler), type(pipe)
    names = {scheduler_class: ("step", "set_timesteps"), pipe_class: ("encode_prompt", "maybe_free_model_hooks")}
    before = {(cls, name): cls.__dict__.get(name) for cls, group in names.items() for name in group}
    patches = PipelinePatches(
        pipe,
        busy=lambda: False,
        on_step=lambda *a: seen.append("step"),
        on_set_timesteps=lambda *a: seen.append("set_timesteps"),
        on_encode_prompt=lambda *a: seen.append("encode_prompt"),
        on_call_end=lambda: seen.append("end"),
    )

    def run():
        return pipe("a cat", num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="pt")[0]

    plain = run()
    instance_names = set(vars(pipe)), set(vars(pipe.scheduler))  # the call sets some (_guidance_scale)
    made = patches.apply()
    assert len(made) == 4 and torch.equal(run(), plain)  # no safety checker callback: four methods
    assert seen == ["encode_prompt", "set_timesteps", "step", "step", "end"]
    for _ in range(2):
        patches.remove()
        assert {(cls, name): cls.__dict__.get(name) for cls, name in before} == before
        assert (set(vars(pipe)), set(vars(pipe.scheduler))) == instance_names
        seen.clear()
        assert torch.equal(run(), plain) and seen == []  # between two attaches: plain, nothing seen
        assert patches.apply() == made and all(p.active for p in made)  # the same patches, put back
        assert torch.equal(run(), plain) and len(seen) == 5
    patches.remove()
    pipe.scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)  # a new scheduler: new patches
    seen.clear()
    fresh = patches.apply()
    assert fresh[0].owner is pipe.scheduler and not set(map(id, fresh)) & set(map(id, made))
    assert torch.equal(run(), plain) and len(seen) == 5
    patches.remove()
    assert {(cls, name): cls.__dict__.get(name) for cls, name in before} == before


def test_a_class_method_wrapped_while_watched_is_watched_once_at_the_next_attach(tmp_path):
    """Someone wraps the scheduler class's ``step`` while a debugger is attached (their wrapper calls
    our dispatcher, which they found there) and keeps it after detach; at the next attach our patch
    wraps theirs: each step runs our wrapper once, theirs once and the method once, and the images
    are bitwise those of an unwatched call (the old dispatcher inside their wrapper used to run our
    chain again: endless recursion in the user's call)."""
    from diffusion_debug import DebugConfig, DiffusionModelDebugger

    pipe = tiny_pipeline("sd")
    cls = type(pipe.scheduler)
    class_step = cls.__dict__["step"]

    def run():
        return pipe("a cat", num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="pt")[0]

    plain = run()
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path)))
    theirs: list[int] = []
    try:
        with dbg:
            found = cls.step  # our dispatcher, while the pipeline is watched

            def their_step(self, *args, **kwargs):
                theirs.append(1)
                return found(self, *args, **kwargs)

            cls.step = their_step
            assert torch.equal(run(), plain)
        assert cls.__dict__["step"] is their_step  # theirs is kept
        with dbg:
            steps_before = len(dbg.report().steps)
            assert torch.equal(run(), plain)
            assert len(dbg.report().steps) - steps_before == 2 and len(theirs) == 4
        assert cls.__dict__["step"] is their_step
        theirs.clear()
        assert torch.equal(run(), plain) and len(theirs) == 2  # detached: theirs, then the method
    finally:
        cls.step = class_step


def test_two_reused_debuggers_taking_turns_on_one_pipeline_each_record_only_their_calls(tmp_path):
    """A reattached debugger's patches are put back over another debugger's still on (and under it
    when that one reattaches), and one closed while the other is attached: each records exactly the
    calls it was attached for, the images are bitwise those of unwatched calls, and once both are
    off the classes, the instances and every hook dict are as before."""
    from diffusion_debug import DebugConfig, DiffusionModelDebugger
    from diffusion_debug.diffusion import pipeline_patches

    pipe = tiny_pipeline("sd")

    def run():
        return pipe("a cat", num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="pt")[0]

    def state():
        classes = [dict(vars(cls)) for cls in (type(pipe), type(pipe.scheduler))]
        return classes, set(vars(pipe)), set(vars(pipe.scheduler)), _hook_count(pipe)

    plain = run()
    before = state()
    a, b = (DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path / n))) for n in "ab")
    named, calls = {"a": a, "b": b}, {a: 0, b: 0}
    # "+b +a -b": a's patches put back over b's (on), then b's taken from under a's
    for turn in ["+a", "+b", "+b +a -b", "+a +b -a", "+b +a -a", "+a +b"]:
        for move in turn.split():
            dbg = named[move[1]]
            dbg.attach() if move[0] == "+" else dbg.detach()
        assert torch.equal(run(), plain)
        for dbg in (a, b):
            calls[dbg] += dbg.attached
        assert [len(d.report().steps) for d in (a, b)] == [2 * calls[a], 2 * calls[b]], turn
        for dbg in (a, b):
            dbg.detach()
        assert state() == before
    a.attach()
    b.attach()
    a.close()
    assert torch.equal(run(), plain) and len(a.report().steps) == 2 * calls[a]
    assert len(b.report().steps) == 2 * (calls[b] + 1)
    b.close()
    assert state() == before and pipeline_patches._DISPATCHERS == {}


def test_a_class_method_wrapped_while_watched_still_runs_once_another_patch_comes():
    """Someone wraps the class's method while an instance is watched (their wrapper calls our
    dispatcher, found there), then a second patch comes (another debugger on the same instance,
    one on another instance): the new dispatcher is set over theirs, and every watched call runs
    theirs once, with each of our wrappers once; theirs is left in the class at the end."""

    class Scheduler:
        def step(self, x):
            return x

    seen: list[str] = []
    first, second = Scheduler(), Scheduler()
    a = _tagging_patch(first, "a", seen, "step")
    dispatcher = Scheduler.step

    def theirs(self, x):
        seen.append("theirs")
        return dispatcher(self, x) + 1

    Scheduler.step = theirs
    assert first.step(1) == 2 and seen == ["theirs", "a"]
    b = _tagging_patch(first, "b", seen, "step")
    c = _tagging_patch(second, "c", seen, "step")
    seen.clear()
    assert (first.step(1), second.step(1), Scheduler().step(1)) == (2, 2, 2)
    assert seen == ["b", "a", "theirs", "c", "theirs", "theirs"]
    a.remove()
    seen.clear()
    assert first.step(1) == 2 and seen == ["b", "theirs"]
    b.remove()
    c.remove()
    seen.clear()
    assert Scheduler.__dict__["step"] is theirs and (first.step(1), seen) == (2, ["theirs"])


def test_a_patched_scheduler_step_has_the_signature_of_its_method_without_unwrapping():
    """diffusers asks ``inspect.signature(self.scheduler.step)`` at every call: the dispatcher carries
    its method's signature (read once per function), so the answer is the method's without
    following ``__wrapped__``; the class has its method back, with no signature of ours, after."""
    pipe = tiny_pipeline("sd")
    plain = inspect.signature(pipe.scheduler.step)
    patches = patch_pipeline(
        pipe,
        busy=lambda: False,
        on_step=lambda *a: None,
        on_set_timesteps=lambda *a: None,
        on_encode_prompt=lambda *a: None,
    )
    try:
        patched = inspect.signature(pipe.scheduler.step)
        assert type(pipe.scheduler).step.__wrapped__ is not None  # the dispatcher is on the class
    finally:
        for patch in patches:
            patch.remove()
    assert patched == plain and list(patched.parameters) == list(plain.parameters)
    assert "eta" in patched.parameters and "self" not in patched.parameters
    assert inspect.signature(pipe.scheduler.step) == plain and not hasattr(type(pipe.scheduler).step, "__signature__")
