"""VAEs whose decoder keeps a causal-conv cache: the Wan VAE (Wan 2.2, SANA-Video, ChronoEdit,
Motif-Video) and the QwenImage VAE (QwenImage, Krea 2, NucleusMoE-Image). ``vae.decode`` calls
``vae.decoder`` once per latent frame with one ``feat_cache`` list that the decoder's causal convs
fill during the call. An Inf made by one decoder module (in its weight or its output) is named at
that module, not blamed on the pipeline through the cache the call filled; the replay that names it
never writes into the user's cache; a NaN/Inf the VAE gets back through its own cache is the
VAE's; a clean run is bitwise equal and quiet."""

from __future__ import annotations

import contextlib

import pytest
import torch

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.diffusion.components import cache_hooks
from diffusion_debug.testing import plant_nonfinite, tiny_pipeline
from diffusion_debug.testing.features import kind_missing
from diffusion_debug.testing.qwenimage import QWENIMAGE_CALL
from diffusion_debug.testing.zoo_video_audio import WAN22_CALL

MODULE = "decoder.up_blocks.0.resnets.0.conv1"  # a causal conv that reads and fills feat_cache
# kind -> (call kwargs, decoder calls per decode: one per latent frame)
KINDS = {"wan22": (WAN22_CALL, 2), "qwenimage": (QWENIMAGE_CALL[0], 1)}


@pytest.fixture(scope="module")
def pipes():
    """Tiny Wan 2.2 (AutoencoderKLWan; 5 frames are 2 latent frames) and QwenImage (AutoencoderKLQwenImage)."""
    missing = [reason for reason in map(kind_missing, KINDS) if reason]
    if missing:
        pytest.skip("; ".join(missing))
    return {kind: tiny_pipeline(kind) for kind in KINDS}


def call(pipe, kind):
    return pipe(**KINDS[kind][0](), num_inference_steps=2, generator=torch.Generator().manual_seed(0))[0]


def watched(pipe, kind, tmp_path):
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    with dbg:
        video = call(pipe, kind)
    dbg.close()
    return video, dbg.report()


@contextlib.contextmanager
def inf_weight(module: torch.nn.Module):
    """One element of ``module.weight`` set to Inf for the block, then put back."""
    weight = module.weight.data
    index = (0,) * weight.dim()
    kept = weight[index].clone()
    weight[index] = float("inf")
    try:
        yield
    finally:
        weight[index] = kept


@contextlib.contextmanager
def inf_output(module: torch.nn.Module):
    with plant_nonfinite(module):
        yield


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, NaN where NaN."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


@pytest.mark.parametrize("kind", KINDS)
def test_a_clean_causal_cache_vae_run_is_bitwise_equal_and_quiet(pipes, tmp_path, kind):
    pipe = pipes[kind]
    plain = call(pipe, kind)
    video, report = watched(pipe, kind, tmp_path)
    assert torch.equal(plain, video)
    assert report.anomalies == [], [a.to_dict() for a in report.anomalies]
    assert report.components["vae"]["calls"] == KINDS[kind][1]  # the decoder, once per latent frame


@pytest.mark.parametrize("fault", [inf_weight, inf_output], ids=["weight", "output"])
@pytest.mark.parametrize("kind", KINDS)
def test_an_inf_made_in_a_decoder_module_is_the_headline_at_that_module(pipes, tmp_path, kind, fault):
    pipe = pipes[kind]
    with fault(pipe.vae.get_submodule(MODULE)):
        plain = call(pipe, kind)
        video, report = watched(pipe, kind, tmp_path)
    assert same(plain, video)  # the replay ran on a copy of feat_cache: later frames decoded as without it
    headline = report.headline
    # the decode runs after the last step: no step, as for the Stable Diffusion VAE
    assert (headline.kind, headline.component, headline.module, headline.step) == ("nonfinite", "vae", MODULE, None)
    assert headline.details["localized_by"] == "output check -> replay with full probes"
    # the advice follows the VAE's dtype: a float32 VAE is not told to keep to float32 (before: "keep the
    # VAE in float32 or bfloat16: pipe.vae.to(torch.float32)"), nor to force_upcast, Stable Diffusion's only
    assert headline.message == (
        f"vae.{MODULE} produced NaN/Inf from finite inputs (it ran in float32, so this is no half-precision "
        "overflow: check its weights and inputs)."
    )
    assert headline.details["vae_dtype"] == "float32"
    assert [a for a in report.anomalies if a.severity == "error"] == [headline]
    assert not [a for a in report.anomalies if a.component == "pipeline"]


def test_an_inf_the_vae_gets_back_through_its_own_feat_cache_is_the_vaes(pipes, tmp_path):
    # the first decoder call leaves an Inf in the cache its second call reads (its output stays
    # finite): the VAE's own state, never a pipeline input nor "the pipeline's own code"
    def poison_cache(module, args, kwargs, output):
        if not calls:
            cache = kwargs["feat_cache"]
            cache[0] = cache[0].clone()
            cache[0][(0,) * cache[0].dim()] = float("inf")
        calls.append(1)

    calls: list[int] = []
    pipe = pipes["wan22"]  # two decoder calls: the second reads the cache the first filled
    handle = pipe.vae.decoder.register_forward_hook(poison_cache, with_kwargs=True)
    try:
        _, report = watched(pipe, "wan22", tmp_path)
    finally:
        handle.remove()
    (error,) = [a for a in report.anomalies if a.severity == "error"]
    assert (error.kind, error.component, error.module, error.step) == ("nonfinite", "vae", "", None)
    assert (error.details["localized_by"], error.details["arguments"]) == ("its own state", ["feat_cache"])
    assert error.message == (
        "vae got NaN/Inf back through its own feat_cache, which its earlier calls fill and read back: one of its "
        "modules made it in an earlier call of this decode whose output was finite or not read (a cache step's); "
        "check vae's dtype and weights."
    )


def test_each_use_of_a_kept_call_gets_the_lists_as_the_call_passed_them():
    """A replay fills the copy of ``feat_cache`` it is given and moves ``feat_idx``: the next replay
    (an overflow after a NaN) and the repro bundle get the call as it was passed, not as a replay left it."""
    from types import SimpleNamespace

    from diffusion_debug.diffusion.components.call_sites import CallSiteHooks, kept_as_passed

    cache, index = [None, None], [0]
    sites = CallSiteHooks.__new__(CallSiteHooks)
    sites.through = {}  # no VAE method compiled: the decoder's own call is kept
    sites.kept = {("vae", "decoder"): kept_as_passed((torch.ones(1),), {"feat_cache": cache, "feat_idx": index})}
    site = SimpleNamespace(component="vae", prefix="decoder")
    _, first = sites.kept_call(site)
    first["feat_cache"][0], first["feat_idx"][0] = torch.zeros(1), 1  # what a replay's causal conv does
    _, second = sites.kept_call(site)
    assert second["feat_cache"] == [None, None] and second["feat_idx"] == [0]
    assert cache == [None, None] and index == [0]  # and the user's own lists were never written


def test_a_feat_cache_held_under_inference_mode_is_replayed_at_its_module(pipes, tmp_path, monkeypatch):
    # at real size (over the step's bytes of copies) the second frame's feat_cache is held as passed: under
    # inference_mode its tensors have no version counter, and the replay and the bundle were refused (two
    # debugger_errors, the Inf named at a block). Its causal convs replace its entries, never write into them
    monkeypatch.setattr(cache_hooks, "KEPT_BYTES", 0)  # a real-size feat_cache
    pipe = pipes["wan22"]
    with plant_nonfinite(pipe.vae.get_submodule(MODULE), from_call=1):  # the 2nd latent frame: a filled cache
        dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
        with dbg, torch.inference_mode():
            call(pipe, "wan22")
        dbg.close()
    report = dbg.report()
    assert not [a.message for a in report.anomalies if a.kind == "debugger_error"]
    (error,) = [a for a in report.anomalies if a.severity == "error"]
    assert (error.kind, error.component, error.module, error.step) == ("nonfinite", "vae", MODULE, None)
    assert error.details["localized_by"] == "output check -> replay with full probes"
