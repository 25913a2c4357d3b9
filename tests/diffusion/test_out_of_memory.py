"""A planted torch.OutOfMemoryError inside a watched pipeline call: recorded with its component,
block, step, figures and remedies, events.jsonl flushed, and the very error re-raised unchanged."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from diffusion_helpers import run

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.core.out_of_memory import REMEDIES
from diffusion_debug.testing import plant_nonfinite, plant_oom
from diffusion_debug.testing.features import HAS_GROUP_OFFLOAD

PLANTED = "CUDA out of memory. Tried to allocate 2.00 GiB (planted by diffusion_debug.testing)"


def _oom_anomalies(run_dir):
    lines = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return [e for e in lines if e["type"] == "anomaly" and e["kind"] == "out_of_memory"]


def hook_count(pipe) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for c in (pipe.unet, pipe.vae) for m in c.modules())


def test_oom_in_the_vae_decoder_names_component_block_and_remedies(pipes, tmp_path):
    pipe = pipes["sd"]
    dbg = DiffusionModelDebugger(pipe, DebugConfig(level="basic", output_dir=str(tmp_path)))
    with pytest.raises(torch.OutOfMemoryError) as caught, plant_oom(pipe.vae.decoder.up_blocks[1].resnets[0]):
        with dbg:
            run(pipe, steps=1)
    assert type(caught.value) is torch.OutOfMemoryError and str(caught.value) == PLANTED
    assert caught.traceback[-1].name == "hook"  # raised where it was planted, not by us
    assert hook_count(pipe) == 0
    (anomaly,) = [a for a in dbg.report().anomalies if a.kind == "out_of_memory"]
    assert (anomaly.component, anomaly.module, anomaly.step, anomaly.severity) == (
        "vae",
        "decoder.up_blocks.1",
        None,
        "error",
    )
    assert anomaly.details["phase"] == "decode"
    assert anomaly.details["remedies"] == list(REMEDIES["vae"])
    assert anomaly.details["error"] == f"OutOfMemoryError: {PLANTED}"
    assert anomaly.message == (
        "Out of memory in vae decoder.up_blocks.1 (decode); try: " + "; ".join(REMEDIES["vae"]) + "."
    )
    assert _oom_anomalies(dbg.record.run_dir)[0]["module"] == "decoder.up_blocks.1"  # on disk already
    dbg.close()


def test_oom_in_the_unet_at_step_1_under_policy_raise_stays_the_oom(pipes, tmp_path):
    pipe = pipes["sd"]
    dbg = DiffusionModelDebugger(pipe, DebugConfig(level="basic", policy="raise", output_dir=str(tmp_path)))
    with plant_oom(pipe.unet.up_blocks[0].resnets[0].conv2, from_call=1), dbg:
        with pytest.raises(torch.OutOfMemoryError, match="planted"):
            run(pipe, steps=3, output_type="latent")
    (anomaly,) = [a for a in dbg.report().anomalies if a.kind == "out_of_memory"]
    assert (anomaly.component, anomaly.module, anomaly.step) == ("unet", "up_blocks.0", 1)
    assert anomaly.details["remedies"] == list(REMEDIES["denoiser"])
    with dbg:  # the policy did not queue it: the next call runs
        run(pipe, steps=1, output_type="latent")
    dbg.close()


def test_watch_records_an_oom_outside_every_component_once(pipes, tmp_path):
    pipe = pipes["sd"]
    dbg = DiffusionModelDebugger(pipe, DebugConfig(level="basic", output_dir=str(tmp_path)))

    @dbg.watch
    def generate():
        run(pipe, steps=1, output_type="latent")
        raise torch.OutOfMemoryError("CUDA out of memory (planted in user code)")

    with pytest.raises(torch.OutOfMemoryError, match="planted in user code"):
        generate()
    with pytest.raises(torch.OutOfMemoryError), plant_oom(pipe.text_encoder), dbg:  # hook first, then __exit__
        run(pipe, steps=1)
    found = [(a.component, a.module, a.details["phase"]) for a in dbg.report().anomalies if a.kind == "out_of_memory"]
    assert found == [("", "", "pipeline call"), ("text_encoder", "", "encode_prompt")]
    dbg.close()


def test_memory_snapshot_writes_host_figures_into_the_run_directory(pipes, tmp_path):
    from diffusion_debug import DiffusionDebugError
    from diffusion_debug.record import load_json

    dbg = DiffusionModelDebugger(pipes["sd"], DebugConfig(level="basic", output_dir=str(tmp_path)))
    first, second = dbg.memory_snapshot("after-load"), dbg.memory_snapshot("after-load")
    assert (first["files"], second["files"]) == (["memory/after-load.json"], ["memory/after-load-2.json"])
    saved = load_json(dbg.record.run_dir / "memory/after-load.json")
    assert saved["host"]["rss_mb"] == first["host"]["rss_mb"] > 0 and saved["cuda_snapshot"] is None
    with pytest.raises(DiffusionDebugError, match="plain file name"):
        dbg.memory_snapshot("../outside")
    events = [e for e in dbg.record.events if e["type"] == "memory_snapshot"]
    assert [e["name"] for e in events] == ["after-load", "after-load-2"]
    dbg.close()


def test_a_caught_oom_then_a_retry_in_its_except_block_is_recorded_once_and_the_retry_watched(pipes, tmp_path):
    """The call sites' own post-hook sees the OOM (no hook of the watch's own: 2 a component call);
    a retry made while the error is handled is a clean call (its steps recorded, nothing more
    recorded), and the error, with the failed call's frames, is let go once a later call begins."""
    pipe = pipes["sd"]
    dbg = DiffusionModelDebugger(pipe, DebugConfig(level="basic", output_dir=str(tmp_path)))
    unet = pipe.unet
    with dbg:
        assert len(unet._forward_hooks_always_called) == 1 and len(unet._forward_pre_hooks) == 1
        try:
            with plant_oom(unet.down_blocks[1], from_call=1):
                run(pipe, steps=2, output_type="latent")
        except torch.OutOfMemoryError as error:
            assert dbg._oom.last is error
            run(pipe, steps=2, output_type="latent")  # smaller next time, as a user would
            assert dbg._oom.last is error  # still in flight
        run(pipe, steps=1, output_type="latent")
        assert dbg._oom.last is None
    found = [(a.component, a.module, a.step) for a in dbg.report().anomalies if a.kind == "out_of_memory"]
    assert found == [("unet", "down_blocks.1", 1)]
    assert [(row["run"], row["step"]) for row in dbg.report().steps] == [(1, 0), (2, 0), (2, 1), (3, 0)]
    assert len(_oom_anomalies(dbg.record.run_dir)) == 1
    dbg.close()


def test_an_error_other_than_oom_in_a_component_call_goes_on_unchanged_and_leaves_the_next_call_clean(pipes, tmp_path):
    """The call sites' post-hook runs for every call that raises (``always_call``, for the OOM
    watch): a user's ValueError inside the UNet's forward at step 1 reaches the user as raised,
    records nothing, and the same debugger's next call (and one that calls the UNet inside its own
    call) is bitwise what an unwatched call gives, with nothing recorded but its steps."""
    pipe = pipes["sd"]
    reference = run(pipe, steps=2)
    dbg = DiffusionModelDebugger(pipe, DebugConfig(level="basic", output_dir=str(tmp_path)))
    calls = {"n": 0}

    def fail_at_step_1(module, args):
        calls["n"] += 1
        if calls["n"] == 2:
            raise ValueError("user bug")

    with dbg:
        with pipe.unet.up_blocks[0].register_forward_pre_hook(fail_at_step_1), pytest.raises(ValueError) as caught:
            run(pipe, steps=2)
        assert str(caught.value) == "user bug" and caught.traceback[-1].name == "fail_at_step_1"
        assert dbg._oom.last is None
        # the call that raised is no call: the prompt's two encodings and step 0's UNet call only
        assert {k: v["calls"] for k, v in dbg.get_summary()["components"].items() if v["calls"]} == {
            "text_encoder": 2,
            "unet": 1,
        }
        assert np.array_equal(run(pipe, steps=2), reference)
        inside = [False]

        def call_again(module, args, kwargs):  # the UNet called inside its own call, once
            if not inside[0]:
                inside[0] = True
                try:
                    module(*args, **kwargs)
                finally:
                    inside[0] = False

        with pipe.unet.register_forward_pre_hook(call_again, with_kwargs=True):
            assert np.array_equal(run(pipe, steps=2), reference)
    kinds = {a.kind for a in dbg.report().anomalies}
    assert kinds <= {"scheduler_config"}, kinds  # 2 leading-spaced steps: the schedule's own warning
    assert [(row["run"], row["step"]) for row in dbg.report().steps][-4:] == [(2, 0), (2, 1), (3, 0), (3, 1)]
    dbg.close()


def _same(first, second) -> bool:
    first, second = np.asarray(first), np.asarray(second)
    return first.shape == second.shape and first.tobytes() == second.tobytes()  # bitwise, NaN included


def test_an_oom_in_the_debuggers_own_preview_decode_is_its_own_failure_not_the_users(pipes, tmp_path):
    """A VAE preview decode (the debugger's own call) that runs out of memory: recorded as the
    debugger's (``debugger_error`` at ``vae_preview``), not as the user's ``out_of_memory``, the
    run goes on to the same latents, no frame of it is held; then the user's own decode runs out
    of memory and that one is recorded as theirs, at the block it came from."""
    pipe = pipes["sd"]
    reference = run(pipe, steps=2, output_type="latent")
    config = DebugConfig(level="basic", previews=True, preview_vae_every=1, output_dir=str(tmp_path))
    dbg = DiffusionModelDebugger(pipe, config)
    with plant_oom(pipe.vae.decoder.up_blocks[1].resnets[0]):  # every decode: the previews' first
        with dbg:
            latents = run(pipe, steps=2, output_type="latent")  # the previews fail, the call does not
            assert dbg._oom.last is None
        assert _same(latents, reference)
        anomalies = dbg.report().anomalies
        assert [a.kind for a in anomalies if a.kind == "out_of_memory"] == []
        (failure,) = [a for a in anomalies if a.kind == "debugger_error"]
        assert failure.details["where"] == "vae_preview" and failure.details["error"] == f"OutOfMemoryError: {PLANTED}"
        with pytest.raises(torch.OutOfMemoryError, match="planted"), dbg:
            run(pipe, steps=1)  # the user's decode: theirs
    found = [(a.component, a.module, a.step) for a in dbg.report().anomalies if a.kind == "out_of_memory"]
    assert found == [("vae", "decoder.up_blocks.1", None)]
    assert [e["module"] for e in _oom_anomalies(dbg.record.run_dir)] == ["decoder.up_blocks.1"]
    dbg.close()


def test_an_oom_in_the_debuggers_own_replay_is_its_own_failure_not_the_users(pipes, tmp_path):
    """The localising replay of the UNet call that made an Inf at step 1 (the UNet's third call,
    the debugger's own) runs out of memory: a ``debugger_error`` at ``replay``, no
    ``out_of_memory``, the Inf still reported in the UNet's call (unlocalised), the same latents
    as an unwatched run; the user's later OOM in the UNet at step 0 of the next call is theirs."""
    pipe = pipes["sd"]

    def faults():
        return plant_nonfinite(pipe.unet.up_blocks[1], from_call=1), plant_oom(pipe.unet.down_blocks[0], from_call=2)

    planted = faults()
    try:
        reference = run(pipe, steps=2, output_type="latent")  # two UNet calls: no OOM without a replay
    finally:
        [handle.remove() for handle in planted]
    dbg = DiffusionModelDebugger(pipe, DebugConfig(level="basic", output_dir=str(tmp_path)))
    planted = faults()
    try:
        with dbg:
            latents = run(pipe, steps=2, output_type="latent")
            assert dbg._oom.last is None
    finally:
        [handle.remove() for handle in planted]
    assert _same(latents, reference)
    anomalies = dbg.report().anomalies
    assert [a for a in anomalies if a.kind == "out_of_memory"] == []
    (failure,) = [a for a in anomalies if a.kind == "debugger_error"]
    assert failure.details["where"] == "replay" and failure.details["error"] == f"OutOfMemoryError: {PLANTED}"
    assert failure.step == 1  # the replayed call's step, read a step late: not the step the run is at then
    (nonfinite,) = [
        a for a in anomalies if a.kind == "nonfinite"
    ]  # still found, in the call (fp32: no block sentinel)
    assert (nonfinite.component, nonfinite.module, nonfinite.step, nonfinite.details["localized_by"]) == (
        "unet",
        "",
        1,
        "sentinel (block level; localize is off, the call was not kept or its replay failed)",
    )
    assert not [e for e in dbg.record.events if e["type"] == "replay"]
    with pytest.raises(torch.OutOfMemoryError), plant_oom(pipe.unet.down_blocks[1]), dbg:
        run(pipe, steps=1, output_type="latent")
    found = [(a.component, a.module, a.step) for a in dbg.report().anomalies if a.kind == "out_of_memory"]
    assert found == [("unet", "down_blocks.1", 0)]
    dbg.close()


def _accelerate_hook(unet):
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    add_hook_to_module(unet, AlignDevicesHook(execution_device="cpu", io_same_device=True))  # forward replaced


def _group_offload(unet):
    cpu = torch.device("cpu")  # diffusers' ModelHook registry on every block, each forward replaced
    unet.enable_group_offload(cpu, offload_device=cpu, offload_type="block_level", num_blocks_per_group=1)


@pytest.mark.parametrize(
    "wrap",
    [
        _accelerate_hook,
        pytest.param(
            _group_offload,
            marks=pytest.mark.skipif(not HAS_GROUP_OFFLOAD, reason="diffusers < 0.33: no group offloading"),
        ),
    ],
    ids=["accelerate", "group_offload"],
)
def test_an_oom_under_forward_wrapping_hooks_is_told_from_one_in_flight_on_a_reused_debugger(tmp_path, wrap):
    """Whether an error was raised in the call is read from the frame that runs the post-hook
    (torch's ``_call_impl``): accelerate's and diffusers' hooks replace the module's ``forward`` and
    leave that frame as it is. On a reused debugger (call-site plans kept), an OOM raised in a
    UNet block is recorded at its block and step, also when the call is made inside the user's
    ``except`` block (an error already in flight), and the call after it is clean."""
    from diffusion_debug.testing import tiny_pipeline

    pipe = tiny_pipeline("sd")
    wrap(pipe.unet)
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    for _ in range(2):
        with dbg:
            run(pipe, steps=1, output_type="latent")
    for handled in (False, True):
        with pytest.raises(torch.OutOfMemoryError, match="planted"):
            with plant_oom(pipe.unet.get_submodule("up_blocks.1"), from_call=1), dbg:
                if not handled:
                    run(pipe, steps=2, output_type="latent")
                try:
                    raise KeyError("the user's own, handled")
                except KeyError:
                    run(pipe, steps=2, output_type="latent")
    with dbg:
        run(pipe, steps=1, output_type="latent")
    found = [(a.component, a.module, a.step) for a in dbg.report().anomalies if a.kind == "out_of_memory"]
    assert found == [("unet", "up_blocks.1", 1)] * 2
    assert [a.kind for a in dbg.report().anomalies if a.kind != "scheduler_config"] == ["out_of_memory"] * 2
    dbg.close()


def test_strict_raises_an_oom_in_the_debuggers_own_preview_decode_as_its_own_failure(pipes, tmp_path):
    """``strict=True`` re-raises the debugger's own errors: the preview decode's OOM reaches the
    user (the very error), and the record names the debugger (one ``debugger_error`` at
    ``vae_preview``, step 0, saying it was raised), never the pipeline's ``out_of_memory``."""
    pipe = pipes["sd"]
    config = DebugConfig(level="basic", previews=True, preview_vae_every=1, strict=True, output_dir=str(tmp_path))
    dbg = DiffusionModelDebugger(pipe, config)
    with plant_oom(pipe.vae.decoder.up_blocks[1].resnets[0]):
        with pytest.raises(torch.OutOfMemoryError) as caught, dbg:
            run(pipe, steps=2, output_type="latent")
    assert str(caught.value) == PLANTED and caught.traceback[-1].name == "hook"  # where it was planted
    assert dbg._oom.last is None
    anomalies = dbg.report().anomalies
    assert [a.kind for a in anomalies if a.kind in ("out_of_memory", "debugger_error")] == ["debugger_error"]
    (failure,) = [a for a in anomalies if a.kind == "debugger_error"]
    assert (failure.details["where"], failure.step, failure.details["error"]) == (
        "vae_preview",
        0,
        f"OutOfMemoryError: {PLANTED}",
    )
    assert failure.message == (
        f"The debugger's vae_preview failed (OutOfMemoryError: {PLANTED}) and was raised (strict=True)."
    )
    assert [e["kind"] for e in _debugger_errors(dbg.record.run_dir)] == ["debugger_error"]  # on disk already
    assert _oom_anomalies(dbg.record.run_dir) == []
    dbg.close()


def test_strict_raises_an_oom_in_the_debuggers_own_replay_as_its_own_failure(pipes, tmp_path):
    """The localising replay of step 1's UNet call (read a step late, at the VAE's decode) runs
    out of memory under ``strict=True``: raised to the user, recorded once as the debugger's
    ``replay`` failure at step 1, not as the user's ``out_of_memory`` (in the VAE, whose call the
    late read happens in, or in the pipeline call)."""
    pipe = pipes["sd"]
    dbg = DiffusionModelDebugger(pipe, DebugConfig(level="basic", strict=True, output_dir=str(tmp_path)))
    planted = plant_nonfinite(pipe.unet.up_blocks[1], from_call=1), plant_oom(pipe.unet.down_blocks[0], from_call=2)
    try:
        with pytest.raises(torch.OutOfMemoryError, match="planted"), dbg:
            run(pipe, steps=2)
    finally:
        [handle.remove() for handle in planted]
    assert dbg._oom.last is None
    anomalies = dbg.report().anomalies
    assert [a for a in anomalies if a.kind == "out_of_memory"] == [] == _oom_anomalies(dbg.record.run_dir)
    (failure,) = [a for a in anomalies if a.kind == "debugger_error"]
    assert (failure.details["where"], failure.step, failure.details["raised"]) == ("replay", 1, True)
    dbg.close()


def _debugger_errors(run_dir):
    lines = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return [e for e in lines if e["type"] == "anomaly" and e["kind"] == "debugger_error"]


@pytest.mark.parametrize("fault", ["oom", "bug"])
def test_strict_raises_a_probe_hooks_own_error_recorded_once_as_the_debuggers(pipes, tmp_path, monkeypatch, fault):
    """``strict=True``: a full probe's hook fails reading the UNet's ``conv_in`` (planted: an OOM,
    or a plain bug). The very error reaches the user, recorded once as the debugger's own (a
    ``debugger_error`` at ``probe unet.conv_in``, step 0, saying it was raised, on disk at once),
    never as the UNet's ``out_of_memory`` (it was raised straight from the hook: not recorded as
    the debugger's, and an OOM was taken for the component's)."""
    from diffusion_debug.core import raised_by_debugger
    from diffusion_debug.probes import Probe

    error = torch.OutOfMemoryError(PLANTED) if fault == "oom" else KeyError("planted probe bug")
    read = Probe._read

    def failing(self, name, *args, **kwargs):
        if name == "conv_in":  # inside _read: its measures failed, and its own except hands the error on
            return self._fail(name, error)
        return read(self, name, *args, **kwargs)

    monkeypatch.setattr(Probe, "_read", failing)
    pipe = pipes["sd"]
    config = DebugConfig(level="basic", probes="full", strict=True, output_dir=str(tmp_path))
    dbg = DiffusionModelDebugger(pipe, config)
    with pytest.raises(type(error)) as caught, dbg:
        run(pipe, steps=1, output_type="latent")
    assert caught.value is error and raised_by_debugger(error)
    anomalies = dbg.report().anomalies
    assert [a.kind for a in anomalies if a.kind in ("out_of_memory", "debugger_error")] == ["debugger_error"]
    (failure,) = [a for a in anomalies if a.kind == "debugger_error"]
    text = f"OutOfMemoryError: {PLANTED}" if fault == "oom" else "KeyError: 'planted probe bug'"
    assert (failure.details["where"], failure.step, failure.details["raised"], failure.details["error"]) == (
        "probe unet.conv_in",
        0,
        True,
        text,
    )
    assert failure.message == f"The debugger's probe unet.conv_in failed ({text}) and was raised (strict=True)."
    assert [e["kind"] for e in _debugger_errors(dbg.record.run_dir)] == ["debugger_error"]  # on disk already
    assert _oom_anomalies(dbg.record.run_dir) == []
    dbg.close()
