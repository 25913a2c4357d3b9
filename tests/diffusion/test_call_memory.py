"""memory_growth across pipeline calls: a planted leak is found with the call where it started, and
the streak rule matches a naive reading of the same series."""

from __future__ import annotations

import contextlib
import gc
import random

import torch

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.diffusion.components.call_memory import STREAK, CallMemoryGrowth
from diffusion_debug.testing import plant_leak


def _naive_first_flag(series: list[float], threshold: float, floor: float):
    """(call flagged at, first call of its streak) by brute force over every window of calls."""
    for end in range(1, len(series)):
        start = end  # walk back while each call grew by more than the floor
        while start >= 1 and series[start] - series[start - 1] > floor:
            start -= 1
        first = start + 1
        if end - first + 1 >= STREAK and series[end] - series[first - 1] >= threshold:
            return end, first
    return None


def test_the_streak_rule_matches_a_naive_reading():
    rng = random.Random(0)
    for _ in range(200):
        series = [500.0]
        for _ in range(12):
            series.append(series[-1] + rng.choice([-3.0, 0.5, 2.0, 8.0, 15.0]))
        growth = CallMemoryGrowth(threshold_mb=30, floor_mb=1.0)
        found = [(call, a) for call, mb in enumerate(series) if (a := growth.after_call(call, {"rss_mb": mb}))]
        expected = _naive_first_flag(series, 30, 1.0)
        got = (found[0][0], found[0][1].details["first_call"]) if found else None
        assert got == expected, series
        assert len(found) <= 1  # once per source


@contextlib.contextmanager
def _no_collection():
    """No garbage collection inside the watched calls: the garbage earlier tests left (pipelines,
    debuggers in reference cycles) is collected first, so that its tensors freed during a call do
    not offset what the call kept (RSS is the process's net)."""
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def test_a_planted_leak_is_found_from_the_call_it_started(pipes, tmp_path):
    """One 64 MB tensor a call from the 3rd: over glibc's largest mmap threshold (32 MB), so each is
    mapped fresh (new pages, which no freed memory can stand in for, as it can for small tensors:
    ``call_memory``'s limits), after a warm-up call and with no collection during the calls. RSS
    also moves with what else the process frees or the kernel reclaims during a call: with 32 MB a
    call (96 MB over the streak against the 80 MB threshold) it flaked twice in fresh-clone CIs;
    64 MB a call leaves 112 MB of such noise, and 63 MB in one call, before it could miss."""
    pipe = pipes["sd"]
    pipe("a cat", num_inference_steps=1, output_type="latent", generator=torch.Generator().manual_seed(0))  # warm
    dbg = DiffusionModelDebugger(pipe, DebugConfig(level="basic", output_dir=str(tmp_path), memory_growth_mb=80))
    with _no_collection(), plant_leak(pipe.unet.conv_out, megabytes=64, from_call=2), dbg:  # from the 3rd call
        for _ in range(5):
            pipe("a cat", num_inference_steps=1, output_type="latent", generator=torch.Generator().manual_seed(0))
    (anomaly,) = [a for a in dbg.report().anomalies if a.kind == "memory_growth"]
    assert (anomaly.details["first_call"], anomaly.details["calls"], anomaly.details["source"]) == (3, 3, "rss")
    assert anomaly.details["per_call_mb"] > 60 and anomaly.component == "" and anomaly.step is None
    assert anomaly.message.startswith("Process memory grew by ")
    assert "over 3 pipeline calls" in anomaly.message and "from call 3 on" in anomaly.message
    dbg.close()


def test_a_40_mb_leak_a_call_is_found_within_8_calls_at_the_default_threshold(pipes, tmp_path):
    """memory_growth_mb (1 GB) would take 26 such calls; the threshold scales with the process."""
    pipe = pipes["sd"]
    dbg = DiffusionModelDebugger(pipe, DebugConfig(level="basic", output_dir=str(tmp_path)))
    assert dbg.config.memory_growth_mb == 1024
    found_at = []
    with plant_leak(pipe.unet.conv_out, megabytes=40), dbg:
        for call in range(1, 9):
            pipe("a cat", num_inference_steps=1, output_type="latent", generator=torch.Generator().manual_seed(0))
            if not found_at and any(a.kind == "memory_growth" for a in dbg.report().anomalies):
                found_at.append(call)
    (anomaly,) = [a for a in dbg.report().anomalies if a.kind == "memory_growth"]
    assert found_at and found_at[0] <= 5  # judged when the next call begins
    assert anomaly.details["source"] == "rss" and anomaly.details["first_call"] <= 2
    assert 38 < anomaly.details["per_call_mb"] < 60
    dbg.close()


def test_clean_calls_at_the_default_threshold_stay_quiet(pipes, tmp_path):
    pipe = pipes["sd"]
    dbg = DiffusionModelDebugger(pipe, DebugConfig(level="basic", output_dir=str(tmp_path)))
    with dbg:
        for _ in range(8):
            pipe("a cat", num_inference_steps=1, output_type="latent", generator=torch.Generator().manual_seed(0))
    assert [a for a in dbg.report().anomalies if a.kind == "memory_growth"] == []
    dbg.close()


def test_a_step_row_takes_the_memory_sample_its_denoiser_call_ended_with(pipes, tmp_path, monkeypatch):
    """One memory read fewer a step: the row's sample is the one the call site took as the step's
    denoiser call ended (the same fields; on a GPU one read of the allocator's statistics fewer);
    a step with no denoiser call since the last one (a hand-written loop) samples on its own."""
    from diffusion_debug.diffusion import steps as steps_module
    from diffusion_debug.diffusion.components import call_sites

    taken, own = [], []
    sample = call_sites.memory_sample

    def at_call_end(device=None):
        taken.append(sample(device))
        return taken[-1]

    def of_the_step(device=None):
        own.append({"rss_mb": -1.0, "vms_mb": -1.0, "percent": -1.0})
        return own[-1]

    monkeypatch.setattr(call_sites, "memory_sample", at_call_end)
    monkeypatch.setattr(steps_module, "memory_sample", of_the_step)
    pipe = pipes["sd"]
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), memory_tracking=True))
    with dbg:
        pipe("a cat", num_inference_steps=3, generator=torch.Generator().manual_seed(0), output_type="latent")
    hand_made = dbg.monitor_diffusion_step(7, torch.zeros(1, 4, 8, 8))  # after the run: no denoiser call of its own
    rows = dbg.report().steps
    # call sites, in order: the text encoder twice (CFG), then the UNet once a step
    assert [row["memory"] for row in rows[:3]] == taken[2:5] and len(taken) == 5
    assert hand_made["memory"] == own[-1] and sorted(rows[0]["memory"]) == ["percent", "rss_mb", "vms_mb"]
    empty = call_sites.CallSiteHooks([], DebugConfig(output_dir=str(tmp_path)))
    empty.denoiser_memory = (torch.device("meta"), {"rss_mb": 1.0})
    assert empty.take_denoiser_memory(torch.device("cpu")) is None and empty.denoiser_memory is None
    dbg.close()
