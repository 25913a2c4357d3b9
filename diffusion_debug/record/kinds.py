"""The built-in anomaly kinds, each registered once with everything about it: severity, colour,
meaning, action, message builder, fold key and cause stage. A new kind is one more
:func:`~diffusion_debug.record.anomaly.register_kind` call (here, or in the code that emits it).
Every built-in kind's message is its builder's, written from the anomaly's fields and details:
the code that finds an anomaly passes what the sentence needs, never the sentence.

>>> KINDS["nonfinite_loss"].stage < KINDS["nonfinite"].stage  # the loss before the gradients
True
"""

from __future__ import annotations

from . import inference_messages, messages, training_messages
from .anomaly import KINDS, Anomaly, register_kind


# -- the kinds both debuggers emit, each with its two families of sentences -------------------
def _nonfinite(anomaly: Anomaly) -> str:
    if anomaly.details.get("localized_by") == "forward replay":  # training: launch's replay of the forward
        return training_messages.nonfinite_forward(anomaly)
    if "localized_by" in anomaly.details:  # inference: how the producer (or the origin) was found
        return inference_messages.nonfinite(anomaly)
    return training_messages.nonfinite_gradients(anomaly)


def _memory_growth(anomaly: Anomaly) -> str:
    if "per_call_mb" in anomaly.details:  # inference: across the calls of a pipeline
        return inference_messages.memory_growth_across_calls(anomaly)
    return training_messages.memory_growth(anomaly)


# -- the kinds ----------------------------------------------------------------------------
# Kinds that tend to appear together get colours far apart.
register_kind(
    "nonfinite",
    severity="error",
    colour="#d62728",
    meaning=(
        "NaN or Inf appeared: in inference, the module named first produced it from finite inputs (or made the "
        "values near its dtype's maximum that the next module overflowed on); in "
        "training, a gradient holds it, or (launch's replay of a NaN-loss step's forward) the module named made it "
        "from finite inputs."
    ),
    action=(
        "Check that module's dtype and weights (fp16 overflow is the usual cause: try float32 or "
        "bfloat16, or for SDXL's VAE its fp16-fix VAE; a float32 model under float16 autocast: autocast to "
        "bfloat16 or run the module outside autocast); in training lower the learning rate or check the loss."
    ),
    training_action=(
        "Fix what the message says it follows first; else lower the learning rate or warm it up, check that "
        "step's loss and batch for NaN/Inf, and under fp16 train with a GradScaler (or in bf16)."
    ),
    stable=True,
    stage=3,
    message=_nonfinite,
)
register_kind(
    "overflow_risk",
    severity="warning",
    colour="#ff7f0e",
    meaning="An activation came close to the largest value its dtype can hold; one more step up and it becomes Inf.",
    action=(  # the message's advice, by the dtype it ran in (advice.overflow_advice)
        "In float16: run that component in bfloat16 or float32; a VAE as the message says for its pipeline's call "
        "(force_upcast where the call reads it, SDXL's; SDXL's VAE: the fp16-fix VAE; otherwise "
        'pipe.vae.to(torch.float32), or where the call hands the VAE its latents uncast, its output_type="latent" '
        "decoded in float32); under float16 autocast, which computes float32 weights in float16 too, an upcast helps "
        "only with the decode run outside the autocast: autocast to bfloat16 instead, or run that component outside "
        "autocast; in bfloat16, whose range is float32's, no dtype holds more: check the named module's weights and "
        "the scale of its inputs."
    ),
    stable=True,
    fold_key=lambda a: (a.kind, a.component, a.module),  # one a module, whatever the step
    message=inference_messages.overflow_risk,
)
register_kind(
    "latent_divergence",
    severity="warning",
    colour="#9467bd",
    meaning=(
        "The latents' spread left the range the scheduler expects, so the image is drifting to noise or saturation."
    ),
    action=(
        "Check the scheduler's prediction_type and timestep_spacing against the model, the guidance "
        "scale, and the initial noise sigma."
    ),
    stable=True,
    message=inference_messages.latent_divergence,
)
register_kind(
    "vae_saturation",
    severity="warning",
    colour="#8c564b",
    meaning="Many decoded pixels sit at the edge of the output range: the image is clipped, black or white.",
    action=(
        "Decode in float32 (force_upcast where the pipeline reads it, SDXL's family; SD 1.5's does not: decode the "
        "latents yourself in float32) or (SDXL's VAE) use its fp16-fix VAE; check the latents' scaling factor."
    ),
    stable=True,
    message=inference_messages.vae_saturation,
)
register_kind(
    "constant_image",
    severity="warning",
    colour="#393b79",
    meaning=(
        "A decoded image is one flat colour (often black) although no value was NaN: nothing of the picture survived."
    ),
    action=(
        "Decode in float32 (force_upcast where the pipeline reads it, SDXL's family; SD 1.5's does not: decode the "
        "latents yourself in float32) or (SDXL's VAE) use its fp16-fix VAE; a bfloat16 VAE has float32's range, "
        "so no dtype helps; under float16 autocast, which a float32 or bfloat16 VAE computes in too, autocast to "
        "bfloat16 or decode outside it; check the latents reaching the VAE (the step table) and the latents' "
        "scaling factor."
    ),
    message=inference_messages.constant_image,
)
register_kind(
    "safety_blackout",
    severity="warning",
    colour="#637939",
    meaning="The safety checker flagged the image as NSFW and replaced it with a black one; the model is fine.",
    action=(
        "Change the prompt or seed; for research on your own model, load the pipeline with "
        "safety_checker=None (and respect the model's licence)."
    ),
    message=inference_messages.safety_blackout,
)
register_kind(
    "compile_bypassed",
    severity="warning",
    colour="#5254a3",
    meaning=(
        "A VAE was compiled whole (torch.compile(vae) or vae.compile()), which compiles its forward; the pipeline "
        "calls vae.decode, which runs uncompiled."
    ),
    action="Compile the method the pipeline calls (pipe.vae.decode = torch.compile(pipe.vae.decode)) or its decoder.",
    message=inference_messages.compile_bypassed,
)
register_kind(
    "nondeterministic",
    severity="warning",
    colour="#8c6d31",
    meaning="The same call with the same seed gave a different image: the run cannot be reproduced.",
    action=(
        "Look at the first step whose latents differ: a non-deterministic kernel (torch.use_deterministic_"
        "algorithms(True)), a generator not passed to the pipeline, or state kept between calls."
    ),
    message=inference_messages.nondeterministic,
)
register_kind(
    "prompt_truncated",
    severity="warning",
    colour="#e377c2",
    meaning=(
        "The prompt was longer than the text encoder's limit (77 tokens for CLIP); the tail was dropped "
        "without a word."
    ),
    action="Shorten the prompt, or use prompt embeddings built from several chunks.",
    stable=True,
    message=inference_messages.prompt_truncated,
)
register_kind(
    "scheduler_config",
    severity="warning",
    colour="#7f7f7f",
    meaning=(
        "The scheduler's settings do not fit the model or the number of steps (prediction_type, "
        "timestep_spacing, zero-terminal-SNR with epsilon)."
    ),
    action="Load the scheduler config that ships with the model, or follow the fix in the message.",
    stable=True,
    message=inference_messages.scheduler_config,
)
register_kind(
    "dtype_mismatch",
    severity="warning",
    colour="#bcbd22",
    meaning=(
        "Components or inputs run in different dtypes, so values are cast back and forth (or an fp16 "
        "component runs where it overflows)."
    ),
    action="Put the pipeline in one dtype (pipe.to(dtype)) and keep the VAE in float32 where it needs it.",
    stable=True,
    fold_key=lambda a: (a.kind, a.message),  # one a mismatch found
    message=inference_messages.dtype_mismatch,
)
register_kind(
    "nonfinite_loss",
    severity="error",
    colour="#17becf",
    meaning="The training loss was NaN or Inf at this step.",
    action=(
        "Look at the batch and the forward pass of that step; lower the learning rate; with fp16 use a "
        "GradScaler (Accelerate does) or switch to bfloat16."
    ),
    stable=True,
    stage=2,
    message=training_messages.nonfinite_loss,
)
register_kind(
    "loss_spike",
    severity="warning",
    colour="#ff7f0e",
    meaning="The loss jumped far above its recent average.",
    action="Check the learning rate schedule and the batch of that step; clip gradients if the script does not.",
    stable=True,
    stage=2,
    message=training_messages.loss_spike,
)
register_kind(
    "gradient_explosion",
    severity="warning",
    colour="#9467bd",
    meaning="The gradient norm (before clipping) passed the configured threshold.",
    action=(
        "Lower the learning rate, check the module with the largest gradient, and clip gradients "
        "(accelerator.clip_grad_norm_) if the script does not."
    ),
    stable=True,
    stage=3,
    message=training_messages.gradient_explosion,
)
register_kind(
    "gradient_vanishing",
    severity="warning",
    colour="#2ca02c",
    meaning=(
        "The gradient norm fell below the configured threshold: the model is barely learning; or one module's (or "
        "block's) gradients fell orders of magnitude below the other modules' and their own history."
    ),
    action="Check that the parameters you train require grad and receive a loss, and the loss scale.",
    stable=True,
    stage=3,
    message=training_messages.gradient_vanishing,
)
register_kind(
    "skipped_step",
    severity="info",
    colour="#8c564b",
    meaning=(
        "The optimizer step was skipped (fp16 loss scaler found Inf/NaN gradients, or the policy skipped it); "
        "a warning when 3 skips fall within 20 steps after the scale settled, or 16 come in a row from the start "
        "with the scale down to 2."
    ),
    action="A few skips while the scale settles are normal; many in a row mean the model overflows in fp16.",
    stable=True,
    stage=4,
    message=training_messages.skipped_step,
    distinct_by=("skipped_since",),  # every step skipped from the start: its warning apart from the settling
)
register_kind(
    "scaler_not_passed",
    severity="warning",
    colour="#c49c94",
    meaning=(
        "A GradScaler alive in the process stepped this optimizer but was not passed to monitor_training_step: "
        "found at its first scaled-looking step and confirmed by its scaler.step, its gradients are read unscaled "
        "(closed before its scaler.step, a script that failed: that step reported as read, said maybe scaled)."
    ),
    action="Pass the scaler: tdbg.monitor_training_step(loss, optimizer=optimizer, scaler=scaler).",
    stage=4,
    message=training_messages.scaler_not_passed,
)
register_kind(
    "memory_growth",
    severity="warning",
    colour="#bcbd22",
    meaning="Memory kept growing across steps beyond the configured allowance.",
    # names the user's own call (advice text, not a read of ours)
    action="Look for tensors kept across steps (losses appended without .item() or .detach(), caches).",
    stable=True,
    message=_memory_growth,
)
register_kind(
    "rank_desync",
    severity="error",
    colour="#e377c2",
    meaning=(
        "Processes disagree (different step, loss or parameters) or stopped in different places (a stall named "
        "by the liveness side channel, stacks in stacks-rank*.txt); a collective may hang."
    ),
    action="Check that every rank runs the same steps and that random seeds and data sharding are set up.",
    stable=True,
    stage=5,
    message=training_messages.rank_desync,
)
register_kind(
    "debugger_error",
    severity="warning",
    colour="#000000",
    meaning=(
        "A measurement or replay of the debugger itself failed; the run went on without it (with strict=True the "
        "error was raised, once recorded)."
    ),
    action="The rest of the report still holds; please report the message with the versions shown above.",
    message=messages.debugger_error,
)

register_kind(
    "nonfinite_input",
    severity="error",
    colour="#ff9896",
    meaning=(
        "The training batch (passed as inputs=, or seen by launch on its way to the trained model) held NaN or Inf, "
        "or a frozen model (the component: a text encoder, a VAE) made them: the loss and the gradients after it "
        "follow."
    ),
    action=(
        "Check the data pipeline of that step (decoding, normalisation, cached latents) before the model; for a "
        "frozen model, its weights and dtype."
    ),
    stage=1,
    message=training_messages.nonfinite_input,
)
register_kind(
    "lr_spike",
    severity="warning",
    colour="#aec7e8",
    meaning=(
        "The learning rate rose by more than lr_jump_factor between two optimizer steps, above any earlier value; "
        "or an optimizer step moved a module by more than update_ratio_threshold times its own norm (measured from "
        "the weights, whatever the optimizer; with per-module norms and an SGD optimizer also lr x gradient norm / "
        "weight norm)."
    ),
    action="Check the learning-rate scheduler (its step count and warmup) and any code that sets param_groups' lr.",
    stage=4,
    message=training_messages.lr_spike,
)
register_kind(
    "nonfinite_update",
    severity="error",
    colour="#7b4173",
    meaning=(
        "An optimizer step made weights non-finite although nothing before it (gradients, loss, learning "
        "rate) was flagged: every forward pass after it is NaN."
    ),
    action=(
        "Check the optimizer's settings (eps, weight decay; a custom or 8-bit optimizer) and any code that "
        "writes the weights between steps (EMA, checkpoint loading, adapters merged in place)."
    ),
    stage=4,
    message=training_messages.nonfinite_update,
)
register_kind(
    "loss_divergence",
    severity="warning",
    colour="#843c39",
    meaning=(
        "The loss has been rising for many steps without a single spike: the median of the window's later half is "
        "well above its earlier half's, beyond the loss's own noise (slow divergence)."
    ),
    action=(
        "Lower the learning rate (or lengthen its warmup), check the schedule and what changed around the window's "
        "start (data order, resumed state, loss weighting)."
    ),
    stage=2,
    message=training_messages.loss_divergence,
)
register_kind(
    "not_learning",
    severity="warning",
    colour="#5254a3",
    meaning=(
        "The optimizer steps move no weight although the gradients are normal: the run does not learn (lr 0, an "
        "optimizer holding other parameters, gradients cleared or masked before optimizer.step(), weights put back "
        "after it, updates lost to rounding); of several optimizers (a GAN's), one whose steps alone move none of "
        "its weights is named; or no optimizer step runs at all: gradient sync left off (every call a micro-step)."
    ),
    action="Follow the cause the message names: the learning rate, the optimizer's parameters, the loop's order.",
    stage=4,
    message=training_messages.not_learning,
    distinct_by=("stalled_optimizer",),  # each optimizer's own stall is its own (a GAN's generator's, its critic's)
)
register_kind(
    "distributed_split",
    severity="warning",
    colour="#c49c94",
    meaning=(
        "WORLD_SIZE > 1 in the environment but this process runs alone: every process trains on its own, "
        "with its own run directory."
    ),
    action=(
        "On CPU create the Accelerator with cpu=True, or start the script with diffusion-debug launch --cpu (plain "
        "accelerate launch --cpu starts one process); check the launcher's backend."
    ),
    stage=0,
    message=training_messages.distributed_split,
)

register_kind(
    "unwatched_parameters",
    severity="warning",
    colour="#98df8a",
    meaning=(
        "The optimizer trains parameters outside the watched model(s), whose NaN gradients and updates go unseen "
        "(or surface a step later, blamed on the watched ones), or parameters of a watched model frozen when the "
        "debugger was made and unfrozen since; or watched trainable parameters are in no optimizer (not the "
        "input embeddings of a model whose LoRA adapters an optimizer holds: diffusers' DreamBooth LoRA scripts "
        "make them trainable for gradient checkpointing)."
    ),
    action=(
        'Watch every model you train: TrainingDebugger({"unet": unet, "text_encoder": text_encoder}, ...), made '
        "after unfreezing what you train; add the parameters you mean to train to the optimizer, or set "
        "requires_grad=False on the others."
    ),
    stage=0,
    message=training_messages.unwatched_parameters,
)
register_kind(
    "nonfinite_loss_weight",
    severity="error",
    colour="#c5b0d5",
    meaning=(
        "A per-sample loss weight (loss_weights=) is NaN or Inf at some timesteps, so the loss of those samples is "
        "too: min-SNR weighting divides by the SNR, which is 0 at the last timestep of a zero-terminal-SNR schedule."
    ),
    action=(
        "Clamp the SNR before dividing by it (snr.clamp(min=1e-8)), or weight by snr / (snr + 1) with v_prediction; "
        "check the timesteps named."
    ),
    stage=1,
    message=training_messages.nonfinite_loss_weight,
)
register_kind(
    "sample_loss_outlier",
    severity="warning",
    colour="#f7b6d2",
    meaning=(
        "A sample's own loss (per_sample_loss=) was far above the run's recent per-sample losses, or non-finite "
        "while the step's loss was finite."
    ),
    action="Look at the samples named (their image, caption, cached latents) and the loss at their timesteps.",
    stage=1,  # a sample of the batch: before the step's loss, whose spike it explains
    message=training_messages.sample_loss_outlier,
)
# -- what the debuggers did or met (issue 25): the out-of-memory record and the stability actions
register_kind(
    "out_of_memory",
    severity="error",
    colour="#843c39",
    meaning=(
        "The device ran out of memory inside this component; the error was re-raised unchanged. (Out of"
        " memory in the debugger's own work, a latent preview or a replay, is a debugger_error.)"
    ),
    action="Apply the remedies listed for the component (tiling, slicing, offloading, a smaller batch).",
    stage=2,
    message=messages.out_of_memory,
)
register_kind(
    "step_error",
    severity="warning",
    colour="#ad494a",
    meaning=(
        "A watched model's training forward raised (a bad batch, a shape mismatch): the forward did not finish. "
        "Not caught, the run ended with it; caught by the loop (except Exception: continue), the step was skipped "
        "unless the loop retried it. The error went on unchanged and no policy acts on it."
    ),
    action="Look at the batch of that step and the block named; skip a bad batch on purpose, saying so in the log.",
    stage=2,
    message=training_messages.step_error,
    distinct_by=("error_type",),  # another error at that block is its own (a bad batch, then a device assert)
)
register_kind(
    "gradients_clipped",
    severity="info",
    colour="#6b6ecf",
    meaning="Stability action (clip_grad_on_explosion): an exploding gradient was scaled down before the step.",
    action="The run went on; if it happens often, lower the learning rate or clip gradients in the script.",
    stage=4,
    message=training_messages.gradients_clipped,
)
register_kind(
    "lr_reduced",
    severity="warning",
    colour="#b5cf6b",
    meaning="Stability action (lr_reduce_after_spikes): repeated spikes made the debugger lower the learning rate.",
    action="Lower the learning rate (or lengthen the warmup) in the script itself for the next run.",
    stage=4,
    message=training_messages.lr_reduced,
)
register_kind(
    "weights_restored",
    severity="warning",
    colour="#e7969c",
    meaning=(
        "Stability action (restore_finite_weights_mb): the weights went non-finite and the last finite copy "
        "was put back (details.restored), or the copy held the NaN/Inf too and nothing was."
    ),
    action=(
        "Find what made them non-finite (the anomalies before this one); the optimizer state of those "
        "weights restarted."
    ),
    stage=5,
    message=training_messages.weights_restored,
)


#: The kinds named in DESIGN.md (stable: tests outside this repository use them).
STABLE_KINDS = tuple(name for name, kind in KINDS.items() if kind.stable)
