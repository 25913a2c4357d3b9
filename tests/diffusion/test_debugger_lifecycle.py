"""DiffusionModelDebugger's lifecycle (core.Lifecycle): attach handles, detach undone by a later
attach, close final, the event stream closed by close() or garbage collection, and
monitor_diffusion_step while attached."""

from __future__ import annotations

import gc
import json
import os
import weakref

import pytest
import torch
from diffusion_helpers import run

from diffusion_debug import DebugConfig, DiffusionDebugError, DiffusionModelDebugger
from diffusion_debug.testing import plant_oom


def cfg(tmp_path, **kwargs):
    return DebugConfig(output_dir=str(tmp_path), **kwargs)


def hook_count(pipe) -> int:
    return sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks)
        for c in (pipe.unet, pipe.vae, pipe.text_encoder)
        for m in c.modules()
    )


def open_files(path) -> int:
    """How many of this process's file descriptors are open on ``path`` (Linux)."""
    fds = "/proc/self/fd"
    return sum(os.path.realpath(os.path.join(fds, fd)) == os.path.realpath(path) for fd in os.listdir(fds))


def event_lines(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def test_close_closes_the_event_stream_once_and_exit_does_not(pipes, tmp_path):
    pipe = pipes["sd"]
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
    run_dir = dbg.record.run_dir
    with dbg:
        run(pipe, steps=2)
    latents = torch.zeros(1, 4, 8, 8)
    dbg.monitor_diffusion_step(2, latents)  # leaving ``with`` only detaches: still streamed
    assert sum(e["type"] == "step" for e in event_lines(run_dir)) == 3
    dbg.attach()
    dbg.close()  # detaches too
    assert not dbg.attached and hook_count(pipe) == 0 and "step" not in vars(pipe.scheduler)
    assert open_files(run_dir / "events.jsonl") == 0
    dbg.monitor_diffusion_step(3, latents)  # kept in memory only
    dbg.close()  # a no-op
    assert [row["step"] for row in dbg.report().steps] == [0, 1, 2, 3]
    run_dir = dbg.report().save()
    assert sum(e["type"] == "step" for e in event_lines(run_dir)) == 3
    assert (run_dir / "summary.json").exists()


def test_close_is_final(pipes, tmp_path):
    dbg = DiffusionModelDebugger(pipes["sd"], cfg(tmp_path))
    dbg.close()
    with pytest.raises(DiffusionDebugError, match="closed"):
        dbg.attach()
    with pytest.raises(DiffusionDebugError, match="closed"):
        with dbg:
            pass
    assert hook_count(pipes["sd"]) == 0


def test_detach_then_attach_watches_again(pipes, tmp_path):
    pipe = pipes["sd"]
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
    with dbg:
        run(pipe, steps=2)
    run(pipe, steps=2)  # detached: not watched
    assert len(dbg.report().steps) == 2
    with dbg:
        run(pipe, steps=2)
    assert [row["step"] for row in dbg.report().steps] == [0, 1, 0, 1]
    assert dbg.get_summary()["runs"] == 2
    types = [e["type"] for e in dbg.record.events]
    assert types.count("attach") == 2 and types.count("detach") == 2
    dbg.close()


@pytest.mark.usefixtures("only_the_tests_objects")  # its gc.collect() walks only what the test made
def test_a_collected_debugger_closes_its_event_stream(pipes, tmp_path):
    dbg = DiffusionModelDebugger(pipes["sd"], cfg(tmp_path))
    with dbg:
        pass
    events = dbg.record.run_dir / "events.jsonl"
    assert open_files(events) == 1
    del dbg
    gc.collect()
    assert open_files(events) == 0


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


def test_a_compiled_component_is_listed_once_per_attach(tmp_path):
    from diffusion_debug.testing import tiny_pipeline

    pipe = tiny_pipeline("sd")
    pipe.unet = torch.compile(pipe.unet, backend="aot_eager")  # wrapped only: nothing compiles until called
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
    for _ in range(2):
        with dbg:
            pass
    listed = [e["components"] for e in dbg.record.events if e["type"] == "compiled_components"]
    assert listed == [["unet"], ["unet"]]
    dbg.close()


def test_every_event_of_a_call_is_on_disk_when_its_first_step_is(pipes, tmp_path):
    """A call's opening events (attach, run_start, set_timesteps) are written with its first step's
    row, not one system call each; every later entry is on disk as it is recorded."""
    pipe = pipes["sd"]
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
    on_disk = []

    def callback(pipeline, step, timestep, kwargs):
        lines = (dbg.record.run_dir / "events.jsonl").read_text().splitlines()
        on_disk.append([json.loads(line)["type"] for line in lines])
        return kwargs

    with dbg:
        run(pipe, steps=2, callback_on_step_end=callback)
    assert on_disk[0] == ["start"]  # step 0 is read a step late, at step 1
    assert on_disk[1][:4] == ["start", "attach", "run_start", "set_timesteps"]  # with step 0's row
    assert on_disk[1].count("step") == 1
    lines = (dbg.record.run_dir / "events.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == list(dbg.record.events)  # detach flushed the rest
    dbg.close()


@pytest.mark.usefixtures("only_the_tests_objects")  # its gc.collect() walks only what the test made
def test_an_oom_caught_inside_the_with_block_is_let_go_at_detach_with_the_failed_call_s_tensors(pipes, tmp_path):
    """An OOM the user catches inside ``with dbg:`` (and gives up on) is recorded once; once the block
    ends, the debugger holds nothing of it: not the error, not the frames of the failed call, and so
    not the tensors that call was given (here the UNet's input, made inside the pipeline call)."""
    pipe = pipes["sd"]
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path, log_level="error"))
    inputs = []
    seen = pipe.unet.register_forward_pre_hook(lambda module, args: inputs.append(weakref.ref(args[0])))
    try:
        with dbg:
            try:
                with plant_oom(pipe.unet, from_call=1):
                    run(pipe, steps=2, output_type="latent")
            except torch.OutOfMemoryError:
                pass
    finally:
        seen.remove()
    gc.collect()
    assert dbg._oom.last is None
    assert [ref() for ref in inputs] == [None, None]  # the failed call's input is freed
    found = [(a.component, a.step) for a in dbg.report().anomalies if a.kind == "out_of_memory"]
    assert found == [("unet", 1)]
    dbg.close()


def test_the_debuggers_own_calls_nested_stay_unseen_until_the_outer_one_ends(pipes, tmp_path):
    """``StepPipeline.quiet`` marks the debugger's own calls (replays, previews) unseen by its hooks:
    one made inside another leaves them unseen until the outer one ends, not only its own end."""
    dbg = DiffusionModelDebugger(pipes["sd"], cfg(tmp_path))
    steps = dbg._steps
    with steps.quiet("vae"):
        with steps.quiet("unet"):
            assert steps.busy
        assert steps.busy and dbg._is_busy()
    assert not steps.busy
    dbg.close()
