"""Every object the debugger patches stays itself under copy.deepcopy, pickle, .to() and a second
pipeline sharing it while attached: the scheduler (step, set_timesteps), the pipeline's methods
(encode_prompt, run_safety_checker, maybe_free_model_hooks) and the hooks on every module. A copy
made while attached computes what a copy of the unwatched object computes and is not watched;
detach puts back the classes and leaves nothing on the originals or the copies called since.
Then LTX-2 (diffusion_debug.testing, ``ltx2``), which deep-copies its scheduler for the audio:
bitwise equal with 3 steps, quiet when clean, and an Inf planted at step 1 named there."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.probes.handles import OwnHook
from diffusion_debug.record import folded
from diffusion_debug.testing import plant_nonfinite, tiny_pipeline
from diffusion_debug.testing.features import kind_missing
from diffusion_debug.testing.zoo_video_audio import LTX2_CALL

PIPELINE_METHODS = ("encode_prompt", "run_safety_checker", "maybe_free_model_hooks")
SCHEDULER_METHODS = ("step", "set_timesteps")
LTX2_MODULE = "transformer_blocks.0.ff.net.2"  # a Linear inside the first block: one call per step


def cfg(tmp_path, **kwargs):
    kwargs.setdefault("log_level", "error")
    return DebugConfig(output_dir=str(tmp_path), **kwargs)


def run_sd(pipe):
    return pipe("a cat", num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="pt")[0]


def class_dicts(pipe):
    """What the pipeline's and the scheduler's classes hold under the patched names."""
    return {
        (cls.__name__, name): cls.__dict__.get(name)
        for obj, names in ((pipe, PIPELINE_METHODS), (pipe.scheduler, SCHEDULER_METHODS))
        for cls in type(obj).__mro__
        for name in names
    }


def hook_entries(module):
    return [
        hook
        for m in module.modules()
        for hooks in (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks)
        for hook in hooks.values()
    ]


def scheduler_trajectory(scheduler, steps=2):
    """The latents a scheduler makes from fixed inputs (values to compare, not "it ran")."""
    scheduler.set_timesteps(steps)
    generator = torch.Generator().manual_seed(1)
    sample = torch.randn(1, 4, 8, 8, generator=generator)
    out = []
    for t in scheduler.timesteps:
        noise = torch.randn(1, 4, 8, 8, generator=generator)
        sample = scheduler.step(noise, t, sample).prev_sample
        out.append(sample)
    return torch.stack(out)


def unet_output(unet, dtype=torch.float32):
    generator = torch.Generator().manual_seed(2)
    sample = torch.randn(1, 4, 8, 8, generator=generator).to(dtype)
    context = torch.randn(1, 77, unet.config.cross_attention_dim, generator=generator).to(dtype)
    return unet(sample, torch.tensor(500), encoder_hidden_states=context).sample


@pytest.fixture
def sd():
    return tiny_pipeline("sd")


def test_copies_made_while_attached_are_copies_of_the_unwatched_objects(sd, tmp_path):
    pipe = sd
    classes_before, vars_before = class_dicts(pipe), set(vars(pipe.scheduler))
    reference = {  # copies of the unwatched objects: what every copy below must compute
        "scheduler": copy.deepcopy(pipe.scheduler),
        "unet": copy.deepcopy(pipe.unet),
        "pipe": copy.deepcopy(pipe),
    }
    expected_trajectory = scheduler_trajectory(reference["scheduler"])
    expected_unet = unet_output(reference["unet"])
    expected_unet64 = unet_output(copy.deepcopy(reference["unet"]).to(torch.float64), torch.float64)
    expected_image = run_sd(reference["pipe"])
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
    with dbg:
        watched_image = run_sd(pipe)
        rows = len(dbg.report().steps)
        copies = {
            "scheduler deepcopy": copy.deepcopy(pipe.scheduler),
            "scheduler pickle": pickle.loads(pickle.dumps(pipe.scheduler)),
            "unet deepcopy": copy.deepcopy(pipe.unet),
            "unet pickle": pickle.loads(unet_pickled := pickle.dumps(pipe.unet)),
            "unet float64": copy.deepcopy(pipe.unet).to(torch.float64),
            "pipe deepcopy": copy.deepcopy(pipe),
        }
        for name in ("scheduler deepcopy", "scheduler pickle"):
            scheduler = copies[name]
            assert not set(SCHEDULER_METHODS) & set(vars(scheduler)), name  # its step runs itself
            assert torch.equal(scheduler_trajectory(scheduler), expected_trajectory), name
        assert b"diffusion_debug" not in unet_pickled  # it loads where diffusion-debug is not installed
        for name in ("unet deepcopy", "unet pickle"):
            assert hook_entries(copies[name]) == [], name  # a plain unet (before: an inert CopiedHook a hook)
            assert torch.equal(unet_output(copies[name]), expected_unet), name
        assert torch.equal(unet_output(copies["unet float64"], torch.float64), expected_unet64)
        copied_pipe = copies["pipe deepcopy"]
        assert not set(PIPELINE_METHODS) & set(vars(copied_pipe))
        assert torch.equal(run_sd(copied_pipe), expected_image)
        assert len(dbg.report().steps) == rows  # no copy was watched
        # .to() of the watched pipeline itself: still watched, still the same values
        assert torch.equal(run_sd(pipe.to("cpu")), expected_image)
        assert len(dbg.report().steps) == rows + 2
        assert all(isinstance(hook, OwnHook) for hook in hook_entries(pipe.unet))
    assert torch.equal(watched_image, expected_image)
    loud = [(a.kind, a.message) for a in dbg.report().anomalies if a.kind != "scheduler_config"]
    assert loud == []  # the tiny SD's 2 'leading' steps are a scheduler_config warning, as without copies
    # detach: the classes and the originals as they were, no trace on the copies called since
    assert class_dicts(pipe) == classes_before
    assert set(vars(pipe.scheduler)) == vars_before and not set(PIPELINE_METHODS) & set(vars(pipe))
    assert hook_entries(pipe.unet) == [] and hook_entries(copied_pipe.unet) == []
    assert not set(SCHEDULER_METHODS) & set(vars(copies["scheduler deepcopy"]))
    assert torch.equal(scheduler_trajectory(pipe.scheduler), expected_trajectory)
    assert torch.equal(scheduler_trajectory(pickle.loads(pickle.dumps(pipe.scheduler))), expected_trajectory)
    dbg.close()


def test_a_second_pipeline_sharing_the_objects_runs_unwatched_and_unchanged(sd, tmp_path):
    from diffusers import StableDiffusionPipeline

    expected = run_sd(sd)
    dbg = DiffusionModelDebugger(sd, cfg(tmp_path))
    with dbg:
        other = StableDiffusionPipeline(**sd.components)  # the same scheduler, UNet, VAE, text encoder
        other.set_progress_bar_config(disable=True)
        assert torch.equal(run_sd(other), expected)
        assert dbg.report().steps == [] and dbg.report().anomalies == []
        assert torch.equal(run_sd(sd), expected)  # the watched one still is, after the other ran
        assert [row["step"] for row in dbg.report().steps] == [0, 1]
    dbg.close()


def test_two_schedulers_of_one_class_watched_by_two_debuggers_stay_apart(tmp_path):
    first, second = tiny_pipeline("sd"), tiny_pipeline("sd", seed=1)
    assert type(first.scheduler) is type(second.scheduler)
    classes_before = class_dicts(first)
    expected = run_sd(first), run_sd(second)
    one = DiffusionModelDebugger(first, cfg(tmp_path / "one"))
    two = DiffusionModelDebugger(second, cfg(tmp_path / "two"))
    with one, two:
        assert torch.equal(run_sd(first), expected[0])
        assert torch.equal(run_sd(second), expected[1])
        assert torch.equal(run_sd(first), expected[0])
    assert [len(one.report().steps), len(two.report().steps)] == [4, 2]
    assert class_dicts(first) == classes_before
    one.close()
    two.close()


def test_a_subclass_calling_super_step_is_watched_once(tmp_path):
    from diffusers import EulerDiscreteScheduler

    class Mine(EulerDiscreteScheduler):  # a user's scheduler whose step calls the class it extends
        def step(self, *args, **kwargs):
            return super().step(*args, **kwargs)

    pipe = tiny_pipeline("sd")
    pipe.scheduler = Mine.from_config(pipe.scheduler.config)
    theirs, mine = EulerDiscreteScheduler.__dict__["step"], Mine.__dict__["step"]
    plain = run_sd(pipe)
    other = DiffusionModelDebugger(tiny_pipeline("sd", seed=1), cfg(tmp_path / "base"))
    other.pipe.scheduler = EulerDiscreteScheduler.from_config(pipe.scheduler.config)
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path / "mine"))
    with other, dbg:  # the base class is patched too, for the other pipeline's scheduler
        assert torch.equal(run_sd(pipe), plain)
    assert [row["step"] for row in dbg.report().steps] == [0, 1] and other.report().steps == []
    assert (EulerDiscreteScheduler.__dict__["step"], Mine.__dict__["step"]) == (theirs, mine)
    other.close()
    dbg.close()


@pytest.mark.usefixtures("only_the_tests_objects")  # its gc.collect() walks only what the test made
def test_a_debugger_dropped_while_attached_lets_its_pipeline_go(tmp_path):
    import gc
    import weakref

    pipe = tiny_pipeline("sd")
    classes = type(pipe), type(pipe.scheduler)
    before = [dict(vars(cls)) for cls in classes]
    getstate = vars(torch.nn.Module)["__getstate__"]
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
    dbg.attach()
    run_sd(pipe)
    alive = weakref.ref(pipe), weakref.ref(pipe.scheduler)
    del pipe, dbg
    gc.collect()
    assert [ref() is None for ref in alive] == [True, True]  # nothing of ours keeps them (no global registry)
    # and the classes hold their own methods again, as after a detach (no dispatcher left on them)
    assert [dict(vars(cls)) for cls in classes] == before
    assert vars(torch.nn.Module)["__getstate__"] is getstate  # the copies patch out with its last holder


# -- LTX-2: the pipeline that deep-copies its scheduler ----------------------------------------------


@pytest.fixture(scope="module")
def ltx2():
    if kind_missing("ltx2"):
        pytest.skip(kind_missing("ltx2"))
    return tiny_pipeline("ltx2")


def run_ltx2(pipe):
    out = pipe(**LTX2_CALL(), num_inference_steps=3, generator=torch.Generator().manual_seed(0))
    return out.frames, out.audio


def test_ltx2_is_bitwise_equal_and_quiet_with_three_steps(ltx2, tmp_path):
    frames, audio = run_ltx2(ltx2)
    classes_before = class_dicts(ltx2)
    dbg = DiffusionModelDebugger(ltx2, cfg(tmp_path))
    with dbg:
        watched = run_ltx2(ltx2)
    assert torch.equal(watched[0], frames) and torch.equal(watched[1], audio)
    assert frames.isfinite().all() and audio.isfinite().all()
    report = dbg.report()
    assert [row["step"] for row in report.steps] == [0, 1, 2]
    assert [row["timestep"] for row in report.steps] == pytest.approx(ltx2.scheduler.timesteps.tolist())
    loud = [a.to_dict() for a in report.anomalies if a.severity in ("warning", "error")]
    assert loud == []
    assert report.components["transformer"]["calls"] == 3
    assert class_dicts(ltx2) == classes_before
    assert not set(SCHEDULER_METHODS) & set(vars(ltx2.scheduler))
    assert hook_entries(ltx2.transformer) == []
    dbg.close()


def test_ltx2_inf_planted_at_step_1_is_the_headline_there(ltx2, tmp_path):
    with plant_nonfinite(ltx2.transformer.get_submodule(LTX2_MODULE), from_call=1):
        dbg = DiffusionModelDebugger(ltx2, cfg(tmp_path, repro_bundle=True))
        with dbg:
            frames, _ = run_ltx2(ltx2)
    report = dbg.report()
    first, _ = folded(report.anomalies)[0]
    assert (first.kind, first.severity, first.component, first.module, first.step) == (
        "nonfinite",
        "error",
        "transformer",
        LTX2_MODULE,
        1,
    )
    assert first.timestep == pytest.approx(ltx2.scheduler.timesteps[1].item())
    assert [a.message for a in report.anomalies if a.kind == "debugger_error"] == []
    assert [a.to_dict() for a in report.anomalies if "norm grew" in a.message] == []
    dbg.close()


def test_a_reused_debugger_puts_back_its_patches_and_leaves_the_pipeline_plain_between_calls(sd, tmp_path):
    """``with dbg:`` at every call: the patches made at the first attach are put back at each later
    one (not made again), and between two watched calls (and after close) the classes and the
    instances hold exactly what they held before: an unwatched call in between is bitwise the plain
    one and records nothing."""
    pipe = sd
    classes_before = class_dicts(pipe)
    plain = run_sd(pipe)
    scheduler_vars, pipe_vars = set(vars(pipe.scheduler)), set(vars(pipe))  # the call sets a few (_guidance_scale)
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
    with dbg:
        first = run_sd(pipe)
    made = list(dbg._patches.patches)
    assert len(made) == 5
    for _ in range(2):
        assert class_dicts(pipe) == classes_before
        assert (set(vars(pipe.scheduler)), set(vars(pipe))) == (scheduler_vars, pipe_vars)
        rows, events = len(dbg.report().steps), len(dbg.record.events)
        assert torch.equal(run_sd(pipe), plain)  # unwatched, between two watched calls
        assert (len(dbg.report().steps), len(dbg.record.events)) == (rows, events)
        with dbg:
            assert torch.equal(run_sd(pipe), plain)
            assert dbg._patches.patches == made and all(patch.active for patch in made)
        assert len(dbg.report().steps) == rows + 2
    assert torch.equal(first, plain)
    dbg.close()
    assert class_dicts(pipe) == classes_before
    assert (set(vars(pipe.scheduler)), set(vars(pipe))) == (scheduler_vars, pipe_vars)
    assert hook_entries(pipe.unet) == hook_entries(pipe.vae) == hook_entries(pipe.text_encoder) == []


def test_a_kept_call_that_cannot_be_cloned_apart_loses_no_step_row(sd, tmp_path, monkeypatch):
    """``keep_apart`` (a clone of the latents a kept call shares) failing, as a clone can on a full GPU, is a
    debugger_error of its own: the step is still recorded and the image unchanged (before: the step's row
    was lost with it, recorded as the step's failure)."""
    from diffusion_debug.diffusion.components.call_sites import CallSiteHooks

    plain = run_sd(sd)

    def fail(self, latents):
        raise RuntimeError("CUDA out of memory (planted)")

    monkeypatch.setattr(CallSiteHooks, "keep_apart", fail)
    dbg = DiffusionModelDebugger(sd, cfg(tmp_path))
    with dbg:
        images = run_sd(sd)
    assert torch.equal(images, plain)
    report = dbg.report()
    assert [row["step"] for row in report.steps] == [0, 1]
    errors = [a for a in report.anomalies if a.kind == "debugger_error"]
    assert {a.details.get("where") for a in errors} == {"keep_apart"}, [a.details for a in errors]
    dbg.close()
