"""DiffusionModelDebugger on real tiny pipelines: no observer effect, per-step record, the
exact module that made a NaN/Inf, detach leaves nothing, manual monitoring."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from diffusion_helpers import plant, run
from PIL import Image

from diffusion_debug import DebugConfig, DiffusionDebugError, DiffusionModelDebugger
from diffusion_debug.op_count import count_aten_ops
from diffusion_debug.testing import tiny_pipeline
from diffusion_debug.testing.features import clip_name


def cfg(tmp_path, **kwargs):
    return DebugConfig(output_dir=str(tmp_path), **kwargs)


def nonfinite(report):
    return [a for a in report.anomalies if a.kind == "nonfinite" and a.severity == "error"]


@pytest.mark.parametrize("kind", ["sd", "sdxl", "sd3"])
def test_images_bitwise_identical_with_debugger(pipes, kind, tmp_path):
    pipe = pipes[kind]
    plain = run(pipe)
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
    with dbg:
        watched = run(pipe)
    assert np.array_equal(plain, watched)
    report = dbg.report()
    assert [row["step"] for row in report.steps] == [0, 1, 2]
    assert not nonfinite(report)
    denoiser = "transformer" if kind == "sd3" else "unet"
    assert report.components[denoiser]["calls"] == 3
    assert report.components["vae"]["calls"] == 1
    row = report.steps[1]
    # CFG: halves and their gap, checked against a naive reference in test_step_row_values
    assert row["model_output"]["shape"][0] == 2 * row["latents"]["shape"][0]
    assert row["guidance_gap"] > 0
    assert run(pipe).tobytes() == plain.tobytes()


def test_step_row_values_match_naive_reference(pipes, tmp_path):
    pipe = pipes["sd"]
    seen = []

    def callback(p, i, t, kw):
        seen.append((i, float(t), kw["latents"].clone()))
        return kw

    outputs = []
    handle = pipe.unet.register_forward_hook(lambda m, a, o: outputs.append(o[0].detach().clone()))
    try:
        dbg = DiffusionModelDebugger(pipe, cfg(tmp_path, level="basic"))
        with dbg:
            run(pipe, callback_on_step_end=callback)
    finally:
        handle.remove()
    rows = dbg.report().steps
    assert len(rows) == len(seen) == 3
    for row, (i, t, latents), out in zip(rows, seen, outputs):
        assert row["step"] == i and row["timestep"] == t
        assert row["latents"]["std"] == pytest.approx(latents.std(unbiased=False).item(), rel=1e-5)
        assert row["latents"]["mean"] == pytest.approx(latents.mean().item(), rel=1e-4, abs=1e-6)
        uncond, cond = out.chunk(2)
        assert row["uncond"]["absmax"] == pytest.approx(uncond.abs().max().item(), rel=1e-6)
        assert row["cond"]["mean"] == pytest.approx(cond.mean().item(), rel=1e-4, abs=1e-6)
        assert row["guidance_gap"] == pytest.approx(torch.linalg.vector_norm(cond - uncond).item(), rel=1e-5)
        assert row["pred_original_sample"]["shape"] == [1, 4, 8, 8]
        assert row["time_s"] > 0


def test_user_callback_still_called_with_same_arguments(pipes, tmp_path):
    pipe = pipes["sdxl"]

    def collect():
        calls = []

        def callback(p, i, t, kw):
            calls.append((i, float(t), kw["latents"].clone()))
            return kw

        run(pipe, callback_on_step_end=callback)
        return calls

    plain = collect()
    with DiffusionModelDebugger(pipe, cfg(tmp_path)):
        watched = collect()
    assert [c[:2] for c in plain] == [c[:2] for c in watched] and len(plain) == 3
    assert all(torch.equal(a[2], b[2]) for a, b in zip(plain, watched))


# -- NaN / Inf producers ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind, component, module, from_call, step",
    [
        ("sd", "unet", "up_blocks.1.resnets.0.conv2", 1, 1),
        ("sd", "unet", "mid_block.attentions.0.transformer_blocks.0.ff.net.2", 2, 2),
        ("sd3", "transformer", "transformer_blocks.1.ff.net.2", 1, 1),
        ("sd", "vae", "decoder.up_blocks.1.resnets.0.conv2", 0, None),
        ("sd", "text_encoder", clip_name("encoder.layers.1.mlp.fc1"), 0, None),
        ("sdxl", "text_encoder_2", clip_name("encoder.layers.0.self_attn.v_proj"), 0, None),
    ],
)
def test_nonfinite_names_the_producer_module_and_step(pipes, tmp_path, kind, component, module, from_call, step):
    pipe = pipes[kind]
    # transformers' CLIP models nest the encoder differently across versions: match the suffix
    module = next(n for n, _ in getattr(pipe, component).named_modules() if n == module or n.endswith("." + module))
    with plant(getattr(pipe, component).get_submodule(module), from_call):
        dbg = DiffusionModelDebugger(pipe, cfg(tmp_path, level="basic"))
        with dbg:
            run(pipe)
    errors = nonfinite(dbg.report())
    assert len(errors) == 1, [a.to_dict() for a in errors]
    anomaly = errors[0]
    assert (anomaly.component, anomaly.module, anomaly.step) == (component, module, step)
    # fp32: the denoiser's sentinel (fp16/fp8 block outputs) reads nothing, and a component called
    # once per image (VAE, text encoders) has no probe; each is checked at its call site and the
    # call is replayed with full probes from there
    assert anomaly.details["localized_by"] == "output check -> replay with full probes"
    if step is not None:
        assert anomaly.timestep == dbg.report().steps[step]["timestep"]
    # downstream components are reported as consequences, not producers
    assert all(a.severity == "warning" for a in dbg.report().anomalies if a.kind == "nonfinite" and a is not anomaly)


def test_extreme_level_localises_with_full_probes(pipes, tmp_path):
    pipe = pipes["sd"]
    with plant(pipe.unet.get_submodule("down_blocks.1.resnets.0.conv1"), 1):
        dbg = DiffusionModelDebugger(pipe, cfg(tmp_path, level="extreme"))
        with dbg:
            run(pipe)
    (anomaly,) = nonfinite(dbg.report())
    assert (anomaly.module, anomaly.step, anomaly.details["localized_by"]) == (
        "down_blocks.1.resnets.0.conv1",
        1,
        "full probes",
    )
    assert anomaly.details["count"] == 2  # steps 1 and 2, one entry
    assert dbg.report().files  # previews, including VAE-decoded ones
    assert "previews/vae_strip.png" in dbg.report().files


# -- detach leaves nothing --------------------------------------------------------------------


def _snapshot(pipe):
    modules = {}
    for name in ("unet", "vae", "text_encoder"):
        for qual, m in getattr(pipe, name).named_modules():
            modules[f"{name}.{qual}"] = (
                tuple(m._forward_hooks),
                tuple(m._forward_pre_hooks),
                tuple(m._backward_hooks),
                tuple(m._forward_hooks_with_kwargs),
                tuple(m._forward_pre_hooks_with_kwargs),
                tuple(sorted(vars(m))),
            )
    from torch.nn.modules import module as torch_module

    global_hooks = tuple(  # torch's process-wide hooks: an armed probe's, while a call runs
        dict(getattr(torch_module, name, {}))  # torch 2.5 has no _global_forward_hooks_with_kwargs
        for name in (
            "_global_forward_hooks",
            "_global_forward_hooks_with_kwargs",
            "_global_forward_hooks_always_called",
            "_global_forward_pre_hooks",
        )
    )
    return modules, dict(vars(pipe)), dict(vars(pipe.scheduler)), global_hooks


def _assert_clean(pipe, before):
    modules, pipe_vars, scheduler_vars, global_hooks = _snapshot(pipe)
    assert modules == before[0] and global_hooks == before[3]
    assert pipe_vars.keys() == before[1].keys()
    assert all(pipe_vars[k] is before[1][k] for k in pipe_vars if k != "_interrupt")
    assert scheduler_vars.keys() == before[2].keys()
    assert "step" not in vars(pipe.scheduler) and "set_timesteps" not in vars(pipe.scheduler)
    assert "encode_prompt" not in vars(pipe)
    assert pipe.scheduler.step.__func__ is type(pipe.scheduler).step


def test_detach_leaves_nothing_also_after_an_exception(tmp_path):
    pipe = tiny_pipeline("sd")
    reference = run(pipe)  # the pipeline sets its own attributes on the first call
    before = _snapshot(pipe)
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path, level="extreme"))
    with dbg:
        run(pipe)
    _assert_clean(pipe, before)

    def boom(p, i, t, kw):
        raise KeyboardInterrupt if False else ValueError("user error")

    with pytest.raises(ValueError, match="user error"):
        with dbg:
            run(pipe, callback_on_step_end=boom)
    _assert_clean(pipe, before)
    handle = dbg.attach()
    handle.remove()
    handle.remove()  # idempotent
    _assert_clean(pipe, before)
    assert np.array_equal(run(pipe), reference)


def test_a_failure_of_the_debuggers_own_work_at_detach_still_removes_every_hook(tmp_path, monkeypatch):
    """What detach reads of the call that ended is the debugger's own work: it failing (an inference tensor's
    version counter read, once) left every hook and patch on the pipeline and raised out of the user's ``with``.
    Now the hooks go first, the failure is a ``debugger_error`` at ``detach`` (raised as it is with ``strict``)."""
    pipe = tiny_pipeline("sd")
    reference = run(pipe)
    before = _snapshot(pipe)

    def fails():
        raise RuntimeError("planted in the debugger")

    for strict in (False, True):
        dbg = DiffusionModelDebugger(pipe, cfg(tmp_path / str(strict), strict=strict))
        monkeypatch.setattr(dbg._steps, "sample_call_memory", fails)
        if strict:
            with pytest.raises(RuntimeError, match="planted in the debugger"), dbg:
                run(pipe)
        else:
            with dbg:
                assert np.array_equal(run(pipe), reference)
            failures = [a for a in dbg.report().anomalies if a.kind == "debugger_error"]  # (at its other uses too)
            (failure,) = [a for a in failures if a.details["where"] == "detach"]
            assert "planted in the debugger" in failure.message
        _assert_clean(pipe, before)
        dbg.close()
    assert np.array_equal(run(pipe), reference)


def test_manual_monitoring_in_a_custom_loop_is_bounded(pipes, tmp_path):
    pipe = pipes["sd"]
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path, history_size=50))
    scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
    scheduler.set_timesteps(3)
    latents = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    context = torch.randn(1, 77, 32, generator=torch.Generator().manual_seed(2))
    with dbg, torch.no_grad():
        for i, t in enumerate(scheduler.timesteps):
            out = pipe.unet(latents, t, encoder_hidden_states=context).sample
            latents = scheduler.step(out, t, latents).prev_sample
            row = dbg.monitor_diffusion_step(i, latents, t)
            assert row["latents"]["std"] == pytest.approx(latents.std(unbiased=False).item(), rel=1e-5)
            assert row["model_output"]["absmax"] == pytest.approx(out.abs().max().item(), rel=1e-6)
            assert row["timestep"] == float(t)
    assert [r["step"] for r in dbg.report().steps] == [0, 1, 2]
    for i in range(1000):
        dbg.monitor_diffusion_step(i, latents)
    report = dbg.report()
    assert len(report.steps) == 50 and report.steps[-1]["step"] == 999
    assert len(dbg.record.events) <= 50
    assert Image.open(io.BytesIO(report.files["previews/steps.gif"])).n_frames <= 32  # previews bounded
    with dbg:
        pipe.scheduler.set_timesteps(4)  # (no step follows: its values wait unread for one)
        dbg.clear_debug_history()
    assert dbg.report().steps == [] and dbg.get_summary()["steps_recorded"] == 0
    assert [e["type"] for e in dbg.record.events if e["type"] == "set_timesteps"] == []  # forgotten, not read late


def test_summary_and_analysis(pipes, tmp_path):
    pipe = pipes["sdxl"]
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
    analysis = dbg.analyze_diffusion_pipeline()
    expected = sum(
        p.numel()
        for name in ("unet", "vae", "text_encoder", "text_encoder_2")
        for p in getattr(pipe, name).parameters()
    )
    assert analysis["total_parameters"] == expected
    assert analysis["unet"]["parameters"] == sum(p.numel() for p in pipe.unet.parameters())
    assert analysis["unet"]["dtype"] == "float32" and analysis["unet"]["class"] == "UNet2DConditionModel"
    assert analysis["scheduler"]["class"] == "EulerDiscreteScheduler"
    assert analysis["scheduler"]["config"]["prediction_type"] == "epsilon"
    with dbg:
        run(pipe, steps=2)
    summary = dbg.get_summary()
    assert summary["steps_recorded"] == 2 and summary["components"]["unet"]["calls"] == 2
    assert dbg.report().steps[0]["sigma"] == pytest.approx(float(pipe.scheduler.sigmas[0]))


def test_the_old_summary_name_warns_and_answers_the_same(pipes, tmp_path):
    pipe = pipes["sd"]
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
    with dbg:
        run(pipe, steps=2)
    with pytest.warns(DeprecationWarning, match=r"get_debug_summary\(\) is now get_summary\(\)"):
        old = dbg.get_debug_summary()
    assert old == dbg.get_summary() and old["steps_recorded"] == 2


# -- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [torch.nn.Linear(2, 2), "runwayml/stable-diffusion-v1-5"])
def test_bad_pipeline_is_a_clear_error_and_writes_nothing(tmp_path, bad):
    with pytest.raises(DiffusionDebugError, match="needs a diffusers DiffusionPipeline"):
        DiffusionModelDebugger(bad, cfg(tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_pipeline_without_denoiser_and_bad_config(pipes, tmp_path):
    from diffusers import DiffusionPipeline

    class Empty(DiffusionPipeline):
        pass

    with pytest.raises(DiffusionDebugError, match="has no denoiser"):
        DiffusionModelDebugger(Empty(), cfg(tmp_path))
    with pytest.raises(DiffusionDebugError, match="config must be a DebugConfig"):
        DiffusionModelDebugger(pipes["sd"], 3)
    assert list(tmp_path.iterdir()) == []


def test_a_float64_pipeline_is_measured_quietly(tmp_path):
    from diffusion_debug.testing import tiny_pipeline

    pipe = tiny_pipeline("sd", dtype=torch.float64)
    try:
        pipe.encode_prompt("a cat", "cpu", 1, False)
    except RuntimeError as error:  # transformers 4.47's CLIP cannot build its float64 causal mask
        pytest.skip(f"this transformers runs no float64 CLIP: {error}")
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    with dbg:
        latents = pipe(
            "a cat", num_inference_steps=2, output_type="latent", generator=torch.Generator().manual_seed(0)
        )
    assert {a.kind for a in dbg.report().anomalies} <= {"scheduler_config"}  # no debugger_error
    last = dbg.report().steps[-1]["latents"]
    assert last["dtype"] == "float64"
    assert last["l2"] == pytest.approx(float(torch.linalg.vector_norm(latents.images)), rel=1e-9)
    dbg.close()


def test_a_call_given_a_generator_that_draws_from_the_global_rng_is_flagged_not_reproducible(pipes, tmp_path):
    """A pipeline that draws noise from torch's global RNG although ``generator=`` was passed (I2VGen-XL's
    ``vae.encode(image).latent_dist.sample()``; planted here: the UNet adds ``torch.randn_like``) gives two
    different images from the same generator: one ``nondeterministic`` warning. A call given no such draw,
    or given the global generator itself (``generator=torch.manual_seed(0)``), or no generator, is not
    flagged, and only a call given a generator of its own compares the global generator's states (one
    ``aten.equal``; the others copy no state and compare nothing), a run begun outside the call too (its
    prompt encoded first by ``encode_prompt``: the state as that run began)."""
    pipe = pipes["sd"]

    def global_noise(module, args, output):
        return output + 1e-3 * torch.randn_like(output)

    def calls(generator):
        with count_aten_ops() as ops:
            pipe("a cat", num_inference_steps=1, output_type="np", generator=generator)
        return ops.counts.get("aten.equal.default", 0)

    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path, log_level="error"))
    with dbg:
        compared = [calls(torch.Generator().manual_seed(0))]  # run 1: clean
        with pipe.unet.conv_out.register_forward_hook(global_noise):
            compared.append(calls(torch.Generator().manual_seed(0)))  # run 2: flagged
            compared.append(calls(torch.manual_seed(0)))  # run 3: the global generator passed, reseeded: reproducible
            compared.append(calls(None))  # run 4: no generator: draws from the global RNG by design
            embeds, _ = pipe.encode_prompt("a cat", "cpu", 1, False)  # run 5 begins outside the call that goes on
            with count_aten_ops() as ops:  # with it (embeddings reused): its state as the run began is compared
                pipe(prompt_embeds=embeds, num_inference_steps=1, output_type="np", generator=torch.Generator())
            compared.append(ops.counts.get("aten.equal.default", 0))
    dbg.close()
    assert compared == [1, 1, 0, 0, 1]
    found = [a for a in dbg.report().anomalies if a.kind == "nondeterministic"]
    assert [(a.severity, a.component, a.step, a.details["run"]) for a in found] == [
        ("warning", "pipeline", None, 2),
        ("warning", "pipeline", None, 5),
    ]
    assert found[0].message == (
        "the call drew random numbers from torch's global RNG although it was given generator=: the same "
        "generator gives another image at each call unless torch.manual_seed is set before it (something "
        "in the pipeline draws without the generator)."
    )
