"""diffusion/localize.py: a block-level overflow is localised by one replay and the place is kept
across runs (until clear_debug_history); debug_timeout caps a run's replays."""

from __future__ import annotations

import torch
from diffusion_helpers import run

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.testing import plant_overflow, tiny_pipeline


def cfg(tmp_path, **kwargs):
    return DebugConfig(output_dir=str(tmp_path), **kwargs)


def kinds(report, kind):
    return [a for a in report.anomalies if a.kind == kind]


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
    dbg.clear_debug_history()  # forgets the localisation: the next run replays again
    handle = plant_overflow(pipe.vae.get_submodule("decoder.up_blocks.0"), fraction=0.7)
    try:
        with dbg:
            run(pipe, steps=2)
    finally:
        handle.remove()
    assert [e["type"] for e in dbg.record.events].count("replay") == 1  # the history was cleared too
    dbg.close()


def test_debug_timeout_caps_the_replays_of_a_run(tmp_path):
    from diffusion_debug.testing import plant_overflow

    pipe = tiny_pipeline("sd", dtype=torch.float16)
    handles = [
        plant_overflow(pipe.unet.get_submodule("up_blocks.1"), fraction=0.7),
        plant_overflow(pipe.vae.get_submodule("decoder.up_blocks.0"), fraction=0.7),
    ]
    try:
        dbg = DiffusionModelDebugger(
            pipe,
            DebugConfig(output_dir=str(tmp_path), run_name="t", level="basic", debug_timeout=1e-9, log_level="error"),
        )
        with dbg:
            run(pipe, steps=2)
    finally:
        for handle in handles:
            handle.remove()
    events = dbg.record.events
    # the first replay starts with nothing spent; after it the budget is gone
    assert [e["component"] for e in events if e["type"] == "replay"] == ["unet"]
    assert [e["component"] for e in events if e["type"] == "replay_skipped"] == ["vae"]
    assert {a.component for a in kinds(dbg.report(), "overflow_risk")} == {"unet", "vae"}
