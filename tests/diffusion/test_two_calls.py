"""A denoiser called twice a step, the conditional and the unconditional pass apart (tiny Wan 2.2:
with guidance, ``transformer(prompt_embeds)`` then ``transformer(negative_prompt_embeds)``): a
NaN/Inf made in either call is named at its module, at its step, on that call's replay; never
blamed on the guidance arithmetic that only passed the first call's output on."""

from __future__ import annotations

import pytest
import torch

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.testing import tiny_pipeline
from diffusion_debug.testing.features import kind_missing
from diffusion_debug.testing.zoo_video_audio import WAN22_CALL

pytestmark = pytest.mark.skipif(bool(kind_missing("wan22")), reason=str(kind_missing("wan22")))

MODULE = "blocks.0.ffn.net.2"


@pytest.fixture(scope="module")
def wan22():
    """Tiny Wan 2.2 (boundary 0.875): with 2 steps, step 0 is ``transformer``'s, step 1 ``transformer_2``'s."""
    return tiny_pipeline("wan22")


def plant_in_pass(expert: torch.nn.Module, passes: set[str]):
    """An Inf in ``MODULE``'s output on the passes named (``cond``: the step's first call, on the
    prompt's embeddings; ``uncond``: the second, on the negative prompt's), decided by the call's
    arguments (as a real fault is), so that a replay of the same call makes it again."""
    now = {}

    def before(module, args, kwargs):
        embeddings = kwargs["encoder_hidden_states"]
        cond = now.setdefault("cond", embeddings)  # the first call is the conditional pass
        now["pass"] = "cond" if torch.equal(embeddings, cond) else "uncond"

    def after(module, args, output):
        if now["pass"] in passes:
            output = output.clone()
            output[(0,) * output.dim()] = float("inf")
            return output
        return None

    handles = [
        expert.register_forward_pre_hook(before, with_kwargs=True),
        expert.get_submodule(MODULE).register_forward_hook(after),
    ]
    return handles


def run(pipe, tmp_path, **config):
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=tmp_path, log_level="error", **config))
    with dbg:
        video = pipe(**WAN22_CALL(), num_inference_steps=2, generator=torch.Generator().manual_seed(0)).frames
    dbg.close()
    return dbg.report(), video


def errors(report):
    return [(a.kind, a.component, a.module, a.step) for a in report.anomalies if a.severity == "error"]


@pytest.mark.parametrize("passes", [{"cond"}, {"uncond"}, {"cond", "uncond"}], ids=["first", "second", "both"])
@pytest.mark.parametrize("expert, step", [("transformer", 0), ("transformer_2", 1)])
def test_an_inf_in_either_call_of_the_step_is_named_at_its_module(wan22, tmp_path, passes, expert, step):
    handles = plant_in_pass(getattr(wan22, expert), passes)
    try:
        report, _ = run(wan22, tmp_path)
        why = report.why()  # the bundle's call replayed on the live expert, the fault still planted
    finally:
        for handle in handles:
            handle.remove()
    assert errors(report) == [("nonfinite", expert, MODULE, step)]
    headline = report.anomalies[0]
    assert headline.message.startswith(f"{expert}.{MODULE} produced NaN/Inf from finite inputs")
    assert headline.details["localized_by"] == "output check -> replay with full probes"
    assert "pipeline" not in {a.component for a in report.anomalies}  # not the guidance arithmetic
    assert (why.component, why.module, why.step, why.baseline.finite) == (expert, MODULE, step, False)


def test_a_clean_run_is_quiet_and_its_video_bitwise_equal(wan22, tmp_path):
    report, watched = run(wan22, tmp_path)
    plain = wan22(**WAN22_CALL(), num_inference_steps=2, generator=torch.Generator().manual_seed(0)).frames
    assert report.anomalies == []
    assert torch.equal(watched, plain)
    assert [row["denoiser_calls"] for row in report.steps] == [2, 2]


def test_in_fp16_the_sentinel_names_the_first_calls_block_and_its_replay_the_module(tmp_path):
    """fp16: the sentinel reads both calls' blocks; the block is replayed on the call that made it."""
    pipe = tiny_pipeline("wan22", dtype=torch.float16)
    handles = plant_in_pass(pipe.transformer, {"cond"})
    try:
        report, _ = run(pipe, tmp_path)
    finally:
        for handle in handles:
            handle.remove()
    assert errors(report) == [("nonfinite", "transformer", MODULE, 0)]
    assert report.anomalies[0].details["localized_by"] == "sentinel -> replay with full probes"
