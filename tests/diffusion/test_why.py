"""``DebugReport.why()`` / ``diffusion-debug why``: one fault planted per factor on the tiny SD
pipeline; the verdict names that factor as the fix (or the weights / inputs at fault), and the
live pipeline is exactly as before the replays.

Long because every factor ``why()`` can name has its planted fault here, each reusing the module's
pipelines and bundles (split by factor, they would build the same pipelines in several files)."""

from __future__ import annotations

import copy

import pytest
import torch

from diffusion_debug import DebugConfig, DiffusionDebugError, DiffusionModelDebugger
from diffusion_debug.diffusion.replay.bundle import save_bundle
from diffusion_debug.diffusion.replay.why import UNANSWERED, explain_bundle
from diffusion_debug.testing import tiny_pipeline
from diffusion_debug.testing.features import (
    HAS_ATTENTION_BACKENDS,
    HAS_CACHE_HOOKS,
    HAS_LAYERWISE_CASTING,
    SDPA_KEEPS_NAN,
    clip_name,
)

INF_MODULE = "up_blocks.1.resnets.0.conv2"


@pytest.fixture(scope="module")
def pipe():
    """fp32 tiny SD, seed 0; each test puts back what it planted."""
    return tiny_pipeline("sd")


def watched_run(pipe, tmp_path):
    """One denoising step (no guidance, no VAE) with the debugger attached; its report."""
    dbg = DiffusionModelDebugger(pipe, DebugConfig(level="advanced", output_dir=tmp_path, log_level="error"))
    with dbg:
        pipe("a cat", num_inference_steps=1, output_type="latent", guidance_scale=1.0, generator=torch.Generator())
    dbg.close()
    return dbg.report()


def snapshot(module):
    """Every parameter and buffer as bytes, the diffusers hooks and attention processors by identity."""
    state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    registries = {
        n: list(vars(m)["_diffusers_hook"].hooks.items())
        for n, m in module.named_modules()
        if "_diffusers_hook" in vars(m)
    }
    forwards = {n: vars(m).get("forward") for n, m in module.named_modules()}
    processors = dict(getattr(module, "attn_processors", {}))
    return state, registries, forwards, processors


def assert_unchanged(before, after):
    (state, registries, forwards, processors), (state2, registries2, forwards2, processors2) = before, after
    assert state.keys() == state2.keys()
    for key in state:
        assert state[key].dtype == state2[key].dtype and torch.equal(
            state[key].view(torch.uint8), state2[key].view(torch.uint8)
        ), key
    assert registries == registries2 and processors == processors2
    assert all(forwards[k] is forwards2[k] for k in forwards)


def test_an_fp16_only_overflow_is_fixed_by_float32(tmp_path):
    pipe = tiny_pipeline("sd", dtype=torch.float16)
    with torch.no_grad():
        pipe.unet.conv_in.weight.mul_(1e5)  # |x| ~1e5 after conv_in: beyond fp16's 65504, fine in fp32
    report = watched_run(pipe, tmp_path)
    result = report.why()
    assert result.module == "conv_in" and result.baseline.finite is False
    assert result.fix == "float32"
    assert result.verdict == "smallest fix: run unet in float32 (float32) makes unet finite (also finite: bfloat16)"
    assert {r.factor: r.finite for r in result.replays} == {
        "SDPA math kernel": False,
        "float32": True,
        "bfloat16": True,
        "finite inputs": False,
    }
    fp32 = next(r for r in result.replays if r.factor == "float32")
    assert fp32.dtype == "float32" and fp32.dtype_max == torch.finfo(torch.float32).max and 0 < fp32.max_abs < 100
    assert fp32.change == "run unet in float32"  # the table's change field names the component too
    written = (report.run_dir / "why.md").read_text()
    assert result.verdict in written and "| float32 | yes |" in written
    assert str(result) == written == result.markdown()  # print(report.why()) shows the table and the verdict


@pytest.mark.skipif(not SDPA_KEEPS_NAN, reason="this torch's CPU attention drops a NaN query: the run is finite")
def test_nan_in_one_lora_adapter_is_fixed_by_disabling_that_adapter(pipe, tmp_path):
    peft = pytest.importorskip("peft")
    unet = pipe.unet
    for name in ("style", "faulty"):
        config = peft.LoraConfig(r=2, lora_alpha=2, target_modules=["to_q", "to_v"], init_lora_weights=False)
        unet.add_adapter(config, adapter_name=name)
    unet.set_adapters(["style", "faulty"])
    layer = unet.get_submodule("down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q")
    with torch.no_grad():
        layer.lora_B["faulty"].weight[0, 0] = float("nan")
    try:
        report = watched_run(pipe, tmp_path)
        before = snapshot(unet)
        result = report.why()
        assert_unchanged(before, snapshot(unet))
        assert [a for a in layer.active_adapters] == ["style", "faulty"] and not layer.disable_adapters
    finally:
        unet.delete_adapters(["style", "faulty"])
    assert result.fix == "LoRA 'faulty' off"
    assert {r.factor: r.finite for r in result.replays}["LoRA 'style' off"] is False
    assert result.verdict == (
        "smallest fix: disable the LoRA adapter 'faulty' (LoRA 'faulty' off) makes unet finite "
        "(also finite: adapters off)"
    )


class NaNProcessor:
    """An extension's attention processor with a bug: NaN out of every attention."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, **kwargs):
        return torch.full_like(hidden_states, float("nan"))


def test_a_faulty_attention_processor_is_fixed_by_the_default_one(pipe, tmp_path):
    processors = pipe.unet.attn_processors
    pipe.unet.set_attn_processor(NaNProcessor())
    try:
        result = watched_run(pipe, tmp_path).why()
    finally:
        pipe.unet.set_attn_processor(processors)
    assert result.fix == "default attention processor"
    assert (
        result.verdict
        == "smallest fix: use diffusers' AttnProcessor2_0 (default attention processor) makes unet finite"
    )


@pytest.mark.skipif(not HAS_ATTENTION_BACKENDS, reason="this diffusers has no attention backends")
def test_a_fault_of_the_attention_backend_set_on_the_model_is_fixed_by_the_native_one(tmp_path):
    """``transformer.set_attention_backend(...)`` (flash, sage, flex on a GPU; ``_native_math`` here) whose
    kernel makes NaN: the native backend is the fix (before: "no setting fixes it", the SDPA math kernel
    changes nothing under diffusers' dispatch), and the model's processors and the active backend are as
    the user left them."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    from diffusion_debug.testing.flux import FLUX_CALL

    active = _AttentionBackendRegistry._active_backend
    pipe = tiny_pipeline("flux")
    pipe.transformer.set_attention_backend("_native_math")  # also makes it the active backend
    attention = pipe.transformer.get_submodule("transformer_blocks.0.attn")

    def made_by_the_backend(module, args, output):  # what the dispatch of a non-native kernel would make
        backend = module.processor._attention_backend or _AttentionBackendRegistry._active_backend
        if backend == AttentionBackendName.NATIVE:
            return None
        return (torch.full_like(output[0], float("nan")), *output[1:])

    attention.register_forward_hook(made_by_the_backend)
    try:
        dbg = DiffusionModelDebugger(pipe, DebugConfig(level="advanced", output_dir=tmp_path, log_level="error"))
        with dbg:
            pipe(**FLUX_CALL[0](), num_inference_steps=1, generator=torch.Generator().manual_seed(0))
        dbg.close()
        result = dbg.report().why()
        assert (result.baseline.finite, result.fix) == (False, "native attention backend")
        assert result.verdict == (
            "smallest fix: use diffusers' native attention backend (pipe.transformer.set_attention_backend('native')) "
            "(native attention backend) makes transformer finite"
        )
        assert attention.processor._attention_backend == AttentionBackendName._NATIVE_MATH
        assert _AttentionBackendRegistry._active_backend == AttentionBackendName._NATIVE_MATH
    finally:
        _AttentionBackendRegistry.set_active_backend(active)


@pytest.mark.skipif(not HAS_ATTENTION_BACKENDS, reason="this diffusers has no attention backends")
def test_the_native_backend_replay_puts_back_a_processor_without_a_dict_and_sets_only_what_it_can():
    """A processor with ``__slots__`` holds its backend in a slot, not in a ``__dict__``: the replay put it
    back by deleting it (before: the slot emptied, the model's next call an AttributeError). One whose
    backend cannot be set (a class attribute, no slot) is left alone and the replay fails as a row."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    from diffusion_debug.diffusion.replay.factors import _native_attention

    class Slotted:
        __slots__ = ("_attention_backend",)

    class Fixed:
        __slots__ = ()
        _attention_backend = AttentionBackendName.FLEX

    slotted, fixed = Slotted(), Fixed()
    slotted._attention_backend = AttentionBackendName._NATIVE_MATH
    model = torch.nn.Sequential(torch.nn.Linear(1, 1), torch.nn.Linear(1, 1))
    model[0].processor = slotted
    active = _AttentionBackendRegistry._active_backend
    with _native_attention(model):
        assert (slotted._attention_backend, _AttentionBackendRegistry._active_backend) == ("native", "native")
    assert slotted._attention_backend == AttentionBackendName._NATIVE_MATH
    model[1].processor = fixed
    with pytest.raises(AttributeError), _native_attention(model):
        pass
    assert (slotted._attention_backend, fixed._attention_backend) == ("_native_math", "flex")
    assert _AttentionBackendRegistry._active_backend == active


def test_a_nan_weight_is_named_when_no_setting_fixes_it(pipe, tmp_path):
    weight = pipe.unet.get_submodule(INF_MODULE).weight
    kept = weight.detach().clone()
    with torch.no_grad():
        weight[0, 0, 0, 0] = float("nan")
    try:
        result = watched_run(pipe, tmp_path).why()
    finally:
        with torch.no_grad():
            weight.copy_(kept)
    assert result.module == INF_MODULE and result.fix is None and result.weights == INF_MODULE
    assert not any(r.finite for r in result.replays)
    assert result.verdict == f"no setting fixes it: the weights of unet {INF_MODULE} hold NaN/Inf"


def test_a_nan_in_a_torchao_quantized_layer_is_named_on_the_live_pipeline(pipe, tmp_path):
    """torchao's weights have no ``isfinite``: ``why`` raised NotImplementedError on any component they were in."""
    quantization = pytest.importorskip("torchao.quantization")
    name = "mid_block.attentions.0.transformer_blocks.0.ff.net.2"
    parent, _, child = name.rpartition(".")
    kept = pipe.unet.get_submodule(name)
    layer = copy.deepcopy(kept)
    quantization.quantize_(layer, quantization.Int8WeightOnlyConfig())
    with torch.no_grad():
        layer.weight.scale.view(-1)[0] = float("nan")  # a corrupt checkpoint's row scale
    setattr(pipe.unet.get_submodule(parent), child, layer)
    try:
        report = watched_run(pipe, tmp_path)
        result = report.why()
    finally:
        setattr(pipe.unet.get_submodule(parent), child, kept)
    assert (report.headline.component, report.headline.module, report.headline.step) == ("unet", name, 0)
    assert result.module == name and result.weights == name and result.fix is None
    assert result.verdict == (
        f"no setting fixes it: the weights of unet {name} hold NaN/Inf (stored quantized, as Int8Tensor: "
        "check the checkpoint or the quantization that made them)"
    )


def test_a_nan_input_is_named_as_the_inputs_at_fault(pipe, tmp_path):
    sample = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    sample[0, 0, 0, 0] = float("nan")
    context = torch.randn(1, 77, pipe.unet.config.cross_attention_dim, generator=torch.Generator().manual_seed(1))
    bundle = save_bundle(
        tmp_path / "bundle",
        component="unet",
        component_module=pipe.unet,
        call_prefix="",
        args=(sample, torch.tensor(500)),
        kwargs={"encoder_hidden_states": context},
        step=3,
        timestep=500.0,
        module="",
        anomaly_kind="nonfinite",
    )
    result = explain_bundle(bundle, pipe.unet)
    assert result.inputs == ["args.0"] and result.weights is None and result.step == 3
    assert {r.factor: r.finite for r in result.replays} == {
        "SDPA math kernel": False,
        "bfloat16": False,
        "finite inputs": True,
    }
    assert result.verdict == "no setting fixes it: the inputs args.0 of unet hold NaN/Inf (the module is not at fault)"


def test_a_compile_only_fault_is_fixed_by_running_eagerly(tmp_path):
    pipe = tiny_pipeline("sd")

    def compile_only(module, args, output):  # a planted difference: traced into the graph, skipped eagerly
        return output * float("inf") if torch.compiler.is_compiling() else None

    pipe.text_encoder.get_submodule(clip_name("final_layer_norm")).register_forward_hook(compile_only)
    pipe.text_encoder = torch.compile(pipe.text_encoder, backend="aot_eager")
    dbg = DiffusionModelDebugger(pipe, DebugConfig(level="advanced", output_dir=tmp_path, log_level="error"))
    with dbg, torch.no_grad():
        pipe.encode_prompt("a cat", "cpu", 1, False)
    dbg.close()
    result = dbg.report().why()
    assert result.component == "text_encoder" and result.baseline.finite is False
    assert {r.factor: r.finite for r in result.replays} == {
        "SDPA math kernel": False,
        "eager (not compiled)": True,
        # its copy runs eagerly, where the compile-only fault is not: it cannot tell whether bfloat16 fixes the
        # compiled call (compiled, the copy would add graphs to the user's cache), and says so
        "bfloat16": None,
    }
    (bfloat16,) = [r for r in result.replays if r.factor == "bfloat16"]
    assert (bfloat16.note, bfloat16.error) == (UNANSWERED, "")
    assert f"| bfloat16 | unanswered | {bfloat16.max_abs:.4g} / " in result.table()
    assert result.fix == "eager (not compiled)"
    assert result.verdict == (
        "smallest fix: run text_encoder without torch.compile (eager (not compiled)) makes text_encoder finite"
    )


@pytest.mark.skipif(not HAS_LAYERWISE_CASTING, reason="this diffusers has no layerwise casting")
def test_an_fp8_layerwise_casting_fault_live_and_from_the_run_directory(tmp_path, capsys):
    """Live, the fp8 copy is all there is: the weights are named, stored in fp8. From the run
    directory the weights load again in float32 and "layerwise casting off" is the fix."""
    from diffusion_debug.cli import main
    from diffusion_debug.record import dumps

    pipe = tiny_pipeline("sd")
    with torch.no_grad():
        pipe.unet.get_submodule(INF_MODULE).weight[0, 0, 0, 0] = 1e5  # beyond float8_e5m2's 57344: Inf there
    pipe.save_pretrained(tmp_path / "model")
    pipe.unet.enable_layerwise_casting(storage_dtype=torch.float8_e5m2, compute_dtype=torch.float32)
    report = watched_run(pipe, tmp_path / "runs")
    run_dir = report.save(html=False)
    (run_dir / "invocation.json").write_text(dumps({"command": "run", "model": str(tmp_path / "model")}))
    before = snapshot(pipe.unet)
    live = report.why()
    assert_unchanged(before, snapshot(pipe.unet))
    assert live.fix is None and live.weights == INF_MODULE
    assert {r.factor: r.finite for r in live.replays}["layerwise casting off"] is False
    assert live.verdict == (
        f"no setting fixes it: the weights of unet {INF_MODULE} hold NaN/Inf "
        "(stored in float8_e5m2: load them without layerwise casting and check them)"
    )
    capsys.readouterr()
    assert main(["why", str(run_dir)]) == 0
    verdict = "smallest fix: turn off diffusers' layerwise casting hooks (layerwise casting off) makes unet finite"
    printed = capsys.readouterr().out
    assert verdict in printed and "| layerwise casting off | yes |" in printed
    assert verdict in (run_dir / "why.md").read_text()
    assert "<a href='why.md'>why.md</a>" in (run_dir / "report.html").read_text()


@pytest.mark.skipif(not HAS_CACHE_HOOKS, reason="this diffusers has no caching hooks (diffusers.hooks)")
def test_a_fault_only_in_a_cache_is_fixed_by_turning_caching_off(tmp_path):
    from diffusers import FirstBlockCacheConfig

    pipe = tiny_pipeline("flux")
    pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=1e9))  # from step 1 on the tail is cached
    head = vars(pipe.transformer.get_submodule("transformer_blocks.0"))["_diffusers_hook"].hooks
    states = head["fbc_leader_block_hook"].state_manager._state_cache

    def poison_the_cache(pipe, step, timestep, kwargs):  # a cache bug: the tail's saved residual is NaN
        state = states["cond"]
        state.tail_block_residuals = tuple(torch.full_like(t, float("nan")) for t in state.tail_block_residuals)
        return kwargs

    # policy raise: the run stops at the error, before the pipeline clears its cache; the debugger resets
    # it as the call's end would (the next call starts fresh) and keeps what the origin call read for why()
    config = DebugConfig(level="advanced", output_dir=tmp_path, log_level="error", policy="raise")
    dbg = DiffusionModelDebugger(pipe, config)
    with dbg, pytest.raises(DiffusionDebugError):
        pipe(
            "a cat",
            num_inference_steps=3,
            height=32,
            width=32,
            output_type="latent",
            callback_on_step_end=poison_the_cache,
        )
    dbg.close()
    report = dbg.report()
    assert "cond" not in states  # reset: a next call would not read the NaN residual
    result = report.why()
    assert "cond" not in states  # why() replayed from the raised call's caches; the live ones are as they were
    assert (result.component, result.step, result.baseline.finite) == ("transformer", 1, False)
    assert {r.factor: r.finite for r in result.replays}["caching off"] is True
    assert result.fix == "caching off"
    assert result.verdict == "smallest fix: turn off diffusers' caching hooks (caching off) makes transformer finite"
    later = pipe("a cat", num_inference_steps=3, height=32, width=32, output_type="latent").images
    assert torch.isfinite(later).all()  # the next call, after why(), reads no NaN residual of the raised one


@pytest.mark.parametrize(
    ("level", "component", "why"),
    [
        ("basic", "unet", "repro_bundle was off (as at level basic); run it again with repro_bundle on "
         "(level advanced)."),
        ("advanced", "input", "no component call made it (a value passed in, a callback, the scheduler): there is no "
         "call to replay."),
    ],
)  # fmt: skip
def test_why_refuses_in_one_line_a_run_without_a_bundle_and_a_report_without_a_pipeline(
    tmp_path, capsys, level, component, why
):
    from diffusion_debug.cli import main
    from diffusion_debug.core import DebugReport
    from diffusion_debug.record import Anomaly, RunRecord

    record = RunRecord(DebugConfig(level=level, output_dir=str(tmp_path), run_name="clean"), kind="diffusion")
    record.add_anomaly(Anomaly(kind="nonfinite", severity="error", message="NaN", component=component))
    report = DebugReport(record.run_dir, record.summary(), list(record.anomalies), [], record=record)
    report.save(html=False)
    record.close()
    capsys.readouterr()
    assert main(["why", str(record.run_dir)]) == 2
    assert capsys.readouterr().err == (
        f"diffusion-debug why: error: {str(record.run_dir)!r} has no repro bundle of its NaN/Inf at {component}: "
        f"{why}\n"
    )
    with pytest.raises(DiffusionDebugError, match="this report has none to replay"):
        report.why()


def test_why_on_a_training_run_says_it_is_one_not_that_it_had_no_nan(tmp_path, capsys):
    """A user's first reflex on a NaN training run is `why RUN_DIR`: it said "the run had no NaN/Inf
    error to replay" of a run whose headline was a NaN."""
    from diffusion_debug.cli import main
    from diffusion_debug.core import DebugReport
    from diffusion_debug.record import Anomaly, RunRecord

    record = RunRecord(DebugConfig(output_dir=str(tmp_path), run_name="train"), kind="training")
    nan = Anomaly(kind="nonfinite_loss", severity="error", message="NaN", component="model", step=5)
    record.add_anomaly(nan)
    DebugReport(record.run_dir, record.summary(), list(record.anomalies), [], record=record).save(html=False)
    record.close()
    capsys.readouterr()
    assert main(["why", str(record.run_dir)]) == 2
    assert capsys.readouterr().err == (
        f"diffusion-debug why: error: {str(record.run_dir)!r} is a training run (its first NaN/Inf: "
        "nonfinite_loss at model, step 5): why replays a pipeline call; "
        f"`diffusion-debug report {record.run_dir}` shows the training run's causes.\n"
    )


def _vae_decode_bundle(tmp_path, vae, latents, module):
    """The bundle kept of ``vae``'s decode of ``latents`` with a NaN made at ``module``."""
    return save_bundle(
        tmp_path / "bundle",
        component="vae",
        component_module=vae,
        call_prefix="decoder",
        args=(latents,),
        kwargs={},
        step=None,
        timestep=None,
        module=module,
        anomaly_kind="nonfinite",
    )


def test_an_fp16_vae_overflow_is_fixed_by_the_vae_upcast(pipe, tmp_path):
    vae = copy.deepcopy(pipe.vae).to(torch.float16)
    with torch.no_grad():
        vae.decoder.conv_in.weight.mul_(1e5)  # the decoder's first conv overflows fp16
    latents = torch.randn(1, vae.config.latent_channels, 8, 8, generator=torch.Generator().manual_seed(0))
    bundle = _vae_decode_bundle(tmp_path, vae, latents.half(), "decoder.conv_in")
    result = explain_bundle(bundle, vae)
    assert result.module == "decoder.conv_in" and result.fix == "vae upcast (float32)"
    assert result.verdict == (
        "smallest fix: upcast the VAE to float32 for the decode (force_upcast where the pipeline reads it, SDXL's) "
        "(vae upcast (float32)) makes vae finite "
        "(also finite: bfloat16)"
    )


def test_an_fp16_vae_decode_the_pipeline_ran_upcast_is_replayed_in_float32_and_put_back(pipe, tmp_path):
    """SDXL's force_upcast casts the fp16 VAE to float32 for the decode, then back: the kept call's latents
    are float32, the VAE fp16 when why() runs. It is replayed as it ran, in float32 (before: "nothing can
    be concluded: the replay of vae as it was failed (RuntimeError: Input type (float) and bias type
    (c10::Half) ...)"), then put back as it was (its float32 buffers too), on its own storage (before: a
    new one, cast back, so a tensor sharing the weights' storage no longer did)."""
    name = "decoder.up_blocks.0.resnets.0.conv2"
    vae = copy.deepcopy(pipe.vae).to(torch.float16)
    vae.register_buffer("kept_in_float32", torch.ones(1))
    with torch.no_grad():
        vae.get_submodule(name).weight[0, 0, 0, 0] = float("nan")
    before = {n: (t, t.dtype, t.data_ptr()) for n, t in [*vae.named_parameters(), *vae.named_buffers()]}
    shared = vae.decoder.conv_in.weight.detach()  # a state_dict() taken before why() holds such views
    latents = torch.randn(1, vae.config.latent_channels, 8, 8, generator=torch.Generator().manual_seed(0))
    bundle = _vae_decode_bundle(tmp_path, vae, latents, name)
    result = explain_bundle(bundle, vae)
    assert result.baseline.finite is False  # no "vae upcast (float32)" row: it ran in float32
    assert [(r.factor, r.finite) for r in result.replays] == [
        ("SDPA math kernel", False),
        ("bfloat16", False),
        ("finite inputs", False),
    ]
    assert result.verdict == f"no setting fixes it: the weights of vae {name} hold NaN/Inf"
    after = {n: (t, t.dtype, t.data_ptr()) for n, t in [*vae.named_parameters(), *vae.named_buffers()]}
    assert after == before
    with torch.no_grad():
        vae.decoder.conv_in.weight[0, 0, 0, 0] = 7.0
    assert shared[0, 0, 0, 0].item() == 7.0
    assert vae.kept_in_float32.dtype == torch.float32 and vae.dtype == torch.float16


def test_weights_stored_in_float8_e4m3fn_are_named():
    # torch has no isfinite for float8_e4m3fn, diffusers' usual storage dtype for layerwise casting
    from diffusion_debug.diffusion.replay.why import module_with_nonfinite_weights

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    with torch.no_grad():
        model[1].weight[0, 0] = float("nan")
    model.to(torch.float8_e4m3fn)
    assert module_with_nonfinite_weights(model) == "1"
    assert module_with_nonfinite_weights(torch.nn.Linear(2, 2).to(torch.float8_e4m3fn)) is None


def test_a_failed_replay_as_it_was_names_no_fix():
    # an fp16 module given a float32 input raises: a copy in float32 runs finite, but that is no fix
    # of a fault the replay never reproduced
    from diffusion_debug.diffusion.replay.factors import OriginCall
    from diffusion_debug.diffusion.replay.why import explain

    module = torch.nn.Sequential(torch.nn.Linear(4, 4)).half()
    result = explain(OriginCall("unet", module, "", (torch.ones(1, 4),), {}))
    assert result.baseline.finite is None and "same dtype" in result.baseline.error
    assert {r.factor: r.finite for r in result.replays}["float32"] is True
    assert result.fix is None
    assert result.verdict == (
        f"nothing can be concluded: the replay of unet as it was failed ({result.baseline.error}), "
        "so no change can be judged against it"
    )
