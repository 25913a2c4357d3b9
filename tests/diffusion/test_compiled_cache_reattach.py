"""Regional compilation (``compile_repeated_blocks``, aot_eager) under a diffusers cache (FirstBlockCache,
MagCache), the debugger attached, detached and attached again across calls of one pipeline, one watched call
ended by an exception the user's ``callback_on_step_end`` raises (mid-run: the cache's state is left as the
step left it, unwatched too). Against a twin making the same calls unwatched, dynamo reset before each so that
neither reuses the other's compiled code: every image and every call's count of graphs made is the twin's, the
exception reaches the user as raised, the run is quiet, and the hooks on the transformer after the last detach
are the twin's."""

from __future__ import annotations

import contextlib

import pytest
import torch
from diffusion_helpers import dynamo_counts

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.diffusion.components.cache_hooks import hook_registries
from diffusion_debug.testing import tiny_pipeline
from diffusion_debug.testing.features import HAS_CACHE_HOOKS, HAS_REPEATED_BLOCKS
from diffusion_debug.testing.flux import FLUX_CALL

pytestmark = pytest.mark.skipif(
    not (HAS_CACHE_HOOKS and HAS_REPEATED_BLOCKS),
    reason="this diffusers has no caching hooks or regional compilation",
)

STEPS = 3
CALLS = ("plain", "watched", "plain", "watched", "raises", "watched")


class Boom(Exception):
    pass


def _raise_at_step_1(pipe, i, t, tensors):
    if i == 1:
        raise Boom("the user's")
    return tensors


def _first_block_cache():
    from diffusers import FirstBlockCacheConfig

    return FirstBlockCacheConfig(threshold=0.3)


def _mag_cache():
    from diffusers import MagCacheConfig

    return MagCacheConfig(threshold=0.5, num_inference_steps=STEPS, mag_ratios=[1.0] * STEPS, retention_ratio=0.0)


def calls(cache, watched: bool, tmp_path) -> tuple[list, list, DiffusionModelDebugger | None]:
    """The images (the exception for the raising call) and graphs made by each of :data:`CALLS`, and the
    hooks on the transformer after the last call."""
    torch._dynamo.reset()
    pipe = tiny_pipeline("flux")
    pipe.transformer.enable_cache(cache())
    pipe.transformer.compile_repeated_blocks(backend="aot_eager")
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error")) if watched else None
    found = []
    for how in CALLS:
        before = dynamo_counts()
        with dbg if dbg is not None and how != "plain" else contextlib.nullcontext():
            try:
                callback = _raise_at_step_1 if how == "raises" else None
                kwargs = dict(generator=torch.Generator().manual_seed(0), callback_on_step_end=callback)
                seen = pipe(num_inference_steps=STEPS, **kwargs, **FLUX_CALL[0]()).images
            except Boom as raised:
                seen = raised
        found.append((seen, tuple(a - b for a, b in zip(dynamo_counts(), before))))
    hooks = [list(registry.hooks) for registry in hook_registries(pipe.transformer)]
    hooks += [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in pipe.transformer.modules()]
    return found, hooks, dbg


@pytest.mark.parametrize("cache", [_first_block_cache, _mag_cache], ids=["first_block_cache", "mag_cache"])
def test_regional_compile_under_a_cache_attached_detached_and_raised_in_changes_no_image_and_no_graph(cache, tmp_path):
    expected, twin_hooks, _ = calls(cache, False, tmp_path)
    seen, hooks, dbg = calls(cache, True, tmp_path)
    try:
        for (image, graphs), (twin_image, twin_graphs) in zip(seen, expected):
            if isinstance(twin_image, Boom):
                assert isinstance(image, Boom) and str(image) == "the user's"
            else:
                torch.testing.assert_close(image, twin_image, rtol=0, atol=0)
            assert graphs == twin_graphs
        assert hooks == twin_hooks
        report = dbg.report()
        told = [(a.kind, a.component, a.module) for a in report.anomalies if a.severity != "info"]
        assert [found for found in told if found[0] != "scheduler_config"] == []
        # the raising call's run holds the steps before its callback raised, the next call a run of its own
        runs = [(1, 3), (2, 3), (3, 2), (4, 3)]
        assert [(row["run"], row["step"]) for row in report.steps] == [(r, s) for r, n in runs for s in range(n)]
    finally:
        dbg.close()
