import importlib.util
from pathlib import Path

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


@pytest.fixture
def deepspeed_engine(monkeypatch):
    """``deepspeed_engine(model, stage, config=None)``: ``deepspeed.initialize`` of ``model`` in this
    process, on the CPU (DS_ACCELERATOR=cpu) and the module's gloo group of world size 1
    (``one_rank_group``), ZeRO ``stage``, ``config`` over the base one; with SGD (lr 0.01) unless
    ``config`` has an ``optimizer`` section. The engine and its optimizer. Skips the test, saying why,
    where DeepSpeed does not install or import (``pip install 'diffusion-debug[deepspeed]'``).
    What DeepSpeed changes for the process is put back at the test's end."""

    def initialize(model, stage, config=None):
        if importlib.util.find_spec("deepspeed") is None:
            pytest.skip("deepspeed is not installed (pip install 'diffusion-debug[deepspeed]')")
        monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # chosen at its first use
        monkeypatch.setenv("LOCAL_RANK", "0")  # the engine asks for it; the process group exists already
        try:
            import deepspeed
            from deepspeed.accelerator import get_accelerator
        except Exception as error:
            pytest.skip(f"deepspeed does not import: {error!r}")
        monkeypatch.setattr(deepspeed.ops, "__compatible_ops__", {})  # no shared-memory collectives to build
        # DeepSpeed keeps a clone of the world group for the process: cloned afresh from this module's
        # gloo group (another module's may be gone), the one before put back after the test
        monkeypatch.setattr(deepspeed.utils.groups, "_WORLD_GROUP", None)
        # a ZeRO-3 engine puts deepspeed's zero3_linear_wrap in torch.nn.functional.linear for the process:
        # put back at the test's end, or every later test of the worker runs its linears through it
        monkeypatch.setattr(torch.nn.functional, "linear", torch.nn.functional.linear)
        # BF16_Optimizer logs its memory twice, each after a gc.collect() of the whole session's heap
        monkeypatch.setattr(deepspeed.runtime.bf16_optimizer, "see_memory_usage", lambda *args, **kwargs: None)
        for supported in ("is_bf16_supported", "is_fp16_supported"):  # the CPU's says no
            monkeypatch.setattr(type(get_accelerator()), supported, lambda self: True)
        config = {
            "train_micro_batch_size_per_gpu": 8,
            "zero_optimization": {"stage": stage},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**6,
            **(config or {}),
        }
        if "optimizer" in config:
            engine, optimizer, _, _ = deepspeed.initialize(
                model=model, model_parameters=model.parameters(), config=config
            )
        else:
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
            engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        return engine, optimizer

    return initialize


STALL_JOB = Path(__file__).with_name("stall_job.py")
ROOT = Path(__file__).resolve().parents[2]
EIGHT_TIMEOUT = 300  # seconds for one 8-process launch (8 processes starting on two shared cores take most of it)
SHARED_EIGHT = (
    "nan_rank5",
    "clean_history10",
    "clean",
    "validation",
    "raise_rank1_backward",
    "raise_rank2_save",
    "skip_rank5",
)
"""The scenarios of the 8-process launch that test_multiprocess.py's and test_stalls_multiprocess.py's
tests share: multiprocess_job.py's two, then the stalls' (skip_rank5's stall ends the job, last)."""


@pytest.fixture(scope="session")
def launch_eight():
    """``launch_eight(output_dir, scenarios, processes=8)``: stall_job.py on 8 CPU processes (or
    ``processes``) under ``accelerate launch``; each scenario's stdout lines (prefix removed) and the
    launch's stderr. Both modules that use it are in the xdist group "launches": their jobs run one
    at a time."""
    from diffusion_debug.testing.launch import accelerate_launcher, by_scenario, cpu_launch_env, free_port, run_launch

    def launch(output_dir: Path, scenarios: tuple[str, ...], processes: int = 8) -> tuple[dict[str, str], str]:
        accelerate = accelerate_launcher()
        if accelerate is None:
            pytest.skip("the accelerate launcher is not installed")
        cmd = [accelerate, "launch", "--config_file", str(ROOT / "configs" / "accelerate_2cpu.yaml")]
        cmd += ["--num_processes", str(processes), "--main_process_port", str(free_port()), str(STALL_JOB)]
        cmd += [str(output_dir)]
        done = run_launch([*cmd, *scenarios], cpu_launch_env(ROOT), output_dir, EIGHT_TIMEOUT)
        if done.returncode is None:
            pytest.fail(
                f"the {processes}-process job {scenarios!r} hung:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            )
        return by_scenario(done.stdout, scenarios), done.stderr

    return launch


@pytest.fixture(scope="session")
def shared_eight(launch_eight, tmp_path_factory):
    """The shared 8-process launch (:data:`SHARED_EIGHT`): its output directory, each scenario's
    stdout lines and the launch's stderr. One launch less: each of 8 processes starting costs
    ~3 CPU-s (torch, accelerate, DDP's first use) on two shared cores."""
    output_dir = tmp_path_factory.mktemp("eight")
    stdout, stderr = launch_eight(output_dir, SHARED_EIGHT)
    return output_dir, stdout, stderr


@pytest.fixture(scope="session")
def gan_loop():
    """``run(config, *, lr_d=1e-2, lr_g=1e-2, iterations=8, critic=1, d_every=1, d_stepped=None, schedule_d=None,
    schedule_g=None, clear=False, clear_g=False, skip_d=False, d_stops=None, g_starts=None, g_grows_at=None,
    fail_at=None, compiled=False, clear_at=None)``: a GAN's loop on one debugger (``{"generator", "discriminator"}``,
    two small MLPs), each model under its own SGD without momentum, monitored before each optimizer's step with that
    optimizer: the discriminator (critic) ``critic`` times an iteration (an int, or a function of the iteration) at
    the iterations ``it % d_every == 0``, then the generator once; a ``LambdaLR`` of ``schedule_d`` / ``schedule_g``
    stepped once an iteration, after the generator's step. Faults: ``lr_d`` / ``lr_g`` (``d_stops``: the
    discriminator's lr 0 from that iteration; ``g_starts``: the generator's 1e-2 from that one); ``clear``: each
    step's gradients cleared between the monitor and ``step()``, ``clear_g`` the generator's only; ``skip_d``: the
    discriminator's step never runs, ``d_stepped(it)``: only at the iterations it says. Seams: ``g_grows_at``: the
    generator's optimizer holds its first layer only until that iteration, where its last layer is added at lr 1e-2
    (``add_param_group``); ``fail_at``: that monitored step's measurement fails; ``compiled``: each
    ``optimizer.step()`` is ``torch.compile``'d; ``clear_at``: ``clear_debug_history()`` after that iteration.
    Returns the debugger (closed) and each optimizer's monitored steps (``{"d": [...], "g": [...]}``)."""
    from torch.nn.functional import softplus

    from diffusion_debug import TrainingDebugger

    def run(
        config,
        *,
        lr_d=1e-2,
        lr_g=1e-2,
        iterations=8,
        critic=1,
        d_every=1,
        d_stepped=None,
        schedule_d=None,
        schedule_g=None,
        clear=False,
        clear_g=False,
        skip_d=False,
        d_stops=None,
        g_starts=None,
        g_grows_at=None,
        fail_at=None,
        compiled=False,
        clear_at=None,
    ):
        generator, discriminator = gan_models()
        opt_d = torch.optim.SGD(discriminator.parameters(), lr=lr_d)
        opt_g = torch.optim.SGD((generator if g_grows_at is None else generator[0]).parameters(), lr=lr_g)
        schedulers = [
            torch.optim.lr_scheduler.LambdaLR(opt, schedule)
            for opt, schedule in ((opt_d, schedule_d), (opt_g, schedule_g))
            if schedule is not None
        ]
        tdbg = TrainingDebugger({"generator": generator, "discriminator": discriminator}, config=config)
        if fail_at is not None:  # that measurement raises (recorded; the step is judged unmeasured)
            measure, calls = tdbg._steps.measurer.measure, iter(range(10**6))
            planted = RuntimeError("planted")
            tdbg._steps.measurer.measure = lambda *a, **k: (
                (_ for _ in ()).throw(planted) if next(calls) == fail_at else measure(*a, **k)
            )
        step_d, step_g = opt_d.step, opt_g.step
        if compiled:
            torch._dynamo.reset()
            step_d, step_g = (torch.compile(lambda o=o: o.step(), backend="eager") for o in (opt_d, opt_g))
        data = torch.Generator().manual_seed(1)
        step, steps = 0, {"d": [], "g": []}
        for it in range(iterations):
            real, fake = torch.randn(16, 4, generator=data) + 3, generator(torch.randn(16, 4, generator=data))
            if it == d_stops:
                opt_d.param_groups[0]["lr"] = 0.0
            if it == g_starts:
                opt_g.param_groups[0]["lr"] = 1e-2
            if it == g_grows_at:
                opt_g.add_param_group({"params": list(generator[2].parameters()), "lr": 1e-2})
            for _ in range((critic(it) if callable(critic) else critic) if it % d_every == 0 else 0):
                opt_d.zero_grad()
                loss_d = softplus(-discriminator(real)).mean() + softplus(discriminator(fake.detach())).mean()
                loss_d.backward()
                tdbg.monitor_training_step(loss_d, optimizer=opt_d, step=step)
                steps["d"].append(step)
                step += 1
                if clear:
                    opt_d.zero_grad()
                if not skip_d and (d_stepped is None or d_stepped(it)):
                    step_d()
            opt_g.zero_grad()
            loss_g = softplus(-discriminator(fake)).mean()
            loss_g.backward()
            tdbg.monitor_training_step(loss_g, optimizer=opt_g, step=step)
            steps["g"].append(step)
            step += 1
            if clear or clear_g:
                opt_g.zero_grad()
            step_g()
            for scheduler in schedulers:
                scheduler.step()
            if it == clear_at:
                tdbg.clear_debug_history()
        tdbg.close()
        if compiled:
            torch._dynamo.reset()
        return tdbg, steps

    return run


def gan_models():
    """A GAN's generator (4 -> 8 -> 4) and discriminator (4 -> 8 -> 1), seeded: the same at every call."""
    torch.manual_seed(0)
    generator = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    discriminator = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return generator, discriminator
