import pytest
import torch


@pytest.fixture
def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


@pytest.fixture
def fresh_accelerate_state():
    """Accelerate keeps process-wide singletons; each test that builds an Accelerator starts clean."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture(scope="session")
def _tiny_sd():
    """The tiny SD pipeline, built once: its UNet and CLIP text encoder are copied by the tests that train them."""
    from diffusion_debug.testing import tiny_pipeline

    return tiny_pipeline("sd")


@pytest.fixture(scope="session")
def _tiny_unet(_tiny_sd):
    return _tiny_sd.unet


@pytest.fixture(scope="session")
def unet_loop(_tiny_unet):
    """``run(config, steps, lr=1e-4, plant=None, after_step=None, unet=None, before_step=None,
    optimizer=None)``: a plain AdamW loop on one fixed batch of a fresh copy of the tiny SD UNet
    (``unet=`` another model; ``optimizer(unet)`` builds another optimizer); ``plant(step, unet,
    optimizer)`` runs after backward, before monitoring, ``before_step(step, unet, optimizer)``
    after monitoring, before ``optimizer.step()``, ``after_step(step, unet, optimizer)`` after it.
    Returns the debugger (closed) and the loss of every step."""
    import copy

    from diffusion_debug import TrainingDebugger

    def run(config, steps, *, lr=1e-4, plant=None, after_step=None, unet=None, before_step=None, optimizer=None):
        unet = (unet if unet is not None else copy.deepcopy(_tiny_unet)).train()
        if optimizer is not None:
            optimizer = optimizer(unet)
        else:
            optimizer = torch.optim.AdamW([p for p in unet.parameters() if p.requires_grad], lr=lr)
        tdbg = TrainingDebugger(unet, config=config)
        generator = torch.Generator().manual_seed(0)
        sample = torch.randn(1, unet.config.in_channels, 8, 8, generator=generator)
        context = torch.randn(1, 4, unet.config.cross_attention_dim, generator=generator)
        noise = torch.randn(sample.shape, generator=generator)
        timesteps = torch.tensor([500])
        losses = []
        for step in range(steps):
            loss = ((unet(sample, timesteps, context).sample - noise) ** 2).mean()
            loss.backward()
            if plant is not None:
                plant(step, unet, optimizer)
            tdbg.monitor_training_step(loss, optimizer=optimizer, step=step, timesteps=timesteps)
            if before_step is not None:
                before_step(step, unet, optimizer)
            optimizer.step()
            optimizer.zero_grad()
            if after_step is not None:
                after_step(step, unet, optimizer)
            losses.append(loss.item())
        tdbg.close()
        return tdbg, losses

    return run
