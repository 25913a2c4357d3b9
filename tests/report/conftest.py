"""Real run directories for the report tests, made once per session by the real debuggers."""

import math

import pytest
import torch
from report_page import LR_SPIKE_STEP, NAN_GRAD_STEP, PLANTED_MODULE, PLANTED_STEP

from diffusion_debug import DebugConfig, DiffusionModelDebugger, TrainingDebugger
from diffusion_debug.testing import plant_nonfinite, tiny_pipeline


@pytest.fixture(scope="session")
def inference_run_dir(tmp_path_factory):
    """A tiny SD run whose UNet block produces Inf from denoising step 2 on."""
    pipe = tiny_pipeline("sd")
    handle = plant_nonfinite(pipe.unet.get_submodule(PLANTED_MODULE), from_call=PLANTED_STEP)
    debugger = DiffusionModelDebugger(
        pipe, DebugConfig(output_dir=str(tmp_path_factory.mktemp("inference")), run_name="planted-inf")
    )
    try:
        with debugger:
            pipe("a photo of a cat", num_inference_steps=4, generator=torch.Generator().manual_seed(0))
    finally:
        handle.remove()
    return debugger.report().save()


class _TinyDenoiser(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.Linear(8, 32)
        self.middle = torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, 8)

    def forward(self, x):
        return self.head(torch.relu(self.middle(torch.relu(self.encoder(x)))))


@pytest.fixture(scope="session")
def training_run_dir(tmp_path_factory):
    """14 steps of a small denoiser: a learning-rate spike at step 5 and a NaN gradient in
    ``encoder.weight`` at step 8 (that optimizer step is skipped, as a GradScaler would)."""
    torch.manual_seed(0)
    model = _TinyDenoiser()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    config = DebugConfig(output_dir=str(tmp_path_factory.mktemp("training")), run_name="planted-nan-grad")
    debugger = TrainingDebugger(model, config=config)
    for step in range(14):
        for group in optimizer.param_groups:
            group["lr"] = 5.0 if step == LR_SPIKE_STEP else 0.05
        x = torch.randn(16, 8)
        timesteps = torch.randint(0, 1000, (16,))
        noise = torch.randn(16, 8)
        loss = torch.nn.functional.mse_loss(model(x + noise * timesteps[:, None] / 1000), noise)
        loss.backward()
        if step == NAN_GRAD_STEP:
            model.encoder.weight.grad[0, 0] = math.nan
        debugger.monitor_training_step(loss, optimizer=optimizer, step=step, timesteps=timesteps)
        if step != NAN_GRAD_STEP:
            optimizer.step()
        optimizer.zero_grad()
    return debugger.report().save()
