"""True CFG keeps an encoder's held finding through the first step: HunyuanVideo reads its Llama's
``hidden_states[-3]`` (it skips the last two layers) and, with ``true_cfg_scale`` > 1 and a negative
prompt, calls its transformer twice a step, once with the prompt's states and once with the negative
prompt's. A NaN in the Llama's last layer is never read: one warning naming its module
(``details["unread_output"]``), the video bitwise the plain run's. A NaN in a layer it reads is the
error at the encoder's module, raised under policy ``raise`` before the transformer call that would
be given it runs, also when only the negative prompt's states hold it (the first call of step 0 was
given finite states: the finding is held on to the second)."""

from __future__ import annotations

import pytest
import torch

from diffusion_debug import DebugConfig, DiffusionDebugError, DiffusionModelDebugger
from diffusion_debug.testing import plant_nonfinite, tiny_pipeline, zoo_newer
from diffusion_debug.testing.features import kind_missing

pytestmark = pytest.mark.skipif(bool(kind_missing("hunyuan_video")), reason=str(kind_missing("hunyuan_video")))

LAST = "layers.2.mlp.down_proj"  # hidden_states[3] (after the final norm): never read
READ = "layers.0.mlp.down_proj"  # hidden_states[1] = hidden_states[-3]: what the transformer is given


@pytest.fixture(scope="module")
def pipe():
    """The zoo's tiny HunyuanVideo with a 3-layer Llama (the zoo's has 2, where hidden_states[-3] is the
    embeddings' output, which no layer's NaN reaches before it): layer 0's states are read, layer 2's not."""
    from transformers import LlamaModel

    pipe = tiny_pipeline("hunyuan_video")
    config = pipe.text_encoder.config
    config.num_hidden_layers = 3
    with torch.random.fork_rng():
        torch.manual_seed(0)
        pipe.text_encoder = LlamaModel(config).eval()
    return pipe


def true_cfg_call(pipe, **extra):
    kwargs = {**zoo_newer.ZOO_CALLS["hunyuan_video"][0](), "negative_prompt": "a dog", "true_cfg_scale": 2.0}
    kwargs.update(num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="pt", **extra)
    return pipe(**kwargs).frames


def watched(pipe, tmp_path, module, given, from_call=0, **config):
    """The call watched with ``module`` of the Llama making a NaN (from its ``from_call``-th call: 1, the
    negative prompt's only); the debugger and the frames. ``given``: whether each transformer call that ran
    was given finite states, appended to."""

    def count(_, args, kwargs, output):  # after the call: one that ran
        given.append(bool(kwargs["encoder_hidden_states"].isfinite().all()))

    counting = pipe.transformer.register_forward_hook(count, with_kwargs=True)
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error", **config))
    try:
        with plant_nonfinite(pipe.text_encoder.get_submodule(module), from_call=from_call, value=float("nan")):
            with dbg:
                frames = true_cfg_call(pipe)
    finally:
        counting.remove()
    return dbg, frames


def test_a_nan_in_the_layer_true_cfg_never_reads_is_one_warning_and_the_video_is_unchanged(pipe, tmp_path):
    plain = true_cfg_call(pipe)
    given = []
    dbg, frames = watched(pipe, tmp_path, LAST, given, policy="raise")
    assert given == [True] * 4  # 2 steps, a cond and an uncond call each: all given finite states
    assert torch.equal(frames, plain)
    report = dbg.report()
    assert [a for a in report.anomalies if a.severity == "error"] == []
    (found,) = [a for a in report.anomalies if a.kind == "nonfinite"]
    assert (found.severity, found.component, found.module, found.step) == ("warning", "text_encoder", LAST, None)
    assert found.details["unread_output"] is True
    dbg.close()


@pytest.mark.parametrize("from_call", [0, 1], ids=["both_prompts", "negative_prompt_only"])
def test_a_nan_in_a_layer_true_cfg_reads_is_the_error_at_the_encoders_module(pipe, tmp_path, from_call):
    given = []
    dbg, _ = watched(pipe, tmp_path, READ, given, from_call=from_call)
    assert given == [from_call == 1, False] * 2  # (cond, uncond) a step: the uncond call given the NaN
    report = dbg.report()
    (error,) = [a for a in report.anomalies if a.severity == "error"]
    assert (error.kind, error.component, error.module, error.step) == ("nonfinite", "text_encoder", READ, None)
    assert "unread_output" not in error.details
    dbg.close()
    given = []
    with pytest.raises(DiffusionDebugError) as raised:
        watched(pipe, tmp_path / "raise", READ, given, from_call=from_call, policy="raise")
    assert (raised.value.anomaly.component, raised.value.anomaly.module) == ("text_encoder", READ)
    # raised before the first call given the NaN runs: the cond call of step 0 ran where its states were finite
    assert given == [True] * from_call
