"""Wherever the API takes "a number", a number of any numpy or Python numeric type is one (issue 24):
``monitor_training_step(np.float32(x))`` raised TypeError while ``np.float64`` passed, a numpy
timestep or guidance scale was silently dropped, a numpy config value was refused."""

from __future__ import annotations

import decimal
import fractions
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from diffusion_debug import DebugConfig, DiffusionModelDebugger, TrainingDebugger
from diffusion_debug.diffusion.guidance import cfg_batch
from diffusion_debug.diffusion.origins import stored_guidance
from diffusion_debug.errors import ConfigError
from diffusion_debug.testing import tiny_pipeline

LOSSES = [
    np.float32(0.75),
    np.float16(0.5),
    np.float64(0.25),
    np.int64(2),
    np.int8(3),
    fractions.Fraction(3, 8),
    decimal.Decimal("0.125"),
    1.5,
    4,
]


@pytest.mark.parametrize("loss", LOSSES, ids=lambda v: type(v).__name__)
def test_a_loss_of_any_numeric_type_is_recorded_as_its_value(tmp_path, loss):
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    debugger = TrainingDebugger(model, config=DebugConfig(output_dir=str(tmp_path)))
    try:
        model(torch.ones(4, 2)).pow(2).mean().backward()
        info = debugger.monitor_training_step(
            loss, optimizer=optimizer, step=np.int64(7), max_grad_norm=np.float32(1e6), batch_size=np.int32(4)
        )
        assert info["loss"] == float(loss) and info["step"] == 7
        assert debugger.report().steps[-1]["loss"] == float(loss)
    finally:
        debugger.close()


def test_a_loss_that_is_no_number_is_still_refused(tmp_path):
    debugger = TrainingDebugger(torch.nn.Linear(2, 1), config=DebugConfig(output_dir=str(tmp_path)))
    try:
        with pytest.raises(TypeError, match=r"needs the loss \(a tensor or a number\), not str"):
            debugger.monitor_training_step("0.5")
    finally:
        debugger.close()


def test_numpy_numbers_in_a_config_are_stored_as_plain_numbers():
    config = DebugConfig(
        grad_explosion_threshold=np.float32(250.0),
        overflow_fraction=np.float64(0.5),
        history_size=np.int64(40),
        max_debug_iterations=np.uint16(9),
        serve_port=np.int32(0),
        loss_spike_threshold=fractions.Fraction(9, 2),
    )
    values = {
        key: getattr(config, key)
        for key in (
            "grad_explosion_threshold",
            "overflow_fraction",
            "history_size",
            "max_debug_iterations",
            "serve_port",
            "loss_spike_threshold",
        )
    }
    assert values == {
        "grad_explosion_threshold": 250.0,
        "overflow_fraction": 0.5,
        "history_size": 40,
        "max_debug_iterations": 9,
        "serve_port": 0,
        "loss_spike_threshold": 4.5,
    }
    assert [type(v) for v in values.values()] == [float, float, int, int, int, float]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"grad_explosion_threshold": np.float32("nan")}, "must be a number"),
        ({"history_size": np.float32(4.0)}, "must be an integer >= 1"),
        ({"serve_port": np.int64(70000)}, "must be a port from 0 to 65535 or None"),
        ({"overflow_fraction": np.float16(2.0)}, r"must be in \(0, 1\], not 2.0"),
    ],
)
def test_a_numpy_number_out_of_range_is_still_refused(options, message):
    with pytest.raises(ConfigError, match=message):
        DebugConfig(**options)


def test_a_numpy_timestep_given_by_hand_is_recorded(tmp_path):
    debugger = DiffusionModelDebugger(tiny_pipeline("sd"), DebugConfig(output_dir=str(tmp_path)))
    try:
        latents = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
        for step, timestep in enumerate((np.int64(981), np.float32(500.5), 21)):
            assert debugger.monitor_diffusion_step(step, latents, timestep)["timestep"] == float(timestep)
    finally:
        debugger.close()


def test_a_numpy_guidance_scale_splits_the_batch_as_a_float_does():
    for scale in (7.5, np.float32(7.5), np.float64(7.5), np.int64(5)):
        assert cfg_batch(4, output_batch=4, guidance_scale=scale, guidance_embedded=False) == 2
    assert cfg_batch(4, output_batch=4, guidance_scale=np.float32(1.0), guidance_embedded=False) == 4


def test_a_numpy_guidance_scale_stored_on_the_pipeline_is_read():
    pipe = SimpleNamespace(_guidance_scale=np.float32(7.5), _guidance_rescale=np.float64(0.7))
    assert stored_guidance(pipe, {}) == {"guidance_scale": 7.5, "guidance_rescale": pytest.approx(0.7)}
