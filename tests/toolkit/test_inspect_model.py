"""inspect_model on a UNet, a VAE, a CLIP text encoder and a transformer: a planted NaN/Inf is named
at its exact module, the statistics match what the module returned, and nothing is left behind."""

from __future__ import annotations

import math

import pytest
import torch

from diffusion_debug import inspect_model
from diffusion_debug.record import loads
from diffusion_debug.testing import plant_nonfinite, plant_overflow
from diffusion_debug.testing.features import clip_name


@pytest.fixture(scope="module")
def models(sd_pipe):
    from diffusers import SD3Transformer2DModel

    pipe = sd_pipe
    torch.manual_seed(0)
    transformer = SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=32,
        caption_projection_dim=16,
        pooled_projection_dim=32,
        pos_embed_max_size=8,
    )
    g = torch.Generator().manual_seed(0)
    latents, context = torch.randn(1, 4, 8, 8, generator=g), torch.randn(1, 4, 32, generator=g)
    return {
        "unet": (pipe.unet, (latents, torch.tensor([500]), context), "down_blocks.1.resnets.0.conv2"),
        "vae": (pipe.vae, (torch.randn(1, 3, 16, 16, generator=g),), "decoder.up_blocks.0.resnets.0.conv1"),
        "text_encoder": (
            pipe.text_encoder,
            (pipe.tokenizer("a cat", return_tensors="pt").input_ids,),
            clip_name("encoder.layers.1.mlp.fc1"),
        ),
        "transformer": (
            transformer,
            (latents,),
            "transformer_blocks.0.attn.to_out.0",
            {
                "encoder_hidden_states": context,
                "pooled_projections": torch.randn(1, 32, generator=g),
                "timestep": torch.tensor([500]),
            },
        ),
    }


def _call(entry):
    model, args, _, *kwargs = entry
    return model, args, (kwargs[0] if kwargs else {})


def _first_tensor(output):
    if isinstance(output, torch.Tensor):
        return output
    return output[0] if isinstance(output, tuple) else next(iter(output.values()))


@pytest.mark.parametrize("name", ["unet", "vae", "text_encoder", "transformer"])
def test_a_planted_nonfinite_is_named_at_its_module_and_nothing_changes(models, name):
    model, args, kwargs = _call(models[name])
    planted = models[name][2]
    with torch.no_grad():
        before = _first_tensor(model(*args, **kwargs)).clone()
    rng = torch.get_rng_state()
    with plant_nonfinite(model.get_submodule(planted)):
        found = inspect_model(model, *args, **kwargs)
    assert found.first_nonfinite == planted
    assert found.first_near_overflow is None
    row = next(r for r in found.rows if r.module == planted)
    assert row.stats.posinf == 1
    assert found.rows[-1].module == "" and found.model == type(model).__name__
    # nothing left behind: the RNG, the hooks, the output
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    with torch.no_grad():
        assert torch.equal(_first_tensor(model(*args, **kwargs)), before)


def test_statistics_match_the_outputs_seen_by_a_plain_hook(models):
    model, args, kwargs = _call(models["unet"])
    names = ["conv_in", "down_blocks.0.resnets.0", "mid_block.attentions.0.proj_out", "conv_out"]
    seen, order = {}, []

    def hook(module, args, out, name):
        order.append(name)
        if name in names:
            seen[name] = out.detach().clone()

    handles = [m.register_forward_hook(lambda m, a, out, n=n: hook(m, a, out, n)) for n, m in model.named_modules()]
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    found = inspect_model(model, *args, **kwargs)
    assert [r.module for r in found.rows] == order  # every module call, in the order calls finished
    rows = {r.module: r for r in found.rows}
    for n in names:
        values = seen[n].double().reshape(-1).tolist()
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
        s = rows[n].stats
        assert rows[n].shape == tuple(seen[n].shape)
        assert (s.min, s.max) == (min(values), max(values))
        assert s.mean == pytest.approx(mean, rel=1e-5, abs=1e-7)
        assert s.std == pytest.approx(std, rel=1e-5)


def test_near_overflow_is_named_in_fp16(models):
    import copy

    model, args, kwargs = _call(models["text_encoder"])
    model = copy.deepcopy(model).half()
    planted = clip_name("encoder.layers.0.mlp.fc2")
    with plant_overflow(model.get_submodule(planted), fraction=0.8):
        found = inspect_model(model, *args, **kwargs)
    assert (found.first_near_overflow, found.first_nonfinite) == (planted, None)
    row = next(r for r in found.rows if r.module == planted)
    assert row.stats.dtype == "float16"
    assert row.stats.dtype_max_fraction == pytest.approx(0.8, rel=1e-3)
    assert str(found).splitlines()[0] == (
        f"CLIPTextModel: {len(found.rows)} module calls; first near its dtype's maximum: {planted}"
    )


def test_table_and_json(models):
    model, args, kwargs = _call(models["vae"])
    with plant_nonfinite(model.get_submodule("decoder.conv_out"), value=float("nan")):
        found = inspect_model(model, *args, **kwargs)
    data = loads(found.to_json())
    assert data["first_nonfinite"] == "decoder.conv_out"
    conv_out = next(m for m in data["modules"] if m["module"] == "decoder.conv_out")
    assert conv_out["stats"]["nan"] == 1 and conv_out["type"] == "Conv2d"
    lines = found.table().splitlines()
    assert lines[0].split() == ["module", "type", "shape", "dtype", "min", "max", "mean", "std", "nonfinite", "range"]
    assert len(lines) == 2 + len(found.rows)
    assert lines[-1].split()[:4] == ["(model)", "AutoencoderKL", "[1,", "3,"]
    assert str(found).splitlines()[0] == (
        f"AutoencoderKL: {len(found.rows)} module calls; first NaN/Inf produced by decoder.conv_out"
    )


def test_inspect_model_refuses_what_is_not_a_module():
    with pytest.raises(TypeError, match="inspect_model takes a torch.nn.Module first, not Tensor"):
        inspect_model(torch.ones(2))


def test_a_model_in_training_mode_keeps_its_running_statistics():
    # BatchNorm in training mode updates its buffers in place on every call: inspecting must not
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3)).train()
    model(torch.randn(8, 3))  # statistics that are not the initial ones
    before = {k: v.clone() for k, v in model.state_dict().items()}
    inspect_model(model, torch.randn(8, 3) * 5)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert int(model[1].num_batches_tracked) == 1
