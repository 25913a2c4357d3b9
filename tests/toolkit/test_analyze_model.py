"""analyze_model and the gradient checks against plain autograd: norms and names computed by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from diffusion_debug import analyze_model, check_gradient_explosion, check_gradient_vanishing
from diffusion_debug.stats import count_host_transfers


@pytest.fixture(scope="module")
def unet_with_grads(sd_pipe):
    import copy

    unet = copy.deepcopy(sd_pipe.unet)
    generator = torch.Generator().manual_seed(0)
    sample = torch.randn(1, unet.config.in_channels, 8, 8, generator=generator)
    context = torch.randn(1, 4, unet.config.cross_attention_dim, generator=generator)
    unet(sample, torch.tensor([500]), context).sample.square().mean().backward()
    return unet


@pytest.fixture(scope="module")
def unet_analysis(unet_with_grads):
    return analyze_model(unet_with_grads)


def _norm(t: torch.Tensor) -> float:
    return math.sqrt(sum(v * v for v in t.detach().double().reshape(-1).tolist()))


def test_parameter_and_module_statistics_match_autograd(unet_with_grads, unet_analysis):
    unet, analysis = unet_with_grads, unet_analysis
    named = dict(unet.named_parameters())
    assert list(analysis.parameters) == list(named)
    for name in ("conv_in.weight", "down_blocks.0.resnets.0.conv1.bias", "up_blocks.1.attentions.0.proj_out.weight"):
        p = analysis.parameters[name]
        assert p.weight.l2 == pytest.approx(_norm(named[name]), rel=1e-5)
        assert p.grad_norm == pytest.approx(_norm(named[name].grad), rel=1e-5)
        assert p.weight.max == pytest.approx(named[name].max().item())
    block = "down_blocks.0"
    grads = [p.grad.reshape(-1) for n, p in named.items() if n.startswith(block + ".") and p.grad is not None]
    module = analysis.modules[block]
    assert module.grad_norm == pytest.approx(_norm(torch.cat(grads)), rel=1e-5)
    assert module.parameters == sum(p.numel() for n, p in named.items() if n.startswith(block + "."))
    assert analysis.modules[""].parameters == sum(p.numel() for p in unet.parameters())


def test_exploding_and_vanishing_names_match_a_naive_reference(unet_with_grads):
    unet = unet_with_grads
    norms = {n: _norm(p.grad) for n, p in unet.named_parameters() if p.grad is not None}
    ordered = sorted(norms.values())
    # thresholds half-way between two norms that float32 and float64 cannot disagree on
    i = next(i for i in range(4, len(ordered)) if ordered[i + 1] > ordered[i] * 1.001)
    j = next(j for j in range(len(ordered) - 5, 0, -1) if ordered[j] > ordered[j - 1] * 1.001)
    low, high = (ordered[i] + ordered[i + 1]) / 2, (ordered[j] + ordered[j - 1]) / 2
    assert check_gradient_explosion(unet, threshold=high) == [n for n, v in norms.items() if v > high]
    assert check_gradient_vanishing(unet, threshold=low) == [n for n, v in norms.items() if v < low]
    assert len(check_gradient_explosion(unet, threshold=high)) == len(ordered) - j
    assert len(check_gradient_vanishing(unet, threshold=low)) == i + 1


def test_a_nonfinite_gradient_is_named_nonfinite_and_exploding():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    model(torch.ones(2, 3)).sum().backward()
    model[0].bias.grad[1] = float("nan")
    model[1].weight.requires_grad_(False)
    model[1].weight.grad = None
    analysis = analyze_model(model, explosion_threshold=1e9, vanishing_threshold=1e-9)
    assert analysis.nonfinite == ["0.bias"]
    assert analysis.exploding == ["0.bias"]
    assert analysis.parameters["1.weight"].grad is None
    assert analysis.modules["0"].grad_norm == math.inf
    assert check_gradient_explosion(model, threshold=1e9) == ["0.bias"]
    assert check_gradient_vanishing(model, threshold=1e9) == ["0.weight", "1.bias"]


def test_analyze_model_reads_the_host_once_per_device(sd_pipe):
    encoder = sd_pipe.text_encoder
    with count_host_transfers() as reads:
        analysis = analyze_model(encoder)
    assert reads.blocking == ["tolist"]
    assert len(analysis.parameters) == len(list(encoder.parameters())) and not analysis.exploding


def test_analyze_model_to_dict_is_strict_json(unet_with_grads, unet_analysis):
    from diffusion_debug.record import dumps, loads

    data = loads(dumps(unet_analysis.to_dict()))
    assert data["thresholds"] == {"explosion": 10.0, "vanishing": 1e-6}
    conv_in = unet_with_grads.conv_in
    assert data["modules"]["conv_in"]["parameters"] == conv_in.weight.numel() + conv_in.bias.numel()


@pytest.mark.parametrize("threshold", ["10", None, float("nan"), -1.0, True])
def test_a_bad_threshold_is_refused_before_any_work(threshold):
    model = torch.nn.Linear(2, 1)  # no gradients: a bad threshold used to pass silently here
    with pytest.raises(ValueError, match=f"^explosion_threshold must be a number >= 0, not {threshold!r}.$"):
        analyze_model(model, explosion_threshold=threshold)
    with pytest.raises(ValueError, match="^vanishing_threshold must be a number >= 0"):
        check_gradient_vanishing(model, threshold)
    assert check_gradient_explosion(model, np.float32(3.0)) == []
