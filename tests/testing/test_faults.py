"""Tests for diffusion_debug.testing.faults: planted NaN/Inf and overflow."""

from __future__ import annotations

import pytest
import torch

from diffusion_debug.testing import plant_nonfinite, plant_overflow


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


def test_nonfinite_leaves_a_tuple_output_alone():
    class Pair(torch.nn.Module):
        def forward(self, x):
            return x, x + 1

    module = Pair()
    with plant_nonfinite(module):
        first, second = module(torch.zeros(2))
    assert torch.equal(first, torch.zeros(2)) and torch.equal(second, torch.ones(2))


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
