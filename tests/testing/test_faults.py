"""Tests for diffusion_debug.testing.faults: planted NaN/Inf and overflow."""

from __future__ import annotations

import pytest
import torch

from diffusion_debug.testing import plant_nonfinite, plant_overflow, tiny_pipeline


def _conv() -> torch.nn.Conv2d:
    torch.manual_seed(0)
    return torch.nn.Conv2d(3, 4, kernel_size=3, padding=1)


def test_nonfinite_is_planted_in_a_channels_last_output():
    conv = _conv().to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 5, 5).to(memory_format=torch.channels_last)
    clean = conv(x)
    assert not clean.is_contiguous()  # the layout that view(-1) could not handle
    with plant_nonfinite(conv):
        planted = conv(x)
    assert planted.is_contiguous(memory_format=torch.channels_last)
    assert planted[0, 0, 0, 0].item() == float("inf")
    expected = clean.detach().clone()
    expected[0, 0, 0, 0] = float("inf")
    torch.testing.assert_close(planted, expected, rtol=0, atol=0)


def test_nonfinite_plants_the_first_element_from_the_given_call_until_removed():
    layer = torch.nn.Linear(3, 2)
    x = torch.ones(2, 3)
    clean = layer(x).detach()
    handle = plant_nonfinite(layer, from_call=2, value=float("nan"))
    outputs = [layer(x).detach() for _ in range(3)]
    handle.remove()
    after = layer(x).detach()
    torch.testing.assert_close(outputs[0], clean, rtol=0, atol=0)
    torch.testing.assert_close(outputs[1], clean, rtol=0, atol=0)
    assert outputs[2][0, 0].isnan() and outputs[2].isnan().sum().item() == 1
    torch.testing.assert_close(outputs[2][1], clean[1], rtol=0, atol=0)
    torch.testing.assert_close(after, clean, rtol=0, atol=0)


def test_nonfinite_is_planted_in_a_tuples_first_tensor_and_the_rest_kept():
    class Pair(torch.nn.Module):
        def forward(self, x):
            return None, x, x + 1

    module = Pair()
    with plant_nonfinite(module):
        output = module(torch.zeros(2))
    assert type(output) is tuple and output[0] is None
    assert output[1].tolist() == [float("inf"), 0.0] and output[2].tolist() == [1.0, 1.0]


def _unet_call(unet) -> dict[str, object]:
    """What the tiny UNet's first down block and its first attention block return, by name."""
    seen: dict[str, object] = {}
    blocks = {"down": unet.down_blocks[0], "attention": unet.down_blocks[0].attentions[0]}
    handles = [m.register_forward_hook(lambda _m, _a, out, n=n: seen.setdefault(n, out)) for n, m in blocks.items()]
    torch.manual_seed(0)
    sample, text = torch.randn(1, 4, 8, 8), torch.randn(1, 3, unet.config.cross_attention_dim)
    with torch.no_grad():
        seen["unet"] = unet(sample, 1, encoder_hidden_states=text).sample
    for handle in handles:
        handle.remove()
    return seen


def test_nonfinite_in_a_unet_down_block_goes_in_its_hidden_states_not_its_residuals():
    """A down block returns ``(hidden_states, residuals)``: the Inf goes in the first, the residuals
    are the clean call's, and the UNet's output is no longer finite."""
    unet = tiny_pipeline("sd").unet
    clean = _unet_call(unet)
    with plant_nonfinite(unet.down_blocks[0]):  # planted first: the test's own hook sees the fault
        planted = _unet_call(unet)
    (hidden, residuals), (clean_hidden, clean_residuals) = planted["down"], clean["down"]
    assert type(residuals) is tuple and len(residuals) == len(clean_residuals) == 2
    for got, want in zip(residuals, clean_residuals):
        assert torch.equal(got, want)
    expected = clean_hidden.clone()
    expected[0, 0, 0, 0] = float("inf")
    assert torch.equal(hidden, expected)
    assert not planted["unet"].isfinite().all() and clean["unet"].isfinite().all()


def test_overflow_in_an_attention_block_called_with_return_dict_false_scales_its_tuple():
    unet = tiny_pipeline("sd").unet
    clean = _unet_call(unet)["attention"]
    with plant_overflow(unet.down_blocks[0].attentions[0], fraction=0.5):
        (planted,) = _unet_call(unet)["attention"]
    (hidden,) = clean
    limit = torch.finfo(torch.float32).max
    assert planted.abs().amax().item() == pytest.approx(0.5 * limit, rel=1e-5)
    torch.testing.assert_close(planted / (0.5 * limit / hidden.abs().amax()), hidden, rtol=1e-5, atol=1e-6)


def test_nonfinite_in_a_diffusers_output_goes_in_its_sample_and_keeps_its_type():
    transformer = tiny_pipeline("sd").unet.down_blocks[0].attentions[0]
    torch.manual_seed(0)
    x, text = torch.randn(1, 32, 4, 4), torch.randn(1, 3, 32)
    with torch.no_grad():
        clean = transformer(x, encoder_hidden_states=text)
        with plant_nonfinite(transformer, value=float("nan")):
            planted = transformer(x, encoder_hidden_states=text)
    assert type(planted) is type(clean) and type(clean).__name__ == "Transformer2DModelOutput"
    assert list(planted.keys()) == ["sample"] and planted[0] is planted.sample
    expected = clean.sample.clone()
    expected[0, 0, 0, 0] = float("nan")
    torch.testing.assert_close(planted.sample, expected, rtol=0, atol=0, equal_nan=True)
    assert planted.sample.isnan().sum().item() == 1


def test_a_module_whose_output_holds_no_tensor_raises_rather_than_plant_nothing():
    class Nothing(torch.nn.Module):
        def forward(self, x):
            return None, None

    module = Nothing()
    with plant_overflow(module, from_call=1), pytest.raises(TypeError) as info:
        assert module(torch.zeros(1)) == (None, None)  # before from_call: not looked at
        module(torch.zeros(1))
    assert str(info.value) == "cannot plant a fault in Nothing: its output, a tuple, holds no tensor"


@pytest.mark.parametrize("fraction", [0.5, 0.8])
def test_overflow_scales_the_abs_max_to_a_fraction_of_the_dtype_max(fraction):
    conv = _conv().half()
    x = torch.randn(1, 3, 6, 6).half()
    clean = conv(x).detach().float()
    with plant_overflow(conv, fraction=fraction):
        planted = conv(x).detach()
    limit = torch.finfo(torch.float16).max
    assert planted.dtype == torch.float16
    assert planted.abs().amax().item() == pytest.approx(fraction * limit, rel=1e-3)
    # a scaling, not a new tensor: every element keeps its ratio to the clean output
    scale = fraction * limit / clean.abs().amax().item()
    torch.testing.assert_close(planted.float(), clean * scale, rtol=2e-3, atol=1e-2 * scale)


def test_overflow_above_one_overflows_to_inf():
    layer = torch.nn.Linear(2, 2).half()
    with plant_overflow(layer, fraction=1.5):
        out = layer(torch.ones(1, 2).half())
    assert out.isinf().any()
