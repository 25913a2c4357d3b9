"""Fine-tuning stacks beyond ``test_user_training_stacks``, each trained twice on a fresh copy of the
tiny SD UNet (or SD3 transformer), with and without the debugger: the losses and the final weights
are bitwise the same, the steps before the planted fault are quiet (no warning or error, no
``debugger_error``), and the fault is the first error, named at its origin (kind, module, step).
Stacks: a GradScaler (fp16 autocast on the CPU) whose loss is inf at a known step (the scaler skips
it); gradient checkpointing (non-reentrant) with a weight written inf between steps; SD3 flow
matching with timesteps drawn by ``compute_density_for_timestep_sampling`` and the SD3 loss
weighting; PEFT LoRA with its default (zero ``lora_B``) init, a NaN planted in one ``lora_B``'s
gradient."""

import copy
import math

import torch

from diffusion_debug import DebugConfig, TrainingDebugger
from diffusion_debug.record import severity_rank


def _batch(unet, step):
    generator = torch.Generator().manual_seed(step)
    sample = torch.randn(2, unet.config.in_channels, 8, 8, generator=generator)
    context = torch.randn(2, 4, unet.config.cross_attention_dim, generator=generator)
    noise = torch.randn(sample.shape, generator=generator)
    return sample, torch.tensor([100, 700]), context, noise


def _train(unet, steps, debugger, *, step_loss, scaler=None):
    """A plain AdamW loop; ``step_loss(step, unet)`` the step's loss. Returns the debugger (closed),
    every step's loss and the final weights."""
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-4)
    tdbg = debugger(unet) if debugger is not None else None
    losses = []
    for step in range(steps):
        loss = step_loss(step, unet)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        losses.append(loss.item())
        if tdbg is not None:
            tdbg.monitor_training_step(
                loss, optimizer=optimizer, step=step, timesteps=torch.tensor([100, 700]), scaler=scaler
            )
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad()
    if tdbg is not None:
        tdbg.close()
    return tdbg, losses, {k: v.detach().clone() for k, v in unet.state_dict().items()}


def _twice(tiny_unet, tmp_path, steps, **loop):
    """The stack unwatched then watched (``loop["setup"](unet)`` first, ``loop["scaler"]()`` a fresh
    scaler each run); asserts the runs are bitwise the same. Returns the debugger."""
    runs = []
    for watch in (False, True):
        unet = copy.deepcopy(tiny_unet).train()
        loop.get("setup", lambda unet: None)(unet)
        debugger = (
            (lambda model: TrainingDebugger(model, config=DebugConfig(output_dir=str(tmp_path), log_level="error")))
            if watch
            else None
        )
        scaler = loop["scaler"]() if "scaler" in loop else None
        runs.append(_train(unet, steps, debugger, step_loss=loop["step_loss"], scaler=scaler))
    (_, reference_losses, reference), (tdbg, losses, weights) = runs
    assert [str(x) for x in losses] == [str(x) for x in reference_losses]  # nan and inf compared too
    assert [k for k in reference if not torch.equal(reference[k].nan_to_num(), weights[k].nan_to_num())] == []
    assert [a for a in tdbg.report().anomalies if a.kind == "debugger_error"] == []
    return tdbg


def _serious(tdbg):
    return [a for a in tdbg.report().anomalies if severity_rank(a.severity) >= severity_rank("warning")]


def _mse(step, unet, *, dtype=None, inf_at=None):
    sample, timesteps, context, noise = _batch(unet, step)
    if dtype is None:
        pred = unet(sample, timesteps, context).sample
    else:
        with torch.autocast("cpu", dtype=dtype):
            pred = unet(sample, timesteps, context).sample
    loss = ((pred.float() - noise) ** 2).mean()
    return loss * math.inf if step == inf_at else loss


def test_fp16_grad_scaler_a_step_whose_loss_is_inf_is_named_there_and_skipped(_tiny_unet, tmp_path):
    tdbg = _twice(
        _tiny_unet,
        tmp_path,
        4,
        step_loss=lambda step, unet: _mse(step, unet, dtype=torch.float16, inf_at=2),
        scaler=lambda: torch.amp.GradScaler("cpu", init_scale=2.0**8),
    )
    serious = _serious(tdbg)
    assert [(a.kind, a.module, a.step, a.severity) for a in serious] == [("nonfinite_loss", "", 2, "error")]
    skipped = [a for a in tdbg.report().anomalies if a.kind == "skipped_step"]
    assert [(a.step, a.details["reason"]) for a in skipped] == [(2, "grad_scaler")]


CONV = "down_blocks.1.resnets.0.conv2"


def _checkpointed(unet):
    import functools
    import inspect

    if "gradient_checkpointing_func" in inspect.signature(unet.enable_gradient_checkpointing).parameters:
        unet.enable_gradient_checkpointing(functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False))
    else:  # diffusers before 0.33 (the floor's 0.32) takes no function: its checkpoint is use_reentrant=False
        unet.enable_gradient_checkpointing()
    assert unet.is_gradient_checkpointing


def _inf_weight_at(step, unet, at):
    """The step's loss after an inf written into :data:`CONV`'s weight before the forward of step ``at``
    (code writing the weights between steps): the forward, recomputed by the checkpoint in backward, makes NaN."""
    if step == at:
        with torch.no_grad():
            unet.get_submodule(CONV).weight.view(-1)[0] = math.inf
    return _mse(step, unet)


def test_gradient_checkpointing_a_weight_made_inf_between_steps_is_named_at_its_module(_tiny_unet, tmp_path):
    """Gradient checkpointing (non-reentrant: diffusers' default) recomputes each block's forward in
    backward: the weight written inf after step 1's optimizer step is the first error, named at its
    module and at step 1 (the interval it was written in); the NaN loss and gradients of step 2 follow it."""
    tdbg = _twice(
        _tiny_unet, tmp_path, 3, setup=_checkpointed, step_loss=lambda step, unet: _inf_weight_at(step, unet, 2)
    )
    serious = _serious(tdbg)
    assert [(a.kind, a.module, a.step, a.severity) for a in serious] == [
        ("nonfinite_update", CONV, 1, "error"),
        ("nonfinite_loss", "", 2, "error"),
        ("nonfinite", "conv_in", 2, "error"),
    ]
    assert (
        "it follows the nonfinite_update at model down_blocks.1.resnets.0.conv2.weight, step 1" in serious[1].message
    )


def _flow_matching_loss(transformer, scheduler, generator):
    """train_dreambooth_sd3's loss: timesteps drawn by ``compute_density_for_timestep_sampling``
    (logit-normal, from the global generator), the flow-matching target, the SD3 loss weighting."""
    from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

    config = transformer.config
    latents = torch.randn(2, config.in_channels, 8, 8, generator=generator)
    noise = torch.randn(latents.shape, generator=generator)
    context = torch.randn(2, 5, config.joint_attention_dim, generator=generator)
    pooled = torch.randn(2, config.pooled_projection_dim, generator=generator)
    u = compute_density_for_timestep_sampling(
        weighting_scheme="logit_normal", batch_size=2, logit_mean=0.0, logit_std=1.0
    )
    indices = (u * scheduler.config.num_train_timesteps).long()
    timesteps, sigmas = scheduler.timesteps[indices], scheduler.sigmas[indices].view(-1, 1, 1, 1)
    noisy = (1.0 - sigmas) * latents + sigmas * noise
    pred = transformer(
        hidden_states=noisy,
        timestep=timesteps,
        encoder_hidden_states=context,
        pooled_projections=pooled,
        return_dict=False,
    )[0]
    weighting = compute_loss_weighting_for_sd3(weighting_scheme="logit_normal", sigmas=sigmas)
    per_sample = (weighting * (pred - (noise - latents)) ** 2).reshape(2, -1).mean(1)
    return per_sample, timesteps


def test_sd3_flow_matching_with_density_sampled_timesteps_trains_unchanged_and_quiet(tmp_path):
    """The timesteps (floats from the flow-matching schedule) and the per-sample losses passed to the
    monitor: the run is bitwise as without the debugger, the global generator the density sampling
    draws from is not moved by the monitor, and the clean run is quiet."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from diffusion_debug.testing import tiny_pipeline

    original = tiny_pipeline("sd3").transformer
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000)
    runs = []
    for watch in (False, True):
        transformer = copy.deepcopy(original).train()
        optimizer = torch.optim.AdamW(transformer.parameters(), lr=1e-4)
        config = DebugConfig(output_dir=str(tmp_path), log_level="error")
        tdbg = TrainingDebugger(transformer, config=config, noise_scheduler=scheduler) if watch else None
        torch.manual_seed(0)
        generator, losses = torch.Generator().manual_seed(0), []
        for step in range(4):
            per_sample, timesteps = _flow_matching_loss(transformer, scheduler, generator)
            loss = per_sample.mean()
            loss.backward()
            losses.append(loss.item())
            if tdbg is not None:
                state = torch.get_rng_state()
                tdbg.monitor_training_step(
                    loss, optimizer=optimizer, step=step, timesteps=timesteps, per_sample_loss=per_sample.detach()
                )
                assert torch.equal(state, torch.get_rng_state())
            optimizer.step()
            optimizer.zero_grad()
        runs.append((tdbg, losses, {k: v.detach().clone() for k, v in transformer.state_dict().items()}))
    (_, reference_losses, reference), (tdbg, losses, weights) = runs
    tdbg.close()
    assert [str(x) for x in losses] == [str(x) for x in reference_losses]
    assert [k for k in reference if not torch.equal(reference[k], weights[k])] == []
    anomalies = tdbg.report().anomalies
    assert [
        (a.kind, a.severity, a.step) for a in anomalies if severity_rank(a.severity) >= severity_rank("warning")
    ] == []
    assert [a for a in anomalies if a.kind == "debugger_error"] == []
    assert tdbg.get_summary()["total_steps"] == 4


LORA_B = "mid_block.attentions.0.transformer_blocks.0.attn1.to_q.lora_B.default"


def _lora(unet):
    """PEFT's default init (``lora_B`` zero: ``lora_A``'s gradients are exactly zero at step 0), only the
    adapter trainable, cast to float32 as diffusers' LoRA scripts do."""
    from diffusers.training_utils import cast_training_params
    from peft import LoraConfig

    unet.requires_grad_(False)
    torch.manual_seed(0)
    unet.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_k", "to_q", "to_v", "to_out.0"]))
    cast_training_params(unet, dtype=torch.float32)


def test_lora_with_the_zero_init_of_lora_b_is_quiet_and_a_nan_in_lora_b_is_named_there(_tiny_unet, tmp_path):
    """The frozen base is neither "not learning" nor unwatched noise, the zero gradients of ``lora_A``
    at step 0 are no finding, and a NaN planted in one ``lora_B``'s gradient at the last step is the
    first error, named at that module."""

    def plant(step, unet):
        loss = _mse(step, unet)
        if step == 5:
            weight = unet.get_submodule(LORA_B).weight
            loss = loss + 0 * weight.sum()
            weight.register_hook(lambda grad: grad.index_fill(0, torch.tensor([0]), math.nan))
        return loss

    tdbg = _twice(_tiny_unet, tmp_path, 6, setup=_lora, step_loss=plant)
    serious = _serious(tdbg)
    assert [(a.kind, a.module, a.step, a.severity) for a in serious][:1] == [("nonfinite", LORA_B, 5, "error")]
    assert all(a.step == 5 for a in serious)
