"""Session 39's sweep of stacks users run, each watched against an unwatched twin (same seed): a LoRA
hotswapped (``enable_lora_hotswap``, ``load_lora_weights(..., hotswap=True)``) under a UNet compiled in
place (aot_eager); Wan, QwenImage and FLUX.2 [klein] transformers compiled regionally
(``compile_repeated_blocks``, fullgraph) in bf16; QwenImage under FirstBlockCache with group offloading
(leaf- and block-level, on CPU: diffusers' hooks still run), and group-offloaded then compiled;
and a ``callback_on_step_end`` that changes the latents and the guidance scale mid-call, under
``torch.inference_mode`` in fp16, with one debugger reused for two image sizes. Each watched call is
its twin's bit for bit (and, compiled, makes the twin's graphs and graph breaks), the clean run says
nothing it should not, and one fault is named at exactly its component, module and step.

Limits: a forward hook added to a module inside a compiled region after it was compiled is never called
(dynamo skips hook guards on nn modules by default), so a compiled stack's fault is an Inf written into
a module's weight by the call's own ``callback_on_step_end`` (a compiled graph reads weights as inputs:
no recompile), named from the next step on. ``enable_sequential_cpu_offload(device="cpu")`` is not here:
on this stack (accelerate 1.16, torch 2.13) the unwatched pipeline raises in accelerate's
``set_module_tensor_to_device`` (a ``TypeError`` from ``Parameter.__new__``), so there is nothing to
watch; ``enable_model_cpu_offload`` is swept in ``test_fp16_user_stacks.py``.
"""

from __future__ import annotations

import diffusers
import pytest
import torch
from diffusion_helpers import assert_watched_unchanged_and_fault_named, dynamo_counts

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.testing import plant_nonfinite, tiny_pipeline
from diffusion_debug.testing.features import HAS_CACHE_HOOKS, HAS_GROUP_OFFLOAD, HAS_REPEATED_BLOCKS, kind_missing

CPU = torch.device("cpu")
SD_ATTENTION = "down_blocks.1.attentions.0.transformer_blocks.0.attn1"
TOLD_SD = ("scheduler_config",)  # 3 steps spaced "leading": the first at t=667 of 1000


def generator():
    return torch.Generator().manual_seed(0)


def faulted_at(component: str, module: str, step: int):
    """A ``callback_on_step_end`` that writes an Inf into ``module``'s first weight as ``step - 1`` ends,
    so that the denoiser's call of ``step`` is the first to read it (the weight is put back by
    :func:`weight_restored`)."""

    def callback(pipe, index, timestep, kwargs):
        if index == step - 1:
            weight = getattr(pipe, component).get_submodule(module).weight
            with torch.no_grad():
                weight.view(-1)[:1].fill_(float("inf"))
        return {}

    return callback


def weight_restored(pipe, component: str, module: str, call):
    weight = getattr(pipe, component).get_submodule(module).weight
    saved = weight.detach().clone()
    try:
        return call()
    finally:
        with torch.no_grad():
            weight.copy_(saved)


def counted(call, pipe):
    before = dynamo_counts()
    image = call(pipe)
    return image, tuple(after - was for after, was in zip(dynamo_counts(), before))


def assert_compiled_watched_unchanged_and_weight_fault_named(tmp_path, build, calls, component, module, step, told=()):
    """``calls`` (each a ``call(pipe, **extra)``, which may change the pipeline first) on an unwatched twin
    and on a pipeline under one attach, then its last call detached: each image bitwise the twin's with the
    twin's graph breaks and graphs made, only ``told`` reported; then, attached again, the last call with an
    Inf written into ``module``'s weight as step ``step - 1`` ends: named as the one error, ``nonfinite`` at
    ``component``, ``module`` and ``step``, with no graph made and no graph break."""
    torch._dynamo.reset()
    twin = build()
    expected = [counted(call, twin) for call in calls] + [counted(calls[-1], twin)]
    torch._dynamo.reset()
    pipe = build()
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    with dbg:
        seen = [counted(call, pipe) for call in calls]
    seen.append(counted(calls[-1], pipe))  # detached
    for (image, graphs), (twins, twin_graphs) in zip(seen, expected):
        torch.testing.assert_close(image, twins, rtol=0, atol=0)
        assert graphs == twin_graphs
    assert [(a.kind, a.component, a.module, a.step) for a in dbg.report().anomalies] == [
        (kind, "", "", None) for kind in told
    ]
    callback = faulted_at(component, module, step)
    with dbg:
        _, graphs = weight_restored(
            pipe, component, module, lambda: counted(lambda p: calls[-1](p, callback_on_step_end=callback), pipe)
        )
    assert graphs == (0, 0)
    errors = [a for a in dbg.report().anomalies if a.severity == "error"]
    assert [(a.kind, a.component, a.module, a.step) for a in errors] == [("nonfinite", component, module, step)]
    dbg.close()


def call_sd(pipe, **extra):
    return pipe("a cat", num_inference_steps=3, generator=generator(), output_type="pt", **extra).images


def saved_adapter(folder, seed: int, rank: int) -> str:
    """A LoRA of ``rank`` on a tiny SD UNet's attention projections (random A and B), written by
    ``save_lora_weights`` to ``folder``, which is returned."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    pipe = tiny_pipeline("sd")
    torch.manual_seed(seed)
    targets = ["to_q", "to_k", "to_v", "to_out.0"]
    config = LoraConfig(r=rank, lora_alpha=rank, target_modules=targets, init_lora_weights=False)
    pipe.unet.add_adapter(config)
    type(pipe).save_lora_weights(str(folder), unet_lora_layers=get_peft_model_state_dict(pipe.unet))
    return str(folder)


@pytest.mark.skipif(not hasattr(diffusers.StableDiffusionPipeline, "enable_lora_hotswap"), reason="no LoRA hotswap")
def test_a_lora_hotswapped_twice_under_a_compiled_fp16_unet_adds_no_graph_and_its_inf_weight_is_named(tmp_path):
    """``enable_lora_hotswap(target_rank=8)``, a rank-4 adapter loaded, the UNet compiled (aot_eager), then
    a rank-2 and a rank-8 adapter hotswapped into it between calls: the twin makes one graph in all (the
    swaps copy into the padded weights), the watched pipeline the same, bitwise the same images; an Inf in
    the swapped adapter's ``lora_B`` from step 1 is named there."""
    pytest.importorskip("peft")
    adapters = [
        saved_adapter(tmp_path / name, seed, rank) for name, seed, rank in (("a", 3, 4), ("b", 4, 2), ("c", 5, 8))
    ]

    def build():
        pipe = tiny_pipeline("sd", dtype=torch.float16)
        pipe.set_progress_bar_config(disable=True)
        pipe.enable_lora_hotswap(target_rank=8)
        pipe.load_lora_weights(adapters[0], adapter_name="style")
        pipe.unet.compile(backend="aot_eager")
        return pipe

    def swapped_to(adapter):
        def call(pipe, **extra):
            if not extra:  # the fault's call runs on the last adapter as it is
                pipe.load_lora_weights(adapter, adapter_name="style", hotswap=True)
            return call_sd(pipe, **extra)

        return call

    calls = [call_sd, swapped_to(adapters[1]), swapped_to(adapters[2])]
    module = f"{SD_ATTENTION}.to_out.0.lora_B.style"
    assert_compiled_watched_unchanged_and_weight_fault_named(tmp_path, build, calls, "unet", module, 1, told=TOLD_SD)


def call_wan(pipe, **extra):  # CFG as two transformer calls a step
    features = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1)).to(pipe.transformer.dtype)
    kwargs = dict(prompt_embeds=features[:1], negative_prompt_embeds=features[1:], height=16, width=16, num_frames=5)
    return pipe(None, num_inference_steps=3, generator=generator(), output_type="pt", **kwargs, **extra).frames


def call_qwenimage(pipe, **extra):
    from diffusion_debug.testing.qwenimage import QWENIMAGE_CALL

    return pipe(num_inference_steps=3, generator=generator(), **QWENIMAGE_CALL[0](), **extra).images


def call_flux2_klein(pipe, **extra):
    from diffusion_debug.testing.zoo_recent import ZOO_CALLS

    kwargs = ZOO_CALLS["flux2_klein"][0]()
    return pipe(num_inference_steps=3, generator=generator(), output_type="pt", **kwargs, **extra).images


def wan(dtype):
    from diffusion_debug.testing.zoo_video_audio import WAN_TRANSFORMER, wan_vae

    torch.manual_seed(0)
    transformer = diffusers.WanTransformer3DModel(**WAN_TRANSFORMER).to(dtype).eval()
    torch.manual_seed(0)
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0)
    vae = wan_vae().to(dtype).eval()
    return diffusers.WanPipeline(
        transformer=transformer, vae=vae, text_encoder=None, tokenizer=None, scheduler=scheduler
    )


REGIONAL = {  # case -> (builder, call, the module given an Inf weight, the step it is named at)
    "wan": (wan, call_wan, "blocks.1.attn1.to_out.0", 2),
    "qwenimage": (
        lambda dtype: tiny_pipeline("qwenimage", dtype=dtype),
        call_qwenimage,
        "transformer_blocks.1.attn.to_out.0",
        1,
    ),
    "flux2_klein": (
        lambda dtype: tiny_pipeline("flux2_klein", dtype=dtype),
        call_flux2_klein,
        "single_transformer_blocks.0.attn.to_out",
        2,
    ),
}


@pytest.mark.skipif(not HAS_REPEATED_BLOCKS, reason="this diffusers has no compile_repeated_blocks")
@pytest.mark.parametrize("case", list(REGIONAL))
def test_a_bf16_dit_compiled_regionally_with_fullgraph_adds_no_graph_and_its_inf_weight_is_named(tmp_path, case):
    """Each repeated block compiled in place (aot_eager, fullgraph): the watched calls make the twin's graphs
    and images; an Inf written into an inner projection's weight is named there at the step that first
    reads it."""
    if (case == "wan" and not hasattr(diffusers, "WanPipeline")) or (case != "wan" and kind_missing(case)):
        pytest.skip(f"this diffusers has no {case}")
    make, call, module, step = REGIONAL[case]

    def build():
        pipe = make(torch.bfloat16)
        pipe.set_progress_bar_config(disable=True)
        pipe.transformer.compile_repeated_blocks(backend="aot_eager", fullgraph=True)
        return pipe

    assert_compiled_watched_unchanged_and_weight_fault_named(
        tmp_path, build, [call, call], "transformer", module, step
    )


def qwenimage_cached_and_offloaded(offload_type: str, dtype):
    def build():
        pipe = tiny_pipeline("qwenimage", dtype=dtype)
        pipe.set_progress_bar_config(disable=True)
        pipe.transformer.enable_cache(diffusers.FirstBlockCacheConfig(threshold=0.5))  # steps 1, 2 reuse blocks 1+
        per_group = {"num_blocks_per_group": 1} if offload_type == "block_level" else {}
        pipe.transformer.enable_group_offload(CPU, offload_device=CPU, offload_type=offload_type, **per_group)
        return pipe

    return build


@pytest.mark.skipif(not (HAS_CACHE_HOOKS and HAS_GROUP_OFFLOAD), reason="this diffusers has no cache hooks")
@pytest.mark.parametrize(
    "offload_type, dtype",
    [("leaf_level", torch.float16), ("block_level", torch.bfloat16)],
    ids=["leaf-fp16", "block-bf16"],
)
def test_qwenimage_under_first_block_cache_and_group_offload_is_unchanged_and_a_cached_steps_fault_named(
    tmp_path, offload_type, dtype
):
    """FirstBlockCache (threshold 0.5: blocks 1 on run only in step 0) under group offloading: bitwise the
    twin's, quiet; an Inf in the first block's output projection from step 2 (a step that reuses the
    cached residual) is named there."""
    if kind_missing("qwenimage"):
        pytest.skip("this diffusers has no QwenImage")
    build = qwenimage_cached_and_offloaded(offload_type, dtype)
    module = "transformer_blocks.0.attn.to_out.0"
    assert_watched_unchanged_and_fault_named(tmp_path, build, call_qwenimage, "transformer", module, 2, 2)


@pytest.mark.skipif(not HAS_GROUP_OFFLOAD, reason="this diffusers has no group offloading")
@pytest.mark.parametrize("offload_type", ["block_level", "leaf_level"])
def test_a_group_offloaded_qwenimage_transformer_compiled_adds_no_graph_and_its_inf_weight_is_named(
    tmp_path, offload_type
):
    """Group offloading (diffusers' hooks onload each group) on a bf16 QwenImage transformer, then the
    transformer compiled in place (aot_eager): the watched calls make the twin's graphs and graph breaks and
    its images; an Inf weight is named at its module and step."""
    if kind_missing("qwenimage"):
        pytest.skip("this diffusers has no QwenImage")

    def build():
        pipe = tiny_pipeline("qwenimage", dtype=torch.bfloat16)
        pipe.set_progress_bar_config(disable=True)
        per_group = {"num_blocks_per_group": 1} if offload_type == "block_level" else {}
        pipe.transformer.enable_group_offload(CPU, offload_device=CPU, offload_type=offload_type, **per_group)
        pipe.transformer.compile(backend="aot_eager")
        return pipe

    module = "transformer_blocks.1.attn.to_out.0"
    assert_compiled_watched_unchanged_and_weight_fault_named(
        tmp_path, build, [call_qwenimage, call_qwenimage], "transformer", module, 2
    )


def steered(pipe, index, timestep, kwargs):
    """Lowers the guidance scale (7.5 -> 3.0, still guided) and moves the latents as step 1 ends."""
    if index == 1:
        pipe._guidance_scale = 3.0
        return {"latents": kwargs["latents"] * 0.9 + 0.05}
    return {}


def call_steered(pipe, size: int):
    with torch.inference_mode():
        return pipe(
            "a cat",
            num_inference_steps=3,
            height=size,
            width=size,
            guidance_scale=7.5,
            generator=generator(),
            output_type="pt",
            callback_on_step_end=steered,
            callback_on_step_end_tensor_inputs=["latents"],
        ).images


def test_a_callback_steering_latents_and_guidance_in_fp16_inference_mode_at_two_sizes_of_one_debugger(tmp_path):
    """One debugger attached for a 32 px call, then again for a 48 px call, each under
    ``torch.inference_mode`` with a callback that changes the latents and the guidance scale at step 1:
    both bitwise the twin's, quiet; then a NaN planted from step 2 of a 48 px call (after the steer) is
    named there, and a 32 px call after detach is the twin's."""
    twin = tiny_pipeline("sd", dtype=torch.float16)
    twin.set_progress_bar_config(disable=True)
    expected = [call_steered(twin, 32), call_steered(twin, 48)]
    pipe = tiny_pipeline("sd", dtype=torch.float16)
    pipe.set_progress_bar_config(disable=True)
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    images = []
    for size in (32, 48):
        with dbg:
            images.append(call_steered(pipe, size))
    assert [torch.equal(*pair) for pair in zip(images, expected)] == [True, True]
    assert [(a.kind, a.step) for a in dbg.report().anomalies] == [("scheduler_config", None)]
    module = f"{SD_ATTENTION}.to_out.0"
    with plant_nonfinite(pipe.unet.get_submodule(module), from_call=2, value=float("nan")), dbg:
        call_steered(pipe, 48)
    errors = [a for a in dbg.report().anomalies if a.severity == "error"]
    assert [(a.kind, a.component, a.module, a.step, a.details.get("run")) for a in errors] == [
        ("nonfinite", "unet", module, 2, 3)
    ]
    assert torch.equal(call_steered(pipe, 32), expected[0])
    dbg.close()


@pytest.mark.skipif(not HAS_REPEATED_BLOCKS, reason="this diffusers has no compile_repeated_blocks")
@pytest.mark.xfail(
    strict=True,
    reason="hunt39d: FLUX.2's single-stream block clips float16 to +-65504, so an Inf made inside it leaves the "
    "transformer finite; eager, the block sentinel sees the clipped 65504 and a replay names the producer, but a "
    "compiled block has no sentinel (it would be traced) and the transformer's output is not near max: nothing said",
)
def test_an_fp16_inf_clipped_inside_a_compiled_flux2_klein_block_is_named_at_its_producer(tmp_path):
    """An Inf weight in ``single_transformer_blocks.0.attn.to_out`` of an fp16 FLUX.2 [klein] whose repeated
    blocks are compiled (aot_eager) from step 2: named there, as it is when the blocks run eagerly."""
    if kind_missing("flux2_klein"):
        pytest.skip("this diffusers has no FLUX.2 [klein]")
    module = "single_transformer_blocks.0.attn.to_out"
    pipe = tiny_pipeline("flux2_klein", dtype=torch.float16)
    pipe.set_progress_bar_config(disable=True)
    pipe.transformer.compile_repeated_blocks(backend="aot_eager", fullgraph=True)
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    with dbg:
        image = weight_restored(
            pipe,
            "transformer",
            module,
            lambda: call_flux2_klein(pipe, callback_on_step_end=faulted_at("transformer", module, 2)),
        )
    assert bool(image.isfinite().all())  # the block's clip: the image stays finite
    errors = [a for a in dbg.report().anomalies if a.severity == "error"]
    assert [(a.kind, a.component, a.module, a.step) for a in errors] == [("nonfinite", "transformer", module, 2)]
    dbg.close()
