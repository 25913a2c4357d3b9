"""Policies (one meaning on both debuggers: core.AnomalySink / check_policy / policy_error) and
the debugger's own failures (debugger_error, strict)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from diffusion_helpers import plant, run

from diffusion_debug import DebugConfig, DiffusionDebugError, DiffusionModelDebugger
from diffusion_debug.core import DebugReport
from diffusion_debug.diffusion import checks
from diffusion_debug.errors import ConfigError
from diffusion_debug.record import load_json

UNET_LEAF = "up_blocks.1.resnets.0.conv2"


def cfg(tmp_path, **kwargs):
    return DebugConfig(output_dir=str(tmp_path), **kwargs)


def kinds(report, kind):
    return [a for a in report.anomalies if a.kind == kind]


def test_policy_raise_saves_and_raises_with_the_anomaly(pipes, tmp_path):
    pipe = pipes["sd"]
    with plant(pipe.unet.get_submodule(UNET_LEAF), 1):
        with pytest.raises(DiffusionDebugError) as info:
            with DiffusionModelDebugger(pipe, cfg(tmp_path, policy="raise")):
                run(pipe, steps=4)
    error = info.value
    assert error.anomaly.kind == "nonfinite" and error.anomaly.module == UNET_LEAF and error.anomaly.step == 1
    summary = load_json(error.run_dir / "summary.json")
    assert [s["step"] for s in summary["steps"]] == [0, 1]
    assert "scheduler" not in vars(pipe.scheduler) and "step" not in vars(pipe.scheduler)


def test_policy_stop_ends_the_loop_early(pipes, tmp_path):
    pipe = pipes["sd"]
    with plant(pipe.unet.get_submodule(UNET_LEAF), 1):
        dbg = DiffusionModelDebugger(pipe, cfg(tmp_path, policy="stop"))
        with dbg:
            run(pipe, steps=4)
    assert [row["step"] for row in dbg.report().steps] == [0, 1]
    assert pipe._interrupt is False  # restored at detach
    assert len(run(pipe, steps=2)) == 1  # the next run is a full, plain run


def test_policy_warn_warns(pipes, tmp_path):
    pipe = pipes["sd"]
    with plant(pipe.unet.get_submodule(UNET_LEAF), 0):
        with pytest.warns(RuntimeWarning, match=f"nonfinite at unet {UNET_LEAF}, step 0"):
            with DiffusionModelDebugger(pipe, cfg(tmp_path, policy="warn", level="basic")):
                run(pipe, steps=2)


def test_internal_error_is_recorded_and_the_run_goes_on(pipes, tmp_path, monkeypatch):
    pipe = pipes["sd"]
    plain = run(pipe, steps=2)

    def broken(*args, **kwargs):
        raise RuntimeError("measurement exploded")

    monkeypatch.setattr(checks, "latent_divergence", broken)
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
    with dbg:
        watched = run(pipe, steps=2)
    assert np.array_equal(plain, watched)
    (error,) = kinds(dbg.report(), "debugger_error")
    assert error.severity == "warning" and error.details["where"] == "latent_divergence"
    assert error.step == 0  # the step whose latents were checked (read one step late, at step 1)
    assert error.details["count"] == 2 and "measurement exploded" in error.message
    strict = DiffusionModelDebugger(pipe, cfg(tmp_path, strict=True))
    with pytest.raises(RuntimeError, match="measurement exploded"):
        with strict:
            run(pipe, steps=2)
    assert "step" not in vars(pipe.scheduler)
    # raised, and recorded once (by the guard it left first, not again by the step's around it)
    (error,) = kinds(strict.report(), "debugger_error")
    assert (error.details["where"], error.details["raised"], error.step) == ("latent_divergence", True, 0)
    assert (
        error.message
        == "The debugger's latent_divergence failed (RuntimeError: measurement exploded) and was raised (strict=True)."
    )
    strict.close()


def test_policy_raise_is_a_diffusion_debug_error_even_when_saving_fails(pipes, tmp_path, monkeypatch):
    pipe = pipes["sd"]

    def broken_save(self, html=True):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(DebugReport, "save", broken_save)
    with plant(pipe.unet.get_submodule(UNET_LEAF), 0):
        with pytest.raises(DiffusionDebugError) as info:
            with DiffusionModelDebugger(pipe, cfg(tmp_path, policy="raise")):
                run(pipe, steps=2)
    error = info.value
    assert error.run_dir is None and error.anomaly.kind == "nonfinite"
    assert isinstance(error.__cause__, OSError) and "could not be saved" in str(error)
    assert "step" not in vars(pipe.scheduler)


def test_policy_skip_is_rejected_up_front_and_writes_nothing(pipes, tmp_path):
    with pytest.raises(ConfigError) as info:
        DiffusionModelDebugger(pipes["sd"], cfg(tmp_path, policy="skip"))
    message = str(info.value)
    assert message.count(". ") == 0 and message.endswith(".")  # one sentence
    assert "'skip'" in message and "DiffusionModelDebugger" in message
    assert list(tmp_path.iterdir()) == []


def test_the_policy_plumbing_is_not_on_the_users_debugger():
    # the policy acts through a private target, as training's does through StepPolicy
    from diffusion_debug import TrainingDebugger

    for debugger in (DiffusionModelDebugger, TrainingDebugger):
        assert [name for name in ("save_run", "agree", "skip_step", "stop") if hasattr(debugger, name)] == []


def test_policy_warn_with_warn_severity_error_warns_only_for_errors(pipes, tmp_path):
    pipe = pipes["sd"]
    config = cfg(tmp_path, policy="warn", warn_severity="error", level="basic")
    with plant(pipe.unet.get_submodule(UNET_LEAF), 1), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dbg = DiffusionModelDebugger(pipe, config)
        with dbg:
            run(pipe, steps=3, prompt=" ".join(["photo"] * 100))  # a truncated prompt: a warning
    ours = [str(w.message) for w in caught if str(w.message).startswith("diffusion-debug")]
    errors = [a for a in dbg.report().anomalies if a.severity == "error"]
    assert kinds(dbg.report(), "prompt_truncated") and errors
    assert ours == [f"diffusion-debug {a.kind} at {a.where()}: {a.message}" for a in errors]
    dbg.close()


def test_policy_stop_raises_where_the_pipeline_has_no_interrupt_flag(pipes, tmp_path, monkeypatch):
    from diffusion_debug.diffusion import pipeline_patches

    pipe = pipes["sd"]
    monkeypatch.setattr(pipeline_patches, "can_interrupt", lambda pipe: False)  # as PixArt before _interrupt
    with plant(pipe.unet.get_submodule(UNET_LEAF), 1):
        with pytest.raises(DiffusionDebugError) as info:
            with DiffusionModelDebugger(pipe, cfg(tmp_path, policy="stop")):
                run(pipe, steps=4)
    assert "(StableDiffusionPipeline has no interrupt flag, so policy 'stop' raises)" in str(info.value)
    assert info.value.anomaly.step == 1 and (info.value.run_dir / "summary.json").exists()
    assert pipe._interrupt is False  # the pipeline's own reset; no flag of ours was set


@pytest.mark.parametrize(
    "where, owner, name",
    [
        ("timing", "diffusion_debug.diffusion.components.call_sites", "read_output"),
        ("text_encoder_output vae_output", "diffusion_debug.diffusion.steps:StepPipeline", "check_call"),
        ("set_timesteps", "diffusion_debug.diffusion.pipeline_patches", "read_set_timesteps"),
        ("prompt_truncated", "diffusion_debug.diffusion.setup_checks", "truncated_prompts"),
        ("static_checks", "diffusion_debug.diffusion.setup_checks", "static_checks"),
        ("step", "diffusion_debug.diffusion.pipeline_patches", "read_scheduler_step"),
        ("memory", "diffusion_debug.diffusion.components.call_sites:CallSiteHooks", "take_denoiser_memory"),
    ],
)
def test_a_failure_in_a_guard_every_call_takes_is_recorded_and_the_run_goes_on(
    pipes, tmp_path, monkeypatch, where, owner, name
):
    """The guards a clean call takes at every component call and event are a ``try`` (issue 45):
    a failure in one is one ``debugger_error`` naming its place (each place once: the text encoder's
    and the VAE's output checks are two), the images unchanged; ``strict`` raises it."""
    import importlib

    pipe = pipes["sd"]
    plain = run(pipe, steps=2)
    module, _, cls = owner.partition(":")
    target = importlib.import_module(module)
    target = getattr(target, cls) if cls else target

    def broken(*args, **kwargs):
        raise RuntimeError("measurement exploded")

    monkeypatch.setattr(target, name, broken)
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
    with dbg:
        watched = run(pipe, steps=2)
    assert np.array_equal(plain, watched)
    errors = kinds(dbg.report(), "debugger_error")
    assert [e.details["where"] for e in errors] == where.split()
    assert "measurement exploded" in errors[0].message
    with pytest.raises(RuntimeError, match="measurement exploded"):
        with DiffusionModelDebugger(pipe, cfg(tmp_path, strict=True)):
            run(pipe, steps=2)
    dbg.close()
