"""DiffusionModelDebugger lifecycle and bounds: close(), attach handles, direct denoiser calls,
the overflow-localisation cache across runs, manual monitoring while attached, errors that must
not escape as anything but DiffusionDebugError, and the one-pass step measurements."""

from __future__ import annotations

import gc
import json

import pytest
import torch
from diffusion_helpers import plant, run

from diffusion_debug import DebugConfig, DiffusionDebugError, DiffusionModelDebugger
from diffusion_debug.core import DebugReport
from diffusion_debug.diffusion import debugger as debugger_module
from diffusion_debug.diffusion.previews import downsample, latent_space, latent_to_rgb
from diffusion_debug.diffusion.transfer import fetch_step, merge_stats
from diffusion_debug.stats import absmax_on_device, collect, measure, tensor_stats
from diffusion_debug.testing import plant_overflow, tiny_pipeline

UNET_LEAF = "up_blocks.1.resnets.0.conv2"


def cfg(tmp_path, **kwargs):
    return DebugConfig(output_dir=str(tmp_path), **kwargs)


def hook_count(pipe) -> int:
    return sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks)
        for c in (pipe.unet, pipe.vae, pipe.text_encoder)
        for m in c.modules()
    )


# -- close ----------------------------------------------------------------------------------------


def test_close_closes_the_event_stream_once_and_exit_does_not(pipes, tmp_path):
    pipe = pipes["sd"]
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
    with dbg:
        run(pipe, steps=2)
    assert dbg.record._stream is not None  # leaving ``with`` only detaches: it can be re-entered
    dbg.attach()
    dbg.close()  # detaches too
    assert not dbg.attached and hook_count(pipe) == 0 and "step" not in vars(pipe.scheduler)
    assert dbg.record._stream is None
    dbg.close()  # a no-op
    run_dir = dbg.report().save()
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    assert sum(json.loads(line)["type"] == "step" for line in lines) == 2
    assert (run_dir / "summary.json").exists()


def test_a_collected_debugger_closes_its_event_stream(pipes, tmp_path):
    dbg = DiffusionModelDebugger(pipes["sd"], cfg(tmp_path))
    with dbg:
        pass
    stream = dbg.record._stream
    assert stream is not None and not stream.closed
    del dbg
    gc.collect()
    assert stream.closed


# -- attach handles ------------------------------------------------------------------------------


def test_an_old_attach_handle_does_not_detach_a_later_attach(pipes, tmp_path):
    pipe = pipes["sd"]
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
    old = dbg.attach()
    dbg.detach()
    new = dbg.attach()
    try:
        hooks = hook_count(pipe)
        old.remove()
        assert dbg.attached and hook_count(pipe) == hooks > 0
        run(pipe, steps=2)
        assert len(dbg.report().steps) == 2
    finally:
        new.remove()
    assert not dbg.attached and hook_count(pipe) == 0
    dbg.close()


# -- direct denoiser calls (no scheduler step) ------------------------------------------------------


def test_direct_denoiser_calls_keep_the_probe_queue_bounded_and_report_a_fault(pipes, tmp_path):
    pipe = pipes["sd"]
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path, level="basic"))
    latents = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    context = torch.randn(1, 4, 32, generator=torch.Generator().manual_seed(2))  # short: 1,000 calls
    handle = plant(pipe.unet.get_submodule(UNET_LEAF), 900)
    pending = []
    try:
        with dbg, torch.no_grad():
            for _ in range(1000):
                pipe.unet(latents, 10, encoder_hidden_states=context)
                pending.append(dbg._probes["unet"].pending)
                assert len(dbg._outputs) <= 2 and len(dbg._captured) <= 3
    finally:
        handle.remove()
    per_call = pending[0]
    assert per_call > 0 and max(pending) <= (debugger_module._MAX_UNSTEPPED_CALLS + 1) * per_call
    (fault,) = [a for a in dbg.report().anomalies if a.kind == "nonfinite"]
    assert fault.severity == "error" and fault.component == "unet" and fault.module == UNET_LEAF
    assert fault.step is None and fault.details["count"] == 100
    assert [e["type"] for e in dbg.record.events].count("unstepped_denoiser_calls") == 1
    assert not [a for a in dbg.report().anomalies if a.kind == "debugger_error"]
    dbg.close()


# -- overflow localisation is cached across runs -----------------------------------------------------


def test_vae_overflow_is_replayed_once_across_runs(tmp_path):
    pipe = tiny_pipeline("sd", dtype=torch.float16)
    handle = plant_overflow(pipe.vae.get_submodule("decoder.up_blocks.0"), fraction=0.7)
    try:
        dbg = DiffusionModelDebugger(pipe, cfg(tmp_path, level="basic"))
        with dbg:
            run(pipe, steps=2)
            run(pipe, steps=2)
    finally:
        handle.remove()
    replays = [e for e in dbg.record.events if e["type"] == "replay"]
    assert [e["component"] for e in replays] == ["vae"]
    risks = [a for a in dbg.report().anomalies if a.kind == "overflow_risk"]
    assert len(risks) == 2 and {a.component for a in risks} == {"vae"}
    assert (
        len({a.module for a in risks}) == 1
        and risks[1].details["localized_by"] == "sentinel -> replay with full probes"
    )
    dbg.clear_debug_history()  # forgets the localisation
    assert dbg._overflow_where == {}
    dbg.close()


# -- manual monitoring while attached ------------------------------------------------------------------


def test_monitor_diffusion_step_in_a_callback_does_not_record_twice(pipes, tmp_path):
    pipe = pipes["sd"]
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
    returned = []

    def callback(p, i, t, kw):
        returned.append(dbg.monitor_diffusion_step(i, kw["latents"], t))
        return kw

    with dbg:
        run(pipe, steps=3, callback_on_step_end=callback)
    steps = dbg.report().steps
    assert [row["step"] for row in steps] == [0, 1, 2]
    assert [row["step"] for row in returned] == [0, 1, 2] and all("latents" in row for row in returned)
    dbg.close()


# -- errors --------------------------------------------------------------------------------------------


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


def test_an_unmeasurable_component_output_is_skipped_not_an_internal_error(pipes, tmp_path, monkeypatch):
    assert absmax_on_device(torch.empty(0)) is None and absmax_on_device(torch.empty(2, device="meta")) is None
    pipe = pipes["sd"]
    monkeypatch.setattr(debugger_module, "absmax_on_device", lambda obj: None)  # as for an empty output
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
    with dbg:
        run(pipe, steps=2)
    anomalies = dbg.report().anomalies
    assert not [a for a in anomalies if a.kind == "debugger_error"], [a.message for a in anomalies]
    assert [e for e in dbg.record.events if e["type"] == "vae_decode"][0]["output_absmax"] is None
    dbg.close()


# -- one pass per step ------------------------------------------------------------------------------------


def test_cfg_output_is_measured_once_and_device_lookups_happen_at_attach(pipes, tmp_path, monkeypatch):
    pipe = pipes["sd"]
    outputs = []
    handle = pipe.unet.register_forward_hook(lambda m, a, o: outputs.append(o[0].detach().clone()))
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path, level="basic"))
    measured, walks = [], []
    real_measure, real_device_of = debugger_module.measure, debugger_module._device_of
    monkeypatch.setattr(debugger_module, "measure", lambda t: measured.append(tuple(t.shape)) or real_measure(t))
    try:
        with dbg:
            monkeypatch.setattr(debugger_module, "_device_of", lambda m: walks.append(m) or real_device_of(m))
            run(pipe, steps=2)
    finally:
        handle.remove()
    assert walks == []  # no parameter walk per component call
    assert (2, 4, 8, 8) not in measured  # the CFG halves only, not the whole output again
    for row, out in zip(dbg.report().steps, outputs):
        whole = tensor_stats(out)
        for key in ("dtype", "nan", "posinf", "neginf", "min", "max", "absmax"):
            assert row["model_output"][key] == getattr(whole, key)
        for key in ("mean", "std", "l2"):
            assert row["model_output"][key] == pytest.approx(getattr(whole, key), rel=1e-5, abs=1e-7)
        assert row["model_output"]["shape"] == [2, 4, 8, 8] and "uncond" in row and "cond" in row
    dbg.close()


def test_merge_stats_equals_the_stats_of_the_whole():
    torch.manual_seed(0)
    x = torch.randn(6, 3, 5) * 3 + 1
    x[0, 0, 0], x[1, 1, 1], x[4, 2, 2], x[5, 0, 1] = float("nan"), float("inf"), float("-inf"), 0.0
    whole = tensor_stats(x)
    for parts in (x.chunk(2), (x[:1], x[1:]), (x[:3], x[3:3], x[3:])):
        merged = merge_stats(collect([measure(p) for p in parts]), tuple(x.shape))
        for key in ("shape", "dtype", "numel", "nan", "posinf", "neginf", "min", "max", "absmax"):
            assert getattr(merged, key) == getattr(whole, key)
        for key in ("mean", "std", "l2", "zero_fraction", "dtype_max_fraction"):
            assert getattr(merged, key) == pytest.approx(getattr(whole, key), rel=1e-5)
    half = torch.tensor([[60000.0, 1.0], [-2.0, 3.0]], dtype=torch.float16)
    merged = merge_stats(collect([measure(p) for p in half.chunk(2)]), (2, 2))
    assert merged.dtype_max_fraction == pytest.approx(tensor_stats(half).dtype_max_fraction)
    all_bad = merge_stats(collect([measure(torch.full((2,), float("nan")))] * 2), (4,))
    assert all_bad.nan == 4 and all_bad.mean is None and all_bad.std is None


def test_fetch_step_keeps_its_behaviour_on_top_of_to_host():
    a, b = torch.arange(6.0).reshape(2, 3), torch.empty(0)
    stats, values = fetch_step([measure(a), measure(b)], [torch.tensor(2.5), torch.tensor([]), torch.tensor(7)])
    assert stats == collect([measure(a), measure(b)])
    assert values[0] == 2.5 and values[1] != values[1] and values[2] == 7.0
    assert fetch_step([], []) == ([], [])


def test_vae_and_latent_previews_share_one_downsample():
    image = torch.rand(3, 256, 192)
    assert tuple(downsample(image, 128).shape) == (3, 128, 96)
    assert downsample(image, 512) is image
    latents = torch.randn(1, 4, 200, 100)
    assert tuple(latent_to_rgb(latents, latent_space(4, None)).shape) == (3, 128, 64)
