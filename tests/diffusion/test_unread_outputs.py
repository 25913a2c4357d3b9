"""Cost where it is spent: a language-model text encoder's vocabulary logits, which pipelines
discard (QwenImage reads ``hidden_states[-1]``), are never measured: no op of the debugger reads
them (counted with a dispatch mode, not timed), and the call is judged on the hidden states."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from diffusion_debug import DiffusionModelDebugger
from diffusion_debug.config import DebugConfig
from diffusion_debug.diffusion.components.call_sites import ComponentProbes, read_output, unread_modules
from diffusion_debug.diffusion.components.inventory import Component, role_of
from diffusion_debug.probes import ProbeConfig, apply_probes
from diffusion_debug.stats import tensors_in, to_host
from diffusion_debug.testing import plant_nonfinite

VOCAB = 4099  # a size no activation has: an op reading a tensor of this last size reads the logits


class OpsOnLogits(TorchDispatchMode):
    """Counts the aten ops that read a tensor whose last dimension is the vocabulary (views included)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t.dim() and t.shape[-1] == VOCAB for t in tensors_in((args, kwargs or {}))):
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def language_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    return Qwen2ForCausalLM(config).eval()


def encode(model):
    """As QwenImage calls its text encoder: the hidden states are read, the logits are not."""
    with torch.no_grad():
        return model(input_ids=torch.arange(12).reshape(1, 12), output_hidden_states=True)


def ops_on_logits(model, probe_config=None):
    handle = apply_probes(model, probe_config) if probe_config is not None else None
    with OpsOnLogits() as ops:
        output = encode(model)
    readings = handle.state.collect() if handle is not None else []
    if handle is not None:
        handle.remove()
    assert output.logits.shape[-1] == VOCAB
    return ops.count, readings


def test_the_vocabulary_head_is_found_and_its_logits_are_never_measured(language_model):
    component = Component("text_encoder", role_of("text_encoder", language_model), language_model)
    assert component.role == "text_encoder" and unread_modules(component) == ("lm_head",)
    plain, _ = ops_on_logits(language_model)
    before, _ = ops_on_logits(language_model, ProbeConfig("full"))  # every output measured, logits too
    after, readings = ops_on_logits(language_model, ProbeConfig("full", unread=("lm_head",)))
    # beyond the model's own ops on its logits, full probes add 1 without `unread` (the reduction;
    # no detach under no_grad), none with it
    assert (before - plain, after - plain) == (1, 0)
    assert "lm_head" not in {r.module for r in readings} and "" in {r.module for r in readings}


def test_the_debugger_probes_a_text_encoder_without_its_head_and_judges_the_hidden_states(language_model):
    component = Component("text_encoder", "text_encoder", language_model)
    plain, _ = ops_on_logits(language_model)
    probes = ComponentProbes(DebugConfig(level="basic"), on_error=lambda where, error: None)
    handle = probes.attach([component])
    try:
        with OpsOnLogits() as ops:
            output = encode(language_model)
        _, values, read = probes.take("text_encoder")
        readings = read(to_host(values))
    finally:
        handle.remove()
    assert ops.count == plain  # the model's own ops on its logits, none of the debugger's
    assert "lm_head" not in {r.module for r in readings}
    assert read_output(output) is output.hidden_states[-1]


# -- hidden states the pipeline does not pass on -----------------------------------------------------
# SDXL reads its CLIP text encoders' penultimate hidden states (``hidden_states[-2]``): a NaN/Inf made in
# text_encoder's last layer (an fp16 overflow there) leaves the image as it is. text_encoder_2's last layer
# makes its pooled ``text_embeds``, which the UNet is given: a NaN/Inf that reaches them reaches the image.


@pytest.fixture(scope="module")
def sdxl():
    from diffusion_debug.testing import tiny_pipeline

    return tiny_pipeline("sdxl")


def sdxl_call(pipe):
    out = pipe("a cat", num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="pt")
    return out.images


def layer_module(component: torch.nn.Module, module: str) -> str:
    # transformers nests a CLIP's layers differently across versions: matched by suffix
    return next(n for n, _ in component.named_modules() if n == module or n.endswith("." + module))


def watched(pipe, tmp_path, component: str, module: str, **config):
    from diffusion_debug import DiffusionModelDebugger
    from diffusion_debug.testing import plant_nonfinite

    name = layer_module(getattr(pipe, component), module)
    unet_calls = []
    counting = pipe.unet.register_forward_pre_hook(lambda *_: unet_calls.append(1))
    try:
        with plant_nonfinite(getattr(pipe, component).get_submodule(name), value=float("nan")):
            dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error", **config))
            with dbg:
                images = sdxl_call(pipe)
    finally:
        counting.remove()
    return dbg, images, name, len(unet_calls)


def test_a_nan_in_a_layer_the_pipeline_does_not_read_is_a_warning_naming_its_module(sdxl, tmp_path):
    plain = sdxl_call(sdxl)
    dbg, images, module, _ = watched(sdxl, tmp_path, "text_encoder", "encoder.layers.1.mlp.fc2")
    assert torch.equal(images, plain)  # SDXL read hidden_states[-2]: the NaN never reached the image
    report = dbg.report()
    assert [a for a in report.anomalies if a.severity == "error"] == []
    (found,) = [a for a in report.anomalies if a.kind == "nonfinite"]
    assert (found.severity, found.component, found.module, found.step) == ("warning", "text_encoder", module, None)
    assert found.details["unread_output"] is True
    assert found.message == (
        f"text_encoder.{module} produced NaN/Inf from finite inputs in hidden states the pipeline did not pass "
        "on (its denoising loop was given finite values), so the result is not affected; an fp16 overflow "
        "in a final layer often does this (check its dtype and weights; try float32 or bfloat16)."
    )
    dbg.close()


def test_a_nan_in_a_layer_the_pipeline_does_not_read_under_fp16_autocast_is_advised_about_autocast(sdxl, tmp_path):
    """The float32 CLIP's last layer under float16 autocast: its NaN (a float16 output, float32 weights) is the
    warning whose advice said "try float32 or bfloat16" (it is float32, and autocast computed it in float16); it
    advises autocast, as the error of a NaN the pipeline reads does."""
    with torch.autocast("cpu", dtype=torch.float16):
        dbg, _, module, _ = watched(sdxl, tmp_path, "text_encoder", "encoder.layers.1.mlp.fc2")
    (found,) = [a for a in dbg.report().anomalies if a.kind == "nonfinite"]
    assert (found.severity, found.component, found.module, found.details["unread_output"]) == (
        "warning",
        "text_encoder",
        module,
        True,
    )
    assert found.message == (
        f"text_encoder.{module} produced NaN/Inf from finite inputs in hidden states the pipeline did not pass "
        "on (its denoising loop was given finite values), so the result is not affected; an fp16 overflow "
        "in a final layer often does this; it ran under float16 autocast (its weights are float32): autocast to "
        f"bfloat16 instead (torch.autocast(..., dtype=torch.bfloat16)) or run text_encoder.{module} outside autocast."
    )
    dbg.close()


def test_policy_raise_lets_a_run_whose_nan_went_unread_finish(sdxl, tmp_path):
    plain = sdxl_call(sdxl)
    dbg, images, _, unet_calls = watched(sdxl, tmp_path, "text_encoder", "encoder.layers.1.mlp.fc2", policy="raise")
    assert torch.equal(images, plain) and unet_calls == 2
    dbg.close()


@pytest.mark.parametrize(
    "component, module",
    [
        ("text_encoder", "encoder.layers.0.mlp.fc2"),  # its output is hidden_states[-2], which SDXL reads
        # the last layer makes the pooled text_embeds at the prompt's end token: a NaN key at the first
        # token reaches every token through the attention
        ("text_encoder_2", "encoder.layers.1.self_attn.k_proj"),
    ],
)
def test_a_nan_in_what_the_pipeline_reads_is_the_one_error_at_its_module(sdxl, tmp_path, component, module):
    from diffusion_debug import DiffusionDebugError

    dbg, _, name, _ = watched(sdxl, tmp_path, component, module)
    report = dbg.report()
    (error,) = [a for a in report.anomalies if a.severity == "error"]
    assert (error.kind, error.component, error.module, error.step) == ("nonfinite", component, name, None)
    assert "unread_output" not in error.details
    others = [a for a in report.anomalies if a.kind == "nonfinite" and a is not error]
    assert all(error.where() in a.message for a in others), [a.message for a in others]
    dbg.close()
    with pytest.raises(DiffusionDebugError) as raised:
        watched(sdxl, tmp_path / "raise", component, module, policy="raise")
    assert (raised.value.anomaly.component, raised.value.anomaly.module) == (component, name)


def test_an_encode_only_call_keeps_the_error_no_later_call_could_clear(sdxl, tmp_path):
    """No call of the loop shows whether the NaN/Inf in the last layer's states was used (the user
    may pass on any of them): the error stays as it was made, at its module."""
    from diffusion_debug import DiffusionDebugError, DiffusionModelDebugger
    from diffusion_debug.testing import plant_nonfinite

    module = layer_module(sdxl.text_encoder, "encoder.layers.1.mlp.fc2")
    with plant_nonfinite(sdxl.text_encoder.get_submodule(module), value=float("nan")):
        dbg = DiffusionModelDebugger(sdxl, DebugConfig(output_dir=str(tmp_path), log_level="error"))
        with dbg:
            embeds = sdxl.encode_prompt("a cat", device="cpu", do_classifier_free_guidance=False)[0]
            found = [a for a in dbg.record.anomalies if a.severity == "error"]  # as the call returned, not at detach
        assert [(a.kind, a.component, a.module) for a in found] == [("nonfinite", "text_encoder", module)]
        assert bool(embeds.isfinite().all())  # hidden_states[-2]
        (error,) = [a for a in dbg.report().anomalies if a.severity == "error"]
        assert (error.kind, error.component, error.module) == ("nonfinite", "text_encoder", module)
        dbg.close()
        config = DebugConfig(output_dir=str(tmp_path / "raise"), log_level="error", policy="raise")
        with DiffusionModelDebugger(sdxl, config), pytest.raises(DiffusionDebugError) as raised:
            sdxl.encode_prompt("a cat", device="cpu", do_classifier_free_guidance=False)  # raised at the call
    assert (raised.value.anomaly.component, raised.value.anomaly.module) == ("text_encoder", module)


def test_a_nan_the_loop_made_itself_after_finite_first_calls_does_not_clear_an_unread_nan_for_blame(sdxl, tmp_path):
    """text_encoder's last layer makes a NaN SDXL does not read (the first step's UNet call is given
    finite states), and the UNet makes its own NaN at step 0: step 1's UNet call is given NaN latents,
    which the UNet made, not the encoder. The error, and the headline, is the UNet's module at step 0;
    the encoder's NaN stays the warning it is (before: the encoder's was the error and the headline, the
    UNet's a warning, and the VAE was told to fix the encoder)."""
    from diffusion_debug import DiffusionModelDebugger
    from diffusion_debug.testing import plant_nonfinite

    encoder_module = layer_module(sdxl.text_encoder, "encoder.layers.1.mlp.fc2")
    unet_module = "down_blocks.1.resnets.0.conv2"
    with (
        plant_nonfinite(sdxl.text_encoder.get_submodule(encoder_module), value=float("nan")),
        plant_nonfinite(sdxl.unet.get_submodule(unet_module), value=float("nan")),
    ):
        dbg = DiffusionModelDebugger(sdxl, DebugConfig(output_dir=str(tmp_path), log_level="error"))
        with dbg:
            sdxl_call(sdxl)
    report = dbg.report()
    (error,) = [a for a in report.anomalies if a.severity == "error"]
    assert (error.kind, error.component, error.module, error.step) == ("nonfinite", "unet", unet_module, 0)
    assert (report.headline.component, report.headline.module) == ("unet", unet_module)
    (unread,) = [a for a in report.anomalies if a.component == "text_encoder"]
    assert (unread.severity, unread.module, unread.details.get("unread_output")) == ("warning", encoder_module, True)
    dbg.close()


# -- a pipeline call that raises after its encoder calls -------------------------------------------------
# diffusers' call end (``maybe_free_model_hooks``) is never reached: the call's held findings are settled as
# its own when it is known to have ended (the next event of ours, ``report()``, detach), never by a later call.


class Raised(Exception):
    pass


def events(dbg):
    lines = (dbg.record.run_dir / "events.jsonl").read_text().splitlines()
    return [(e["type"], e.get("run"), e.get("component")) for e in map(json.loads, lines)]


def raising_call(pipe, how):
    """An SDXL call that raises after encoding: before its loop (``prepare_latents``), or at step 0 after the
    loop's first UNet call (its ``callback_on_step_end``, or the scheduler's ``step``). Returns the exception
    raised, as the user caught it, with the one the pipeline raised."""
    thrown = Raised(how)

    def throw(*args, **kwargs):
        raise thrown

    if how == "callback":
        with pytest.raises(Raised) as caught:
            sdxl_call_with(pipe, callback_on_step_end=throw)
        return caught.value, thrown
    target = pipe if how == "prepare_latents" else pipe.scheduler
    name = "prepare_latents" if how == "prepare_latents" else "step"
    setattr(target, name, throw)  # an instance attribute the pipeline (or our wrapper) calls
    try:
        with pytest.raises(Raised) as caught:
            sdxl_call(pipe)
    finally:
        delattr(target, name)
    return caught.value, thrown


def sdxl_call_with(pipe, **kwargs):
    generator = torch.Generator().manual_seed(0)
    return pipe("a cat", num_inference_steps=2, generator=generator, output_type="pt", **kwargs).images


@pytest.mark.parametrize("policy", ["record", "raise"])
def test_a_call_that_raises_before_its_loop_keeps_its_held_error_and_the_next_call_runs_clean(sdxl, tmp_path, policy):
    """No call of the loop read the encoder's output (the call raised first): whether the NaN/Inf in its last
    layer would have been read is not known, so it stays the error it was made, at its module, the raising
    call's (run 1, on disk before the next call begins). Before: the next call's finite loop settled it as
    "result not affected" (a warning, the error lost) in a run that never ended."""
    plain = sdxl_call(sdxl)
    module = layer_module(sdxl.text_encoder, "encoder.layers.1.mlp.fc2")
    dbg = DiffusionModelDebugger(sdxl, DebugConfig(output_dir=str(tmp_path), log_level="error", policy=policy))
    with dbg:
        with plant_nonfinite(sdxl.text_encoder.get_submodule(module), value=float("nan")):
            caught, thrown = raising_call(sdxl, "prepare_latents")
        assert caught is thrown and str(caught) == "prepare_latents"  # the user's exception as it was raised
        images = sdxl_call(sdxl)  # the next call: clean, and under policy raise not raised for the last call's
    assert torch.equal(images, plain)
    report = dbg.report()
    (error,) = [a for a in report.anomalies if a.severity == "error"]
    assert (error.kind, error.component, error.module, error.step) == ("nonfinite", "text_encoder", module, None)
    assert error.details["run"] == 1 and "unread_output" not in error.details
    order = events(dbg)
    assert order.index(("anomaly", None, "text_encoder")) < order.index(("run_start", 2, None))
    assert [row["run"] for row in report.steps] == [2, 2]
    dbg.close()


@pytest.mark.parametrize("how", ["callback", "scheduler"])
def test_a_call_that_raises_at_step_0_settles_its_unread_nan_as_its_own_warning(sdxl, tmp_path, how):
    """The first step's UNet call was given finite states before the call raised (its step-end callback,
    or its scheduler): the NaN in the last layer went unread, the raising call's warning, written as that
    call ended (before: settled by the next call, after its run had begun, or in a run that never ended)."""
    module = layer_module(sdxl.text_encoder, "encoder.layers.1.mlp.fc2")
    dbg = DiffusionModelDebugger(sdxl, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    with dbg:
        with plant_nonfinite(sdxl.text_encoder.get_submodule(module), value=float("nan")):
            raising_call(sdxl, how)
        sdxl_call(sdxl)
    report = dbg.report()
    assert [a for a in report.anomalies if a.severity == "error"] == []
    (found,) = [a for a in report.anomalies if a.kind == "nonfinite"]
    assert (found.severity, found.component, found.module, found.details["run"]) == (
        "warning",
        "text_encoder",
        module,
        1,
    )
    assert found.details["unread_output"] is True
    order = events(dbg)
    assert order.index(("anomaly", None, "text_encoder")) < order.index(("run_start", 2, None))
    dbg.close()


def test_a_raised_calls_held_error_is_in_the_report_asked_next_and_the_exception_goes_on_unchanged(sdxl, tmp_path):
    """Caught while attached: ``get_summary()`` and ``report()`` asked next hold the raised call's error
    (before: held until a later call or detach). Left to propagate out of ``with dbg``: the same exception
    object, with the same traceback, and its own held error (run 2) beside the first call's."""
    module = layer_module(sdxl.text_encoder, "encoder.layers.1.mlp.fc2")
    dbg = DiffusionModelDebugger(sdxl, DebugConfig(output_dir=str(tmp_path), log_level="error", policy="raise"))
    with plant_nonfinite(sdxl.text_encoder.get_submodule(module), value=float("nan")):
        with dbg:
            raising_call(sdxl, "prepare_latents")
            first = dbg.get_summary()["first_error"]
            found = [(a.severity, a.module, a.details["run"]) for a in dbg.report().anomalies if a.kind == "nonfinite"]
        assert (first["component"], first["module"]) == ("text_encoder", module)
        assert found == [("error", module, 1)]
        thrown = Raised("propagates")

        def throw(*args, **kwargs):
            raise thrown

        sdxl.prepare_latents = throw
        try:
            with pytest.raises(Raised) as left:
                with dbg:
                    try:
                        sdxl_call(sdxl)
                    except Raised as error:
                        inner = (error, error.__traceback__)
                        raise
        finally:
            del sdxl.prepare_latents
    assert left.value is thrown and inner == (thrown, left.value.__traceback__)
    found = [(a.severity, a.module, a.details["run"]) for a in dbg.report().anomalies if a.kind == "nonfinite"]
    assert found == [("error", module, 1), ("error", module, 2)]
    dbg.close()


@pytest.mark.parametrize("asked", ["report", "get_summary"])
def test_a_report_asked_in_the_except_that_raises_on_begins_no_second_run_for_the_same_call(sdxl, tmp_path, asked):
    """The user's handler asks ``report()`` (or logs ``get_summary()``) and raises on through ``with dbg``: the
    call was ended unseen by that ask, and the detach that sees its exception is still that call's, in its run
    (before: a second run was begun for it, run_start 2 with no step)."""
    module = layer_module(sdxl.text_encoder, "encoder.layers.1.mlp.fc2")
    dbg = DiffusionModelDebugger(sdxl, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    thrown = Raised("handled, then raised on")

    def throw(*args, **kwargs):
        raise thrown

    sdxl.prepare_latents = throw
    try:
        with plant_nonfinite(sdxl.text_encoder.get_submodule(module), value=float("nan")):
            with pytest.raises(Raised) as left:
                with dbg:
                    try:
                        sdxl_call(sdxl)
                    except Raised:
                        getattr(dbg, asked)()
                        raise
    finally:
        del sdxl.prepare_latents
    assert left.value is thrown
    assert [run for kind, run, _ in events(dbg) if kind == "run_start"] == [1]
    found = [(a.severity, a.module, a.details["run"]) for a in dbg.report().anomalies if a.kind == "nonfinite"]
    assert found == [("error", module, 1)]
    dbg.close()
